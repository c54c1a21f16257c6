"""tfcore.quantization: per-output-channel symmetric int8 weights, equal to PyTorch's quantised weights;
a per-tensor scale (a planted bug) is caught."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import tfcore
import tfcore.quantization as quant


def _uneven_weight():
    """Rows of very different sizes: a per-tensor scale wastes most of the small rows' range."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 16, generator=g) * torch.tensor([0.01, 0.1, 1.0, 3.0, 0.05, 0.5])[:, None]


def check_per_channel(quantize):
    """Every row uses the full range (its largest weight maps to ±127) and rounds within half its own scale."""
    w = _uneven_weight()
    q, scale = quantize(w)
    assert q.dtype == torch.int8 and scale.shape == (w.shape[0],)
    assert torch.equal(q.abs().amax(dim=1), torch.full((w.shape[0],), 127, dtype=torch.int8))
    assert torch.allclose(scale, w.abs().amax(dim=1) / 127)
    assert ((quant.dequantize(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_per_channel_scales():
    check_per_channel(quant.quantize_per_channel)


def test_planted_bug_scale_per_tensor_is_caught():
    def per_tensor(w):
        scale = w.abs().max() / 127
        return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale.expand(w.shape[0])

    with pytest.raises(AssertionError):
        check_per_channel(per_tensor)


def test_int8_linear_computes_with_its_dequantized_weight():
    linear = torch.nn.Linear(16, 6)
    with torch.no_grad():
        linear.weight.copy_(_uneven_weight())
    layer = quant.Int8Linear.from_linear(linear)
    x = torch.randn(3, 5, 16)
    expected = F.linear(x, quant.dequantize(layer.weight_int8, layer.scale), linear.bias)
    assert layer(x).shape == (3, 5, 6) and torch.allclose(layer(x), expected, atol=1e-5)
    assert layer.weight_int8.element_size() == 1


def test_quantize_linears_skips_the_tied_head_and_saves_bytes():
    gpt = tfcore.GPT(tfcore.GPTConfig(vocab_size=50, max_position_embeddings=16, hidden_size=32,
                                      num_hidden_layers=2, num_attention_heads=2)).eval()
    before = quant.weight_bytes(gpt)
    small = quant.quantize_linears(copy.deepcopy(gpt))
    assert sum(isinstance(m, quant.Int8Linear) for m in small.modules()) == 2 * 6
    assert isinstance(small.lm_head, torch.nn.Linear) and small.lm_head.weight is small.token_embeddings.weight
    linear_weights = sum(m.weight.numel() for m in gpt.blocks.modules() if isinstance(m, torch.nn.Linear))
    rows = sum(m.weight.shape[0] for m in gpt.blocks.modules() if isinstance(m, torch.nn.Linear))
    assert before - quant.weight_bytes(small) == 3 * linear_weights - 4 * rows  # 4 bytes -> 1, plus a scale per row
    ids = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        assert (small(ids) - gpt(ids)).abs().max() < 0.05


def test_equal_to_pytorch_quantize_dynamic_weights_and_exact_activations():
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    linear = torch.nn.Linear(16, 6)
    with torch.no_grad():
        linear.weight.copy_(_uneven_weight())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_dynamic is deprecated in torch 2.13, still present
        reference = quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear: per_channel_dynamic_qconfig},
                                     dtype=torch.qint8)[0]
    ours = quant.Int8Linear.from_linear(linear, qmax=127.5)  # PyTorch's convention: half of (127 - (-128))
    w = reference.weight()
    assert torch.equal(w.int_repr(), ours.weight_int8)
    assert torch.equal(w.q_per_channel_scales().float(), ours.scale)
    x = torch.randint(-64, 64, (5, 16)).float()  # on the activations' own uint8 grid: quantised exactly
    x[0, :2] = torch.tensor([-64.0, 63.0])
    assert torch.allclose(reference(x), ours(x), atol=1e-5, rtol=1e-5)  # float32 rounding only
    x = torch.randn(5, 16)  # off the grid: PyTorch also rounds the activations to 8 bits, we do not
    assert not torch.allclose(reference(x), ours(x), atol=1e-4, rtol=1e-4)
    with pytest.raises(AssertionError):  # with /127 (our default) the integers differ
        assert torch.equal(w.int_repr(), quant.Int8Linear.from_linear(linear).weight_int8)


def test_clear_error_for_a_non_matrix():
    with pytest.raises(ValueError, match="Linear weight"):
        quant.quantize_per_channel(torch.ones(3))
