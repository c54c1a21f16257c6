"""Batched decoding: prompts of different lengths padded on the left, run with transformers'
``attention_mask`` (1 = real token, 0 = padding) through ``tfcore.generate`` and the cached
forward of each decoder. Checked token for token against transformers' ``generate`` (greedy and
seeded sampling, float32 and float64, with and without the cache), and against each prompt
decoded alone; each check is shown to fail on a planted bug at the end of its section.

The helpers at the top (``left_padded``, ``reference_generate``, ``decoded_alone``,
``greedy_margin``, ``logit_gap_to_alone``, ``cached_gap``) serve every decoder of tfcore; a new
decoder adds its own section below.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import transformers

import tfcore
from tfcore import attention as tfcore_attention
from tfcore import gpt as tfcore_gpt
from tfcore import llama as tfcore_llama

from ports import widen
from test_modern_decoder import GPT2_OFF_DEFAULT, LLAMA_OFF_DEFAULT, gpt2, llama

transformers.utils.logging.set_verbosity_error()

LENGTHS = (11, 3, 7, 1)  # row 0 unpadded, the others padded by 8, 4 and 10 (a one-token prompt)
NEW = 12  # new tokens: 11 + 12 = 23 positions, within every model's max_position_embeddings
DTYPES = [torch.float32, torch.float64]


# --- shared helpers -------------------------------------------------------------------------------

def left_padded(vocab_size: int, lengths=LENGTHS, seed: int = 0, pad_id: int = 0):
    """Random prompts of the given lengths, padded on the left with ``pad_id`` to the longest:
    ``input_ids [B, L]`` and ``attention_mask [B, L]`` (long, 1 = real token)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(0, vocab_size, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


def reference_generate(reference, ids, mask, n: int = NEW, **sampling):
    """transformers' ``generate`` with the mask, exactly ``n`` new tokens (``min_new_tokens=n``; the
    references have no eos token, so nothing stops a row early, and no pad_token_id: with the mask
    given, transformers reads the padding from it). Greedy unless ``sampling`` is given."""
    if sampling:
        return reference.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                                  **sampling)
    return reference.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def decoded_alone(model, ids, mask, n: int = NEW):
    """Each row's prompt decoded alone, unpadded, by ``tfcore.generate``, with its padding put back on
    the left: the batched output it should equal ``[B, L + n]``."""
    rows = []
    for row, real in zip(ids, mask.bool()):
        rows.append(torch.cat([row[~real], tfcore.generate(model, row[real].unsqueeze(0), n)[0]]))
    return torch.stack(rows)


@torch.no_grad()
def greedy_margin(model, out, mask) -> float:
    """The smallest gap between the best and the second-best logit over the steps that chose the new
    tokens of ``out [B, L + n]`` (prompt mask ``[B, L]``): a rounding smaller than half of it cannot
    change a greedy token."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], out.shape[1] - mask.shape[1])], dim=1)
    logits = model(out[:, :-1], attention_mask=full_mask[:, :-1])[:, mask.shape[1] - 1:]  # [B, n, vocab]
    top = logits.topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


@torch.no_grad()
def logit_gap_to_alone(model, out, mask) -> float:
    """The largest gap between the logits of the padded batch ``out`` and those of each row run alone."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], out.shape[1] - mask.shape[1])], dim=1).bool()
    batched = model(out, attention_mask=full_mask)
    return max(float((batched[i, real] - model(out[i:i + 1, real])[0]).abs().max())
               for i, real in enumerate(full_mask))


