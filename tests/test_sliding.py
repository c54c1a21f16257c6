"""Sliding-window masks and the rolling KV cache (chapter 18). Each equality is shown to fail on a
planted bug: a window off by one, a ring buffer that overwrites the wrong slot."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.utils import logging as hf_logging

import tfcore
from tfcore.sliding import RingBuffer, RollingKVCache, position_mask, sliding_window_mask

hf_logging.set_verbosity_error()


def hf_mask(length, window):
    config = Gemma3TextConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=1,
                              num_key_value_heads=1, head_dim=16, sliding_window=window,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=torch.zeros(1, length, 16),
                                             attention_mask=None, past_key_values=None,
                                             position_ids=torch.arange(length)[None], allow_is_causal_skip=False)
    return mask[0, 0]


def off_by_one_mask(length, window):
    """The planted bug: 'the last W' read as the W positions before the query, plus itself."""
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return ((k <= q) & (k >= q - window)).unsqueeze(0)


@pytest.mark.parametrize("window", [1, 2, 3, 5, 8])
def test_mask_equals_transformers(window):
    for length in (1, window, window + 1, 20):
        assert torch.equal(sliding_window_mask(length, window)[0], hf_mask(length, window))


def test_off_by_one_window_is_caught():
    assert not torch.equal(off_by_one_mask(12, 4)[0], hf_mask(12, 4))


def test_window_none_is_the_causal_mask_and_past_shifts_the_queries():
    assert torch.equal(sliding_window_mask(7, None), tfcore.causal_mask(7))
    assert torch.equal(sliding_window_mask(3, 4, past=5), sliding_window_mask(8, 4)[:, 5:])


def test_pair_count_formula():
    for length in range(1, 40):
        for window in (1, 3, 8, 64):
            expected = length * (length + 1) // 2 if length < window else length * window - window * (window - 1) // 2
            assert sliding_window_mask(length, window).sum().item() == expected


def test_bad_window_is_a_clear_error():
    with pytest.raises(ValueError, match="sliding window must be a whole number"):
        sliding_window_mask(5, 0)
    with pytest.raises(ValueError, match="needs a window"):
        RingBuffer(None)


def ring_attention_gap(slots=None, steps=30, window=5, prompt=3):
    """Attention of one head over a RingBuffer, one query at a time, against attention over every key
    under the sliding-window mask. ``slots`` replaces RingBuffer.slots (a planted bug)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, steps, 8) for _ in range(3))
    positions = torch.arange(steps)
    full, _ = tfcore.scaled_dot_product_attention(q, k, v, sliding_window_mask(steps, window))
    ring = RingBuffer(window)
    if slots is not None:
        ring.slots = slots.__get__(ring)
    outs = []
    for start, end in [(0, prompt)] + [(t, t + 1) for t in range(prompt, steps)]:
        keys, values, key_positions = ring.append(k[..., start:end, :], v[..., start:end, :], positions[start:end])
        mask = position_mask(positions[start:end], key_positions, window)
        outs.append(tfcore.scaled_dot_product_attention(q[..., start:end, :], keys, values, mask)[0])
    return (torch.cat(outs, dim=-2) - full).abs().max().item(), ring


def test_ring_buffer_is_exact_and_holds_the_last_window():
    gap, ring = ring_attention_gap()
    assert gap < 1e-6
    assert sorted(ring.positions.tolist()) == list(range(25, 30)) and len(ring) == 5


def test_ring_buffer_writing_the_wrong_slot_is_caught():
    gap, _ = ring_attention_gap(slots=lambda self, positions: torch.arange(len(positions)) % self.window)
    assert gap > 1e-2
    gap, _ = ring_attention_gap(slots=lambda self, positions: (positions + 1) % (self.window - 1))
    assert gap > 1e-2


def test_a_prompt_longer_than_the_window_keeps_its_last_positions():
    ring = RingBuffer(4)
    keys = torch.arange(10.0).view(1, 1, 10, 1)
    ring.append(keys, keys, torch.arange(10))
    assert sorted(ring.positions.tolist()) == [6, 7, 8, 9]
    assert sorted(ring.keys.flatten().tolist()) == [6.0, 7.0, 8.0, 9.0]


