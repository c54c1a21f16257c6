"""Attention: scaled dot-product attention, masks, one head, and multi-head attention (chapters 2-4).

Shapes: ``B`` batch, ``H`` heads, ``Lq`` queries, ``Lk`` keys, ``d`` width of a query/key,
``hidden`` the model width (``config.hidden_size``).

Masks hold 1/True where attention is allowed and 0/False where it is blocked, everywhere in
tfcore. A query whose keys are all blocked gets all-zero weights (and so a zero output), not NaN.
"""

from __future__ import annotations

import itertools
import math
import operator

import torch
import torch.nn.functional as F
from torch import nn


def _whole(name: str, value, minimum: int) -> int:
    """``value`` as an int (Python, NumPy or 0-d torch integers), or a ValueError naming ``name``."""
    try:
        ok = not isinstance(value, bool) and operator.index(value) >= minimum
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return operator.index(value)


def _check_attention_inputs(query, key, value):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 3-D [B, L, d] or 4-D [B, heads, L, d] tensor, got {shape}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must hold floating-point numbers, got {t.dtype}; "
                            f"convert it first, e.g. {name}.float()")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype} and "
                        f"{value.dtype}; convert them first, e.g. key.to(query.dtype)")
    if not query.dim() == key.dim() == value.dim():
        raise ValueError(f"query, key and value must have the same number of dimensions, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have the same last dimension (d_k) to be multiplied, got "
                         f"query {tuple(query.shape)} and key {tuple(key.shape)}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must hold the same number of positions, got key "
                         f"{tuple(key.shape)} and value {tuple(value.shape)}")
    if _broadcast_shape(query.shape[:-2], key.shape[:-2], value.shape[:-2]) is None:
        raise ValueError(f"query, key and value must have the same batch (and heads) axes, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")


def _broadcast_shape(*shapes) -> tuple | None:
    """The shape that ``shapes`` broadcast to, or None where they do not (NumPy's rule: aligned from
    the right, each place holds sizes of 1 and at most one other size). ``torch.broadcast_shapes``
    answers the same, but it cost about 9 µs a call in torch 2.13 (it runs torch._refs' Python
    code), and attention calls it at every layer of every decoding step; this, about 1 µs."""
    result = []
    for sizes in itertools.zip_longest(*(reversed(shape) for shape in shapes), fillvalue=1):
        other = set(sizes) - {1}
        if len(other) > 1:
            return None
        result.append(other.pop() if other else 1)
    return tuple(reversed(result))


def _broadcast_mask(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``mask`` as a bool tensor that broadcasts to ``scores.shape``, or a ValueError naming both."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a tensor (True/1 = may attend), got {type(mask).__name__}; "
                        f"build one with causal_mask(L) or padding_mask(attention_mask)")
    if mask.is_floating_point() and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must hold 1/True (attend) and 0/False (blocked); it holds other values. "
                         "An additive mask (0 and -inf) should be converted first: mask = additive == 0")
    if scores.dim() == 4 and mask.dim() == 3:
        mask = mask.unsqueeze(1)  # [B, Lq|1, Lk] -> [B, 1, Lq|1, Lk]: the same mask for every head
    if _broadcast_shape(mask.shape, scores.shape) != tuple(scores.shape):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast against the attention "
                         f"scores of shape {tuple(scores.shape)} ([B, Lq, Lk] or [B, heads, Lq, Lk]); "
                         f"use causal_mask(L) -> [1, L, L] or padding_mask(attention_mask) -> [B, 1, L]")
    return mask.to(torch.bool)


def scaled_dot_product_attention(query, key, value, mask=None, dropout: nn.Module | None = None,
                                 need_weights: bool = True):
    """softmax(query keyᵀ / √d) value, with an optional mask.

    query ``[B, Lq, d]``, key ``[B, Lk, d]``, value ``[B, Lk, dv]`` (or with a heads axis:
    ``[B, H, L, d]``). ``mask`` broadcasts against the scores ``[B, (H,) Lq, Lk]``; a 3-D mask
    used with 4-D inputs applies to every head. ``dropout``, when given, is applied to the weights.

    Returns ``(output [B, (H,) Lq, dv], weights [B, (H,) Lq, Lk])``. With ``need_weights=False``
    the weights are never formed: PyTorch's ``scaled_dot_product_attention`` computes the output
    (with a fused kernel for 4-D inputs; 3-D ones take its math path, chapter 13 §13.4), and
    ``weights`` is None. PyTorch does not promise zeros for a fully masked row
    (on an NVIDIA H100 with torch 2.11, 4-D float16 and bfloat16 inputs took cuDNN, which returned
    finite non-zero rows: ``benchmarks/gpu_runs/2026-11-26-h100.md``), so such
    rows are set to zero after the fused call, as here; ``tests/test_attention.py`` checks that
    step with a stand-in kernel on the CPU.
    """
    _check_attention_inputs(query, key, value)
    scores_shape = (*query.shape[:-1], key.shape[-2])
    allowed = None if mask is None else _broadcast_mask(mask, torch.empty(scores_shape, device="meta"))
    if not need_weights:
        p = dropout.p if dropout is not None and dropout.training else 0.0
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=p)
        if allowed is not None:  # zero the rows with no allowed key, whatever the kernel gave
            output = output.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
        return output, None
    # Scaling the queries (Lq x d numbers) instead of the scores (Lq x Lk): fewer divisions
    # when d < Lk, and the same formula, rounded in another order.
    scores = (query / math.sqrt(query.shape[-1])) @ key.transpose(-2, -1)
    if allowed is None:
        weights = scores.softmax(dim=-1)
    else:
        # The most negative finite number instead of -inf: a row with every key blocked then
        # gives a finite (uniform) softmax instead of NaN, and we zero such rows below.
        weights = scores.masked_fill_(~allowed, torch.finfo(scores.dtype).min).softmax(dim=-1)
        anything = allowed.any(dim=-1, keepdim=True)
        if not anything.all():
            weights = weights.masked_fill(~anything, 0.0)
    if dropout is not None:
        weights = dropout(weights)
    return weights @ value, weights


