"""The cost of a token: FLOPs and bytes of each operation of a decoder, arithmetic intensity and the
roofline (chapter 23).

One forward pass runs ``batch`` rows of ``new`` tokens after ``cached`` positions: ``T = batch x new``
tokens, each attending to ``S = cached + new`` keys. ``decoder_ops`` lists every operation of that
pass with

- ``flops``: floating-point operations. A matrix product ``[m, k] @ [k, n]`` costs ``2 m k n`` (one
  multiply and one add per term), the count of ``torch.utils.flop_counter.FlopCounterMode``;
  ``counted_flops`` runs the tfcore model on the ``meta`` device under that counter (no memory, no
  arithmetic) and ``tests/test_cost.py`` checks the two agree exactly. The counter sees matrix
  products only (in torch 2.13 its registry holds mm, addmm, bmm, baddbmm, _scaled_mm,
  convolutions, flex attention and the CUDA fused attention kernels; a bias, a softmax, a norm or
  an activation counts 0, and so does the CPU's fused attention kernel, shown by running it): the
  other operations are counted here by a stated convention (``ELEMENTWISE_FLOPS``), and they are
  under 2% of the total on the shapes ``tests/test_cost.py`` checks.
- bytes moved, as if every operation read its inputs from memory and wrote its output back once
  (no reuse through the CPU's caches between operations; attention fused as tfcore runs it, its
  scores never stored, unless ``fused_attention=False``): ``weight_bytes`` (the weights it reads:
  once per pass, whatever the batch), ``cache_read_bytes`` and ``cache_write_bytes`` (the KV
  cache), and ``activation_bytes`` (every other tensor read or written).

The rule of thumb it refines: a forward pass costs 2 FLOPs per parameter per token, ``2 N``, plus
attention's context-dependent ``2 n_layer n_ctx d_attn`` per token (Kaplan et al., 2020, *Scaling
Laws for Neural Language Models*, section 2.1 and Table 1, where N leaves out the embeddings).
``kaplan_flops`` evaluates it; tfcore's attention computes two products of that size, the scores
``Q Kᵀ`` and the weighted sum ``P V``, so the exact count has ``4 n_layer S d_attn`` per token.

``roofline(flops, bytes, peak, bandwidth)`` is the bound ``max(flops / peak, bytes / bandwidth)``:
a pass cannot take less time than its arithmetic at the peak rate, nor than its traffic at the
full memory bandwidth; the larger term is the one that binds, and ``flops / bytes`` (the
arithmetic intensity) against ``peak / bandwidth`` says which.

Configs: ``tfcore.GPTConfig`` (GPT-2: LayerNorm, GELU), ``tfcore.LlamaConfig`` (RMSNorm, rotary,
SwiGLU, grouped-query attention), ``tfcore.MixtralConfig`` (experts) for the operations;
``parameter_counts``, ``model_weight_bytes`` and ``kv_cache_bytes_per_token`` also take
``tfcore.DeepseekV3Config`` and ``tfcore.DeepseekV3MoEConfig`` (latent attention), and
``tfcore.Qwen35Config`` (Qwen3.5's hybrid of Gated DeltaNet and attention layers, chapter 20).
``published_configs()`` gives the published sizes of GPT-2 small, Llama 2 7B, Llama 3 8B,
Mixtral 8x7B and DeepSeek-V3, and the default sizes of transformers' Qwen3.5 text model.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .gpt import GPT, GPTConfig
from .hybrid import Qwen35Config
from .llama import Llama, LlamaConfig
from .mla import DeepseekV3Config
from .moe import DeepseekV3MoEConfig, MixtralConfig, SparseMoeBlock

# FLOPs per element of the operations FlopCounterMode does not see: a convention (one per add,
# multiply, divide, comparison, exp, tanh or erf), written out so that the reader can change it.
ELEMENTWISE_FLOPS = {
    "layer_norm": 7,  # mean (1), subtract it (1), square (1), sum (1), times 1/sqrt (1), scale (1), shift (1)
    "rms_norm": 4,  # square (1), sum (1), times 1/sqrt (1), scale (1)
    "softmax": 5,  # per score: running max (1), subtract it (1), exp (1), sum (1), divide (1)
    "gelu_new": 9,  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): x^3 (2), 4 products/sums, tanh, +1, x, 0.5
    "gelu_pytorch_tanh": 9,
    "gelu": 5,  # 0.5 x (1 + erf(x / sqrt 2)): divide, erf, +1, times x, times 0.5
    "silu": 5,  # x / (1 + exp(-x)): negate, exp, +1, divide, and x times it
    "relu": 1,
    "rotary": 3,  # x cos + rotate_half(x) sin: two products and a sum (the sign flip of half not counted)
    "residual": 1,
    "gate_product": 1,  # SwiGLU's silu(gate) * up
    "dequantize": 1,  # int8 -> float, per weight (tfcore.Int8Linear); and one product per output for the scale
}

_MATMUL_KINDS = ("matmul",)


def _whole(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def _dtype_bytes(dtype, name: str = "dtype") -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype such as torch.float32 or torch.bfloat16, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def _check_config(config, allowed=(GPTConfig, LlamaConfig)):
    if not isinstance(config, allowed):
        names = ", ".join(f"tfcore.{c.__name__}" for c in allowed)
        raise TypeError(f"config must be one of {names}, got {type(config).__name__}; for a transformers "
                        f"config use tfcore.cost.from_transformers_config(config)")
    return config


# ----------------------------------------------------------------------------------------------
# Sizes


def _attention_sizes(config):
    """``(H, H_kv, head_dim)`` of a GPT or Llama config."""
    if isinstance(config, GPTConfig):
        heads = config.num_attention_heads
        return heads, heads, config.hidden_size // heads
    return config.num_attention_heads, config.num_key_value_heads, config.head_dim


def parameter_counts(config) -> dict:
    """Parameters of the model a config describes (numbers, not bytes), each shared tensor once.

    Returns ``total`` (every parameter: what ``sum(p.numel() for p in model.parameters())`` gives),
    ``active`` (those one token uses: every expert not routed to left out; the embedding table is
    counted whole, as published totals count it), ``embedding`` (token and learned position tables),
    and ``non_embedding`` (total minus embedding: Kaplan et al.'s N; a tied output layer is the
    embedding table, so it is not in N).
    """
    _check_config(config, (GPTConfig, LlamaConfig, DeepseekV3Config, Qwen35Config))
    if isinstance(config, Qwen35Config):
        return _qwen35_counts(config)
    d, n, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    tied = config.tie_word_embeddings
    if isinstance(config, GPTConfig):
        i = config.intermediate_size
        attention = 4 * (d * d + d)  # q, k, v, o with biases
        ff = d * i + i + i * d + d
        norms = 2 * 2 * d
        embedding = vocab * d + config.max_position_embeddings * d
        per_layer = attention + ff + norms
        total = embedding + n * per_layer + 2 * d + (0 if tied else vocab * d)
        return dict(total=total, active=total, embedding=embedding, non_embedding=total - embedding)
    if isinstance(config, DeepseekV3Config):
        return _deepseek_counts(config)
    heads, kv_heads, head_dim = _attention_sizes(config)
    bias = config.attention_bias
    attention = (d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d
                 + bias * (heads * head_dim + 2 * kv_heads * head_dim + d))
    swiglu = 3 * d * config.intermediate_size + config.mlp_bias * (2 * config.intermediate_size + d)
    if isinstance(config, MixtralConfig):
        experts, k = config.num_local_experts, config.num_experts_per_tok
        ff_total, ff_active = d * experts + experts * swiglu, d * experts + k * swiglu  # router + experts
    else:
        ff_total = ff_active = swiglu
    embedding = vocab * d
    outside = embedding + d + (0 if tied else vocab * d)  # table, final norm, output layer
    total = outside + n * (attention + ff_total + 2 * d)
    active = outside + n * (attention + ff_active + 2 * d)
    return dict(total=total, active=active, embedding=embedding, non_embedding=total - embedding)


def _deepseek_counts(config: DeepseekV3Config) -> dict:
    d, n, vocab, heads = config.hidden_size, config.num_hidden_layers, config.vocab_size, config.num_attention_heads
    bias = config.attention_bias
    q_width = heads * config.qk_head_dim
    if config.q_lora_rank is None:
        queries = d * q_width
    else:
        queries = d * config.q_lora_rank + bias * config.q_lora_rank + config.q_lora_rank + config.q_lora_rank * q_width
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    attention = (queries + d * latent + bias * latent + config.kv_lora_rank
                 + config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
                 + heads * config.v_head_dim * d + bias * d)
    dense_ff = 3 * d * config.intermediate_size
    layers_total = layers_active = n * (attention + 2 * d)
    if isinstance(config, DeepseekV3MoEConfig):
        dense = config.first_k_dense_replace
        expert = 3 * d * config.moe_intermediate_size
        moe_layers = max(n - dense, 0)
        router = d * config.n_routed_experts  # tfcore's e_score_correction_bias is a buffer, not a parameter
        shared = config.n_shared_experts * expert
        layers_total += min(dense, n) * dense_ff + moe_layers * (router + shared + config.n_routed_experts * expert)
        layers_active += min(dense, n) * dense_ff + moe_layers * (router + shared + config.num_experts_per_tok * expert)
    else:
        layers_total += n * dense_ff
        layers_active += n * dense_ff
    embedding = vocab * d
    outside = embedding + d + (0 if config.tie_word_embeddings else vocab * d)
    total, active = outside + layers_total, outside + layers_active
    return dict(total=total, active=active, embedding=embedding, non_embedding=total - embedding)


def _qwen35_counts(config: Qwen35Config) -> dict:
    """``tfcore.Qwen35``'s parameters, module by module (tfcore/hybrid.py)."""
    d, vocab, bias = config.hidden_size, config.vocab_size, config.attention_bias
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = (d * 2 * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d  # q (and gate), k, v, o
                 + bias * (2 * heads * head_dim + 2 * kv_heads * head_dim + d) + 2 * head_dim)  # biases, q/k norms
    v_heads, value_dim = config.linear_num_value_heads, config.linear_num_value_heads * config.linear_value_head_dim
    linear = (d * config.conv_dim + d * value_dim + 2 * d * v_heads  # in_proj_qkv, in_proj_z, in_proj_b and _a
              + config.conv_dim * config.linear_conv_kernel_dim + 2 * v_heads  # conv1d, dt_bias, A_log
              + config.linear_value_head_dim + value_dim * d)  # the gated norm, out_proj
    block = 3 * d * config.intermediate_size + 2 * d  # SwiGLU, two norms
    layers = sum((linear if kind == "linear_attention" else attention) + block for kind in config.layer_types)
    embedding = vocab * d
    total = embedding + d + (0 if config.tie_word_embeddings else vocab * d) + layers
    return dict(total=total, active=total, embedding=embedding, non_embedding=total - embedding)


