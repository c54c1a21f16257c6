"""tfcore.hybrid: Qwen3.5's hybrid text model against transformers 5.23's ``Qwen3_5ForCausalLM``.

Checked: logits (float32 and float64, a length that crosses the 64-position chunk and a short one), greedy
``generate`` tokens, the cache at every decoding step against the full pass and against transformers'
``DynamicCache``, a prompt fed in pieces, a left-padded batch, the state bytes; every equality is also shown
failing on a planted bug. Gaps are relative: max |a - b| / max |b|.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as q5
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.utils import logging as hf_logging

import tfcore
from tfcore import hybrid
from tfcore import linear_attention as la
from tfcore.gemma import GemmaRMSNorm
from tfcore.hybrid import GatedDeltaNet, GatedRMSNorm, HybridCache, Qwen35, Qwen35Config, state_bytes
from tfcore.llama import RMSNorm, rotary_cos_sin, rotary_frequencies

from ports import widen
from test_linear_attention import in_float64

hf_logging.set_verbosity_error()  # the "falling back to its reference PyTorch implementation" notices

DTYPES = (torch.float32, torch.float64)
# float64: the largest gap measured below is 4.4e-16 (ours cached against ours whole; against transformers the
# logits came out bit-equal); 1e-10 is the bound. float32: the largest measured is 8.1e-6 (ours cached against
# ours whole; 1.8e-6 against transformers, on logits up to 20), so 1e-4 leaves a margin above 10, while every
# planted bug moves the logits by more than 0.3 (measured).
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
BUG = 1e-3
VOCAB = 101

# Every option off transformers' default: the layer pattern, grouped value heads (4 = 2 x 2), d_k != d_v,
# kernel 3, partial_rotary_factor 0.5, GQA, rms_norm_eps, rope_theta, hidden_act (also the convolution's
# activation), attention biases, tied embeddings.
HF_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, hidden_act="gelu_pytorch_tanh", max_position_embeddings=512,
                 rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
                 linear_conv_kernel_dim=3, linear_key_head_dim=12, linear_value_head_dim=8, linear_num_key_heads=2,
                 linear_num_value_heads=4,
                 layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                              "linear_attention"])


def gap(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def refs():
    """The reference in float32 and float64, every weight drawn at random (norm weights, A_log, dt_bias and
    the convolution included: ports.widen), with sdpa attention, transformers' default here (its
    eager_attention_forward takes the softmax with dtype=torch.float32, which a float64 check would see)."""
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**copy.deepcopy(HF_CONFIG))
    model = widen(Qwen3_5ForCausalLM(config)).eval()
    assert model.config._attn_implementation == "sdpa"
    return {torch.float32: model, torch.float64: copy.deepcopy(model).double()}


@pytest.fixture(scope="module")
def ports(refs):
    return {dtype: Qwen35.from_transformers(model) for dtype, model in refs.items()}


@pytest.fixture
def library(monkeypatch):
    """``library(dtype)``: in float64, transformers' two gated-delta functions (and only those) with their float32
    cast turned into float64 (tests/test_linear_attention.py's ``in_float64``); in float32, as shipped."""
    def patch(dtype):
        if dtype == torch.float64:
            for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
                monkeypatch.setattr(q5, name, in_float64(getattr(q5, name)))
    return patch


def ids(batch, length, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def port_of(refs, dtype):
    """A fresh port (for tests that plant a bug at construction)."""
    return Qwen35.from_transformers(refs[dtype])


@torch.no_grad()
def logits_gap(ours, ref, x):
    return gap(ours(x), ref(x).logits)


# ----------------------------------------------------------------------------- library facts the port rests on

def test_mrope_of_text_is_the_plain_rotation():
    """transformers' Qwen3.5 rotary embedding gets three position rows; for text they are equal, and it then gives
    exactly the plain rotation of the first rotary_dim numbers (default config: rotary_dim 64, sections [11, 11, 10])."""
    for kwargs in ({}, copy.deepcopy(HF_CONFIG)):
        config = Qwen3_5TextConfig(**kwargs)
        rope = q5.Qwen3_5TextRotaryEmbedding(config)
        ours = Qwen35Config(head_dim=config.head_dim, rope_theta=config.rope_parameters["rope_theta"],
                            partial_rotary_factor=config.rope_parameters["partial_rotary_factor"])
        positions = torch.arange(300).repeat(2, 1)  # [B, L]
        for dtype in DTYPES:
            cos, sin = rope(torch.zeros(2, 300, 8, dtype=dtype), positions[None].expand(3, -1, -1))
            c, s = (t.to(dtype) for t in rotary_cos_sin(positions, rotary_frequencies(ours.rotary_dim, ours.rope_theta)))
            assert torch.equal(cos, c) and torch.equal(sin, s)
        # the check can fail: rows that differ (an image's grid positions) give another rotation
        cos, _ = rope(torch.zeros(2, 300, 8), torch.stack([positions, positions // 7, positions % 7]))
        assert gap(cos, c.float()) > BUG


def test_norms_equal_transformers_with_their_cast_order():
    """GemmaRMSNorm == Qwen3_5RMSNorm and GatedRMSNorm == Qwen3_5RMSNormGated bit for bit in bfloat16, float32 and
    float64, with random weights; a Llama-order norm (weight times the input-dtype value) differs in bfloat16."""
    torch.manual_seed(3)
    theirs, ours = q5.Qwen3_5RMSNorm(24, eps=1e-5), GemmaRMSNorm(24, eps=1e-5)
    gated_theirs, gated_ours = q5.Qwen3_5RMSNormGated(24, eps=1e-5), GatedRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        for a, b in ((theirs, ours), (gated_theirs, gated_ours)):
            a.weight.normal_()
            b.weight.copy_(a.weight)
    x, z = 3 * torch.randn(5, 7, 24, dtype=torch.float64), torch.randn(5, 7, 24, dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for module in (theirs, ours, gated_theirs, gated_ours):
            module.to(dtype)
        xd, zd = x.to(dtype), z.to(dtype)
        assert torch.equal(ours(xd), theirs(xd)), dtype
        assert torch.equal(gated_ours(xd, zd), gated_theirs(xd, zd)), dtype
    xb = x.to(torch.bfloat16)
    x32 = xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    llama_order = (1 + ours.weight) * x32.to(torch.bfloat16)
    assert not torch.equal(llama_order, theirs(xb))


def test_float64_reference_needs_its_rule_patched(refs, ports):
    """As shipped, transformers' gated-delta functions compute in float32 even in a float64 model: the float64
    comparisons below need the patch (``library``), which changes nothing else."""
    x = ids(2, 20)
    assert logits_gap(ports[torch.float64], refs[torch.float64], x) > 1e-9


# ----------------------------------------------------------------------------- logits

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [150, 7])
def test_logits_equal_transformers(refs, ports, library, dtype, length):
    library(dtype)
    assert logits_gap(ports[dtype], refs[dtype], ids(2, length)) < TOL[dtype]


hybrid_conv = hybrid.causal_conv1d  # the port's own, for the planted versions that wrap it


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_second_configuration(library, dtype):
    """The other side of each option: a linear layer first (transformers then reads the cached length from its
    first attention layer), one value head per key head, kernel 5, the whole head rotated, no attention biases,
    an untied output layer: logits over 150 positions and cached decoding after a 66-position prompt."""
    library(dtype)
    torch.manual_seed(1)
    config = Qwen3_5TextConfig(**{**copy.deepcopy(HF_CONFIG), "linear_conv_kernel_dim": 5, "linear_num_value_heads": 2,
                                  "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                      "partial_rotary_factor": 1.0},
                                  "num_hidden_layers": 4, "layer_types": ["linear_attention", "linear_attention",
                                                                          "full_attention", "linear_attention"]})
    reference = widen(Qwen3_5ForCausalLM(config)).eval().to(dtype)
    ours = Qwen35.from_transformers(reference)
    assert ours.config.rotary_dim == 16 and not ours.config.tie_word_embeddings
    assert logits_gap(ours, reference, ids(2, 150)) < TOL[dtype]
    assert max(cached_gaps(ours, reference, pieces=(66,), steps=5)) < TOL[dtype]


def _planted(monkeypatch, name):
    """Plant one bug in tfcore.hybrid (each a plausible mistake)."""
    if name == "output gate missing":
        monkeypatch.setattr(hybrid, "gate_output", lambda context, gate: context)
    elif name == "rotary on the whole head":
        monkeypatch.setattr(Qwen35Config, "rotary_dim", property(lambda self: self.head_dim))
    elif name == "key heads tiled":
        monkeypatch.setattr(hybrid, "expand_key_heads", lambda x, groups: x.repeat(1, groups, 1, 1))
    elif name == "carry dropped between chunks":
        def chunked(q, k, v, g, beta, *, chunk_size, initial_state=None, **kw):
            outs, state = [], initial_state
            for s in range(0, q.shape[2], chunk_size):
                c = slice(s, s + chunk_size)
                o, state = la.gated_delta_rule_chunked(q[:, :, c], k[:, :, c], v[:, :, c], g[:, :, c], beta[:, :, c],
                                                       chunk_size=chunk_size, initial_state=initial_state if s == 0
                                                       else None, **kw)
                outs.append(o)
            return torch.cat(outs, dim=2), state
        monkeypatch.setattr(hybrid, "gated_delta_rule_chunked", chunked)
    elif name == "last chunk padded":  # padding that decays by -1 (the cause PR #46873 proposed for #46190)
        def chunked(q, k, v, g, beta, *, chunk_size, **kw):
            T, pad = q.shape[2], -q.shape[2] % chunk_size
            def p(t, value=0.0):
                return torch.nn.functional.pad(t, (0, 0, 0, pad) if t.dim() == 4 else (0, pad), value=value)
            o, state = la.gated_delta_rule_chunked(p(q), p(k), p(v), p(g, -1.0), p(beta), chunk_size=chunk_size, **kw)
            return o[:, :, :T], state
        monkeypatch.setattr(hybrid, "gated_delta_rule_chunked", chunked)
    elif name == "conv state off by one":
        def conv(x, weight, state=None, act=torch.nn.functional.silu):
            out, _ = hybrid_conv(x, weight, state, act)
            kernel = weight.shape[-1]
            full = torch.cat([x.new_zeros(x.shape[0], x.shape[1], kernel - 1) if state is None else state, x], dim=-1)
            return out, full[..., full.shape[-1] - kernel:-1]  # the K - 1 inputs before the last one
        monkeypatch.setattr(hybrid, "causal_conv1d", conv)
    elif name == "step without decay":
        monkeypatch.setattr(hybrid, "gated_delta_rule_recurrent",
                            lambda q, k, v, g, beta, **kw: la.gated_delta_rule_recurrent(q, k, v, torch.zeros_like(g),
                                                                                         beta, **kw))
    elif name == "gate after the write":
        def step(q, k, v, g, beta, *, initial_state, use_qk_l2norm):
            q, k = la.l2norm(q) * k.shape[-1] ** -0.5, la.l2norm(k)
            S, out = initial_state, []
            for t in range(q.shape[2]):
                error = v[:, :, t] - (k[:, :, t].unsqueeze(-2) @ S).squeeze(-2)  # read before the decay
                S = S + k[:, :, t].unsqueeze(-1) * (beta[:, :, t].unsqueeze(-1) * error).unsqueeze(-2)
                S = g[:, :, t].exp()[..., None, None] * S  # decayed after the write
                out.append((q[:, :, t].unsqueeze(-2) @ S).squeeze(-2))
            return torch.stack(out, dim=2), S
        monkeypatch.setattr(hybrid, "gated_delta_rule_recurrent", step)
    else:
        raise AssertionError(name)


def test_bfloat16_logits_follow_the_reference_casts(refs):
    """In bfloat16 the port makes transformers' casts (norms and gates in float32, the delta rule and its state
    in float32): its logits came out bit-equal (gap 0 measured), against 0.09 to 0.23 from the float32 model.
    The bound 1e-2 is a few bfloat16 roundings (2^-8 = 3.9e-3 each)."""
    reference = copy.deepcopy(refs[torch.float32]).to(torch.bfloat16)
    x = ids(2, 150)
    assert logits_gap(Qwen35.from_transformers(reference), reference, x) < 1e-2


def test_planted_gate_in_bfloat16_is_caught(refs, monkeypatch):
    """The gated norm's silu(z) taken in bfloat16 instead of float32: 0.062 measured."""
    reference = copy.deepcopy(refs[torch.float32]).to(torch.bfloat16)
    monkeypatch.setattr(GatedRMSNorm, "forward",
                        lambda self, x, gate: (RMSNorm.forward(self, x) * torch.nn.functional.silu(gate)).to(x.dtype))
    assert logits_gap(Qwen35.from_transformers(reference), reference, ids(2, 150)) > 3e-2


def test_planted_decay_without_the_reference_casts_is_caught(refs, library, monkeypatch):
    """g computed in the model's dtype (A_log and a not rounded to float32 first): float64 logits move by 8.9e-7
    (measured), far above the float64 bound."""
    library(torch.float64)
    monkeypatch.setattr(hybrid, "log_decay",
                        lambda A_log, a, dt_bias: -A_log.exp() * torch.nn.functional.softplus(a + dt_bias))
    assert logits_gap(port_of(refs, torch.float64), refs[torch.float64], ids(2, 150)) > 100 * TOL[torch.float64]


@pytest.mark.parametrize("bug", ["output gate missing", "rotary on the whole head", "key heads tiled",
                                 "carry dropped between chunks"])
def test_planted_bug_moves_the_logits(refs, library, monkeypatch, bug):
    library(torch.float64)
    _planted(monkeypatch, bug)
    assert logits_gap(port_of(refs, torch.float64), refs[torch.float64], ids(2, 150)) > BUG


# ----------------------------------------------------------------------------- the cache

@torch.no_grad()
def cached_gaps(ours, ref, pieces=(70,), steps=12, seed=2):
    """Feed a prompt in ``pieces`` and then ``steps`` single tokens through our cache and transformers'
    DynamicCache; return the largest gap of our cached logits to our full pass of the sequence so far, and to
    the reference's cached logits, at every call."""
    total = sum(pieces) + steps
    x = ids(2, total, seed)
    cache, theirs = ours.new_cache(), DynamicCache(config=ref.config)
    to_full, to_ref, start = 0.0, 0.0, 0
    for size in list(pieces) + [1] * steps:
        chunk = x[:, start:start + size]
        start += size
        a = ours(chunk, cache=cache)
        b = ref(chunk, past_key_values=theirs, use_cache=True).logits
        to_full = max(to_full, gap(a, ours(x[:, :start])[:, -size:]))
        to_ref = max(to_ref, gap(a, b))
    assert cache.length == total
    return to_full, to_ref


@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_decoding_is_exact(refs, ports, library, dtype):
    """A 70-position prompt (one chunk of 64 and one of 6), then 12 tokens one at a time: at every step our cached
    logits equal our full pass and transformers' cached step."""
    library(dtype)
    to_full, to_ref = cached_gaps(ports[dtype], refs[dtype])
    assert to_full < TOL[dtype] and to_ref < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_in_pieces_is_exact(refs, ports, library, dtype):
    """37 positions, then 29 more (the convolution and the chunked rule continue from the cached states), then
    one at a time: equal to the whole, and to transformers fed the same pieces."""
    library(dtype)
    to_full, to_ref = cached_gaps(ports[dtype], refs[dtype], pieces=(37, 29), steps=6)
    assert to_full < TOL[dtype] and to_ref < TOL[dtype]


@pytest.mark.parametrize("bug", ["conv state off by one", "step without decay", "gate after the write",
                                 "last chunk padded", "carry dropped between chunks"])
def test_planted_bug_breaks_the_cache(refs, library, monkeypatch, bug):
    library(torch.float64)
    _planted(monkeypatch, bug)
    _, to_ref = cached_gaps(port_of(refs, torch.float64), refs[torch.float64], pieces=(70,), steps=4)
    assert to_ref > BUG


def test_padded_last_chunk_keeps_the_outputs_but_not_the_state(refs, ports, library, monkeypatch):
    """A padded last chunk that decays the state is invisible in a full pass (the padding comes after every real
    position) and shows only in what follows: the reason the cache checks run after a prompt whose length is not a
    multiple of 64."""
    library(torch.float64)
    x = ids(2, 70)
    clean = ports[torch.float64](x)
    _planted(monkeypatch, "last chunk padded")
    assert gap(port_of(refs, torch.float64)(x), clean) < TOL[torch.float64]


# ----------------------------------------------------------------------------- generate

@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_generate_equals_transformers(refs, ports, library, dtype):
    library(dtype)
    x, n = ids(2, 9, seed=4), 24
    theirs = refs[dtype].generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    ours = tfcore.generate(ports[dtype], x, n)
    assert torch.equal(ours, theirs)
    assert torch.equal(tfcore.generate(ports[dtype], x, n, use_cache=False), theirs)
    assert len(set(theirs[0, 9:].tolist())) > 3  # the tokens vary: a wrong model would not match by chance


def test_planted_bug_changes_the_greedy_tokens(refs, library, monkeypatch):
    library(torch.float64)
    x, n = ids(2, 9, seed=4), 24
    theirs = refs[torch.float64].generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    _planted(monkeypatch, "step without decay")
    assert not torch.equal(tfcore.generate(port_of(refs, torch.float64), x, n), theirs)


def _padded_batch():
    x = ids(3, 12, seed=5)
    mask = torch.ones_like(x)
    mask[0, :5], mask[2, :2] = 0, 0
    return x.masked_fill(mask == 0, 0), mask  # padding id 0 on the left


@pytest.mark.parametrize("dtype", DTYPES)
def test_left_padded_generate_equals_transformers(refs, ports, library, dtype):
    """A left-padded batch: equal to transformers' generate with the same attention_mask, and each row equal to
    its prompt generated alone (the padding writes nothing into the states)."""
    library(dtype)
    x, mask = _padded_batch()
    n = 20
    theirs = refs[dtype].generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)
    ours = tfcore.generate(ports[dtype], x, n, attention_mask=mask)
    assert torch.equal(ours, theirs)
    for row in range(3):
        alone = tfcore.generate(ports[dtype], x[row:row + 1, mask[row].bool()], n)
        assert torch.equal(ours[row, 12:], alone[0, -n:])


def test_planted_unmasked_padding_is_caught(refs, ports, library, monkeypatch):
    library(torch.float64)
    x, mask = _padded_batch()
    n = 20
    theirs = refs[torch.float64].generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False, pad_token_id=0)
    forward = GatedDeltaNet.forward
    monkeypatch.setattr(GatedDeltaNet, "forward", lambda self, h, cache=None, keep=None: forward(self, h, cache, None))
    assert not torch.equal(tfcore.generate(ports[torch.float64], x, n, attention_mask=mask), theirs)


# ----------------------------------------------------------------------------- bytes

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_state_bytes_equal_the_cache(ports, dtype):
    """``state_bytes`` counts what a real run's ``HybridCache`` holds: the linear layers' states (the delta state in
    float32 at least) do not grow with the length, the attention layers' keys and values do."""
    model = copy.deepcopy(ports[torch.float32]).to(dtype)
    size = torch.finfo(dtype).bits // 8
    for length in (5, 70):
        cache = model.new_cache()
        with torch.no_grad():
            model(ids(3, length), cache=cache)
        expected = state_bytes(model.config, length, batch=3, dtype_bytes=size)
        assert cache.state_nbytes() == expected["linear_state"] and cache.kv_nbytes() == expected["kv"]
        assert cache.nbytes() == expected["linear_state"] + expected["kv"]
        assert expected["all_attention_kv"] == expected["kv"] * 5 // 2  # 5 layers, 2 of them attention
        assert all(c.recurrent_state.dtype == torch.promote_types(dtype, torch.float32)
                   for c in cache.layers if isinstance(c, hybrid.RecurrentLayerCache))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cache_holds_what_transformers_holds(refs, dtype):
    """Per linear layer transformers' DynamicCache keeps ``kernel`` convolution inputs per channel, the port
    ``kernel - 1`` (the oldest is never read: the cached steps above are exact), and the same delta state, in
    float32 for a bfloat16 model; per attention layer the same keys and values."""
    reference = copy.deepcopy(refs[torch.float32]).to(dtype)
    ours = Qwen35.from_transformers(reference)
    x = ids(2, 9)
    cache, theirs = ours.new_cache(), DynamicCache(config=reference.config)
    with torch.no_grad():
        ours(x, cache=cache)
        reference(x, past_key_values=theirs, use_cache=True)
    kernel, tol = reference.config.linear_conv_kernel_dim, {torch.bfloat16: 1e-2, torch.float32: TOL[torch.float32]}[dtype]
    for i, kind in enumerate(reference.config.layer_types):
        layer = theirs.layers[i]
        if kind == "linear_attention":
            conv, state = layer.conv_states[0], layer.recurrent_states[0]
            assert conv.shape[-1] == kernel and cache[i].conv_state.shape[-1] == kernel - 1
            assert gap(cache[i].conv_state, conv[..., 1:]) < tol
            assert state.dtype == cache[i].recurrent_state.dtype == torch.promote_types(dtype, torch.float32)
            assert state.shape == cache[i].recurrent_state.shape == (2, 4, 12, 8)
        else:
            assert gap(cache[i].keys, layer.keys) < tol and gap(cache[i].values, layer.values) < tol


def test_planted_cache_keeping_the_whole_kernel_is_caught(ports, monkeypatch):
    """transformers keeps ``kernel`` inputs per channel; the port keeps ``kernel - 1``, and the byte count sees it."""
    def conv(x, weight, state=None, act=torch.nn.functional.silu):
        out, _ = hybrid_conv(x, weight, state, act)
        return out, torch.nn.functional.pad(x, (weight.shape[-1], 0))[..., -weight.shape[-1]:]
    monkeypatch.setattr(hybrid, "causal_conv1d", conv)
    cache = ports[torch.float32].new_cache()
    with torch.no_grad():
        ports[torch.float32](ids(1, 9), cache=cache)
    assert cache.state_nbytes() != state_bytes(ports[torch.float32].config, 9, dtype_bytes=4)["linear_state"]


# ----------------------------------------------------------------------------- bad input

def test_config_errors():
    with pytest.raises(ValueError, match="layer_types"):
        Qwen35Config(num_hidden_layers=2, layer_types=["linear_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="layer_types"):
        Qwen35Config(num_hidden_layers=3, layer_types=["linear_attention"])
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        Qwen35Config(linear_num_key_heads=3, linear_num_value_heads=4)
    with pytest.raises(ValueError, match="even"):
        Qwen35Config(head_dim=12, partial_rotary_factor=0.25)  # 3 numbers would turn
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        Qwen35Config(partial_rotary_factor=1.5)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Qwen35Config(num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="linear_conv_kernel_dim"):
        Qwen35Config(linear_conv_kernel_dim=0)
    with pytest.raises(ValueError, match="rope_theta"):
        Qwen35Config(rope_theta=-1.0)


def test_from_transformers_refuses_what_it_does_not_build(refs):
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, bos_token_id=None, eos_token_id=None))
    with pytest.raises(TypeError, match="Qwen3_5ForCausalLM"):
        Qwen35.from_transformers(llama)
    vision = types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen3_5"))
    with pytest.raises(TypeError, match="vision-language"):
        Qwen35.from_transformers(vision)
    moe = types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen3_5_moe"))
    with pytest.raises(TypeError, match="experts"):
        Qwen35.from_transformers(moe)
    text_model = refs[torch.float32].model  # a Qwen3_5TextModel: no output layer
    with pytest.raises(TypeError, match="lm_head"):
        Qwen35.from_transformers(text_model)
    scaled = copy.deepcopy(refs[torch.float32])
    scaled.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0,
                                     "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="rotary scaling 'linear'"):
        Qwen35.from_transformers(scaled)


def test_cache_misuse_is_refused(ports):
    model = ports[torch.float32]
    cache = model.new_cache()
    with torch.no_grad():
        model(ids(2, 5), cache=cache)
        with pytest.raises(ValueError, match="holds 2 sequences"):
            model(ids(3, 1), cache=cache)
        with pytest.raises(ValueError, match="new_cache"):
            model(ids(2, 1), cache=tfcore.KVCache(5))
        with pytest.raises(ValueError, match="layer_types"):
            model(ids(2, 1), cache=HybridCache(["linear_attention"] * 5))
        with pytest.raises(ValueError, match="float32 model"):
            copy.deepcopy(model).double()(ids(2, 1), cache=cache)
        with pytest.raises(ValueError, match="at least one token"):
            model(ids(2, 0), cache=cache)
        padded = model.new_cache()
        x, mask = _padded_batch()
        model(x, cache=padded, attention_mask=mask)
        with pytest.raises(ValueError, match="attention_mask is None"):
            model(ids(3, 1), cache=padded)
        with pytest.raises(ValueError, match="do not fit"):
            model(ids(1, 513))
    with pytest.raises(ValueError, match="layer_types"):
        HybridCache(["attention"])
    with pytest.raises(TypeError, match="Qwen35Config"):
        state_bytes(tfcore.LlamaConfig(), 10)
    with pytest.raises(ValueError, match="length"):
        state_bytes(model.config, -1)
    with pytest.raises(ValueError, match="dtype_bytes"):
        state_bytes(model.config, 10, dtype_bytes=0)