def causal_mask(seq_len: int, device=None, past: int = 0) -> torch.Tensor:
    """``[1, L, L]`` bool, True on and below the diagonal: position i may look at positions ≤ i.

    With ``past`` > 0 (generation with a KV cache, chapter 15) the ``L`` queries are the positions
    ``past .. past + L - 1`` and the keys are all ``past + L`` positions: ``[1, L, past + L]``.
    ``seq_len`` and ``past`` are whole numbers ≥ 0; anything else is refused with a ValueError.
    """
    seq_len, past = _whole("seq_len", seq_len, 0), _whole("past", past, 0)
    ones = torch.ones(seq_len, past + seq_len, dtype=torch.bool, device=device)
    return torch.tril(ones, diagonal=past).unsqueeze(0)


def padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The tokenizer's ``attention_mask [B, L]`` (1 = real token) as a key mask ``[B, 1, L]``."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a 2-D [B, L] tensor of 0/1, got {shape}")
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token); it holds other "
                         "values: pass the tokenizer's attention_mask, not the input_ids")
    return attention_mask.to(torch.bool).unsqueeze(1)


class AttentionHead(nn.Module):
    """One attention head: learned projections to queries, keys and values, then attention.

    ``[B, Lq, embed_dim]`` -> ``[B, Lq, head_dim]``.
    """

    def __init__(self, embed_dim: int, head_dim: int):
        super().__init__()
        self.embed_dim = _whole("embed_dim", embed_dim, 1)
        _whole("head_dim", head_dim, 1)
        self.q = nn.Linear(embed_dim, head_dim)
        self.k = nn.Linear(embed_dim, head_dim)
        self.v = nn.Linear(embed_dim, head_dim)

    def forward(self, query, key=None, value=None, mask=None, return_weights=False):
        """``key`` defaults to ``query`` and ``value`` to ``key`` (self-attention)."""
        key = query if key is None else key
        value = key if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != self.embed_dim:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must be a tensor [..., L, embed_dim] with embed_dim = "
                                 f"{self.embed_dim}, the width this head was built for; got {shape}")
        output, weights = scaled_dot_product_attention(self.q(query), self.k(key), self.v(value), mask,
                                                       need_weights=return_weights)
        return (output, weights) if return_weights else output


class MultiHeadAttention(nn.Module):
    """Multi-head attention, fused: one projection for all heads, then a view into heads.

    The weights are named as in BERT's self-attention (``query``, ``key``, ``value``) so that a
    checkpoint maps onto them one to one; ``output_linear`` is BERT's ``attention.output.dense``.

    ``forward(query [B, Lq, hidden], key [B, Lk, hidden] = query, value = key, mask)`` ->
    ``[B, Lq, hidden]``; with ``return_weights=True``, also the weights ``[B, heads, Lq, Lk]``.

    ``cache`` (a ``tfcore.LayerCache``, chapter 15) keeps keys and values between calls. In
    self-attention (no ``key`` given) the new positions' keys and values are appended to it and
    the queries attend to all of them. In cross-attention (``key`` given) the keys and values of
    ``key``/``value`` are computed on the first call, stored, and reused afterwards.
    """

    def __init__(self, config):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        _whole("hidden_size", hidden, 1), _whole("num_attention_heads", heads, 1)
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}): "
                             f"every head must get the same width; choose a hidden size that is a "
                             f"multiple of {heads}, e.g. {heads * max(1, round(hidden / heads))}")
        self.num_heads, self.head_dim, self.hidden_size = heads, hidden // heads, hidden
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(getattr(config, "attention_probs_dropout_prob", 0.0))
        self.output_linear = nn.Linear(hidden, hidden)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, hidden]`` -> ``[B, heads, L, head_dim]``."""
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, query, key=None, value=None, mask=None, return_weights=False, cache=None):
        self_attention = key is None
        key = query if key is None else key
        value = key if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must have shape [B, L, {self.hidden_size}] (hidden_size), got {shape}")
        q = self._split_heads(self.query(query))
        if cache is not None and not self_attention and cache.keys is not None:
            k, v = cache.keys, cache.values  # cross-attention: the memory's keys and values, made once
        else:
            k = self._split_heads(self.key(key))
            v = self._split_heads(self.value(value))
            if cache is not None:
                k, v = cache.append(k, v) if self_attention else cache.store(k, v)
        context, weights = scaled_dot_product_attention(q, k, v, mask, dropout=self.dropout,
                                                        need_weights=return_weights)
        batch, _, length, _ = context.shape
        output = self.output_linear(context.transpose(1, 2).reshape(batch, length, self.hidden_size))
        return (output, weights) if return_weights else output