def model_weight_bytes(config, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Bytes of the weights, every parameter stored in ``dtype``: ``total`` and ``active`` (per token;
    for a mixture of experts, only the routed experts' weights). See ``parameter_counts``."""
    size = _dtype_bytes(dtype)
    counts = parameter_counts(config)
    return dict(total=counts["total"] * size, active=counts["active"] * size)


def kv_cache_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16, expanded: bool = False) -> int:
    """Bytes the cache keeps for each token (all layers), each number stored in ``dtype``.

    - GPT (multi-head attention): a key and a value of ``hidden`` numbers per layer;
    - Llama (grouped-query; multi-query when ``H_kv = 1``): ``2 x H_kv x head_dim`` per layer;
    - DeepSeek-V3 (latent attention): ``kv_lora_rank + qk_rope_head_dim`` per layer (the latent and
      the shared rotary key, as ``tfcore.LatentCache`` keeps them); with ``expanded=True``, what
      caching its expanded keys and values would need instead: ``H x (qk_nope + qk_rope)`` key
      numbers and ``H x v_head_dim`` value numbers per layer;
    - Qwen3.5's hybrid: ``2 x H_kv x head_dim`` per *attention* layer only; its Gated DeltaNet layers
      keep a state of fixed size instead, whatever the number of tokens
      (``tfcore.hybrid.state_bytes(config, length)["linear_state"]``).
    """
    _check_config(config, (GPTConfig, LlamaConfig, DeepseekV3Config, Qwen35Config))
    size, n = _dtype_bytes(dtype), config.num_hidden_layers
    if isinstance(config, Qwen35Config):
        if expanded:
            raise ValueError("expanded=True describes DeepSeek's latent cache only; Qwen3.5's attention layers "
                             "cache their keys and values expanded already")
        attention_layers = config.layer_types.count("full_attention")
        return attention_layers * 2 * config.num_key_value_heads * config.head_dim * size
    if isinstance(config, DeepseekV3Config):
        heads = config.num_attention_heads
        per_layer = heads * (config.qk_head_dim + config.v_head_dim) if expanded else \
            config.kv_lora_rank + config.qk_rope_head_dim
        return n * per_layer * size
    if expanded:
        raise ValueError("expanded=True describes DeepSeek's latent cache only; a GPT or Llama cache holds "
                         "its keys and values expanded already")
    _, kv_heads, head_dim = _attention_sizes(config)
    return n * 2 * kv_heads * head_dim * size


# ----------------------------------------------------------------------------------------------
# Operations


def _op(name, kind, flops=0, weight=0, cache_read=0, cache_write=0, activation=0) -> dict:
    return dict(name=name, kind=kind, flops=int(flops), weight_bytes=int(weight), cache_read_bytes=int(cache_read),
                cache_write_bytes=int(cache_write), activation_bytes=int(activation),
                bytes=int(weight + cache_read + cache_write + activation))


def _scale(op: dict, times: int) -> dict:
    return {key: value * times if isinstance(value, int) else value for key, value in op.items()}


def decoder_ops(config, batch: int = 1, new: int = 1, cached: int = 0, dtype: torch.dtype = torch.float32,
                weights: str | None = None, use_cache: bool | None = None, fused_attention: bool = True) -> list[dict]:
    """Every operation of one forward pass, each summed over the layers, in the order they run.

    ``batch`` rows of ``new`` tokens after ``cached`` positions (whole numbers, ``batch, new >= 1``,
    ``cached >= 0``); weights, activations and cache in ``dtype``. ``weights="int8"`` stores every
    linear layer of the blocks as ``tfcore.Int8Linear`` does (int8 weights, one float32 scale per
    output; the output layer and the embeddings stay in ``dtype``), including the float copy its
    forward makes of each weight (``self.weight_int8.t().to(x.dtype)`` in tfcore/quantization.py).
    ``use_cache`` (default: ``cached > 0``) writes the new keys and values into a KV cache and reads
    every key and value from it; without one (a prompt with no cache) they stay activations.
    ``fused_attention`` (default True): the scores and their softmax never leave the kernel, as in
    tfcore's attention, which calls PyTorch's fused ``F.scaled_dot_product_attention`` for 4-D
    inputs (tfcore/attention.py); False writes the scores and the weights to memory and reads them
    back (chapter 13's plain attention with its weights).

    Each row: ``name``, ``kind`` ("matmul": counted by FlopCounterMode, or "elementwise"),
    ``flops``, ``weight_bytes``, ``cache_read_bytes``, ``cache_write_bytes``, ``activation_bytes``,
    ``bytes`` (their sum). Grouped-query attention reads each key/value head once for its group
    of query heads, as ``tfcore.GroupedQueryAttention`` does (it stacks a group's queries as the
    rows of one head instead of copying the keys and values out to every query head); the
    expert layers read the weights of ``min(E, T k)`` experts, the most that ``T`` tokens with ``k``
    experts each can touch. Not counted: the cos/sin tables, the mask, the heads' reshapes, and
    the experts' gather and scatter of rows.
    """
    _check_config(config)
    batch, new = _whole("batch (rows)", batch, 1), _whole("new (tokens per row)", new, 1)
    cached = _whole("cached (positions already in the cache)", cached, 0)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (weights, activations and cache), got {dtype!r}; "
                        f"for int8 weights pass weights='int8'")
    if weights not in (None, "int8"):
        raise ValueError(f"weights must be None (stored in dtype) or 'int8' (tfcore.Int8Linear), got {weights!r}")
    if use_cache is None:
        use_cache = cached > 0
    if not isinstance(fused_attention, bool):
        raise TypeError(f"fused_attention must be True or False, got {fused_attention!r}")
    if cached and not use_cache:
        raise ValueError(f"cached={cached} positions need use_cache=True: without a cache there is nothing cached")
    a = _dtype_bytes(dtype)
    gpt = isinstance(config, GPTConfig)
    d, n, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv_heads, head_dim = _attention_sizes(config)
    tokens, keys = batch * new, cached + new
    norm = "layer_norm" if gpt else "rms_norm"
    norm_weights = (2 if gpt else 1) * d
    bias_gpt = 1 if gpt else 0
    int8 = weights == "int8"
    dequantized = []  # (in, out) of every int8 linear of one layer

    def linear(name, fan_in, fan_out, bias, rows=tokens, copies=1, kind="matmul"):
        if int8:
            dequantized.append((fan_in * copies, fan_out * copies))
            weight = copies * (fan_in * fan_out + 4 * fan_out + bias * fan_out * a)
            activation = rows * (fan_in + fan_out) * a + copies * 2 * fan_in * fan_out * a  # the float copy, written and read
        else:
            weight = copies * (fan_in * fan_out + bias * fan_out) * a
            activation = rows * (fan_in + fan_out) * a
        return _op(name, kind, 2 * rows * fan_in * fan_out, weight, 0, 0, activation)

    def elementwise(name, per_element, elements, reads=1, writes=1, weight=0):
        return _op(name, "elementwise", ELEMENTWISE_FLOPS.get(per_element, per_element) * elements, weight * a,
                   0, 0, (reads + writes) * elements * a)

    layer = [elementwise("norm_1", norm, tokens * d, weight=norm_weights)]
    layer += [linear("q_proj", d, heads * head_dim, bias_gpt or config.attention_bias),
              linear("k_proj", d, kv_heads * head_dim, bias_gpt or config.attention_bias),
              linear("v_proj", d, kv_heads * head_dim, bias_gpt or config.attention_bias)]
    if not gpt:
        layer.append(elementwise("rotary", "rotary", tokens * (heads + kv_heads) * head_dim))
    kv_new = 2 * batch * kv_heads * new * head_dim  # numbers written to the cache
    if use_cache:
        layer.append(_op("cache_write", "elementwise", 0, 0, 0, kv_new * a, kv_new * a))
    scores = batch * heads * new * keys
    # each key/value head is read once for its group of query heads: from the cache, or as an activation
    k_read = batch * kv_heads * keys * head_dim * a if use_cache else 0
    k_act = 0 if use_cache else batch * kv_heads * keys * head_dim * a
    q_numbers = batch * heads * new * head_dim
    masked = not (use_cache and new == 1)  # tfcore passes a mask unless one new token follows a cache
    softmax_flops = ELEMENTWISE_FLOPS["softmax"] * scores + q_numbers  # and the query scaled by 1/sqrt(head_dim)
    if fused_attention:  # the scores stay inside the kernel: read q, K and V, write the output
        zeroing = 2 * q_numbers * a if masked else 0  # tfcore zeroes fully masked rows after the kernel
        layer += [_op("scores", "matmul", 2 * scores * head_dim, 0, k_read, 0, q_numbers * a + k_act),
                  _op("softmax", "elementwise", softmax_flops),
                  _op("weighted_sum", "matmul", 2 * scores * head_dim, 0, k_read, 0, q_numbers * a + k_act + zeroing)]
    else:  # every step through memory: scores written, masked (read, write), softmax (read, write), read
        layer += [_op("scores", "matmul", 2 * scores * head_dim, 0, k_read, 0, (q_numbers + scores) * a + k_act),
                  _op("softmax", "elementwise", softmax_flops, 0, 0, 0,
                      (2 * (2 if masked else 1) * scores + 2 * q_numbers) * a),
                  _op("weighted_sum", "matmul", 2 * scores * head_dim, 0, k_read, 0, (scores + q_numbers) * a + k_act)]
    layer.append(linear("o_proj", heads * head_dim, d, bias_gpt or config.attention_bias))
    layer.append(elementwise("residual_1", "residual", tokens * d, reads=2))
    layer.append(elementwise("norm_2", norm, tokens * d, weight=norm_weights))
    if gpt:
        i = config.intermediate_size
        layer += [linear("ff_up", d, i, 1), elementwise("activation", config.hidden_act, tokens * i),
                  linear("ff_down", i, d, 1)]
    else:
        i, mlp_bias = config.intermediate_size, config.mlp_bias
        if isinstance(config, MixtralConfig):
            experts, k = config.num_local_experts, config.num_experts_per_tok
            touched = min(experts, tokens * k)
            layer.append(linear("router", d, experts, 0))
            routed = tokens * k
            ff = [linear("ff_gate", d, i, mlp_bias, rows=routed, copies=touched),
                  linear("ff_up", d, i, mlp_bias, rows=routed, copies=touched)]
            act_rows = routed
            down = linear("ff_down", i, d, mlp_bias, rows=routed, copies=touched)
        else:
            ff = [linear("ff_gate", d, i, mlp_bias), linear("ff_up", d, i, mlp_bias)]
            act_rows = tokens
            down = linear("ff_down", i, d, mlp_bias)
        act = act_rows * i
        layer += ff + [_op("activation", "elementwise",
                           (ELEMENTWISE_FLOPS[config.hidden_act] + ELEMENTWISE_FLOPS["gate_product"]) * act,
                           0, 0, 0, 5 * act * a), down]  # silu: read 1, write 1; product: read 2, write 1
    layer.append(elementwise("residual_2", "residual", tokens * d, reads=2))
    if int8:
        conversions = sum(fi * fo for fi, fo in dequantized)
        outputs = sum(fo for _, fo in dequantized)
        layer.append(_op("dequantize", "elementwise", conversions + tokens * outputs, 0, 0, 0, 0))
    # embeddings: a lookup of T rows (GPT: and L position rows, added)
    rows_read = tokens * d + (new * d if gpt else 0)
    ops = [_op("embedding", "elementwise", tokens * d if gpt else 0, rows_read * a, 0, 0,
               (tokens * d * (2 if gpt else 0) + tokens * d) * a)]
    ops += [_scale(op, n) for op in layer]
    ops.append(elementwise("final_norm", norm, tokens * d, weight=norm_weights))
    ops.append(_op("lm_head", "matmul", 2 * tokens * d * vocab, d * vocab * a, 0, 0, tokens * (d + vocab) * a))
    return ops


