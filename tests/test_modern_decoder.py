"""The modern decoder (chapters 14-16): GPT and Llama ported from transformers, the KV cache,
greedy decoding and sampling. Each equality is shown to fail on a planted bug at the end."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from transformers.utils import logging as hf_logging

import tfcore
from tfcore.cache import LayerCache

hf_logging.set_verbosity_error()
TOLERANCE = 1e-4  # the interface's "equal": within 1e-4 of transformers' logits


def gpt2(seed=0, drawn=True, **overrides):
    """A random transformers GPT-2, spread (drawn=True) or at its own initialisation."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=101, n_positions=48, n_embd=48, n_layer=2, n_head=4,
                    bos_token_id=None, eos_token_id=None)
    settings.update(overrides)
    model = GPT2LMHeadModel(GPT2Config(**settings)).eval()
    return spread(model) if drawn else model


def llama(seed=0, drawn=True, **overrides):
    """A random transformers Llama, spread (drawn=True) or at its own initialisation."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                    bos_token_id=None, eos_token_id=None)
    settings.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    return spread(model) if drawn else model


def spread(model):
    """Random weights large enough that greedy decoding does not repeat one token: a reference
    that always says the same word would let a broken cache or port pass. Norm weights (ones at
    initialisation) and biases get random values too, so the ports must carry them."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or "ln_" in name:
                parameter.uniform_(0.5, 1.5) if name.endswith("weight") else parameter.normal_(0, 0.1)
            elif parameter.dim() == 1:
                parameter.normal_(0, 0.1)
            elif "wpe" in name:  # strong positions: the next token depends on where we are
                parameter.normal_(0, 1.0)
            elif "wte" in name or "embed_tokens" in name:
                parameter.normal_(0, 0.3)
            else:
                parameter.normal_(0, 1 / math.sqrt(parameter.shape[-1]))
    return model


def logit_gap(ours, reference, ids) -> float:
    with torch.no_grad():
        return float((ours(ids) - reference(ids).logits).abs().max())


def reference_greedy(reference, prompt, n):
    # No pad_token_id and no attention_mask: generate() then attends to every prompt token
    # (test_generate_needs_no_pad_token_id). With pad_token_id=0 and no mask it would mask every 0.
    return reference.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def cached_logits_gap(model, ids, prompt_len=3) -> float:
    """Feed the prompt, then one token at a time through a cache; compare every step's logits with
    one full forward pass over the whole sequence."""
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :prompt_len], cache=cache)]
        steps += [model(ids[:, i:i + 1], cache=cache) for i in range(prompt_len, ids.shape[1])]
    return float((torch.cat(steps, dim=1) - full).abs().max())


@pytest.mark.parametrize("make", [gpt2, llama])
def test_generate_needs_no_pad_token_id(make):
    """transformers' generate (the pinned version): without pad_token_id and attention_mask it equals the
    all-ones mask; pad_token_id=0 without a mask masks every prompt token 0 (the trap chapters 15-16 show)."""
    reference = make()
    prompt = torch.randint(1, 90, (3, 8), generator=torch.Generator().manual_seed(2))
    prompt[:, 3] = 0
    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    plain = reference.generate(prompt, **greedy)
    assert torch.equal(plain, reference.generate(prompt, attention_mask=torch.ones_like(prompt), **greedy))
    pad_zero = reference.generate(prompt, pad_token_id=0, **greedy)
    assert not torch.equal(pad_zero, plain)
    assert torch.equal(pad_zero, reference.generate(prompt, attention_mask=(prompt != 0).long(), **greedy))


def residual_and_other_stds(named_parameters, is_residual):
    groups = {True: [], False: []}
    for name, p in named_parameters:
        if p.dim() == 2:
            groups[bool(is_residual(name))].append(p.detach().flatten())
    return {residual: torch.cat(ps).std().item() for residual, ps in groups.items()}


