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

import copy
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


def assert_all_ones_mask_is_no_mask(reference, ours, ids):
    """An all-ones mask gives tfcore.generate's tokens without a mask, and transformers' with it."""
    plain = tfcore.generate(ours, ids, NEW)
    assert torch.equal(tfcore.generate(ours, ids, NEW, attention_mask=torch.ones_like(ids)), plain)
    assert torch.equal(plain, reference_generate(reference, ids, torch.ones_like(ids)))


@pytest.mark.parametrize("kind", KINDS)
def test_an_all_ones_mask_equals_no_mask(kind):
    reference, ours, ids, _ = pair(kind, torch.float32)
    assert_all_ones_mask_is_no_mask(reference, ours, ids)


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
    past, length = (0 if cache is None else cache.length), input_ids.shape[1]
    causal = None if (cache is not None and length == 1) else tfcore_attention.causal_mask(length, input_ids.device, past)
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


# ==================================================================================================
# Gemma 3 and DeepSeek-V3 (helper H3): tfcore.Gemma with its rolling cache (chapter 18), tfcore.DeepseekV3
# with its latent cache, expanded and absorbed (chapter 19), and DeepseekV3WithExperts (chapter 21).
# The references are the float64 port tests' configurations (tests/test_gemma.py, tests/test_mla.py,
# tests/test_moe.py), every option off its default and every parameter random, drawn in float64;
# float32 is the same model rounded. Gemma's window (3) is far shorter than the 11 + 12 columns, so
# the rings wrap.
# ==================================================================================================

import test_gemma
import test_mla
from tfcore import gemma as tfcore_gemma
from tfcore import mla as tfcore_mla


def gemma3(dtype):
    """tests/test_gemma.py's float64 reference with embeddings N(0, 0.3²): at its N(0, 1/40) two rows of
    this batch fall into repeating tokens (3 and 2 distinct tokens among 12, measured)."""
    model = test_gemma.float64_reference()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.3)
    return model.to(dtype)


def _doubled(model):
    """Every matrix times 2: greedy rows of these small references otherwise repeat tokens (distinct
    tokens among a row's 12, measured on this batch: DeepSeek 1, 1, 2, 1; with experts 4, 7, 7, 1)."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.mul_(2.0)
    return model


def deepseek_v3(dtype):
    """tests/test_mla.py's float64 reference (dense, 3 layers, rope_interleave=False, GELU, biases, tied)."""
    return _doubled(test_mla.float64_reference()).to(dtype)


def deepseek_v3_experts(dtype):
    """A DeepSeek-V3 with experts as tests/test_moe.py's float64 check builds it (every expert option
    off its default, rms_norm_eps at its default as there; ``widen`` draws every parameter, the
    choice biases too), smaller; transformers' eager experts (its grouped product takes no float64)."""
    torch.manual_seed(7)
    config = transformers.DeepseekV3Config(
        vocab_size=61, max_position_embeddings=48, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=1.7,
        attention_bias=True, rope_interleave=False, hidden_act="gelu", norm_topk_prob=False,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 700.0},
        experts_implementation="eager", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return _doubled(widen(transformers.DeepseekV3ForCausalLM(config).double().eval())).to(dtype)


H3_KINDS = {  # name -> (reference builder(dtype), port); vocabulary 61 for all three
    "gemma3": (gemma3, tfcore.Gemma.from_transformers),
    "deepseek_v3": (deepseek_v3, tfcore.DeepseekV3.from_transformers),
    "deepseek_v3_experts": (deepseek_v3_experts, tfcore.DeepseekV3WithExperts.from_transformers),
}
_correct_key_mask = tfcore_gemma.key_mask


@functools.lru_cache(maxsize=None)
def h3_reference(kind: str, dtype: torch.dtype):
    return H3_KINDS[kind][0](dtype)


def h3_pair(kind: str, dtype: torch.dtype):
    """The reference (built once), a fresh port of it (tests set its ``absorbed``) and H2's padded batch."""
    reference = h3_reference(kind, dtype)
    return (reference, H3_KINDS[kind][1](reference), *left_padded(61))


def forms(model):
    """Set each form of the model in turn and yield it: DeepSeek's attention expanded, then absorbed
    (``generate`` reads ``model.absorbed``); Gemma's one form."""
    if not isinstance(model, tfcore.DeepseekV3):
        yield "Gemma"
        return
    for absorbed in (False, True):
        model.absorbed = absorbed
        yield absorbed