def forward_cost(config, batch: int = 1, new: int = 1, cached: int = 0, dtype: torch.dtype = torch.float32,
                 weights: str | None = None, use_cache: bool | None = None, fused_attention: bool = True) -> dict:
    """Totals of ``decoder_ops`` (same arguments): ``flops``, ``matmul_flops``, ``elementwise_flops``,
    ``bytes``, ``weight_bytes``, ``cache_read_bytes``, ``cache_write_bytes``, ``activation_bytes``,
    and ``intensity`` = flops / bytes (FLOPs per byte)."""
    ops = decoder_ops(config, batch, new, cached, dtype, weights, use_cache, fused_attention)
    total = {key: sum(op[key] for op in ops) for key in
             ("flops", "bytes", "weight_bytes", "cache_read_bytes", "cache_write_bytes", "activation_bytes")}
    total["matmul_flops"] = sum(op["flops"] for op in ops if op["kind"] == "matmul")
    total["elementwise_flops"] = total["flops"] - total["matmul_flops"]
    total["intensity"] = arithmetic_intensity(total["flops"], total["bytes"])
    return total


def kaplan_flops(config, batch: int = 1, new: int = 1, cached: int = 0) -> int:
    """Kaplan et al.'s forward-pass estimate for ``batch x new`` tokens at context ``S = cached + new``:
    ``(2 N + 2 n_layer S d_attn)`` per token, plus the output layer's ``2 d vocab`` (their Table 1's
    "De-embed" row; N, without embeddings, leaves it out when the output layer is tied).
    For experts, N counts the active parameters."""
    _check_config(config)
    batch, new = _whole("batch (rows)", batch, 1), _whole("new (tokens per row)", new, 1)
    cached = _whole("cached (positions already in the cache)", cached, 0)
    counts = parameter_counts(config)
    heads, _, head_dim = _attention_sizes(config)
    n_active = counts["active"] - counts["embedding"]  # the 2N of every matrix a token multiplies
    lm_head = 2 * config.hidden_size * config.vocab_size if config.tie_word_embeddings else 0
    per_token = 2 * n_active + 2 * config.num_hidden_layers * (cached + new) * heads * head_dim + lm_head
    return batch * new * per_token