@pytest.mark.parametrize("n_layer", [1, 3, 8])
def test_gpt_init_is_gpt2s(n_layer):
    """tfcore.GPT draws GPT-2's initialisation: std 0.02, the residual projections (c_proj) scaled by
    1/sqrt(2 n_layer), as transformers' GPT2LMHeadModel does. Without the scaling, this fails."""
    sizes = dict(vocab_size=500, n_positions=64, n_embd=64, n_layer=n_layer, n_head=4, bos_token_id=None,
                 eos_token_id=None)
    torch.manual_seed(0)
    theirs = residual_and_other_stds(GPT2LMHeadModel(GPT2Config(**sizes)).named_parameters(),
                                     lambda name: name.endswith("c_proj.weight"))
    ours_model = tfcore.GPT(tfcore.GPTConfig(vocab_size=500, max_position_embeddings=64, hidden_size=64,
                                             num_hidden_layers=n_layer, num_attention_heads=4))
    is_residual = lambda name: name.endswith(("output_linear.weight", "linear_2.weight"))  # noqa: E731
    ours = residual_and_other_stds(ours_model.named_parameters(), is_residual)
    expected = {True: 0.02 / math.sqrt(2 * n_layer), False: 0.02}
    for stds in (theirs, ours):
        for residual in (True, False):
            assert abs(stds[residual] / expected[residual] - 1) < 0.06, (stds, expected)
    # the planted bug: undo the scaling, and the residual projections no longer match GPT-2's
    with torch.no_grad():
        for block in ours_model.blocks:
            block.attention.output_linear.weight.mul_(math.sqrt(2 * n_layer))
            block.feed_forward.linear_2.weight.mul_(math.sqrt(2 * n_layer))
    unscaled = residual_and_other_stds(ours_model.named_parameters(), is_residual)
    assert abs(unscaled[True] / expected[True] - 1) > 0.06


# --- the ports ------------------------------------------------------------------------------

GPT_CONFIGS = {
    "tied": {},
    "untied": dict(tie_word_embeddings=False),
    "wide-inner-3-layers": dict(n_inner=80, n_layer=3, n_head=6),
    "relu": dict(activation_function="relu"),
    # scores in float32, scaled before the product: the same attention, rounded otherwise (eager only;
    # transformers 5.23 itself raises on this path in float64, so it is checked here in float32)
    "upcast-eager": dict(reorder_and_upcast_attn=True, attn_implementation="eager"),
}


@pytest.mark.parametrize("name", list(GPT_CONFIGS))
def test_gpt_port_equals_transformers_gpt2(name):
    reference = gpt2(**GPT_CONFIGS[name])
    ours = tfcore.GPT.from_transformers(reference)
    assert not ours.training
    ids = torch.randint(0, 101, (3, 20), generator=torch.Generator().manual_seed(1))
    assert logit_gap(ours, reference, ids) < TOLERANCE
    assert (ours.lm_head.weight is ours.token_embeddings.weight) == reference.config.tie_word_embeddings


LLAMA_CONFIGS = {
    "MHA": dict(num_key_value_heads=4),
    "GQA": dict(num_key_value_heads=2),
    "MQA": dict(num_key_value_heads=1),
    "GQA-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "GQA-8-heads-head_dim-12": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12),
    "biases": dict(attention_bias=True, mlp_bias=True),
    "rope-linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}),
    "rope-llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                         "rope_theta": 500000.0}),
}


@pytest.mark.parametrize("name", list(LLAMA_CONFIGS))
def test_llama_port_equals_transformers_llama(name):
    reference = llama(**LLAMA_CONFIGS[name])
    ours = tfcore.Llama.from_transformers(reference)
    assert not ours.training
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    assert logit_gap(ours, reference, ids) < TOLERANCE
    assert ours.layers[0].self_attn.k_proj.out_features == reference.config.num_key_value_heads * ours.config.head_dim