@torch.no_grad()
def gap_to_transformers(reference, ours, out, mask) -> float:
    """The largest gap between our logits and transformers' at the real tokens of ``out [B, L + n]``
    (prompt mask ``[B, L]``): one forward over the whole sequences, and the cached run (the prompt,
    then one column a step). transformers gets the position_ids its generate builds."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], out.shape[1] - mask.shape[1])], dim=1)
    real, width = full_mask.bool(), mask.shape[1]
    theirs = reference(out, attention_mask=full_mask, position_ids=_correct_mask_positions(real, out.shape[1])).logits
    cache = ours.new_cache()
    steps = [ours(out[:, :width], cache=cache, attention_mask=full_mask[:, :width])]
    steps += [ours(out[:, i:i + 1], cache=cache, attention_mask=full_mask[:, :i + 1]) for i in range(width, out.shape[1])]
    return max(float((logits - theirs)[real].abs().max())
               for logits in (ours(out, attention_mask=full_mask), torch.cat(steps, dim=1)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", H3_KINDS)
def test_gemma_and_deepseek_batched_greedy_equal_transformers_generate(kind, dtype):
    reference, ours, ids, mask = h3_pair(kind, dtype)
    expected = reference_generate(reference, ids, mask)
    assert min(len(set(row.tolist())) for row in expected[:, ids.shape[1]:]) >= 5  # varied: a test with teeth
    for _ in forms(ours):
        for use_cache in (True, False):
            assert torch.equal(tfcore.generate(ours, ids, NEW, use_cache=use_cache, attention_mask=mask), expected)
    if dtype == torch.float64:  # and the logits behind the tokens (0 measured)
        for _ in forms(ours):
            assert gap_to_transformers(reference, ours, expected, mask) < 1e-10


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", H3_KINDS)
def test_gemma_and_deepseek_batched_sampling_equals_transformers_generate_under_the_same_seed(kind, dtype):
    """As for GPT, Llama and Mixtral above: the same float32 draw from the same global generator."""
    reference, ours, ids, mask = h3_pair(kind, dtype)
    sampling = dict(temperature=0.7, top_k=20, top_p=0.9)  # transformers' defaults: 1.0, 50, 1.0
    torch.manual_seed(0)
    expected = reference_generate(reference, ids, mask, **sampling)
    assert not torch.equal(expected, reference_generate(reference, ids, mask))  # it sampled: not greedy
    for _ in forms(ours):
        torch.manual_seed(0)
        assert torch.equal(tfcore.generate(ours, ids, NEW, attention_mask=mask, **sampling), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", H3_KINDS)
def test_gemma_and_deepseek_rows_equal_their_prompts_decoded_alone(kind, dtype):
    """Float64: logits within 1e-12 of each row run alone (3.6e-15 at most, measured) and the same
    tokens. Float32: logits within 5e-5 (1.3e-5 at most, measured, on logits up to 12 in size) and
    the same tokens, which the bound implies where every step's best logit leads the second by more
    than twice it (3.0e-4 at least, measured), which the test checks too."""
    _, ours, ids, mask = h3_pair(kind, dtype)
    bound = 1e-12 if dtype == torch.float64 else 5e-5
    for _ in forms(ours):
        batched = tfcore.generate(ours, ids, NEW, attention_mask=mask)
        assert logit_gap_to_alone(ours, batched, mask) < bound
        if dtype == torch.float32:
            assert greedy_margin(ours, batched, mask) > 2 * bound
        assert torch.equal(batched, decoded_alone(ours, ids, mask))


@pytest.mark.parametrize("kind", H3_KINDS)
def test_gemma_and_deepseek_all_ones_mask_equals_no_mask_and_a_padded_cache_needs_its_mask(kind):
    reference, ours, ids, mask = h3_pair(kind, torch.float32)
    assert_all_ones_mask_is_no_mask(reference, ours, ids)
    cache = ours.new_cache()
    with torch.no_grad():
        ours(ids, cache=cache, attention_mask=mask)
        with pytest.raises(ValueError, match="holds padded"):  # the cache holds padding: a silent wrong result
            ours(ids[:, :1], cache=cache)


def _padded_query_outputs(model, ids, mask):
    """Each layer's attention output at the padded queries, and the logits (float64)."""
    outputs = []
    hooks = [layer.self_attn.register_forward_hook(lambda module, args, out: outputs.append(out[mask == 0]))
             for layer in model.layers]
    try:
        with torch.no_grad():
            logits = model(ids, attention_mask=mask)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, logits


