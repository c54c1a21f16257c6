"""The KV cache: the keys and values of the positions generated so far (chapter 15).

A causal model never lets an earlier position look at a later one, so the keys and values that a
position produced stay valid for the rest of the generation. Keeping them means each new token
costs one position's work instead of the whole sequence's.

Shapes: keys and values ``[B, H_kv, L, head_dim]``, where ``H_kv`` is the number of key/value
heads (the number of heads in multi-head attention, fewer in grouped-query attention).
"""

from __future__ import annotations

import torch

from .attention import _whole


class LayerCache:
    """The keys and values of one attention layer; empty (``keys is None``) until first used.

    By default each ``append`` makes a new tensor with ``torch.cat``, which copies every cached
    position again. With a ``capacity`` (the most positions it will hold), the first ``append``
    allocates room for all of them and each later one writes its positions in place: ``keys``
    and ``values`` are then views of the filled part. ``tfcore.generate`` knows the final length
    and uses it. A capacity is a whole number >= 1 (a cache with room for nothing is an error).
    """

    def __init__(self, capacity: int | None = None):
        if capacity is not None:
            _whole("capacity (the most positions it will hold, or None for a cache that grows)", capacity, 1)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.capacity = capacity
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        """The number of positions held."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, keys: torch.Tensor, values: torch.Tensor):
        """Self-attention: add the new positions' ``[B, H_kv, L_new, d]``; return all of them."""
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise TypeError(f"keys and values must be tensors [B, H_kv, L_new, d], got "
                            f"{type(keys).__name__} and {type(values).__name__}")
        if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must be "
                             f"[B, H_kv, L_new, d] with the same B, H_kv and L_new (d may differ)")
        if self.keys is not None and (keys.shape[:2] != self.keys.shape[:2] or keys.shape[-1] != self.keys.shape[-1]):
            raise ValueError(f"the cache holds keys of shape {tuple(self.keys.shape)} ([B, heads, L, d]); "
                             f"new keys of shape {tuple(keys.shape)} do not continue them: use one cache "
                             f"per sequence batch, and model.new_cache() for a new one")
        if self.capacity is not None:
            return self._write(keys, values)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values

    def _write(self, keys, values):
        start, end = len(self), len(self) + keys.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the cache has room for {self.capacity} positions (capacity); {end} do not fit")
        if self._room is None:  # [B, H_kv, capacity, d_k] for the keys, [B, H_kv, capacity, d_v] for the values
            self._room = (keys.new_empty((*keys.shape[:-2], self.capacity, keys.shape[-1])),
                          values.new_empty((*values.shape[:-2], self.capacity, values.shape[-1])))
        room_keys, room_values = self._room
        room_keys[..., start:end, :] = keys
        room_values[..., start:end, :] = values
        self.keys, self.values = room_keys[..., :end, :], room_values[..., :end, :]
        return self.keys, self.values

    def store(self, keys: torch.Tensor, values: torch.Tensor):
        """Cross-attention: keep the memory's keys and values, computed once; return them."""
        self.keys, self.values = keys, values
        return keys, values


class KVCache:
    """One ``LayerCache`` per layer (``cache[i]``), and for an encoder-decoder one more per layer
    for the cross-attention (``cache.cross[i]``). ``capacity`` is handed to the self-attention
    caches."""

    def __init__(self, num_layers: int, cross_attention: bool = False, capacity: int | None = None):
        _whole("num_layers (one cache per attention layer)", num_layers, 1)
        self.layers = [LayerCache(capacity) for _ in range(num_layers)]
        self.cross = [LayerCache() for _ in range(num_layers)] if cross_attention else None
        self.padded = False  # whether a padded position is held (set by the model: tfcore.gpt.positions_and_mask)

    def __getitem__(self, index: int) -> LayerCache:
        return self.layers[index]

    @property
    def length(self) -> int:
        """The number of positions already cached: the position the next token will take."""
        return len(self.layers[0]) if self.layers else 0

    def nbytes(self) -> int:
        """The bytes of every cached key and value (a cache with a capacity reserves more)."""
        slots = self.layers + (self.cross or [])
        return sum(t.numel() * t.element_size() for c in slots for t in (c.keys, c.values) if t is not None)