# ----------------------------------------------------------------------------------------------
# Counted by code


class _Walk(nn.Module):
    """Runs a tfcore GPT's or Llama's blocks, final norm and output layer on hidden states, as their
    ``forward`` does after the embedding lookup (which multiplies nothing): the lookup and the input
    check need token ids' values, which meta tensors do not have. Its child is named ``model`` so
    that FlopCounterMode reports each module by its path (``model.blocks.0.attention.query``)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, cached: int):
        from .attention import causal_mask
        from .llama import rotary_cos_sin

        model, (batch, new, _) = self.model, x.shape
        cache = model.new_cache()
        if cached:
            config = model.config
            heads, kv_heads, head_dim = _attention_sizes(config)
            for layer_cache in cache.layers:
                past = torch.empty(batch, kv_heads, cached, head_dim, device=x.device, dtype=x.dtype)
                layer_cache.append(past, past)
        mask = None if (cached and new == 1) else causal_mask(new, x.device, cached)
        if isinstance(model, GPT):
            for i, block in enumerate(model.blocks):
                x = block(x, mask, cache=cache[i] if cached else None)
            return model.lm_head(model.final_layer_norm(x))
        cos, sin = rotary_cos_sin(torch.arange(cached, cached + new, device=x.device), model.inv_freq)
        for i, layer in enumerate(model.layers):
            x = layer(x, cos, sin, mask, cache[i] if cached else None)
        return model.lm_head(model.norm(x))


_OP_NAMES = {  # the last part of a module's path -> the operation of decoder_ops
    "query": "q_proj", "key": "k_proj", "value": "v_proj", "output_linear": "o_proj",
    "q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "o_proj",
    "linear_1": "ff_up", "linear_2": "ff_down", "gate_proj": "ff_gate", "up_proj": "ff_up", "down_proj": "ff_down",
    "gate": "router", "lm_head": "lm_head",
}
_ATTENTION_MODULES = ("attention", "self_attn")


def count_matmul_flops(run, model: nn.Module) -> dict[str, int]:
    """FLOPs that ``FlopCounterMode`` counts while ``run()`` runs ``model`` (a tfcore GPT, Llama or
    Mixtral, called as the root module or through a wrapper), summed by operation name:
    ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``ff_gate``, ``ff_up``, ``ff_down``, ``router``,
    ``lm_head``, and ``attention``: the products inside the attention module that no linear layer
    makes (the scores ``Q Kᵀ`` and the weighted sum ``P V``); ``total`` is everything counted."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    # PyTorch's math backend for F.scaled_dot_product_attention: the counter of torch 2.13 has no
    # formula for the CPU's fused kernel (aten._scaled_dot_product_flash_attention_for_cpu) and
    # counts it 0; the math path runs its two products as bmm, which it counts (tests/test_cost.py)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        run()
    counts = {name: sum(per_op.values()) for name, per_op in counter.get_flop_counts().items()}
    out = {"total": counts.pop("Global", 0)}
    linear_in_attention = attention_total = linear_in_moe = moe_total = 0
    for path, flops in counts.items():
        parts = path.split(".")
        module = _module_at(model, parts)
        if parts[-1] in _ATTENTION_MODULES:
            attention_total += flops
        elif isinstance(module, SparseMoeBlock):
            moe_total += flops
        elif parts[-1] in _OP_NAMES and isinstance(module, nn.Linear):
            out[_OP_NAMES[parts[-1]]] = out.get(_OP_NAMES[parts[-1]], 0) + flops
            if len(parts) > 1 and parts[-2] in _ATTENTION_MODULES:
                linear_in_attention += flops
            if "mlp" in parts[:-1] and "experts" in parts:
                linear_in_moe += flops
    out["attention"] = attention_total - linear_in_attention
    if moe_total:  # the router's product, F.linear(x, gate.weight): counted on the block, not on gate
        out["router"] = moe_total - linear_in_moe
    return out


