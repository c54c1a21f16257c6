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

from .cache import LayerCache


def _check_window(window) -> None:
    if window is not None and (int(window) != window or window < 1):
        raise ValueError(f"the sliding window must be a whole number of positions ≥ 1 (or None for global "
                         f"attention), got {window!r}")


def position_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[1, Lq, Lk]`` bool: query at position ``q`` may see the key at position ``k`` when
    ``k ≤ q`` (causal) and, with a ``window``, ``k > q - window`` (the last ``window`` positions,
    itself included). Keys with a negative position (empty slots) are never seen."""
    _check_window(window)
    q, k = query_positions[:, None], key_positions[None, :]
    allowed = (k <= q) & (k >= 0)
    if window is not None:
        allowed &= k > q - window
    return allowed.unsqueeze(0)


def sliding_window_mask(seq_len: int, window: int | None, device=None, past: int = 0) -> torch.Tensor:
    """``[1, L, past + L]`` bool, the sliding-window causal mask: query ``i`` (at position
    ``past + i``) sees the positions ``past + i - window + 1 .. past + i``. ``window=None`` is
    ``tfcore.causal_mask``."""
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
    filled ones are returned and counted.
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
        if keys.shape[-2] != positions.shape[0]:
            raise ValueError(f"{keys.shape[-2]} new keys but {positions.shape[0]} positions: pass one position "
                             f"per new key, e.g. torch.arange(past, past + L)")
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
    layers' ``LayerCache`` (``tfcore.generate`` passes the final length).
    """

    def __init__(self, windows: list[int | None], capacity: int | None = None):
        self.windows = list(windows)
        self.layers = [LayerCache(capacity) if w is None else RingBuffer(w) for w in self.windows]
        self.length = 0  # positions seen: the position the next token takes

    def __getitem__(self, index: int):
        return self.layers[index]

    def append(self, index: int, keys, values, positions):
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
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be [B, H, L, d]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads but k and v have {k.shape[1]} and {v.shape[1]}: "
                         f"repeat the key/value heads first (k.repeat_interleave(group, dim=1))")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must hold one logit per head, shape ({q.shape[1]},); got {tuple(sinks.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be bool (True = may attend), got {mask.dtype}")
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    shift = combined.amax(dim=-1, keepdim=True)
    shift = shift.masked_fill(shift == float("-inf"), 0.0)  # a -inf sink and no key: exp(-inf) = 0
    exp = torch.exp(combined - shift)
    total = exp.sum(dim=-1, keepdim=True)
    weights = (exp / total.masked_fill(total == 0, 1.0))[..., :-1]  # nothing at all: zeros, not NaN
    return weights @ v, weights
