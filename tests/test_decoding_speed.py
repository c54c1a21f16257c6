"""The speed changes made to tfcore's decoding path for chapter 23 keep its behaviour: each
replacement gives the answers of what it replaced, and a planted bug in it is caught."""

import itertools

import pytest
import torch

from tfcore import attention


def _torch_broadcast(*shapes):
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return None


SHAPES = [(), (1,), (0,), (3,), (2, 1), (1, 3), (2, 3), (4, 1, 3), (4, 2, 1), (1, 1, 1), (5, 0), (2, 3, 4)]


def test_broadcast_shape_equals_torch_broadcast_shapes():
    """Every pair and triple of some shapes, broadcastable or not, sizes 0 and 1 included."""
    cases = list(itertools.product(SHAPES, repeat=2)) + list(itertools.product(SHAPES, repeat=3))
    assert sum(_torch_broadcast(*c) is None for c in cases) > 100  # both answers are exercised
    for case in cases:
        assert attention._broadcast_shape(*case) == _torch_broadcast(*case), case


def test_planted_bug_in_broadcast_shape_is_caught(monkeypatch):
    """``zip`` instead of ``zip_longest`` drops the leading axes of the longer shape."""
    monkeypatch.setattr(attention.itertools, "zip_longest", lambda *its, fillvalue: zip(*its))
    cases = list(itertools.product(SHAPES, repeat=2))
    assert any(attention._broadcast_shape(*c) != _torch_broadcast(*c) for c in cases)


def test_attention_still_refuses_shapes_that_do_not_broadcast():
    q = torch.randn(2, 4, 3, 8)
    with pytest.raises(ValueError, match="same batch"):
        attention.scaled_dot_product_attention(q, torch.randn(3, 4, 5, 8), torch.randn(3, 4, 5, 8))
    with pytest.raises(ValueError, match="does not broadcast against the attention scores"):
        attention.scaled_dot_product_attention(q, torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8),
                                               mask=torch.ones(3, 1, 5, dtype=torch.bool))
    # and shapes that broadcast still run: keys shared by the heads, a mask for every head
    out, _ = attention.scaled_dot_product_attention(q, torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8),
                                                    mask=torch.ones(2, 1, 5, dtype=torch.bool))
    assert out.shape == (2, 4, 3, 8)