def _module_at(model: nn.Module, parts: list[str]):
    """The module a FlopCounterMode path names (its first part is the root's class name), or None."""
    for start in range(len(parts)):
        try:
            return model.get_submodule(".".join(parts[start:]))
        except AttributeError:
            continue
    return None


def counted_flops(config, batch: int = 1, new: int = 1, cached: int = 0) -> dict[str, int]:
    """``count_matmul_flops`` of a forward pass of the tfcore model ``config`` describes (a
    ``GPTConfig`` or a ``LlamaConfig``; not experts, whose routing picks rows by value), built and
    run on the ``meta`` device: no weights are drawn and nothing is computed, so a 7B model counts
    in a fraction of a second."""
    _check_config(config)
    if isinstance(config, MixtralConfig):
        raise TypeError("counted_flops cannot run experts on the meta device: the routing picks rows by "
                        "value (torch.where), which meta tensors do not have; run a small Mixtral on the CPU "
                        "with count_matmul_flops(lambda: model(ids), model)")
    batch, new = _whole("batch (rows)", batch, 1), _whole("new (tokens per row)", new, 1)
    cached = _whole("cached (positions already in the cache)", cached, 0)
    with torch.device("meta"):
        model = (GPT if isinstance(config, GPTConfig) else Llama)(config).eval()
    walk = _Walk(model)
    x = torch.empty(batch, new, config.hidden_size, device="meta")
    return count_matmul_flops(lambda: walk(x, cached), walk)


