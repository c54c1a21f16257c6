"""tfcore.flash: the online softmax, the tiled forward and the backward by recomputation (chapter 17).

Each property is checked against a reference (torch's softmax, tfcore's plain attention, PyTorch's
SDPA, autograd through plain attention), and each check is shown to catch a planted bug: a variant
of the module with one line changed must fail it.
"""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import tfcore
from tfcore import flash
from tfcore.flash import flash_attention, flash_attention_forward, online_softmax

B, H, L, D = 2, 3, 77, 16  # L is not a multiple of the blocks below
BLOCKS = dict(block_q=16, block_k=32)


def mutant(old: str, new: str):
    """tfcore.flash with one piece of its source replaced: a planted bug."""
    source = inspect.getsource(flash)
    assert source.count(old) == 1, f"the line to break is not in tfcore/flash.py once: {old!r}"
    namespace = {"__name__": "tfcore._flash_mutant", "__package__": "tfcore"}
    exec(compile(source.replace(old, new), "flash_mutant", "exec"), namespace)  # noqa: S102
    return namespace


def inputs(dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=generator, dtype=dtype).requires_grad_() for _ in range(3)]


def masks():
    """name -> (tfcore mask for flash_attention, causal flag, the same as an explicit mask for the references)."""
    attention_mask = torch.ones(B, L, dtype=torch.long)
    attention_mask[1, 50:] = 0  # the second sequence has 27 padding tokens
    padding = tfcore.padding_mask(attention_mask)                    # [B, 1, L]: padding never attended to
    full_rows = padding & padding.transpose(-1, -2)                  # [B, L, L]: padding queries see nothing
    return {"no mask": (None, False, None),
            "causal": (None, True, tfcore.causal_mask(L)),
            "padding": (padding, False, padding),
            "fully masked rows": (full_rows, False, full_rows)}


def forward_gap(module, mask, causal, reference_mask):
    q, k, v = inputs()
    ours, _ = module["flash_attention_forward"](q, k, v, mask, causal, **BLOCKS)
    reference, _ = tfcore.scaled_dot_product_attention(q, k, v, reference_mask)
    return (ours - reference).abs().max().item()


def backward_gap(module, mask, causal, reference_mask):
    q, k, v = inputs()
    ours = module["flash_attention"](q, k, v, mask, causal, **BLOCKS)
    reference, _ = tfcore.scaled_dot_product_attention(q, k, v, reference_mask)
    grad = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1), dtype=ours.dtype)
    mine = torch.autograd.grad(ours, (q, k, v), grad)
    theirs = torch.autograd.grad(reference, (q, k, v), grad)
    return max((a - b).abs().max().item() for a, b in zip(mine, theirs))


# --- the online softmax ---------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 3, 8, 37, 100])
def test_online_softmax_equals_softmax_on_large_negative_and_masked_rows(block_size):
    x = torch.randn(4, 37, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 5
    x[0, 30] = 1e4                                 # one huge score, late in the row: exp(1e4) overflows
    x[1] = -1e4 + x[1]                             # every score very negative: exp underflows to 0
    x[2, ::2] = -math.inf                          # half the entries blocked
    x[3] = -math.inf                               # a fully blocked row
    got = online_softmax(x, block_size)
    assert torch.allclose(got[:3], x[:3].softmax(dim=-1), rtol=0, atol=1e-12)
    assert torch.equal(got[3], torch.zeros(37, dtype=torch.float64))


def test_online_softmax_catches_a_missing_rescale_of_the_running_sum():
    broken = mutant("l = l * torch.exp(m - shift) + torch.exp(", "l = l + torch.exp(")["online_softmax"]
    x = torch.randn(4, 37, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[:, 30] = 5.0  # the maximum rises late, in another block than the first
    assert not torch.allclose(broken(x, 8), x.softmax(dim=-1), atol=1e-6)


# --- the tiled forward and backward ---------------------------------------------------------------

@pytest.mark.parametrize("case", list(masks()))
def test_forward_and_backward_equal_plain_attention(case):
    mask, causal, reference_mask = masks()[case]
    assert forward_gap(vars(flash), mask, causal, reference_mask) < 1e-12
    assert backward_gap(vars(flash), mask, causal, reference_mask) < 1e-12


@pytest.mark.parametrize("case", list(masks()))
def test_forward_and_backward_equal_torch_sdpa_in_float32(case):
    mask, causal, reference_mask = masks()[case]
    q, k, v = inputs(torch.float32)
    ours = flash_attention(q, k, v, mask, causal, **BLOCKS)
    sdpa_mask = None if reference_mask is None else reference_mask.unsqueeze(1)  # [B, 1, Lq|1, Lk]: every head
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask)
    # Every row, the fully masked ones included: the pinned PyTorch's SDPA returns zeros and zero
    # gradients there on the CPU, as tfcore does (some GPU kernels of torch 2.1 returned NaN).
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5)
    grad = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(theirs, (q, k, v), grad)):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)