def test_nbytes_follows_the_formula():
    cache = RollingKVCache([3, None, 3])
    for t in range(1, 9):
        k = torch.zeros(2, 2, 1, 4)
        for i in range(3):
            cache.append(i, k, k, torch.tensor([t - 1]))
        assert cache.nbytes() == 2 * 2 * 2 * 4 * 4 * (t + 2 * min(t, 3))


def test_a_ring_that_forgets_its_positions_is_caught(monkeypatch):
    """The planted bug: the slots taken to be in position order, which they are not after a wrap-around."""
    right = RingBuffer.append

    def assumes_order(self, keys, values, positions):
        k, v, _ = right(self, keys, values, positions)
        last = positions[-1].item()
        return k, v, torch.arange(last - k.shape[-2] + 1, last + 1)

    monkeypatch.setattr(RingBuffer, "append", assumes_order)
    gap, _ = ring_attention_gap()
    assert gap > 1e-2


# --- learned sink logits (gpt-oss) ----------------------------------------------------------------

def _sink_inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 10, 6, generator=g, dtype=dtype) for _ in range(3))
    sinks = torch.randn(3, generator=g, dtype=dtype)
    positions = torch.arange(10)
    mask = position_mask(positions, positions, 3).expand(2, 10, 10).clone()
    mask[0, 4] = False  # a query with no key
    return q, k, v, sinks, mask


def _gpt_oss(q, k, v, sinks, mask):
    import math
    import types

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=1, training=False)
    additive = torch.zeros(mask.shape[0], 1, *mask.shape[1:], dtype=q.dtype).masked_fill(~mask.unsqueeze(1), -math.inf)
    out, weights = eager_attention_forward(module, q, k, v, additive, scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2), weights


def test_sink_attention_equals_gpt_oss_in_float64():
    from tfcore.sliding import sink_attention
    q, k, v, sinks, mask = _sink_inputs()
    ours, weights = sink_attention(q, k, v, sinks, mask)
    theirs, their_weights = _gpt_oss(q, k, v, sinks, mask)
    assert (ours - theirs).abs().max() < 1e-12 and (weights - their_weights).abs().max() < 1e-12
    assert torch.equal(ours[0, :, 4], torch.zeros(3, 6))  # no key: zeros, not NaN
    assert (weights.sum(-1) < 1).all()
    # a sink logit of -inf is plain attention
    plain, _ = tfcore.scaled_dot_product_attention(q, k, v, mask.unsqueeze(1))
    none, _ = sink_attention(q, k, v, torch.full((3,), float("-inf"), dtype=torch.float64), mask)
    assert (none - plain).abs().max() < 1e-12


def test_sink_attention_planted_bugs_are_caught():
    """The sink's weight kept in the output (a softmax over keys only), and the sinks of the wrong heads."""
    from tfcore.sliding import sink_attention
    q, k, v, sinks, mask = _sink_inputs()
    theirs, _ = _gpt_oss(q, k, v, sinks, mask)
    keys_only, _ = sink_attention(q, k, v, torch.full((3,), float("-inf"), dtype=torch.float64), mask)
    swapped, _ = sink_attention(q, k, v, sinks.flip(0), mask)
    live = mask.any(-1)[:, None, :, None]
    assert ((keys_only - theirs) * live).abs().max() > 1e-3
    assert (swapped - theirs).abs().max() > 1e-3


def test_sink_attention_bad_input_is_a_clear_error():
    from tfcore.sliding import sink_attention
    q, k, v, sinks, mask = _sink_inputs()
    with pytest.raises(ValueError, match="one logit per head"):
        sink_attention(q, k, v, sinks[:2], mask)
    with pytest.raises(ValueError, match="repeat the key/value heads"):
        sink_attention(q, k[:, :1], v[:, :1], sinks, mask)
    with pytest.raises(ValueError, match="must be bool"):
        sink_attention(q, k, v, sinks, mask.long())
    with pytest.raises(ValueError, match=r"\[B, H, L, d\]"):
        sink_attention(q[0], k, v, sinks)