def matmul_flops_by_op(config, batch: int = 1, new: int = 1, cached: int = 0) -> dict[str, int]:
    """``decoder_ops``' matrix-product FLOPs under ``count_matmul_flops``' names (``scores`` and
    ``weighted_sum`` summed as ``attention``), for comparing the formula with the counter."""
    out = {}
    for op in decoder_ops(config, batch, new, cached):
        if op["kind"] == "matmul":
            name = "attention" if op["name"] in ("scores", "weighted_sum") else op["name"]
            out[name] = out.get(name, 0) + op["flops"]
    out["total"] = sum(value for key, value in out.items())
    return out


# ----------------------------------------------------------------------------------------------
# Intensity and roofline


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive, finite number, got {value!r}")
    return float(value)


def arithmetic_intensity(flops, bytes_moved) -> float:
    """FLOPs per byte moved: ``flops / bytes_moved`` (``flops >= 0``, ``bytes_moved > 0``)."""
    if isinstance(flops, bool) or not isinstance(flops, numbers.Real) or not 0 <= flops < math.inf:
        raise ValueError(f"flops must be a finite number >= 0, got {flops!r}")
    return flops / _positive("bytes_moved", bytes_moved)


def roofline(flops, bytes_moved, peak_flops_per_second, bytes_per_second) -> dict:
    """The least time a pass of ``flops`` FLOPs moving ``bytes_moved`` bytes can take on a machine of
    ``peak_flops_per_second`` and ``bytes_per_second``: ``max(compute_seconds, memory_seconds)``.

    Returns ``compute_seconds`` (flops / peak), ``memory_seconds`` (bytes / bandwidth),
    ``bound_seconds`` (the larger), ``binds`` ("compute" or "memory"), ``intensity`` (FLOPs per
    byte) and ``ridge_intensity`` (peak / bandwidth: the intensity above which compute binds).
    """
    peak = _positive("peak_flops_per_second", peak_flops_per_second)
    bandwidth = _positive("bytes_per_second", bytes_per_second)
    intensity = arithmetic_intensity(flops, bytes_moved)
    compute, memory = flops / peak, bytes_moved / bandwidth
    return dict(compute_seconds=compute, memory_seconds=memory, bound_seconds=max(compute, memory),
                binds="compute" if compute >= memory else "memory", intensity=intensity,
                ridge_intensity=peak / bandwidth)