# --- the ports in float64: every option off its default, every parameter drawn at random --------

FLOAT64_TOLERANCE = 1e-10
GPT2_OFF_DEFAULT = dict(vocab_size=61, n_positions=40, n_embd=40, n_layer=3, n_head=5, n_inner=72,
                        activation_function="gelu", layer_norm_epsilon=1e-3, resid_pdrop=0.2,
                        embd_pdrop=0.2, attn_pdrop=0.25, tie_word_embeddings=False)
LLAMA_OFF_DEFAULT = dict(vocab_size=53, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                         max_position_embeddings=40, hidden_act="gelu", rms_norm_eps=1e-3,
                         attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                         attention_dropout=0.1,
                         rope_parameters={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.5,
                                          "high_freq_factor": 3.0, "rope_theta": 3000.0,
                                          "original_max_position_embeddings": 12})


def float64_pair(make, port, settings, drawn=True):
    """A float64 reference built by `make`, spread (every parameter random) or left at its own
    initialisation (drawn=False), and tfcore's port of it."""
    reference = make(drawn=drawn, **settings).double()
    return reference, port(reference)


# the same Llama with the other rotary scaling the port reads
LLAMA_LINEAR_OFF_DEFAULT = {**LLAMA_OFF_DEFAULT,
                            "rope_parameters": {"rope_type": "linear", "factor": 2.5, "rope_theta": 3000.0}}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama-linear"])
def test_ports_equal_transformers_in_float64_with_every_option_off_its_default(kind):
    make, port, settings, vocab = (
        (gpt2, tfcore.GPT.from_transformers, GPT2_OFF_DEFAULT, 61) if kind == "gpt2"
        else (llama, tfcore.Llama.from_transformers,
              LLAMA_OFF_DEFAULT if kind == "llama" else LLAMA_LINEAR_OFF_DEFAULT, 53))
    reference, ours = float64_pair(make, port, settings)
    assert all(p.dtype == torch.float64 for p in ours.parameters())  # the port keeps the dtype
    for name, parameter in reference.named_parameters():  # nothing left at 1 or 0: a lost copy shows
        assert not torch.all(parameter == 1) and not torch.all(parameter == 0), name
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    assert logit_gap(ours, reference, ids) < FLOAT64_TOLERANCE


def _norm_left_at_init(kind, model):
    """The planted bug: one norm of the last block left as initialised (weight 1, bias 0)."""
    with torch.no_grad():
        norm = model.blocks[-1].layer_norm_2 if kind == "gpt2" else model.layers[-1].post_attention_layernorm
        norm.weight.fill_(1.0)
        if getattr(norm, "bias", None) is not None:
            norm.bias.zero_()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_planted_norm_not_copied_shows_only_with_random_norms(kind):
    """A norm weight that the port forgets to copy: invisible at transformers' initialisation
    (norms 1, biases 0), far beyond the float64 tolerance once every parameter is drawn."""
    make, port, settings, vocab = ((gpt2, tfcore.GPT.from_transformers, GPT2_OFF_DEFAULT, 61) if kind == "gpt2"
                                   else (llama, tfcore.Llama.from_transformers, LLAMA_OFF_DEFAULT, 53))
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    gaps = {}
    for drawn in (False, True):
        reference, ours = float64_pair(make, port, settings, drawn=drawn)
        _norm_left_at_init(kind, ours)
        gaps[drawn] = logit_gap(ours, reference, ids)
    assert gaps[False] < FLOAT64_TOLERANCE < 1e-3 < gaps[True], gaps


