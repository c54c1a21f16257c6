"""tfcore's attention against PyTorch's own implementations, masks, and clear errors on bad input."""

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig

import tfcore
from tfcore import (AttentionHead, MultiHeadAttention, causal_mask, padding_mask,
                    scaled_dot_product_attention)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _qkv(*batch_dims, lq=7, lk=7, d=16):
    return (torch.randn(*batch_dims, lq, d), torch.randn(*batch_dims, lk, d), torch.randn(*batch_dims, lk, d))


def _random_bool_mask(*shape):
    mask = torch.rand(*shape) > 0.5
    mask[..., 0] = True  # every query may see at least one key, so PyTorch's reference is defined
    return mask


def _padding(batch, length):
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        attention_mask[b, length - b:] = 0  # row b has b padded positions
    return attention_mask


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.float64, 1e-12)],
                         ids=["float32", "float64"])
@pytest.mark.parametrize("batch_dims", [(3,), (2, 4)], ids=["3-D", "4-D"])
@pytest.mark.parametrize("kind", ["none", "causal", "padding", "random"])
def test_matches_torch_sdpa(batch_dims, kind, dtype, atol):
    q, k, v = (t.to(dtype) for t in _qkv(*batch_dims))
    mask = {
        "none": None,
        "causal": causal_mask(7),
        "padding": padding_mask(_padding(batch_dims[0], 7)),
        "random": _random_bool_mask(*batch_dims, 7, 7),
    }[kind]
    output, weights = scaled_dot_product_attention(q, k, v, mask)
    reference_mask = None
    if mask is not None:
        reference_mask = mask.unsqueeze(1) if len(batch_dims) == 2 and mask.dim() == 3 else mask
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=reference_mask)
    torch.testing.assert_close(output, expected, atol=atol, rtol=0)
    fast, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=False)
    torch.testing.assert_close(fast, expected, atol=atol, rtol=0)
    assert weights.shape == (*batch_dims, 7, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(*batch_dims, 7, dtype=dtype))
    if mask is not None:
        blocked = ~(reference_mask.expand_as(weights))
        assert (weights[blocked] == 0).all()


def test_cross_attention_lengths_and_value_width():
    q, k, _ = _qkv(2, lq=3, lk=9, d=8)
    v = torch.randn(2, 9, 5)
    output, weights = scaled_dot_product_attention(q, k, v)
    assert output.shape == (2, 3, 5) and weights.shape == (2, 3, 9)
    torch.testing.assert_close(output, F.scaled_dot_product_attention(q, k, v), atol=1e-6, rtol=0)


def test_fully_masked_row_gives_zeros_not_nan_and_finite_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(1, lq=4, lk=4, d=8))
    mask = torch.ones(1, 4, 4, dtype=torch.bool)
    mask[0, 2] = False  # query 2 may look at nothing
    output, weights = scaled_dot_product_attention(q, k, v, mask)
    assert not torch.isnan(output).any() and not torch.isnan(weights).any()
    assert (weights[0, 2] == 0).all() and (output[0, 2] == 0).all()
    torch.testing.assert_close(weights[0, [0, 1, 3]].sum(-1), torch.ones(3))
    output.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("layer", ["function", "head", "multi-head"])
def test_fast_path_zeroes_fully_masked_rows_whatever_the_fused_kernel_returns(monkeypatch, layer):
    """Observed by hand on an NVIDIA H200 with torch 2.11 (not re-run on the pinned version):
    on 4-D float16/bfloat16 inputs PyTorch's fused attention took cuDNN, which returned finite
    non-zero rows where every key is blocked. This test runs no GPU kernel: a stand-in kernel that
    adds 1 everywhere plays that part on the CPU, and tfcore's fast path (need_weights=False, the
    layers' default) must still give zeros on the fully masked rows, and leave every other row as
    the kernel gave it."""
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: fused(*a, **kw) + 1.0)
    attention_mask = _padding(2, 5)
    mask = causal_mask(5) & padding_mask(attention_mask.flip(-1))  # left padding: row 1 has 1 [PAD]
    blocked = ~mask.any(dim=-1)  # [B, L]: queries with no allowed key
    assert blocked.tolist() == [[False] * 5, [True] + [False] * 4]
    if layer == "function":
        q, k, v = _qkv(2, lq=5, lk=5)
        output, weights = scaled_dot_product_attention(q, k, v, mask, need_weights=False)
        assert weights is None
        kernel = fused(q, k, v, attn_mask=mask) + 1.0
    else:
        module = AttentionHead(16, 8) if layer == "head" else MultiHeadAttention(
            BertConfig(hidden_size=16, num_attention_heads=2, attention_probs_dropout_prob=0.0))
        x = torch.randn(2, 5, 16)
        with torch.no_grad():
            output = module(x, mask=mask)
        kernel = None
    if layer != "multi-head":
        assert (output[blocked] == 0).all()
    else:  # the output projection follows: a blocked row gets exactly its bias
        torch.testing.assert_close(output[blocked], module.output_linear.bias.expand(1, 16))
    if kernel is not None:
        torch.testing.assert_close(output[~blocked], kernel[~blocked], atol=0, rtol=0)
        assert (kernel[blocked] != 0).all()  # the stand-in kernel really returned non-zero rows


def test_fully_masked_rows_in_a_padded_batch_with_outer_product_mask():
    attention_mask = _padding(2, 5)
    mask = attention_mask[:, :, None].bool() & attention_mask[:, None, :].bool()  # [B, L, L]
    _, weights = scaled_dot_product_attention(*_qkv(2, lq=5, lk=5), mask)
    assert (weights[1, 4] == 0).all() and not torch.isnan(weights).any()