def roofline_of_ops(ops: list[dict], peak_flops_per_second, bytes_per_second) -> dict:
    """The roofline of each operation of ``decoder_ops``, summed: ``bound_seconds`` (each op at its
    own bound, one after the other), ``compute_bound_seconds`` and ``memory_bound_seconds`` (the
    part of it spent in operations that compute, or memory, binds)."""
    rows = [roofline(op["flops"], max(op["bytes"], 1), peak_flops_per_second, bytes_per_second) for op in ops]
    return dict(bound_seconds=sum(r["bound_seconds"] for r in rows),
                compute_bound_seconds=sum(r["bound_seconds"] for r in rows if r["binds"] == "compute"),
                memory_bound_seconds=sum(r["bound_seconds"] for r in rows if r["binds"] == "memory"))


# ----------------------------------------------------------------------------------------------
# Published models


def from_transformers_config(hf) -> GPTConfig | LlamaConfig | DeepseekV3Config:
    """The tfcore config of a transformers ``GPT2Config``, ``LlamaConfig``, ``MixtralConfig`` or
    ``DeepseekV3Config`` (its sizes; dropout and rotary options are not read)."""
    kind = getattr(hf, "model_type", None)
    if kind == "gpt2":
        return GPTConfig(vocab_size=hf.vocab_size, max_position_embeddings=hf.n_positions, hidden_size=hf.n_embd,
                         num_hidden_layers=hf.n_layer, num_attention_heads=hf.n_head, intermediate_size=hf.n_inner,
                         hidden_act=hf.activation_function, tie_word_embeddings=getattr(hf, "tie_word_embeddings", True))
    common = dict(vocab_size=hf.vocab_size, max_position_embeddings=hf.max_position_embeddings,
                  hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
                  num_attention_heads=hf.num_attention_heads, intermediate_size=hf.intermediate_size,
                  hidden_act=hf.hidden_act, tie_word_embeddings=hf.tie_word_embeddings)
    if kind in ("llama", "mixtral"):
        llama = dict(common, num_key_value_heads=hf.num_key_value_heads, head_dim=getattr(hf, "head_dim", None))
        if kind == "llama":
            return LlamaConfig(**llama, attention_bias=hf.attention_bias, mlp_bias=hf.mlp_bias)
        return MixtralConfig(**llama, num_local_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok)
    if kind == "deepseek_v3":
        return DeepseekV3MoEConfig(
            **common, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, attention_bias=hf.attention_bias,
            n_routed_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
            n_shared_experts=hf.n_shared_experts, moe_intermediate_size=hf.moe_intermediate_size,
            n_group=hf.n_group, topk_group=hf.topk_group, first_k_dense_replace=hf.first_k_dense_replace)
    raise TypeError(f"expected a transformers GPT2Config, LlamaConfig, MixtralConfig or DeepseekV3Config, "
                    f"got {type(hf).__name__}")