@torch.no_grad()
def cached_gap(model, out, mask) -> float:
    """The largest gap between the logits of a cached run (prompt, then one token a step, the mask
    grown each step) and one full forward over ``out`` with the whole mask."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], out.shape[1] - mask.shape[1])], dim=1)
    cache, width = model.new_cache(), mask.shape[1]
    steps = [model(out[:, :width], cache=cache, attention_mask=full_mask[:, :width])]
    steps += [model(out[:, i:i + 1], cache=cache, attention_mask=full_mask[:, :i + 1])
              for i in range(width, out.shape[1])]
    return float((torch.cat(steps, dim=1) - model(out, attention_mask=full_mask)).abs().max())


# --- GPT, Llama, Mixtral ----------------------------------------------------------------------------

# Every option off its default (tests/test_modern_decoder.py), every parameter random. The Llama and
# the Mixtral keep transformers' default untied output layer: tied, these small random models fall
# into repeating a token (the fewest distinct tokens among a row's 12 new ones: Llama, seeds 0-5,
# 1 on five seeds and 2 on the sixth; this Mixtral 1 in float32, 2 in float64), which would blunt
# the checks; untied, every row here has 3 or more.
LLAMA_BATCHED = {**LLAMA_OFF_DEFAULT, "tie_word_embeddings": False}


def mixtral(dtype=torch.float32):
    """A random Mixtral with every option the port reads off its default (as tests/test_moe.py) but
    the untied output layer (see above); transformers' eager experts in float64 (its grouped product
    takes no float64)."""
    torch.manual_seed(3)
    config = transformers.MixtralConfig(
        vocab_size=96, max_position_embeddings=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=6, num_experts_per_tok=3,
        sliding_window=None, rms_norm_eps=1e-3, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        hidden_act="gelu", tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        experts_implementation="eager" if dtype == torch.float64 else None)
    return widen(transformers.MixtralForCausalLM(config).to(dtype).eval())


KINDS = {  # name -> (reference builder(dtype), port, vocab size)
    "gpt2": (lambda dtype: gpt2(**GPT2_OFF_DEFAULT).to(dtype), tfcore.GPT.from_transformers, 61),
    "llama": (lambda dtype: llama(**LLAMA_BATCHED).to(dtype), tfcore.Llama.from_transformers, 53),
    "mixtral": (mixtral, tfcore.Mixtral.from_transformers, 96),
}


@functools.lru_cache(maxsize=None)
def pair(kind: str, dtype: torch.dtype):
    """The reference, tfcore's port of it, and a left-padded batch for it (built once per test run)."""
    make, port, vocab = KINDS[kind]
    reference = make(dtype)
    ids, mask = left_padded(vocab)
    return reference, port(reference), ids, mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_batched_greedy_equals_transformers_generate(kind, dtype):
    reference, ours, ids, mask = pair(kind, dtype)
    expected = reference_generate(reference, ids, mask)
    assert torch.equal(expected[:, :ids.shape[1]], ids)  # transformers keeps the padding on the left
    assert min(len(set(row.tolist())) for row in expected[:, ids.shape[1]:]) >= 3  # varied: a test with teeth
    for use_cache in (True, False):
        assert torch.equal(tfcore.generate(ours, ids, NEW, use_cache=use_cache, attention_mask=mask), expected)
    assert torch.equal(tfcore.generate(ours, ids, NEW, attention_mask=mask.bool()), expected)  # bool mask too


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_batched_sampling_equals_transformers_generate_under_the_same_seed(kind, dtype):
    """transformers 5.23's ``_sample`` casts each step's last logits to float32, warps them
    (temperature, top-k, top-p) and draws one ``torch.multinomial(probs, 1)`` over ``[B, vocab]``
    from the global generator; ``tfcore.generate`` with ``generator=None`` computes the same float32
    distribution (renormalised after the cuts instead of a softmax of the cut logits: other roundings)
    and makes the same one draw per step, so the same global seed gives the same tokens, float64
    models included (their logits are cast to float32 on both sides)."""
    reference, ours, ids, mask = pair(kind, dtype)
    sampling = dict(temperature=0.7, top_k=20, top_p=0.9)  # transformers' defaults: 1.0, 50, 1.0
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = reference_generate(reference, ids, mask, **sampling)
        torch.manual_seed(seed)
        assert torch.equal(tfcore.generate(ours, ids, NEW, attention_mask=mask, **sampling), expected)
    assert not torch.equal(expected, reference_generate(reference, ids, mask))  # it sampled: not greedy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_each_row_equals_its_prompt_decoded_alone(kind, dtype):
    """Padding changes nothing a real token computes, up to rounding: the batch runs products of other
    shapes (padded rows, masked keys) than each row alone. Float64: logits within 1e-12 of the rows
    run alone (about 2e-15 measured), and the same tokens. Float32: logits within 1e-5 (about 2e-6
    measured, and about 3e-6 between the cached and the full batched run), and the same tokens; only a
    near-tie could swap a token at such gaps, and every step's best logit leads the second by more
    than 2e-5 (3.5e-4 at least, measured), which the test checks too."""
    _, ours, ids, mask = pair(kind, dtype)
    batched = tfcore.generate(ours, ids, NEW, attention_mask=mask)
    bound = 1e-12 if dtype == torch.float64 else 1e-5
    assert logit_gap_to_alone(ours, batched, mask) < bound
    if dtype == torch.float32:
        assert cached_gap(ours, batched, mask) < bound
        assert greedy_margin(ours, batched, mask) > 2 * bound
    assert torch.equal(batched, decoded_alone(ours, ids, mask))