def test_integer_and_float_01_masks_work_like_bool_masks():
    q, k, v = _qkv(2)
    bool_mask = _random_bool_mask(2, 7, 7)
    expected, _ = scaled_dot_product_attention(q, k, v, bool_mask)
    for mask in (bool_mask.long(), bool_mask.float()):
        torch.testing.assert_close(scaled_dot_product_attention(q, k, v, mask)[0], expected)


def test_masks():
    assert causal_mask(3).tolist() == [[[True, False, False], [True, True, False], [True, True, True]]]
    assert padding_mask(torch.tensor([[1, 1, 0]])).tolist() == [[[True, True, False]]]
    assert padding_mask(torch.ones(4, 6)).shape == (4, 1, 6)


@pytest.mark.parametrize("call, message", [
    (lambda: scaled_dot_product_attention(torch.randn(1, 5, 8), torch.randn(1, 5, 6), torch.randn(1, 5, 6)),
     r"same last dimension.*\(1, 5, 8\).*\(1, 5, 6\)"),
    (lambda: scaled_dot_product_attention(torch.randn(1, 5, 8), torch.randn(1, 4, 8), torch.randn(1, 3, 8)),
     r"same number of positions.*\(1, 4, 8\).*\(1, 3, 8\)"),
    (lambda: scaled_dot_product_attention(torch.randn(5, 8), torch.randn(5, 8), torch.randn(5, 8)),
     r"3-D \[B, L, d\] or 4-D.*\(5, 8\)"),
    (lambda: scaled_dot_product_attention(torch.randn(1, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)),
     r"same number of dimensions"),
    (lambda: scaled_dot_product_attention(*_qkv(2, lq=5, lk=5), torch.ones(3, 5, 5)),
     r"mask of shape \(3, 5, 5\) does not broadcast.*\(2, 5, 5\)"),
    (lambda: scaled_dot_product_attention(*_qkv(2, lq=5, lk=5), torch.ones(2, 5, 4)),
     r"mask of shape \(2, 5, 4\) does not broadcast"),
    (lambda: scaled_dot_product_attention(*_qkv(1, lq=3, lk=3), torch.tensor([[0.0, -float("inf"), 0.0]])),
     r"additive mask"),
    (lambda: padding_mask(torch.ones(6)), r"2-D \[B, L\].*\(6,\)"),
    (lambda: MultiHeadAttention(BertConfig(hidden_size=770)),
     r"hidden_size \(770\) is not divisible by num_attention_heads \(12\).*e\.g\. 768"),
    (lambda: MultiHeadAttention(BertConfig())(torch.randn(1, 5, 512)), r"\[B, L, 768\].*\(1, 5, 512\)"),
    (lambda: MultiHeadAttention(BertConfig())(torch.randn(5, 768)), r"\[B, L, 768\].*\(5, 768\)"),
])
def test_bad_input_raises_a_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_attention_head_shapes_and_self_attention_default():
    head = AttentionHead(768, 64)
    x = torch.randn(2, 5, 768)
    assert head(x).shape == (2, 5, 64)
    torch.testing.assert_close(head(x), head(x, x, x))
    out, weights = head(x, return_weights=True)
    assert weights.shape == (2, 5, 5)


def test_multi_head_attention_shapes():
    mha = MultiHeadAttention(BertConfig()).eval()
    x, memory = torch.randn(2, 5, 768), torch.randn(2, 9, 768)
    assert mha(x).shape == (2, 5, 768)
    out, weights = mha(x, memory, return_weights=True)
    assert out.shape == (2, 5, 768) and weights.shape == (2, 12, 5, 9)


def test_multi_head_attention_matches_torch_multihead_attention():
    config = BertConfig()
    ours = MultiHeadAttention(config).eval()
    theirs = torch.nn.MultiheadAttention(768, 12, batch_first=True).eval()
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.query.weight, ours.key.weight, ours.value.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.query.bias, ours.key.bias, ours.value.bias]))
        theirs.out_proj.weight.copy_(ours.output_linear.weight)
        theirs.out_proj.bias.copy_(ours.output_linear.bias)
    x = torch.randn(3, 6, 768)
    attention_mask = _padding(3, 6)
    with torch.no_grad():
        out, weights = ours(x, mask=padding_mask(attention_mask), return_weights=True)
        expected, expected_weights = theirs(x, x, x, key_padding_mask=attention_mask == 0,
                                            average_attn_weights=False)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=0)


def test_multi_head_attention_equals_its_heads_concatenated():
    """The fused layout: rows h*64:(h+1)*64 of the query/key/value weights are head h."""
    ours = MultiHeadAttention(BertConfig()).eval()
    x = torch.randn(1, 5, 768)
    heads = []
    for h in range(12):
        head, rows = AttentionHead(768, 64), slice(64 * h, 64 * (h + 1))
        for mine, fused in ((head.q, ours.query), (head.k, ours.key), (head.v, ours.value)):
            mine.load_state_dict({"weight": fused.weight[rows], "bias": fused.bias[rows]})
        heads.append(head(x))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ours.output_linear(torch.cat(heads, dim=-1)), atol=1e-5, rtol=0)


def test_dropout_on_weights_only_in_training():
    mha = MultiHeadAttention(BertConfig(attention_probs_dropout_prob=0.5))
    x = torch.randn(1, 5, 768)
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x))
    mha.train()
    assert not torch.allclose(mha(x), mha(x))