def test_ports_refuse_what_they_do_not_implement():
    for flag, value in (("scale_attn_weights", False), ("scale_attn_by_inverse_layer_idx", True)):
        with pytest.raises(ValueError, match=flag):
            tfcore.GPT.from_transformers(gpt2(**{flag: value}))
    with pytest.raises(ValueError, match="add_cross_attention"):
        tfcore.GPT.from_transformers(gpt2(add_cross_attention=True))
    for rope_type, extra in (("dynamic", {}), ("yarn", {"original_max_position_embeddings": 24}),
                             ("longrope", {"original_max_position_embeddings": 24, "short_factor": [1.0] * 8,
                                           "long_factor": [2.0] * 8})):
        parameters = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0, **extra}
        with pytest.raises(ValueError, match=f"rotary scaling '{rope_type}' is not implemented"):
            tfcore.Llama.from_transformers(llama(rope_parameters=parameters))
    with pytest.raises(ValueError, match="unknown activation 'gelu_fast'"):
        tfcore.Llama.from_transformers(llama(hidden_act="gelu_fast"))


def test_ports_reject_the_wrong_model():
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        tfcore.GPT.from_transformers(llama())
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        tfcore.Llama.from_transformers(gpt2())
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        tfcore.GPT.from_transformers(gpt2(scale_attn_by_inverse_layer_idx=True))
    # one dropout rate serves tfcore.GPT's embeddings and residual branches: a GPT-2 with two
    # different rates would be ported with the wrong one, silently
    with pytest.raises(ValueError, match="embd_pdrop=0.3 and resid_pdrop=0.2"):
        tfcore.GPT.from_transformers(gpt2(embd_pdrop=0.3, resid_pdrop=0.2))


def test_rmsnorm_and_swiglu_equal_transformers_modules():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64) * 3 + 1
    reference = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
    ours = tfcore.RMSNorm(64, eps=1e-6)
    ours.load_state_dict(reference.state_dict())
    assert torch.allclose(ours(x), reference(x), atol=1e-6)
    rms = ours(x) / ours.weight
    assert torch.allclose(rms.pow(2).mean(-1), torch.ones(2, 5), atol=1e-4)  # unit root mean square
    config = llama().config
    reference_mlp, ours_mlp = LlamaMLP(config), tfcore.SwiGLU(tfcore.LlamaConfig(hidden_size=64, intermediate_size=96,
                                                                                  num_attention_heads=4))
    ours_mlp.load_state_dict(reference_mlp.state_dict())
    assert torch.allclose(ours_mlp(x), reference_mlp(x), atol=1e-6)


def test_rotary_keeps_lengths_and_scores_depend_only_on_the_offset():
    torch.manual_seed(0)
    head_dim = 16
    inv_freq = tfcore.rotary_frequencies(head_dim)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def rotated(x, position):
        cos, sin = tfcore.rotary_cos_sin(torch.tensor([position]), inv_freq)
        return tfcore.apply_rotary(x[None], cos, sin)[0]

    assert torch.allclose(rotated(q, 37).norm(), q.norm(), atol=1e-5)
    score = torch.dot(rotated(q, 7), rotated(k, 3))
    for shift in (1, 10, 100):
        assert torch.allclose(torch.dot(rotated(q, 7 + shift), rotated(k, 3 + shift)), score, atol=1e-4)
    assert not torch.allclose(torch.dot(rotated(q, 8), rotated(k, 3)), score, atol=1e-2)  # another offset


# --- the cache ------------------------------------------------------------------------------

def models_with_cache():
    return {"gpt": tfcore.GPT.from_transformers(gpt2()),
            "llama-gqa": tfcore.Llama.from_transformers(llama(num_key_value_heads=2)),
            "llama-mqa": tfcore.Llama.from_transformers(llama(num_key_value_heads=1))}


@pytest.mark.parametrize("name", ["gpt", "llama-gqa", "llama-mqa"])
def test_cached_logits_equal_full_recompute_at_every_step(name):
    model = models_with_cache()[name]
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    assert cached_logits_gap(model, ids) < 1e-5


