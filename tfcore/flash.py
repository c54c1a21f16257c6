"""FlashAttention in pure PyTorch: the online softmax, the tiled forward, and the backward by recomputation.

Chapter 17 builds these step by step. Shapes: ``B`` batch, ``H`` heads, ``Lq`` queries, ``Lk``
keys, ``d`` width of a query/key, ``dv`` width of a value; ``Bq`` and ``Bk`` the block sizes.

- :func:`online_softmax`: softmax over the last axis, read in blocks of keys with a running maximum
  ``m`` and a running sum ``l`` that are corrected as each block arrives (Milakov and Gimelshein, 2018).
- :func:`flash_attention_forward`: attention computed one ``Bq x Bk`` block of scores at a time,
  never forming the ``Lq x Lk`` matrix; returns the output and the per-row log-sum-exp
  (Dao et al., 2022; the loop order of FlashAttention-2, Dao 2023: queries outside, keys inside).
- :func:`flash_attention_backward`: the gradients, recomputing each block of weights from the saved
  log-sum-exp (Dao 2023, Algorithm 2).
- :class:`FlashAttentionFunction` joins the two for autograd; :func:`flash_attention` is the
  user-facing function, shaped like :func:`tfcore.scaled_dot_product_attention`.

Masks follow tfcore (``tfcore.attention``): True where attention is allowed. A query whose keys are
all blocked gets a zero output and zero gradients, not NaN. ``causal=True`` lets query ``i`` see
key ``j`` when ``j <= i + (Lk - Lq)``: the lower triangle when ``Lq == Lk``, and the alignment of
``tfcore.causal_mask(Lq, past=Lk - Lq)`` (queries at the end, as with a KV cache) when ``Lq < Lk``;
with ``Lq > Lk`` the first ``Lq - Lk`` queries see no key and get zeros.
"""

from __future__ import annotations

import math

import torch

from .attention import _broadcast_mask

__all__ = ["online_softmax", "flash_attention_forward", "flash_attention_backward",
           "FlashAttentionFunction", "flash_attention"]


def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive whole number of rows per block, got {value!r}; "
                         f"pass e.g. {name}=64")
    return value