@pytest.mark.parametrize("kind", KINDS)
def test_padded_forward_is_finite_and_the_cache_changes_nothing(kind):
    """Every logit is finite, padded positions included (a padded query sees no key: attention gives
    it zeros, not NaN), even for a row of padding only; feeding the prompt and then one token at a
    time through the cache, with the mask grown each step, gives the full forward's logits."""
    _, ours, ids, mask = pair(kind, torch.float64)
    out = tfcore.generate(ours, ids, NEW, attention_mask=mask)
    full_mask = torch.cat([mask, torch.ones(len(ids), NEW, dtype=torch.long)], dim=1)
    with torch.no_grad():
        full = ours(out, attention_mask=full_mask)
        assert torch.isfinite(full).all()
        empty = full_mask.clone()
        empty[1] = 0  # a row of padding only: allowed in forward (generate refuses it)
        assert torch.isfinite(ours(out, attention_mask=empty)).all()
    assert cached_gap(ours, out, mask) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_an_all_ones_mask_equals_no_mask(kind):
    reference, ours, ids, _ = pair(kind, torch.float32)
    plain = tfcore.generate(ours, ids, NEW)
    assert torch.equal(tfcore.generate(ours, ids, NEW, attention_mask=torch.ones_like(ids)), plain)
    assert torch.equal(plain, reference_generate(reference, ids, torch.ones_like(ids)))


# --- planted bugs: each check above can fail -----------------------------------------------------

def _positions_from_the_padded_columns(real, length):
    """Bug: a token's position is its column, padding counted (what a model without a mask does)."""
    width = real.shape[1]
    return torch.arange(width - length, width, device=real.device).expand(real.shape[0], length)


def _positions_from_the_new_columns_only(real, length):
    """Bug: positions counted over the new tokens' columns only, the cached ones forgotten."""
    return _correct_mask_positions(real[:, real.shape[1] - length:], length)


_correct_mask_positions = tfcore_gpt.mask_positions
_correct_positions_and_mask = tfcore_gpt.positions_and_mask


def _cached_steps_see_padding(input_ids, cache, vocab_size, max_positions, attention_mask=None):
    """Bug: "one new token may see every key", as without a mask: the cached padding is not masked."""
    positions, mask = _correct_positions_and_mask(input_ids, cache, vocab_size, max_positions, attention_mask)
    return positions, (None if cache is not None and input_ids.shape[1] == 1 else mask)


def _causal_mask_only(input_ids, cache, vocab_size, max_positions, attention_mask=None):
    """Bug: the mask gives the positions but only the causal mask is applied: padded keys are seen."""
    positions, _ = _correct_positions_and_mask(input_ids, cache, vocab_size, max_positions, attention_mask)
    _, causal = _correct_positions_and_mask(input_ids, cache, vocab_size, max_positions)
    return positions, causal