def test_cache_size_is_two_tensors_per_layer_of_kv_heads():
    model = tfcore.Llama.from_transformers(llama(num_key_value_heads=2))
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.zeros(3, 11, dtype=torch.long), cache=cache)
    config = model.config
    assert cache.length == 11
    assert cache[0].keys.shape == (3, 2, 11, config.head_dim)
    assert cache.nbytes() == 2 * config.num_hidden_layers * 3 * 2 * 11 * config.head_dim * 4


def test_a_cache_with_capacity_writes_in_place_and_equals_the_growing_one():
    model = tfcore.Llama.from_transformers(llama())
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        growing, reserved = model.new_cache(), model.new_cache(capacity=30)
        a = torch.cat([model(ids[:, :5], cache=growing)] + [model(ids[:, i:i + 1], cache=growing) for i in range(5, 30)], 1)
        b = torch.cat([model(ids[:, :5], cache=reserved)] + [model(ids[:, i:i + 1], cache=reserved) for i in range(5, 30)], 1)
    assert torch.equal(a, b) and torch.equal(growing[0].keys, reserved[0].keys)
    assert reserved[0].keys.data_ptr() == reserved[0]._room[0].data_ptr()  # a view of the room, not a copy
    assert reserved.nbytes() == growing.nbytes()
    with pytest.raises(ValueError, match="room for 30 positions"):
        with torch.no_grad():
            model(ids[:, :1], cache=reserved)


def test_a_cache_with_capacity_holds_values_narrower_than_the_keys():
    # MLA (chapter 19) caches a latent and a rotary key of different widths in one LayerCache
    keys, values = torch.randn(2, 1, 7, 12), torch.randn(2, 1, 7, 4)
    growing, reserved = tfcore.LayerCache(), tfcore.LayerCache(capacity=9)
    for cache in (growing, reserved):
        cache.append(keys[:, :, :5], values[:, :, :5])
        cache.append(keys[:, :, 5:], values[:, :, 5:])
    assert torch.equal(reserved.keys, keys) and torch.equal(reserved.values, values)
    assert torch.equal(growing.values, reserved.values)


def test_encoder_decoder_cache_gives_the_same_tokens_and_encodes_the_memory_once():
    torch.manual_seed(0)
    model = tfcore.make_model(11, 13, N=2, d_model=32, d_ff=64, h=4, dropout=0.0, verbose=False).eval()
    src = torch.randint(1, 11, (4, 7))
    src_mask = tfcore.padding_mask(torch.tensor([[1] * 7] * 3 + [[1] * 5 + [0] * 2]))
    projections = []
    hook = model.decoder.layers[0].cross_attention.key.register_forward_hook(lambda *_: projections.append(1))
    cached = tfcore.greedy_decode(model, src, src_mask, 12, 1, use_cache=True)
    assert len(projections) == 1  # the memory's keys: once, not once per step
    projections.clear()
    plain = tfcore.greedy_decode(model, src, src_mask, 12, 1)
    hook.remove()
    assert len(projections) == 11
    assert torch.equal(cached, plain)
    # and the step logits match: decode the finished sequence token by token
    memory = model.encode(src, src_mask)
    with torch.no_grad():
        full = model.decode(memory, src_mask, plain)
        cache = model.new_cache()
        steps = torch.cat([model.decode(memory, src_mask, plain[:, i:i + 1], cache=cache) for i in range(12)], dim=1)
    assert float((steps - full).abs().max()) < 1e-5


# --- generation -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpt2", "gpt2-untied", "llama-mha", "llama-gqa", "llama-mqa"])
def test_greedy_generation_equals_transformers_generate(kind):
    reference = {"gpt2": lambda: gpt2(), "gpt2-untied": lambda: gpt2(tie_word_embeddings=False),
                 "llama-mha": lambda: llama(num_key_value_heads=4), "llama-gqa": lambda: llama(),
                 "llama-mqa": lambda: llama(num_key_value_heads=1)}[kind]()
    ours = (tfcore.GPT if kind.startswith("gpt2") else tfcore.Llama).from_transformers(reference)
    prompt = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(3))
    expected = reference_greedy(reference, prompt, 30)
    assert min(len(set(row[6:].tolist())) for row in expected) >= 5  # varied output: a test with teeth
    for use_cache in (True, False):
        assert torch.equal(tfcore.generate(ours, prompt, 30, use_cache=use_cache), expected)