def test_fully_masked_rows_give_zeros_and_zero_gradients_not_nan():
    mask, _, _ = masks()["fully masked rows"]
    q, k, v = inputs()
    out = flash_attention(q, k, v, mask, **BLOCKS)
    out.sum().backward()
    assert torch.equal(out[1, :, 50:], torch.zeros_like(out[1, :, 50:]))
    assert torch.equal(q.grad[1, :, 50:], torch.zeros_like(q.grad[1, :, 50:]))  # nothing to attend: no gradient
    assert not any(t.grad.isnan().any() for t in (q, k, v))
    _, lse = flash_attention_forward(q, k, v, mask, **BLOCKS)
    assert torch.isinf(lse[1, :, 50:]).all() and torch.isfinite(lse[0]).all()


def test_causal_with_more_keys_than_queries_matches_a_cache_mask():
    q, k, v = inputs()
    ours = flash_attention(q[:, :, -5:], k, v, causal=True, block_q=2, block_k=8)
    reference, _ = tfcore.scaled_dot_product_attention(q[:, :, -5:], k, v, tfcore.causal_mask(5, past=L - 5))
    assert torch.allclose(ours, reference, rtol=0, atol=1e-12)


def test_causal_skips_every_block_above_the_diagonal():
    n, block = 8, 16  # 8 x 8 blocks: the lower triangle with its diagonal, n(n + 1)/2 of them
    visited = sum(len(flash._key_blocks(True, i0, i0 + block, n * block, block, 0)) for i0 in range(0, n * block, block))
    assert visited == n * (n + 1) // 2


def test_half_precision_inputs_give_their_dtype_and_the_float32_result():
    q, k, v = (t.detach().to(torch.bfloat16) for t in inputs())
    ours = flash_attention(q, k, v, causal=True, **BLOCKS)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert ours.dtype == torch.bfloat16
    assert torch.allclose(ours.float(), reference, rtol=0, atol=1e-2)


def test_backward_saves_no_lq_by_lk_tensor():
    q, k, v = (t.detach().float().requires_grad_() for t in inputs())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        flash_attention(q, k, v, causal=True, **BLOCKS)
    assert saved and max(saved) == B * H * L * D   # q, k, v and o; lse is B * H * L
    assert sum(saved) == 4 * B * H * L * D + B * H * L


# --- planted bugs: each must break the equality that the tests above check -------------------------

