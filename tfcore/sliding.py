"""Sliding-window attention and a KV cache that forgets (chapter 18).

A *local* (sliding-window) layer lets the query at position ``q`` see the keys at positions
``q - W + 1 .. q``: the last ``W`` positions, itself included, as ``transformers`` 5.23 defines
``sliding_window`` (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``).
A *global* layer is plain causal attention. Masks hold True where attention is allowed, as
everywhere in tfcore.

Since a local layer never looks further back than ``W - 1`` positions, its cache needs only the last
``W`` keys and values: ``RingBuffer`` keeps them in ``W`` slots, position ``p`` in slot ``p % W``.
Keys are stored with their rotary angle already applied and each slot remembers its position, so
the order of the slots does not matter: the mask is built from positions, not from slot numbers.

Shapes: keys and values ``[B, H_kv, L, head_dim]``; positions ``[L]`` (long).
"""

from __future__ import annotations

import torch

from .attention import _broadcast_mask, _whole
from .cache import LayerCache


def _check_window(window) -> None:
    try:
        ok = window is None or (not isinstance(window, bool) and int(window) == window and window >= 1)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"the sliding window must be a whole number of positions ≥ 1 (or None for global "
                         f"attention), got {window!r}")


def _check_positions(name: str, positions) -> None:
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.is_floating_point() \
            or positions.dtype == torch.bool:
        what = f"{positions.dtype} tensor of shape {tuple(positions.shape)}" \
            if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"{name} must be a 1-D integer tensor of positions [L], e.g. torch.arange(L), "
                         f"got {what}")


def position_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[1, Lq, Lk]`` bool: query at position ``q`` may see the key at position ``k`` when
    ``k ≤ q`` (causal) and, with a ``window``, ``k > q - window`` (the last ``window`` positions,
    itself included). Keys with a negative position (empty slots) are never seen. Both position
    tensors are 1-D integer tensors (``[Lq]``, ``[Lk]``)."""
    _check_window(window)
    _check_positions("query_positions", query_positions)
    _check_positions("key_positions", key_positions)
    q, k = query_positions[:, None], key_positions[None, :]
    allowed = (k <= q) & (k >= 0)
    if window is not None:
        allowed &= k > q - window
    return allowed.unsqueeze(0)


def sliding_window_mask(seq_len: int, window: int | None, device=None, past: int = 0) -> torch.Tensor:
    """``[1, L, past + L]`` bool, the sliding-window causal mask: query ``i`` (at position
    ``past + i``) sees the positions ``past + i - window + 1 .. past + i``. ``window=None`` is
    ``tfcore.causal_mask``. ``seq_len`` and ``past`` are whole numbers ≥ 0."""
    seq_len, past = _whole("seq_len", seq_len, 0), _whole("past", past, 0)
    queries = torch.arange(past, past + seq_len, device=device)
    keys = torch.arange(past + seq_len, device=device)
    return position_mask(queries, keys, window)


class RingBuffer:
    """The cache of one local layer: the keys and values of the last ``window`` positions, in
    ``window`` slots reused in turn (position ``p`` goes to slot ``p % window``).

    ``append(keys, values, positions)`` returns the keys and values to attend over, the slots held
    so far followed by the new ones, with their positions ``[L_held + L_new]`` (build the mask
    with ``position_mask``); then it writes the new positions into their slots, keeping the last
    ``window`` of them. Slots are allocated on first use; before they are all filled, only the
    filled ones are returned and counted. Keys and values have the same shape, and the positions
    continue the ones written: ``positions`` is ``torch.arange(seen, seen + L)``.
    """

    def __init__(self, window: int):
        _check_window(window)
        if window is None:
            raise ValueError("a RingBuffer needs a window; use tfcore.LayerCache for a global layer")
        self.window = int(window)
        self.seen = 0  # positions written so far
        self._keys = self._values = None  # [B, H_kv, window, d]
        self.positions = torch.full((self.window,), -1, dtype=torch.long)  # the position each slot holds

    def __len__(self) -> int:
        """The number of positions held: ``min(seen, window)``."""
        return min(self.seen, self.window)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The slot of each position: ``position % window``."""
        return positions % self.window

    @property
    def keys(self):
        return None if self._keys is None else self._keys[..., :len(self), :]

    @property
    def values(self):
        return None if self._values is None else self._values[..., :len(self), :]

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a 4-D [B, H_kv, L, head_dim] tensor, got {got}")
        if keys.shape != values.shape:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must have the same "
                             f"shape [B, H_kv, L, head_dim]")
        _check_positions("positions", positions)
        if keys.shape[-2] != positions.shape[0]:
            raise ValueError(f"{keys.shape[-2]} new keys but {positions.shape[0]} positions: pass one position "
                             f"per new key, e.g. torch.arange(past, past + L)")
        expected = torch.arange(self.seen, self.seen + positions.shape[0], device=positions.device)
        if not torch.equal(positions, expected):
            raise ValueError(f"the positions must continue the {self.seen} written so far: expected "
                             f"torch.arange({self.seen}, {self.seen + positions.shape[0]}), got "
                             f"{positions.tolist()}; for a new sequence use a new RingBuffer")
        if self._keys is None:
            shape = (*keys.shape[:-2], self.window, keys.shape[-1])
            self._keys, self._values = keys.new_zeros(shape), values.new_zeros(shape)
            self.positions = self.positions.to(keys.device)
        elif keys.shape[:2] != self._keys.shape[:2] or keys.shape[-1] != self._keys.shape[-1]:
            raise ValueError(f"the cache holds keys of shape {tuple(self._keys.shape)} ([B, heads, W, d]); "
                             f"new keys of shape {tuple(keys.shape)} do not continue them: use one cache per "
                             f"sequence batch, and model.new_cache() for a new one")
        held = len(self)
        all_keys = torch.cat([self._keys[..., :held, :], keys], dim=-2)
        all_values = torch.cat([self._values[..., :held, :], values], dim=-2)
        all_positions = torch.cat([self.positions[:held], positions])
        last = slice(max(0, keys.shape[-2] - self.window), None)  # only the last `window` new ones are kept
        slots = self.slots(positions[last])
        self._keys[..., slots, :] = keys[..., last, :]
        self._values[..., slots, :] = values[..., last, :]
        self.positions[slots] = positions[last]
        self.seen += keys.shape[-2]
        return all_keys, all_values, all_positions

    def nbytes(self) -> int:
        """The bytes of the keys and values held (the filled slots)."""
        if self._keys is None:
            return 0
        return sum(t[..., :len(self), :].numel() * t.element_size() for t in (self._keys, self._values))