def test_sampling_with_and_without_cache_draws_the_same_tokens():
    model = tfcore.GPT.from_transformers(gpt2())
    prompt = torch.randint(0, 101, (2, 4), generator=torch.Generator().manual_seed(4))
    draws = [tfcore.generate(model, prompt, 25, use_cache=c, temperature=1.5, top_k=20, top_p=0.9,
                             generator=torch.Generator().manual_seed(5)) for c in (True, False)]
    assert torch.equal(draws[0], draws[1])
    assert draws[0].shape == (2, 29) and torch.equal(draws[0][:, :4], prompt)


def test_generate_rejects_too_many_positions_and_bad_settings():
    model = tfcore.GPT.from_transformers(gpt2())  # 48 positions
    prompt = torch.zeros(1, 10, dtype=torch.long)
    assert tfcore.generate(model, prompt, 38).shape == (1, 48)
    with pytest.raises(ValueError, match=r"48 \(max_position_embeddings\).*at most 38"):
        tfcore.generate(model, prompt, 39)
    with pytest.raises(ValueError, match="48 positions"):
        model(torch.zeros(1, 49, dtype=torch.long))
    for settings, message in ((dict(temperature=-1), "temperature"), (dict(temperature=1, top_k=0), "top_k"),
                              (dict(temperature=1, top_p=1.5), "top_p"), (dict(top_k=5), "temperature > 0")):
        with pytest.raises(ValueError, match=message):
            tfcore.generate(model, prompt, 3, **settings)
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        tfcore.generate(model, torch.zeros(10, dtype=torch.long), 3)


def test_generate_and_the_cache_refuse_what_they_cannot_use():
    seq2seq = tfcore.make_model(13, 13, N=1, d_model=16, d_ff=32, h=2)
    with pytest.raises(TypeError, match="greedy_decode"):  # no new_cache/max_positions of a decoder
        tfcore.generate(seq2seq, torch.ones(1, 3, dtype=torch.long), 2)
    cache = LayerCache()
    with pytest.raises(ValueError, match="same B, H_kv and L_new"):  # a silent mix-up before
        cache.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4))
    keys, values = cache.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 6))  # d_v may differ
    assert keys.shape == (1, 2, 3, 4) and values.shape == (1, 2, 3, 6)


def test_next_token_probs_cuts_as_documented():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    plain = logits.softmax(-1)
    assert torch.allclose(tfcore.next_token_probs(logits), plain)
    assert torch.equal(tfcore.next_token_probs(logits, temperature=0), torch.tensor([[1.0, 0, 0, 0, 0]]))
    entropy = lambda p: float(-(p * p.clamp_min(1e-30).log()).sum())  # noqa: E731
    assert entropy(tfcore.next_token_probs(logits, 0.5)) < entropy(plain) < entropy(tfcore.next_token_probs(logits, 2.0))
    top2 = tfcore.next_token_probs(logits, top_k=2)
    assert torch.allclose(top2, torch.cat([plain[:, :2] / plain[:, :2].sum(), torch.zeros(1, 3)], dim=1))
    # plain ≈ [0.563, 0.207, 0.126, 0.076, 0.028]: top-p 0.7 needs the first two (0.770 ≥ 0.7)
    nucleus = tfcore.next_token_probs(logits, top_p=0.7)
    assert (nucleus > 0).sum() == 2 and torch.allclose(nucleus.sum(), torch.tensor(1.0))
    assert (tfcore.next_token_probs(logits, top_p=0.5) > 0).sum() == 1  # the first alone has 0.563 ≥ 0.5
    assert (tfcore.next_token_probs(logits, top_p=0.8) > 0).sum() == 3