def _plant(monkeypatch, bug):
    if bug in (_positions_from_the_padded_columns, _positions_from_the_new_columns_only):
        monkeypatch.setattr(tfcore_gpt, "mask_positions", bug)
    else:  # tfcore.llama imported the name: patch both
        monkeypatch.setattr(tfcore_gpt, "positions_and_mask", bug)
        monkeypatch.setattr(tfcore_llama, "positions_and_mask", bug)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bug", [_positions_from_the_new_columns_only, _cached_steps_see_padding,
                                 _causal_mask_only], ids=lambda bug: bug.__name__.strip("_"))
def test_planted_mask_bugs_break_the_checks(kind, bug, monkeypatch):
    reference, ours, ids, mask = pair(kind, torch.float64)
    expected = reference_generate(reference, ids, mask)
    _plant(monkeypatch, bug)
    got = tfcore.generate(ours, ids, NEW, attention_mask=mask)
    assert not torch.equal(got, expected)  # transformers' generate
    assert not torch.equal(got, decoded_alone(ours, ids, mask))  # each row alone
    uncached = tfcore.generate(ours, ids, NEW, attention_mask=mask, use_cache=False)
    if bug is _causal_mask_only:  # a bug of every forward: the full forward sees padding too
        assert not torch.equal(uncached, expected)
        assert logit_gap_to_alone(ours, expected, mask) > 1e-3
    else:  # a bug of the cached steps only: without a cache every step is one whole forward
        assert torch.equal(uncached, expected)
        assert cached_gap(ours, expected, mask) > 1e-3


def test_positions_from_the_padded_columns_show_in_gpt_only(monkeypatch):
    """Positions taken from the columns (padding counted) shift each row by its padding. GPT's
    learned positions see it; rotary scores depend only on the difference of two positions
    (tests/test_modern_decoder.py), so Llama and Mixtral give the same tokens, and logits that differ
    only by the rounding of the angles (computed in float32, as transformers does: about 1e-6 here,
    float64 models included): for them the mask's positions matter through rounding only."""
    expected = {}
    for kind in KINDS:
        reference, _, ids, mask = pair(kind, torch.float64)
        expected[kind] = reference_generate(reference, ids, mask)
    _plant(monkeypatch, _positions_from_the_padded_columns)
    for kind in KINDS:
        _, ours, ids, mask = pair(kind, torch.float64)
        got = tfcore.generate(ours, ids, NEW, attention_mask=mask)
        assert torch.equal(got, expected[kind]) == (kind != "gpt2"), kind
        if kind != "gpt2":
            assert logit_gap_to_alone(ours, got, mask) < 1e-4


def _textbook_attention(query, key, value, mask=None, dropout=None, need_weights=True):
    """Bug: blocked scores set to -inf before the softmax, and nothing more: a query whose keys are
    all blocked (a padded one) gets 0/0 = NaN weights."""
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.shape[-1])
    if mask is not None:
        mask = mask.unsqueeze(1) if scores.dim() == 4 and mask.dim() == 3 else mask
        scores = scores.masked_fill(~mask.bool(), float("-inf"))
    weights = scores.softmax(dim=-1)
    return weights @ value, weights if need_weights else None


@pytest.mark.parametrize("kind", KINDS)
def test_planted_nan_for_a_padded_query_breaks_the_finite_check(kind, monkeypatch):
    """A padded query's NaN does not stay at its position: the next layer's real queries give its key
    weight 0, and 0 x NaN is NaN, so every logit of a padded row's real tokens is lost (2 layers or more)."""
    _, ours, ids, mask = pair(kind, torch.float64)
    out = tfcore.generate(ours, ids, NEW, attention_mask=mask)
    full_mask = torch.cat([mask, torch.ones(len(ids), NEW, dtype=torch.long)], dim=1)
    monkeypatch.setattr(tfcore_attention, "scaled_dot_product_attention", _textbook_attention)
    monkeypatch.setattr(tfcore_llama, "scaled_dot_product_attention", _textbook_attention)
    with torch.no_grad():
        assert torch.isfinite(ours(out)).all()  # no padding, no blocked row: the bug hides
        logits = ours(out, attention_mask=full_mask)
    assert torch.isnan(logits[1:][full_mask[1:].bool()]).all()  # rows 1-3 are padded
    assert torch.isfinite(logits[0]).all()  # the unpadded row keeps its own