# Llama 3 8B (Grattafiori et al., 2024, *The Llama 3 Herd of Models*, Table 3): 32 layers, model
# dimension 4,096, FFN dimension 14,336, 32 attention heads, 8 key/value heads, vocabulary 128,000.
LLAMA3_8B = dict(vocab_size=128000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=8192)

# The published totals we check our counts against (parameters), with their sources.
PUBLISHED = {
    "GPT-2 small": dict(total=124e6, source="Radford et al. 2019 list 117M; the released checkpoint's 124M "
                                             "(transformers' GPT2Config defaults) is what we count"),
    "Llama 2 7B": dict(total=7e9, source="Touvron et al. 2023, Llama 2, Table 1 ('7B')"),
    "Llama 3 8B": dict(total=8e9, source="Grattafiori et al. 2024, Table 3 ('8B')"),
    "Mixtral 8x7B": dict(total=46.7e9, active=12.9e9, source="Jiang et al. 2024, Mixtral of Experts"),
    "DeepSeek-V3": dict(total=671e9, active=37e9, source="DeepSeek-AI 2024, DeepSeek-V3 Technical Report, abstract"),
    "Qwen3.5 (9B)": dict(total=9e9, source="transformers 5.23's Qwen3_5TextConfig: its docstring's example calls its "
                                           "defaults a 'Qwen3.5-9B style configuration' (its header names "
                                           "Qwen/Qwen3.5-27B; the count, 8.95B, agrees with 9B)"),
}


def published_configs() -> dict:
    """tfcore configs of published models: GPT-2 small, Llama 2 7B, Mixtral 8x7B and DeepSeek-V3 from
    transformers' default config classes (whose defaults are those models' sizes), Llama 3 8B from
    its paper (``LLAMA3_8B``), and "Qwen3.5 (9B)": ``tfcore.Qwen35Config()``, whose defaults are those
    of transformers' ``Qwen3_5TextConfig``, "a Qwen3.5-9B style configuration" by its docstring's example
    (its header names Qwen/Qwen3.5-27B; the count, 8.95B parameters, agrees with 9B).
    Offline: builds configs only, downloads nothing."""
    import transformers

    return {
        "GPT-2 small": from_transformers_config(transformers.GPT2Config()),
        "Llama 2 7B": from_transformers_config(transformers.LlamaConfig()),
        "Llama 3 8B": LlamaConfig(**LLAMA3_8B),
        "Mixtral 8x7B": from_transformers_config(transformers.MixtralConfig()),
        "DeepSeek-V3": from_transformers_config(transformers.DeepseekV3Config()),
        "Qwen3.5 (9B)": Qwen35Config(),
    }


__all__ = ["ELEMENTWISE_FLOPS", "LLAMA3_8B", "PUBLISHED", "arithmetic_intensity", "count_matmul_flops",
           "counted_flops", "decoder_ops", "forward_cost", "from_transformers_config", "kaplan_flops",
           "kv_cache_bytes_per_token", "matmul_flops_by_op", "parameter_counts", "published_configs", "roofline",
           "roofline_of_ops", "model_weight_bytes"]