def online_softmax(scores: torch.Tensor, block_size: int = 64) -> torch.Tensor:
    """softmax(scores) over the last axis, reading it ``block_size`` entries at a time.

    ``scores [..., n]`` -> weights ``[..., n]``. A blocked entry is ``-inf``; a row whose entries
    are all ``-inf`` gives zeros. One pass keeps, per row, the running maximum ``m`` and the running
    sum ``l`` of ``exp(score - m)``; when a block raises the maximum from ``m_old`` to ``m_new``,
    the sum so far is rescaled by ``exp(m_old - m_new)``. A second pass writes ``exp(score - m) / l``.
    """
    _check_block("block_size", block_size)
    if not isinstance(scores, torch.Tensor) or scores.dim() < 1 or not scores.is_floating_point():
        what = f"{scores.dtype} tensor of shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) \
            else type(scores).__name__
        raise ValueError(f"scores must be a floating-point tensor [..., n] (blocked entries -inf), got {what}")
    m = torch.full(scores.shape[:-1], -math.inf, dtype=scores.dtype, device=scores.device)
    l = torch.zeros_like(m)
    for start in range(0, scores.shape[-1], block_size):
        block = scores[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        shift = m_new.masked_fill(m_new == -math.inf, 0.0)  # all blocked so far: exp(-inf - 0) = 0
        l = l * torch.exp(m - shift) + torch.exp(block - shift.unsqueeze(-1)).sum(dim=-1)
        m = m_new
    shift = m.masked_fill(m == -math.inf, 0.0)
    weights = torch.exp(scores - shift.unsqueeze(-1))
    return weights / l.masked_fill(l == 0, 1.0).unsqueeze(-1)  # a fully blocked row: 0 / 1 = 0


def _check_window(window, causal):
    if window is None:
        return
    if not causal:
        raise ValueError("a sliding window needs causal=True (tfcore's local layers are causal)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a whole number of positions >= 1 (the last `window` positions, "
                         f"the query's own included, as transformers' sliding_window), got {window!r}")


def _prepare(q, k, v, mask, block_q, block_k):
    """Check the inputs; return the mask as a bool view ``[B, H, Lq, Lk]`` (expanded, not copied) or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D [batch, heads, L, d] tensor, got {shape}; "
                             f"a single head [B, L, d] becomes 4-D with {name}.unsqueeze(1)")
        if not t.is_floating_point():
            raise TypeError(f"{name} must hold floating-point numbers, got {t.dtype}; convert it first, "
                            f"e.g. {name}.float()")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}; "
                        f"convert them first, e.g. k.to(q.dtype)")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"q, k and v must have the same batch and heads (the first two axes), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; for grouped-query "
                         f"attention repeat the key/value heads first (k.repeat_interleave(groups, dim=1))")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same last dimension d to be multiplied, got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must hold the same number of positions, got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"mask must be a bool tensor (True = may attend), got {type(mask).__name__}")
    scores_shape = (*q.shape[:-1], k.shape[-2])  # [B, H, Lq, Lk]
    return _broadcast_mask(mask, torch.empty(scores_shape, device="meta")).to(q.device).expand(scores_shape)


def _block_mask(mask, causal, i0, i1, j0, j1, offset, device, window=None):
    """The allowed entries of the score block (queries i0:i1, keys j0:j1), or None if all are allowed."""
    allowed = None
    if mask is not None:
        allowed = mask[:, :, i0:i1, j0:j1]
    rows = torch.arange(i0, i1, device=device).unsqueeze(-1)
    cols = torch.arange(j0, j1, device=device)
    if causal and j1 - 1 > i0 + offset:  # the block reaches above the diagonal: mask inside it
        below = cols <= rows + offset  # [Bq, Bk]
        allowed = below if allowed is None else allowed & below
    if window is not None and j0 <= i1 - 1 + offset - window:  # it reaches left of the band
        inside = cols > rows + offset - window  # the last `window` positions, the query's own included
        allowed = inside if allowed is None else allowed & inside
    return allowed


def _key_blocks(causal, i0, i1, length_k, block_k, offset, window=None):
    """The starts of the key blocks that query rows i0:i1 must visit (with causal: none wholly above
    the diagonal, whose first key ``j0`` lies beyond the last query's reach ``i1 - 1 + offset``;
    with a ``window``: none wholly left of the band, whose last key lies before the first query's
    earliest key ``i0 + offset - window + 1``)."""
    end = length_k if not causal else min(length_k, i1 + offset)
    start = 0 if window is None else max(0, i0 + offset - window + 1) // block_k * block_k
    return range(start, max(end, start), block_k)


def flash_attention_forward(q, k, v, mask=None, causal: bool = False, block_q: int = 64, block_k: int = 64,
                            window: int | None = None):
    """Tiled attention: softmax(q kᵀ / √d) v, one ``[Bq, Bk]`` block of scores at a time.

    q ``[B, H, Lq, d]``, k ``[B, H, Lk, d]``, v ``[B, H, Lk, dv]``; ``mask`` (bool, True = may
    attend) broadcasts against ``[B, H, Lq, Lk]`` (a 3-D ``[B, Lq|1, Lk]`` mask applies to every
    head). Returns ``(o [B, H, Lq, dv], lse [B, H, Lq])``: ``lse`` is each row's log-sum-exp of the
    allowed scaled scores, ``+inf`` for a row with nothing allowed (so that ``exp(s - lse)`` is 0
    there). Computed in float32 for 16-bit inputs; ``o`` is returned in the input's dtype.
    ``window`` (with ``causal=True``): each query sees only the last ``window`` positions, itself
    included (``tfcore.sliding``'s convention), and key blocks wholly left of that band are skipped.
    """
    mask = _prepare(q, k, v, mask, block_q, block_k)
    _check_window(window, causal)
    dtype = q.dtype
    work = torch.promote_types(dtype, torch.float32)
    q, k, v = q.to(work), k.to(work), v.to(work)
    batch, heads, length_q, d = q.shape
    length_k, offset = k.shape[-2], k.shape[-2] - q.shape[-2]
    scale = 1.0 / math.sqrt(d)
    o = torch.empty(batch, heads, length_q, v.shape[-1], dtype=work, device=q.device)
    lse = torch.empty(batch, heads, length_q, dtype=work, device=q.device)
    for i0 in range(0, length_q, block_q):
        i1 = min(i0 + block_q, length_q)
        q_i = q[:, :, i0:i1] * scale                                     # [B, H, Bq, d]
        m = torch.full((batch, heads, i1 - i0), -math.inf, dtype=work, device=q.device)  # running max
        l = torch.zeros_like(m)                                          # running sum of exp(s - m)
        acc = torch.zeros(batch, heads, i1 - i0, v.shape[-1], dtype=work, device=q.device)  # unnormalised output
        for j0 in _key_blocks(causal, i0, i1, length_k, block_k, offset, window):
            j1 = min(j0 + block_k, length_k)
            s = q_i @ k[:, :, j0:j1].transpose(-2, -1)                   # [B, H, Bq, Bk]
            allowed = _block_mask(mask, causal, i0, i1, j0, j1, offset, q.device, window)
            if allowed is not None:
                s = s.masked_fill(~allowed, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            shift = m_new.masked_fill(m_new == -math.inf, 0.0)           # nothing allowed yet: keep zeros
            p = torch.exp(s - shift.unsqueeze(-1))                       # [B, H, Bq, Bk]
            correction = torch.exp(m - shift)                            # exp(m_old - m_new)
            l = l * correction + p.sum(dim=-1)
            acc = acc * correction.unsqueeze(-1) + p @ v[:, :, j0:j1]
            m = m_new
        empty = l == 0                                                   # every key blocked
        o[:, :, i0:i1] = acc / l.masked_fill(empty, 1.0).unsqueeze(-1)
        lse[:, :, i0:i1] = torch.where(empty, math.inf, m + torch.log(l.masked_fill(empty, 1.0)))
    return o.to(dtype), lse


def flash_attention_backward(do, q, k, v, o, lse, mask=None, causal: bool = False, block_q: int = 64,
                             block_k: int = 64, window: int | None = None):
    """Gradients of :func:`flash_attention_forward`, recomputing the weights block by block.

    ``do [B, H, Lq, dv]`` is the gradient of the output; ``o`` and ``lse`` are what the forward
    returned. With ``D = rowsum(do * o)``, for each block: ``P = exp(q kᵀ/√d - lse)``,
    ``dV += Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P (dP - D)``, ``dQ += dS K / √d``, ``dK += dSᵀ Q / √d``
    (Dao 2023, Algorithm 2). Returns ``(dq, dk, dv)`` in the inputs' dtypes.
    """
    mask = _prepare(q, k, v, mask, block_q, block_k)
    _check_window(window, causal)
    out_shape = (*q.shape[:-1], v.shape[-1])
    for name, t, shape in (("do", do, out_shape), ("o", o, out_shape), ("lse", lse, tuple(q.shape[:-1]))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape {tuple(shape)} (what flash_attention_forward gives "
                             f"for these q, k, v), got {got}")
    work = torch.promote_types(q.dtype, torch.float32)
    dtypes = q.dtype, k.dtype, v.dtype
    q, k, v, o, do = (t.to(work) for t in (q, k, v, o, do))
    length_q, length_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    offset, scale = length_k - length_q, 1.0 / math.sqrt(d)
    big_d = (do * o).sum(dim=-1)                                         # D: [B, H, Lq]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i0 in range(0, length_q, block_q):
        i1 = min(i0 + block_q, length_q)
        q_i, do_i = q[:, :, i0:i1], do[:, :, i0:i1]
        lse_i, d_i = lse[:, :, i0:i1].unsqueeze(-1), big_d[:, :, i0:i1].unsqueeze(-1)
        for j0 in _key_blocks(causal, i0, i1, length_k, block_k, offset, window):
            j1 = min(j0 + block_k, length_k)
            k_j, v_j = k[:, :, j0:j1], v[:, :, j0:j1]
            s = (q_i * scale) @ k_j.transpose(-2, -1)                    # [B, H, Bq, Bk]
            allowed = _block_mask(mask, causal, i0, i1, j0, j1, offset, q.device, window)
            if allowed is not None:
                s = s.masked_fill(~allowed, -math.inf)
            p = torch.exp(s - lse_i)                                     # the forward's weights, recomputed
            dv[:, :, j0:j1] += p.transpose(-2, -1) @ do_i
            dp = do_i @ v_j.transpose(-2, -1)
            ds = p * (dp - d_i)                                          # softmax's backward, row by row
            dq[:, :, i0:i1] += (ds @ k_j) * scale
            dk[:, :, j0:j1] += (ds.transpose(-2, -1) @ q_i) * scale
    return tuple(g.to(dtype) for g, dtype in zip((dq, dk, dv), dtypes))


class FlashAttentionFunction(torch.autograd.Function):
    """Tiled attention for autograd: saves only q, k, v, the output ``o [B, H, Lq, dv]`` and the
    log-sum-exp ``lse [B, H, Lq]`` (no ``Lq x Lk`` weights); backward recomputes the weights."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, block_q, block_k, window=None):
        o, lse = flash_attention_forward(q, k, v, mask, causal, block_q, block_k, window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask, ctx.causal, ctx.blocks, ctx.window = mask, causal, (block_q, block_k), window
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, ctx.mask, ctx.causal, *ctx.blocks,
                                              window=ctx.window)
        return dq, dk, dv, None, None, None, None, None


def flash_attention(q, k, v, mask=None, causal: bool = False, block_q: int = 64, block_k: int = 64,
                    window: int | None = None):
    """softmax(q kᵀ / √d) v by tiles, with the backward by recomputation: ``[B, H, Lq, dv]``.

    The same inputs and output as ``tfcore.scaled_dot_product_attention(q, k, v, mask,
    need_weights=False)[0]`` for 4-D inputs: q ``[B, H, Lq, d]``, k ``[B, H, Lk, d]``,
    v ``[B, H, Lk, dv]``, ``mask`` bool (True = may attend) broadcasting against ``[B, H, Lq, Lk]``;
    ``causal=True`` adds the causal mask (see the module's docstring for ``Lq != Lk``).
    ``block_q`` and ``block_k`` are the rows of queries and of keys per block. ``window`` (with
    ``causal=True``) makes the attention local, as ``tfcore.sliding.sliding_window_mask`` does, and
    skips the key blocks left of the band as well as those above the diagonal (chapter 18).
    """
    _prepare(q, k, v, mask, block_q, block_k)  # fail early, before autograd
    _check_window(window, causal)
    return FlashAttentionFunction.apply(q, k, v, mask, causal, block_q, block_k, window)
