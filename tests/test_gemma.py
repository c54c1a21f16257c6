"""tfcore.gemma (chapter 18) against transformers' Gemma3ForCausalLM: logits, greedy tokens past the
window, the rolling cache at every step. Each equality is shown to fail on a planted bug: the window
off by one, the local layers' rotary base, embeddings not scaled, RMSNorm's 1 + weight."""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import tfcore
from tfcore.gemma import Gemma, GemmaConfig, GemmaRMSNorm
from tfcore.sliding import RingBuffer

hf_logging.set_verbosity_error()
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                              sliding_window=4, max_position_embeddings=64,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # larger random weights: varied tokens, and norm weights w away from 0
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(-0.5, 0.5)
            elif "embed_tokens" in name:
                parameter.normal_(0, 0.3 / math.sqrt(parameter.shape[-1]))
            else:
                parameter.normal_(0, 1 / math.sqrt(parameter.shape[-1]))
    return model


@pytest.fixture(scope="module")
def ported(reference):
    return Gemma.from_transformers(reference)


IDS = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
PROMPT = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))


def gap(model, reference):
    with torch.no_grad():
        return (model(IDS) - reference(IDS).logits).abs().max().item()


def test_logits_equal_transformers(ported, reference):
    assert gap(ported, reference) < TOLERANCE


def test_greedy_tokens_equal_generate_past_the_window(ported, reference):
    theirs = reference.generate(PROMPT, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert len(set(theirs[:, 5:].flatten().tolist())) >= 8  # varied: a constant output would prove nothing
    assert torch.equal(tfcore.generate(ported, PROMPT, 20, use_cache=True), theirs)
    assert torch.equal(tfcore.generate(ported, PROMPT, 20, use_cache=False), theirs)


def cached_gap(model, ids=IDS, prompt_len=3):
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :prompt_len], cache=cache)]
        steps += [model(ids[:, t:t + 1], cache=cache) for t in range(prompt_len, ids.shape[1])]
    return (torch.cat(steps, dim=1) - full).abs().max().item()


def test_rolling_cache_is_exact_at_every_step(ported):
    assert cached_gap(ported) < TOLERANCE
    cache = ported.new_cache()
    with torch.no_grad():
        ported(IDS, cache=cache)  # a prompt longer than the window, in one call
    assert [len(layer) for layer in cache.layers] == [4, 4, 4, 4, 4, 24]


def test_ring_buffer_writing_the_wrong_slot_is_caught(ported, monkeypatch):
    monkeypatch.setattr(RingBuffer, "slots", lambda self, positions: torch.arange(len(positions)) % self.window)
    assert cached_gap(ported) > 1e-2


def broken(ported, kind):
    model = copy.deepcopy(ported)
    if kind == "window off by one":
        for layer in model.layers:
            if layer.self_attn.window is not None:
                layer.self_attn.window += 1
    elif kind == "local rotary base":
        model.local_inv_freq = model.global_inv_freq.clone()
    elif kind == "embeddings not scaled":
        model.embed_scale = 1.0
    elif kind == "RMSNorm weight, not 1 + weight":
        for module in model.modules():
            if isinstance(module, GemmaRMSNorm):
                module.forward = types.MethodType(tfcore.RMSNorm.forward, module)
    elif kind == "no QK-norm":
        for layer in model.layers:
            layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
    return model


@pytest.mark.parametrize("kind", ["window off by one", "local rotary base", "embeddings not scaled",
                                  "RMSNorm weight, not 1 + weight", "no QK-norm"])
def test_planted_port_bugs_are_caught(ported, reference, kind):
    assert gap(broken(ported, kind), reference) > 100 * TOLERANCE


def test_default_pattern_and_clear_errors():
    assert GemmaConfig(num_hidden_layers=12).layer_types.count("full_attention") == 2
    with pytest.raises(ValueError, match="layer_types must list"):
        GemmaConfig(num_hidden_layers=2, layer_types=["sliding_attention"])
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, bos_token_id=None, eos_token_id=None))
    with pytest.raises(TypeError, match="Gemma3ForCausalLM"):
        Gemma.from_transformers(llama)