PLANTED = {
    "the running sum not rescaled by exp(m_old - m_new)": (
        "l = l * correction + p.sum(dim=-1)", "l = l + p.sum(dim=-1)"),
    "the accumulator not rescaled by exp(m_old - m_new)": (
        "acc = acc * correction.unsqueeze(-1) + p @ v", "acc = acc + p @ v"),
    "the correction the wrong way round, exp(m_new - m_old)": (
        "correction = torch.exp(m - shift)", "correction = torch.exp(shift - m).nan_to_num(posinf=0.0)"),
    "the causal skip one block too early (the diagonal block skipped)": (
        "end = length_k if not causal else min(length_k, i1 + offset)",
        "end = length_k if not causal else min(length_k, i0 + offset)"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_forward_bugs_are_caught(bug):
    broken = mutant(*PLANTED[bug])
    mask, causal, reference_mask = masks()["causal"]
    assert forward_gap(broken, mask, causal, reference_mask) > 1e-3


def test_a_backward_with_the_wrong_log_sum_exp_is_caught():
    broken = mutant("lse_i, d_i = lse[:, :, i0:i1].unsqueeze(-1)", "lse_i, d_i = lse[:, :, i0:i1].roll(1, -1).unsqueeze(-1)")
    for case in ("no mask", "causal"):
        mask, causal, reference_mask = masks()[case]
        assert forward_gap(broken, mask, causal, reference_mask) < 1e-12  # the forward is untouched
        assert backward_gap(broken, mask, causal, reference_mask) > 1e-3


def test_the_causal_count_catches_a_skip_off_by_one_block():
    broken = mutant("end = length_k if not causal else min(length_k, i1 + offset)",
                    "end = length_k if not causal else min(length_k, i1 + offset + 1)")
    n, block = 8, 16
    visited = sum(len(broken["_key_blocks"](True, i0, i0 + block, n * block, block, 0)) for i0 in range(0, n * block, block))
    assert visited != n * (n + 1) // 2  # one block too many per row: still correct, but not skipped


# --- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda q: flash_attention(q[0], q[0], q[0]), "must be a 4-D"),
    (lambda q: flash_attention(q, q[:, :2], q[:, :2]), "same batch and heads"),
    (lambda q: flash_attention(q, q[..., :8], q), "same last dimension"),
    (lambda q: flash_attention(q, q, q[:, :, :10]), "same number of positions"),
    (lambda q: flash_attention(q, q, q, block_q=0), "block_q must be a positive whole number"),
    (lambda q: flash_attention(q, q, q, block_k=2.5), "block_k must be a positive whole number"),
    (lambda q: flash_attention(q, q, q, mask=torch.ones(B, L + 1, dtype=torch.bool)), "does not broadcast"),
    (lambda q: flash_attention(q, q, q, mask=[[True]]), "mask must be a bool tensor"),
])
def test_bad_input_gets_a_clear_error(call, message):
    q = torch.randn(B, H, L, D)
    with pytest.raises(ValueError, match=message):
        call(q)


# --- a sliding window in the tiled loop (chapter 18) ----------------------------------------------

@pytest.mark.parametrize("length_q, length_k, window, block_q, block_k",
                         [(37, 37, 5, 8, 4), (40, 40, 16, 16, 16), (23, 23, 1, 4, 8), (9, 30, 7, 4, 4)])
def test_window_equals_the_sliding_window_mask_forward_and_backward(length_q, length_k, window, block_q, block_k):
    from tfcore.sliding import sliding_window_mask
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, length_q, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, length_k, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = sliding_window_mask(length_q, window, past=length_k - length_q)  # [1, Lq, Lk]
    ours = flash_attention(q, k, v, causal=True, window=window, block_q=block_q, block_k=block_k)
    plain, _ = tfcore.scaled_dot_product_attention(q, k, v, mask)
    assert (ours - plain).abs().max() < 1e-12
    do = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), do), torch.autograd.grad(plain, (q, k, v), do)):
        assert (a - b).abs().max() < 1e-12


def test_window_skips_the_blocks_left_of_the_band():
    from tfcore.flash import _key_blocks
    length, block, window = 1024, 64, 256
    visited = [list(_key_blocks(True, i0, i0 + block, length, block, 0, window)) for i0 in range(0, length, block)]
    # every visited block holds a key some query of the block may see, and no other block does
    for i0, starts in zip(range(0, length, block), visited):
        needed = [j0 for j0 in range(0, length, block)
                  if any(q - window < key <= q for q in range(i0, i0 + block) for key in range(j0, j0 + block))]
        assert starts == needed
    assert sum(map(len, visited)) < 0.6 * sum(len(_key_blocks(True, i0, i0 + block, length, block, 0))
                                               for i0 in range(0, length, block))


def test_planted_window_skip_one_block_too_many_is_caught(monkeypatch):
    from tfcore import flash as module
    right = module._key_blocks
    monkeypatch.setattr(module, "_key_blocks", lambda *a: right(*a)[1:] if a[-1] is not None else right(*a))
    q, k, v = (torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))
    from tfcore.sliding import sliding_window_mask
    plain, _ = tfcore.scaled_dot_product_attention(q, k, v, sliding_window_mask(40, 12))
    assert (module.flash_attention(q, k, v, causal=True, window=12, block_q=8, block_k=8) - plain).abs().max() > 1e-3


def test_window_bad_input_is_a_clear_error():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="causal=True"):
        flash_attention(q, q, q, window=4)
    with pytest.raises(ValueError, match="window must be a whole number"):
        flash_attention(q, q, q, causal=True, window=0)