def test_the_book_prose_corpus():
    documents = tfcore.load_book_prose()
    names = list(documents)
    assert len(names) == 15 and names[0] == "01_text_to_tensors" and names[-1] == "book/how_to_run"
    assert documents["01_text_to_tensors"].startswith("# 1. From text to tensors")
    text = "".join(documents.values())
    assert 250_000 < len(text) < 350_000
    assert "```" not in text and "](" not in text and "<div" not in text  # no code, link targets or HTML


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tfcore.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="not divisible"):
        tfcore.GPT(tfcore.GPTConfig(vocab_size=10, hidden_size=50, num_attention_heads=4))


# --- planted bugs: each check above must be able to fail ----------------------------------

def test_planted_rope_on_the_values_breaks_the_port_check():
    reference = llama()
    ours = tfcore.Llama.from_transformers(reference)
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    assert logit_gap(ours, reference, ids) < TOLERANCE
    for layer in ours.layers:
        attention = layer.self_attn
        angles = {}
        attention.register_forward_pre_hook(lambda m, args, angles=angles: angles.update(cos=args[1], sin=args[2]))

        def rotate_values(module, args, output, attention=attention, angles=angles):
            b, length, _ = output.shape
            v = output.view(b, length, attention.num_kv_heads, attention.head_dim).transpose(1, 2)
            return tfcore.apply_rotary(v, angles["cos"], angles["sin"]).transpose(1, 2).reshape(b, length, -1)

        attention.v_proj.register_forward_hook(rotate_values)
    assert logit_gap(ours, reference, ids) > TOLERANCE


def test_planted_missing_final_norm_breaks_the_gpt_port_check():
    reference = gpt2()
    ours = tfcore.GPT.from_transformers(reference)
    ours.final_layer_norm = torch.nn.Identity()
    assert logit_gap(ours, reference, torch.randint(0, 101, (2, 10))) > TOLERANCE


def test_planted_cache_that_drops_a_position_breaks_the_cache_checks(monkeypatch):
    model = tfcore.Llama.from_transformers(llama())
    reference = llama()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    prompt = ids[:, :6]
    original = LayerCache.append

    def forgetful(self, keys, values):
        k, v = original(self, keys, values)
        if k.shape[-2] == 8:  # drop position 4 once the cache holds 8
            keep = [i for i in range(8) if i != 4]
            self.keys, self.values = k[:, :, keep], v[:, :, keep]
        return self.keys, self.values

    monkeypatch.setattr(LayerCache, "append", forgetful)
    assert cached_logits_gap(model, ids) > 1e-3
    assert not torch.equal(tfcore.generate(model, prompt, 20), reference_greedy(reference, prompt, 20))


def test_planted_wrong_cache_position_breaks_generation_equality(monkeypatch):
    reference = gpt2()
    ours = tfcore.GPT.from_transformers(reference)
    prompt = torch.randint(0, 101, (3, 6), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(tfcore.KVCache, "length", property(lambda self: max(0, len(self.layers[0]) - 1)))
    assert not torch.equal(tfcore.generate(ours, prompt, 30), reference_greedy(reference, prompt, 30))


def test_planted_top_p_that_keeps_one_token_too_few_is_caught():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = logits.softmax(-1)
    sorted_probs = probs[0].sort(descending=True).values
    wrong_keep = int((sorted_probs.cumsum(-1) < 0.7).sum())  # the usual off-by-one: 1 token, mass 0.563 < 0.7
    right_keep = int((tfcore.next_token_probs(logits, top_p=0.7) > 0).sum())
    assert wrong_keep == 1 and right_keep == 2
    assert math.isclose(float(sorted_probs[:right_keep].sum()), 0.7701, abs_tol=1e-3)