def test_softcapping_as_transformers_applies_it():
    """Gemma3ForCausalLM (5.23) applies final_logit_softcapping and ignores attn_logit_softcapping."""
    torch.manual_seed(3)
    settings = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                    max_position_embeddings=32, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    capped = Gemma3ForCausalLM(Gemma3TextConfig(**settings, attn_logit_softcapping=0.5,
                                                final_logit_softcapping=0.3)).eval()
    ids = IDS[:, :12] % 50
    ours = Gemma.from_transformers(capped)
    assert gap_on(ours, capped, ids) < TOLERANCE
    with torch.no_grad():
        assert capped(ids).logits.abs().max() < 0.3  # the final cap is applied
    ours.config.final_logit_softcapping = None  # planted: the final cap forgotten
    assert gap_on(ours, capped, ids) > 100 * TOLERANCE


def gap_on(model, reference, ids):
    with torch.no_grad():
        return (model(ids) - reference(ids).logits).abs().max().item()


def test_rolling_cache_after_a_long_prompt_and_in_chunks(ported):
    """A prompt longer than the window (each ring keeps its last W), then chunks of 3 tokens."""
    with torch.no_grad():
        full = ported(IDS)
        cache = ported.new_cache()
        parts = [ported(IDS[:, :10], cache=cache)]
        parts += [ported(IDS[:, t:t + 3], cache=cache) for t in range(10, 24, 3)]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() < TOLERANCE


def test_positions_that_do_not_fit_are_a_clear_error(ported):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ported(torch.zeros(1, 65, dtype=torch.long))


# --- the port in float64: every option off its default, every parameter drawn at random --------

FLOAT64_TOLERANCE = 1e-10
OFF_DEFAULT = dict(vocab_size=61, hidden_size=40, intermediate_size=72, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=12, query_pre_attn_scalar=20, sliding_window=3,
                   max_position_embeddings=48, rms_norm_eps=1e-3,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 20000.0}},
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                   attention_bias=True, tie_word_embeddings=False, final_logit_softcapping=5.0,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
IDS64 = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(4))


def float64_reference(**changes):
    torch.manual_seed(5)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**OFF_DEFAULT, **changes})).double().eval()
    with torch.no_grad():  # every parameter random: norm weights and biases included
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 1 / math.sqrt(parameter.shape[-1]))
            else:
                parameter.uniform_(-0.5, 0.5)
    return model


def test_port_equals_transformers_in_float64_with_every_option_off_its_default():
    reference = float64_reference()
    ours = Gemma.from_transformers(reference)
    assert all(p.dtype == torch.float64 for p in ours.parameters())  # the port keeps the dtype
    for name, parameter in reference.named_parameters():
        assert not torch.all(parameter == 0) and not torch.all(parameter == 1), name
    assert gap_on(ours, reference, IDS64) < FLOAT64_TOLERANCE
    assert cached_gap(ours, IDS64) < FLOAT64_TOLERANCE  # the rolling cache, in float64 too


@pytest.mark.parametrize("kind", ["exact sqrt(hidden)", "weights rounded to float32", "attention bias dropped"])
def test_float64_check_catches_what_float32_cannot(kind):
    """Mistakes below float32's resolution, or a bias left at zero, show in float64."""
    reference = float64_reference()
    ours = Gemma.from_transformers(reference)
    if kind == "exact sqrt(hidden)":  # transformers keeps sqrt(hidden) as a float32 buffer
        ours.embed_scale = OFF_DEFAULT["hidden_size"] ** 0.5
    elif kind == "weights rounded to float32":
        ours = ours.float().double()
    else:
        with torch.no_grad():
            ours.layers[2].self_attn.o_proj.bias.zero_()
    assert gap_on(ours, reference, IDS64) > 1e3 * FLOAT64_TOLERANCE


def test_port_refuses_rotary_scaling_and_bidirectional_attention():
    """Scope: the default rotation only. transformers applies a rope_scaling (as the released 128K
    models carry) to the global layers alone; the port refuses it, naming the kind of layer."""
    small = dict(OFF_DEFAULT, rope_parameters=None)
    for scaling in ({"rope_type": "linear", "factor": 8.0},
                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 12}):
        model = Gemma3ForCausalLM(Gemma3TextConfig(**small, rope_scaling=scaling))
        assert model.config.rope_parameters["full_attention"]["rope_type"] == scaling["rope_type"]
        assert model.config.rope_parameters["sliding_attention"]["rope_type"] == "default"
        with pytest.raises(ValueError, match=f"rotary scaling '{scaling['rope_type']}' of the full_attention layers"):
            Gemma.from_transformers(model)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma.from_transformers(Gemma3ForCausalLM(Gemma3TextConfig(**small, use_bidirectional_attention=True)))