def _attend_without_zeroing(q, k, v, scale, mask=None):
    """Bug: a query that sees no key is left to the softmax (DeepSeek's most negative float then
    averages the padded values)."""
    return _correct_attend(q, k, v, scale, None if mask is None else mask | ~mask.any(dim=-1, keepdim=True))


_correct_attend = tfcore_mla.attend


@pytest.mark.parametrize("planted", [False, True], ids=["as built", "planted: padded queries not zeroed"])
@pytest.mark.parametrize("kind", ["gemma3", "deepseek_v3"])
def test_gemma_and_deepseek_padded_queries_get_zeros_not_nan(kind, planted, monkeypatch):
    """A padded query sees no key: attention gives it a zero context, so each layer's attention
    output there is o_proj's bias, and every logit is finite, for a row of padding only too. The
    cache changes nothing: the cached run equals one forward (cached_gap, above). Planted, Gemma's
    row of -inf gives NaN, which reaches the real tokens through the next layer's values; DeepSeek's
    most negative float gives a finite average of the padded values instead."""
    _, ours, ids, mask = h3_pair(kind, torch.float64)
    if planted:
        if kind == "gemma3":
            monkeypatch.setattr(tfcore_gemma, "zero_empty_rows", lambda weights, mask: weights)
        else:
            monkeypatch.setattr(tfcore_mla, "attend", _attend_without_zeroing)
    for _ in forms(ours):
        outputs, logits = _padded_query_outputs(ours, ids, mask)
        zeros = all(torch.equal(out, layer.self_attn.o_proj.bias.expand_as(out))
                    for out, layer in zip(outputs, ours.layers))
        assert zeros != planted
        if planted:
            assert logits[mask == 1].isnan().any() if kind == "gemma3" else torch.isfinite(logits).all()
            continue
        assert torch.isfinite(logits).all()
        empty = mask.clone()
        empty[1] = 0  # a row of padding only: allowed in forward (generate refuses it)
        with torch.no_grad():
            assert torch.isfinite(ours(ids, attention_mask=empty)).all()
        assert cached_gap(ours, tfcore.generate(ours, ids, NEW, attention_mask=mask), mask) < 1e-12


# --- planted bugs: each check of this section can fail ------------------------------------------------

def _window_in_positions(query_columns, key_columns, window, real=None):
    """Bug: the window measured in positions (real tokens before) instead of columns."""
    if window is None or real is None:
        return _correct_key_mask(query_columns, key_columns, window, real)
    positions = _correct_mask_positions(real, real.shape[1])  # [B, T]
    q, k = positions[:, query_columns], positions[:, key_columns]
    return _correct_key_mask(query_columns, key_columns, None, real) & (k[:, None, :] > q[:, :, None] - window)


def _gemma_cached_steps_see_padding(query_columns, key_columns, window, real=None):
    """Bug: the padding mask applied to the prompt only, as if one new token could see every key."""
    return _correct_key_mask(query_columns, key_columns, window, real if len(query_columns) > 1 else None)


@torch.no_grad()
def test_gemma_window_counts_columns_padding_included(monkeypatch):
    """transformers measures a local layer's window in columns, padding included, not in positions:
    a row with a gap of padding as wide as the window tells the two apart (its query right after the
    gap sees only itself). Left padding cannot: a row's positions are its columns minus its padding,
    so the generate checks above pass with either (shown here)."""
    reference, ours, ids, mask = h3_pair("gemma3", torch.float64)
    expected = reference_generate(reference, ids, mask)
    gapped = torch.ones(2, 12, dtype=torch.long)
    gapped[0, 3:6] = 0  # a gap of 3 columns, the window, inside row 0
    gapped[1, :4] = 0  # row 1 padded on the left
    sequences = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(8))
    assert gap_to_transformers(reference, ours, sequences, gapped[:, :7]) < 1e-10
    monkeypatch.setattr(tfcore_gemma, "key_mask", _window_in_positions)
    assert gap_to_transformers(reference, ours, sequences, gapped[:, :7]) > 1e-2
    assert torch.equal(tfcore.generate(ours, ids, NEW, attention_mask=mask), expected)  # left padding: the same


