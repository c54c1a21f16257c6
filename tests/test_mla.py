"""Multi-head latent attention (chapter 19): tfcore.mla's DeepseekV3 ported from transformers, its
latent cache and the absorbed form. Each check is shown to fail on a planted bug: an absorbed
projection without its transpose, a rotary key that is not shared or in Llama's layout, and a cache
that stores expanded keys instead of the latent."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config as HFConfig
from transformers import DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
from transformers.utils import logging as hf_logging

import tfcore
from tfcore import mla
from tfcore.mla import DeepseekV3, DeepseekV3Config, LatentLayerCache, MultiHeadLatentAttention

from ports import widen

hf_logging.set_verbosity_error()
TOLERANCE = 1e-4  # the interface's "equal": within 1e-4 of transformers' logits
SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, first_k_dense_replace=2, max_position_embeddings=64, bos_token_id=None,
             eos_token_id=None)


def reference(seed=0, **overrides):
    """A small dense DeepseekV3ForCausalLM with weights large enough that greedy decoding varies."""
    torch.manual_seed(seed)
    return widen(DeepseekV3ForCausalLM(HFConfig(**{**SIZES, **overrides})).eval())


def ids(seed=1, length=20):
    return torch.randint(0, SIZES["vocab_size"], (2, length), generator=torch.Generator().manual_seed(seed))


def logit_gap(ours, theirs, tokens, absorbed=False) -> float:
    with torch.no_grad():
        return float((ours(tokens, absorbed=absorbed) - theirs(tokens).logits).abs().max())


def cached_logits_gap(model, tokens, prompt_len=5, absorbed=False) -> float:
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache()
        steps = [model(tokens[:, :prompt_len], cache=cache, absorbed=absorbed)]
        steps += [model(tokens[:, i:i + 1], cache=cache, absorbed=absorbed) for i in range(prompt_len, tokens.shape[1])]
    return float((torch.cat(steps, dim=1) - full).abs().max())


def cache_bytes_problem(model, tokens) -> str | None:
    """The cache must hold layers x B x positions x (kv_lora_rank + qk_rope_head_dim) float32 numbers."""
    c = model.config
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens, cache=cache)
    expected = c.num_hidden_layers * tokens.numel() * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    return None if cache.nbytes() == expected else f"nbytes() {cache.nbytes()} != latent formula {expected}"


def rotary_key_shared(attention, x, cos, sin) -> bool:
    """Every head's expanded key ends with the same rotary part: the one that was cached."""
    layer_cache = LatentLayerCache()
    with torch.no_grad():
        attention(x, cos, sin, None, layer_cache)
        keys, _ = attention.expand(layer_cache.latent, layer_cache.k_rope)
    nope = attention.nope
    return all(torch.equal(keys[:, h, :, nope:], layer_cache.k_rope) for h in range(keys.shape[1]))


# --- the port ---------------------------------------------------------------------------------

@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_logits_equal_transformers_in_both_forms(q_lora_rank):
    theirs = reference(q_lora_rank=q_lora_rank)
    ours = DeepseekV3.from_transformers(theirs)
    tokens = ids()
    assert logit_gap(ours, theirs, tokens) < TOLERANCE
    assert logit_gap(ours, theirs, tokens, absorbed=True) < TOLERANCE


@pytest.mark.parametrize("absorbed", [False, True])
def test_cached_steps_equal_the_full_pass(absorbed):
    ours = DeepseekV3.from_transformers(reference())
    assert cached_logits_gap(ours, ids(), absorbed=absorbed) < 1e-5