class RollingKVCache:
    """One cache per layer: a ``RingBuffer(window)`` for each local layer (``windows[i]`` an
    integer), a ``tfcore.LayerCache`` keeping every position for each global one (``None``).

    ``append(i, keys, values, positions)`` returns layer ``i``'s keys, values and key positions.
    ``length`` counts the positions seen (the position the next token takes); the model advances it
    after each call, once all its layers have appended. ``capacity`` is handed to the global
    layers' ``LayerCache`` (``tfcore.generate`` passes the final length). In a padded batch the
    positions are columns, padding included; ``padded`` records that a padded column was written,
    so that ``tfcore.Gemma`` refuses a later call without the ``attention_mask`` that marks it.
    """

    def __init__(self, windows: list[int | None], capacity: int | None = None):
        windows = list(windows)
        if not windows:
            raise ValueError("windows must list one entry per layer (an integer window for a local layer, "
                             "None for a global one), got an empty list; e.g. model.new_cache()")
        for window in windows:
            _check_window(window)
        if capacity is not None:
            _whole("capacity", capacity, 1)
        self.windows = windows
        self.layers = [LayerCache(capacity) if w is None else RingBuffer(w) for w in self.windows]
        self.length = 0  # positions seen: the position the next token takes
        self.padded = False  # whether a padded column is held (set by the model)

    def __getitem__(self, index: int):
        return self.layers[index]

    def append(self, index: int, keys, values, positions):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.layers):
            raise ValueError(f"index must name a layer, 0..{len(self.layers) - 1}, got {index!r}")
        layer = self.layers[index]
        if isinstance(layer, RingBuffer):
            return layer.append(keys, values, positions)
        keys, values = layer.append(keys, values)
        return keys, values, torch.arange(len(layer), device=keys.device)

    def nbytes(self) -> int:
        """The bytes of every key and value held, over all layers."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, RingBuffer):
                total += layer.nbytes()
            else:
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
        return total


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None = None, scale: float | None = None):
    """Attention with a learned *sink logit* per head, as gpt-oss has it (``transformers`` 5.23,
    ``models/gpt_oss/modeling_gpt_oss.py``, ``eager_attention_forward``).

    Each row of scores gets one more entry, the head's sink logit ``sinks[h]``; the softmax runs over
    the keys and the sink together, and the sink's weight is dropped. A row's weights on its keys
    then sum to less than 1: the head may attend to *nothing*. A row whose keys are all masked puts
    all of its weight on the sink and returns zeros (zeros too with a sink of ``-inf``, which is
    plain attention).

    ``q [B, H, Lq, d]``, ``k`` and ``v [B, H, Lk, d]`` (key/value heads already repeated to ``H``),
    ``sinks [H]``, ``mask`` bool broadcastable to ``[B, H, Lq, Lk]`` (True = may attend; a
    ``[B, Lq, Lk]`` or ``[1, Lq, Lk]`` mask as ``position_mask`` builds is applied to every head).
    ``scale`` defaults to ``1/sqrt(d)``. Returns ``(output [B, H, Lq, d], weights [B, H, Lq, Lk])``.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating-point tensor, got {got}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be [B, H, L, d]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or q.shape[0] != k.shape[0] \
            or k.shape[0] != v.shape[0]:
        raise ValueError(f"q and k must share their width d, k and v their positions, and all three their "
                         f"batch; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads but k and v have {k.shape[1]} and {v.shape[1]}: "
                         f"repeat the key/value heads first (k.repeat_interleave(group, dim=1))")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must hold one logit per head, shape ({q.shape[1]},); got {tuple(sinks.shape)}")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and 0 < scale < float("inf")):
        raise ValueError(f"scale must be a positive number (None for 1/sqrt(d)), got {scale!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask must be bool (True = may attend), got {got}")
        mask = _broadcast_mask(mask, torch.empty(scores.shape, device="meta"))  # 3-D -> [B, 1, Lq, Lk]
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    shift = combined.amax(dim=-1, keepdim=True)
    shift = shift.masked_fill(shift == float("-inf"), 0.0)  # a -inf sink and no key: exp(-inf) = 0
    exp = torch.exp(combined - shift)
    total = exp.sum(dim=-1, keepdim=True)
    weights = (exp / total.masked_fill(total == 0, 1.0))[..., :-1]  # nothing at all: zeros, not NaN
    return weights @ v, weights