@pytest.mark.parametrize("bug", ["positions from the new columns only", "cached steps see padding"])
@pytest.mark.parametrize("kind", ["gemma3", "deepseek_v3"])
def test_planted_bugs_break_the_gemma_and_deepseek_checks(kind, bug, monkeypatch):
    reference, ours, ids, mask = h3_pair(kind, torch.float64)
    expected = reference_generate(reference, ids, mask)
    if bug == "positions from the new columns only":  # H2's bugs, where these models read them
        monkeypatch.setattr(tfcore_gemma if kind == "gemma3" else tfcore_gpt, "mask_positions",
                            _positions_from_the_new_columns_only)
    elif kind == "gemma3":
        monkeypatch.setattr(tfcore_gemma, "key_mask", _gemma_cached_steps_see_padding)
    else:
        monkeypatch.setattr(tfcore_mla, "positions_and_mask", _cached_steps_see_padding)
    for _ in forms(ours):
        got = tfcore.generate(ours, ids, NEW, attention_mask=mask)
        assert not torch.equal(got, expected)  # transformers' generate
        assert not torch.equal(got, decoded_alone(ours, ids, mask))  # each row alone
        assert gap_to_transformers(reference, ours, expected, mask) > 1e-3
        assert torch.equal(tfcore.generate(ours, ids, NEW, attention_mask=mask, use_cache=False), expected)


@pytest.mark.parametrize("kind", ["gemma3", "deepseek_v3"])
def test_positions_from_the_padded_columns_show_in_the_float64_logits_only(kind, monkeypatch):
    """Rotary scores depend on the difference of two positions, so positions taken from the columns
    shift a row's queries and keys alike: the tokens stay, and the logits move by the rounding of
    the float32 angles (9e-7 for Gemma, 4e-6 for DeepSeek, measured), which the float64
    comparison with transformers (1e-10) sees and the float32 one could not."""
    reference, ours, ids, mask = h3_pair(kind, torch.float64)
    expected = reference_generate(reference, ids, mask)
    monkeypatch.setattr(tfcore_gemma if kind == "gemma3" else tfcore_gpt, "mask_positions",
                        _positions_from_the_padded_columns)
    for _ in forms(ours):
        assert torch.equal(tfcore.generate(ours, ids, NEW, attention_mask=mask), expected)
        assert 1e-8 < gap_to_transformers(reference, ours, expected, mask) < 1e-4


# ----------------------------------------------------------------------------------------------
# bfloat16: the rotary angles are computed in float32 and handed to the layers in the model's
# dtype, as transformers' rotary embeddings return them; before, a bfloat16 Llama, Gemma or
# DeepSeek-V3 met float32 queries and keys and raised (chapter 23 runs bfloat16 weights).

@pytest.mark.parametrize("kind", [*KINDS, *H3_KINDS])
def test_ports_run_in_bfloat16_as_close_to_transformers_as_its_own_rounding(kind):
    """In bfloat16 a port's logits (padded batch, positions from the mask) lie within twice the
    distance of transformers' bfloat16 logits from its float32 ones: the port rounds no worse than
    the reference does. GPT-2 and Llama gave exactly transformers' bfloat16 logits in the run
    this bound was set on; the others differ in the order of their roundings."""
    reference, ours, ids, mask = (pair if kind in KINDS else h3_pair)(kind, torch.float32)
    positions = tfcore_gpt.mask_positions(mask.bool(), ids.shape[1])
    real = mask.bool()
    with torch.no_grad():
        exact = reference(ids, attention_mask=mask, position_ids=positions).logits
        theirs = copy.deepcopy(reference).to(torch.bfloat16)(ids, attention_mask=mask, position_ids=positions).logits
        mine = copy.deepcopy(ours).to(torch.bfloat16)(ids, attention_mask=mask)
    assert mine.dtype == torch.bfloat16 and torch.isfinite(mine).all()
    rounding = float((theirs.float() - exact)[real].abs().max())
    assert 0 < rounding < 1  # bfloat16 rounds, and not wildly
    assert float((mine.float() - theirs.float())[real].abs().max()) <= 2 * rounding