def test_greedy_tokens_equal_generate_with_and_without_cache():
    theirs = reference()
    ours = DeepseekV3.from_transformers(theirs)
    prompt = torch.randint(1, SIZES["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(2))
    expected = theirs.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert len(set(expected[:, 5:].flatten().tolist())) >= 8  # varied: a constant output would prove little
    assert torch.equal(tfcore.generate(ours, prompt, 20), expected)
    assert torch.equal(tfcore.generate(ours, prompt, 20, use_cache=False), expected)
    ours.absorbed = True
    assert torch.equal(tfcore.generate(ours, prompt, 20), expected)


def test_our_cache_holds_what_transformers_caches():
    theirs = reference()
    ours = DeepseekV3.from_transformers(theirs)
    tokens, cache = ids(), ours.new_cache()
    with torch.no_grad():
        ours(tokens, cache=cache)
        their_cache = theirs(tokens, use_cache=True).past_key_values
    for t, c in zip(their_cache.layers, cache.layers):
        assert torch.allclose(t.keys[:, 0], c.latent, atol=1e-5)
        assert torch.allclose(t.values[:, 0], c.k_rope, atol=1e-5)
    assert cache_bytes_problem(ours, tokens) is None


def test_defaults_and_softmax_scale_are_deepseek_v3s():
    ours, theirs = DeepseekV3Config(), HFConfig()
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "vocab_size"):
        assert getattr(ours, name) == getattr(theirs, name), name
    with torch.device("meta"):
        assert DeepseekV3Attention(theirs, layer_idx=0).scaling == ours.softmax_scale == 192 ** -0.5


def test_num_key_value_heads_is_not_read():
    theirs = reference(num_key_value_heads=128)  # transformers' default; its sdpa attention ignores it
    assert logit_gap(DeepseekV3.from_transformers(theirs), theirs, ids()) < TOLERANCE


def test_a_llama_layout_reference_is_ported_with_its_layout():
    theirs = reference(rope_interleave=False)
    ours = DeepseekV3.from_transformers(theirs)
    assert ours.config.rope_interleave is False
    assert logit_gap(ours, theirs, ids()) < TOLERANCE


# --- clear errors ----------------------------------------------------------------------------

def test_bad_configs_and_models_get_clear_errors():
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        DeepseekV3.from_transformers(DeepseekV3ForCausalLM(HFConfig(**{**SIZES, "first_k_dense_replace": 1,
                                                                         "n_routed_experts": 4, "n_group": 1,
                                                                         "topk_group": 1, "num_experts_per_tok": 2,
                                                                         "moe_intermediate_size": 16})))
    with pytest.raises(TypeError, match="DeepseekV3ForCausalLM"):
        DeepseekV3.from_transformers(tfcore.Llama(tfcore.LlamaConfig(hidden_size=32, num_attention_heads=4,
                                                                     num_hidden_layers=1, vocab_size=11)))
    with pytest.raises(ValueError, match="must be even"):
        DeepseekV3Config(qk_rope_head_dim=7)
    cache = LatentLayerCache()
    cache.append(torch.zeros(2, 3, 32), torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match="new_cache"):
        cache.append(torch.zeros(1, 1, 32), torch.zeros(1, 1, 8))
    with pytest.raises(ValueError, match="capacity"):
        LatentLayerCache(capacity=2).append(torch.zeros(1, 3, 32), torch.zeros(1, 3, 8))


def test_a_fully_masked_row_gives_zeros_not_nan():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = torch.ones(1, 3, 5, dtype=torch.bool)
    mask[0, 1] = False  # query 1 may see no key
    out = mla.attend(q, k, v, 0.5, mask)
    assert not out.isnan().any() and torch.equal(out[:, :, 1], torch.zeros(1, 2, 4))
    assert torch.allclose(out[:, :, 0], mla.attend(q[:, :, :1], k, v, 0.5)[:, :, 0], atol=1e-6)
    # without the zeroing (the planted bug) the blocked row would average every value instead
    unzeroed = (q @ k.transpose(-2, -1) * 0.5).masked_fill(~mask[:, None], torch.finfo(q.dtype).min).softmax(-1) @ v
    assert not torch.equal(unzeroed[:, :, 1], torch.zeros(1, 2, 4))


# --- planted bugs: each check above must catch one -------------------------------------------

def test_planted_absorbed_projections_without_their_transpose_are_caught(monkeypatch):
    # With qk_nope_head_dim = v_head_dim = kv_lora_rank the wrong products have the right shapes and run.
    theirs = reference(kv_lora_rank=16)
    ours, tokens = DeepseekV3.from_transformers(theirs), ids()
    assert logit_gap(ours, theirs, tokens, absorbed=True) < TOLERANCE
    monkeypatch.setattr(mla, "absorb_query", lambda q_nope, w_uk: torch.einsum("bhln,hrn->bhlr", q_nope, w_uk))
    assert logit_gap(ours, theirs, tokens, absorbed=True) > 0.1
    monkeypatch.undo()
    monkeypatch.setattr(mla, "absorb_output", lambda c, w_uv: torch.einsum("bhlr,hrv->bhlv", c, w_uv))
    assert logit_gap(ours, theirs, tokens, absorbed=True) > 0.1
    assert logit_gap(ours, theirs, tokens) < TOLERANCE  # the expanded form never uses them


def test_planted_llama_layout_is_caught():
    theirs = reference()  # rope_interleave=True, DeepSeek's layout
    ours = DeepseekV3.from_transformers(theirs)
    ours.config.rope_interleave = False  # the planted bug: Llama's halves on an interleaved model
    assert logit_gap(ours, theirs, ids()) > 0.1


def test_planted_unshared_rotary_key_is_caught(monkeypatch):
    torch.manual_seed(0)
    attention = MultiHeadLatentAttention(DeepseekV3Config(**{k: v for k, v in SIZES.items() if k in (
        "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim")})).eval()
    x = torch.randn(2, 6, SIZES["hidden_size"])
    cos, sin = tfcore.rotary_cos_sin(torch.arange(6), tfcore.rotary_frequencies(8))
    assert rotary_key_shared(attention, x, cos, sin)

    def expand_with_reshape(self, latent, k_rope):  # the bug: reshape where a transpose was needed
        B, S, _ = latent.shape
        kv = self.kv_b_proj(latent).view(B, S, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope[:, :, None].expand(B, S, self.num_heads, self.rope).reshape(B, self.num_heads, S, self.rope)
        return torch.cat([k_nope, k_rope], dim=-1), values

    monkeypatch.setattr(MultiHeadLatentAttention, "expand", expand_with_reshape)
    assert not rotary_key_shared(attention, x, cos, sin)
    theirs = reference()
    assert logit_gap(DeepseekV3.from_transformers(theirs), theirs, ids()) > 0.1


def test_planted_cache_of_expanded_keys_is_caught(monkeypatch):
    theirs = reference()
    ours, tokens = DeepseekV3.from_transformers(theirs), ids()
    assert cache_bytes_problem(ours, tokens) is None

    def forward_caching_expanded(self, x, cos, sin, mask=None, cache=None, absorbed=False):
        # the bug: expand first, then cache every head's keys and values (a chapter-15 cache)
        batch, length, _ = x.shape
        q_nope, q_rope = self.queries(x)
        latent, k_rope = self.compress(x)
        q_rope, k_rope = self.rotate(q_rope, cos, sin), self.rotate(k_rope, cos, sin)
        keys, values = self.expand(latent, k_rope)
        if cache is not None:
            keys, values = cache.append(keys, values)
        context = mla.attend(torch.cat([q_nope, q_rope], dim=-1), keys, values, self.scaling, mask)
        return self.o_proj(context.transpose(1, 2).reshape(batch, length, -1))

    monkeypatch.setattr(MultiHeadLatentAttention, "forward", forward_caching_expanded)
    monkeypatch.setattr(DeepseekV3, "new_cache", lambda self, capacity=None: tfcore.KVCache(len(self.layers)))
    assert cached_logits_gap(ours, tokens) < 1e-5  # still exact: only the bytes give it away
    assert cache_bytes_problem(ours, tokens) is not None


# --- the port in float64: every option off its default, every parameter drawn at random --------

FLOAT64_TOLERANCE = 1e-10
OFF_DEFAULT = dict(vocab_size=61, hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=6, qk_rope_head_dim=4,
                   v_head_dim=10, first_k_dense_replace=3, max_position_embeddings=48, rms_norm_eps=1e-3,
                   rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rope_interleave=False,
                   hidden_act="gelu", attention_bias=True, tie_word_embeddings=True,
                   bos_token_id=None, eos_token_id=None)


def float64_reference(**changes):
    torch.manual_seed(6)
    model = DeepseekV3ForCausalLM(HFConfig(**{**OFF_DEFAULT, **changes})).double().eval()
    with torch.no_grad():  # every parameter random: norm weights and biases included
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 1 / parameter.shape[-1] ** 0.5)
            elif "norm" in name:
                parameter.uniform_(0.5, 1.5)
            else:  # biases
                parameter.uniform_(-0.5, 0.5)
    return model


IDS64 = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_port_equals_transformers_in_float64_with_every_option_off_its_default(absorbed, q_lora_rank):
    theirs = float64_reference(q_lora_rank=q_lora_rank)
    ours = DeepseekV3.from_transformers(theirs)
    assert all(p.dtype == torch.float64 for p in ours.parameters())  # the port keeps the dtype
    for name, parameter in theirs.named_parameters():
        assert not torch.all(parameter == 0) and not torch.all(parameter == 1), name
    assert logit_gap(ours, theirs, IDS64, absorbed=absorbed) < FLOAT64_TOLERANCE
    assert cached_logits_gap(ours, IDS64, absorbed=absorbed) < FLOAT64_TOLERANCE


@pytest.mark.parametrize("kind", ["weights rounded to float32", "o_proj bias dropped", "q_a_layernorm at 1",
                                  "latent norms read rms_norm_eps"])
def test_float64_check_catches_what_float32_cannot(kind):
    theirs = float64_reference()
    ours = DeepseekV3.from_transformers(theirs)
    with torch.no_grad():
        if kind == "weights rounded to float32":
            ours = ours.float().double()
        elif kind == "o_proj bias dropped":
            ours.layers[1].self_attn.o_proj.bias.zero_()
        elif kind == "q_a_layernorm at 1":
            ours.layers[2].self_attn.q_a_layernorm.weight.fill_(1.0)
        else:  # what tfcore.mla did before the float64 check: transformers uses 1e-6 there
            for layer in ours.layers:
                layer.self_attn.q_a_layernorm.eps = layer.self_attn.kv_a_layernorm.eps = OFF_DEFAULT["rms_norm_eps"]
    assert logit_gap(ours, theirs, IDS64) > 1e3 * FLOAT64_TOLERANCE


def test_port_refuses_yarn_and_names_its_softmax_scale_correction():
    """Scope: the default rotation only. The released DeepSeek-V3 uses YaRN (factor 40, mscale_all_dim 1),
    under which transformers multiplies the softmax scale by mscale**2 = (0.1 ln 40 + 1)**2."""
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
            "beta_slow": 1, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    with torch.device("meta"):
        attention = DeepseekV3Attention(HFConfig(**{**SIZES, "rope_parameters": yarn}), layer_idx=0)
    mscale = 0.1 * torch.log(torch.tensor(40.0, dtype=torch.float64)).item() + 1
    assert abs(attention.scaling - mscale ** 2 / 24 ** 0.5) < 1e-12  # not 1/sqrt(24)
    model = DeepseekV3ForCausalLM(HFConfig(**{**SIZES, "rope_parameters": yarn}))
    with pytest.raises(ValueError, match="rotary scaling 'yarn' is not built in tfcore.mla.*mscale"):
        DeepseekV3.from_transformers(model)
