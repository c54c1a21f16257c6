"""Qwen3.5's hybrid text model: Gated DeltaNet layers with a fixed-size state, and a few gated attention layers.

What changes from Llama (chapter 16), as ``transformers``' ``Qwen3_5ForCausalLM`` (5.23) computes it:

- interleaved token mixers: ``layer_types`` lists, per layer, ``"linear_attention"`` (a Gated DeltaNet) or
  ``"full_attention"``; the default pattern is three linear layers, then one attention layer, repeated;
- the Gated DeltaNet (``GatedDeltaNet``): one projection to q, k and v, a depthwise causal convolution over
  the last ``linear_conv_kernel_dim`` positions (then the activation), the gated delta rule of
  ``tfcore.linear_attention`` (q and k L2-normalised, decay ``alpha = exp(g)`` with
  ``g = -exp(A_log) * softplus(a + dt_bias)``, write strength ``beta = sigmoid(b)``), and an RMSNorm of each
  head's output multiplied by ``silu(z)``; ``linear_num_value_heads`` may be a multiple of
  ``linear_num_key_heads``: each query/key head then serves that many consecutive value heads;
- the gated attention (``GatedAttention``): ``q_proj`` gives each head's query *and* an output gate, the output
  is multiplied by ``sigmoid(gate)`` before ``o_proj``; QK-norm; rotary angles on the first
  ``partial_rotary_factor * head_dim`` numbers of each head only (a quarter by default);
- zero-centred RMSNorms, scaled by ``1 + weight`` (``tfcore.GemmaRMSNorm``), computed in float32.

The positions of a text-only batch are three equal rows of "multimodal" rotary positions in transformers;
with three equal rows its ``mrope`` is the plain rotation (checked by running it, tests/test_hybrid.py).

The cache (``HybridCache``) keeps, per attention layer, the keys and values (``tfcore.LayerCache``: it grows
with the sequence) and, per linear layer, two tensors whose size does not: the convolution's last
``kernel - 1`` inputs ``[B, conv_dim, kernel - 1]`` and the delta rule's state ``[B, H_v, d_k, d_v]``. A
prompt runs the chunked rule (``gated_delta_rule_chunked``, chunks of 64 as transformers), one new token the
recurrent step; a later prompt piece continues from the cached state with the chunked rule.

Computation dtypes follow the reference: the delta rule runs in float32 for a float32, float16 or bfloat16
model (transformers casts to float32, and its state is float32) and in float64 for a float64 model (the test
patches transformers' two rule functions, and only those, to keep float64); the norms run in float32.

Padding: a batch padded on the left runs with ``attention_mask [B, P + L]`` (1 = real token), as
``tfcore.gpt.positions_and_mask`` defines it for the attention layers; a linear layer zeroes the inputs of
the masked positions of a multi-token call (transformers' ``apply_mask_to_padding_states``), so that left
padding writes nothing into its state. Checked equal to transformers' ``generate`` on a padded batch.

Every module carries ``transformers``' name (without the ``model.`` prefix), so the state dict loads key for
key. Shapes: ``input_ids [B, L]`` -> logits ``[B, L, vocab_size]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .attention import _whole, scaled_dot_product_attention
from .cache import LayerCache
from .gemma import GemmaRMSNorm, _positive
from .gpt import activation, positions_and_mask
from .linear_attention import gated_delta_rule_chunked, gated_delta_rule_recurrent
from .llama import RMSNorm, SwiGLU, apply_rotary, init_weights_, rotary_cos_sin, rotary_frequencies

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class Qwen35Config:
    """The sizes of a Qwen3.5 text model (dense MLP), with ``transformers``' field names and the defaults of its
    ``Qwen3_5TextConfig`` (5.23). ``layer_types`` defaults to three linear layers, then one full attention
    layer, repeated. ``rope_theta`` and ``partial_rotary_factor`` are read from transformers'
    ``rope_parameters``."""

    vocab_size: int = 248_320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = field(default=None)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "linear_conv_kernel_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads"):
            _whole(name, getattr(self, name), 1)
        for name in ("rms_norm_eps", "rope_theta"):
            if not _positive(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if not (_positive(self.partial_rotary_factor) and self.partial_rotary_factor <= 1):
            raise ValueError(f"partial_rotary_factor must lie in (0, 1] (the share of each head that turns), "
                             f"got {self.partial_rotary_factor!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"int(head_dim * partial_rotary_factor) = {self.rotary_dim} numbers would turn; it must "
                             f"be even and >= 2 (rotary embeddings turn pairs): change head_dim ({self.head_dim}) "
                             f"or partial_rotary_factor ({self.partial_rotary_factor})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads}): each query/key head serves the "
                             f"same number of value heads")
        if self.layer_types is None:
            self.layer_types = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_hidden_layers)]
        if not isinstance(self.layer_types, (list, tuple)) or len(self.layer_types) != self.num_hidden_layers \
                or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types must list {self.num_hidden_layers} entries (num_hidden_layers), each "
                             f"{LINEAR!r} or {FULL!r}; got {self.layer_types!r}")
        self.layer_types = list(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        """How many numbers of each attention head turn: ``int(head_dim * partial_rotary_factor)``, transformers'
        formula (``Qwen3_5TextRotaryEmbedding.compute_default_rope_parameters``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        """The channels of a linear layer's convolution: q and k (``H_k x d_k`` each) and v (``H_v x d_v``)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim \
            + self.linear_num_value_heads * self.linear_value_head_dim


# ----------------------------------------------------------------------------- the Gated DeltaNet

def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                  act=F.silu) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution over positions, then ``act``: each channel mixes its own last K inputs.

    x: ``[B, C, L]``; weight: ``[C, K]``; state: None (the sequence starts here: zeros before it) or
    ``[B, C, K - 1]``, the K - 1 inputs just before ``x``. Output t sees inputs t - K + 1 .. t.
    Returns ``(act(out) [B, C, L], new state [B, C, K - 1])``: the last K - 1 inputs seen, so that a later
    call continues exactly. (transformers' cache keeps K; the oldest one is never read.)
    """
    channels, kernel = weight.shape
    if state is None:
        state = x.new_zeros(x.shape[0], channels, kernel - 1)
    full = torch.cat([state, x], dim=-1)  # [B, C, K - 1 + L]
    out = F.conv1d(full, weight.unsqueeze(1), groups=channels)  # [B, C, L]
    return act(out), full[..., full.shape[-1] - (kernel - 1):]


def expand_key_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, H_k, L, d] -> [B, H_k * groups, L, d]``: key head j serves value heads j*groups .. (j+1)*groups - 1,
    as transformers' ``repeat_interleave`` in ``torch_chunk_gated_delta_rule`` pairs them."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def log_decay(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g = -exp(A_log) * softplus(a + dt_bias): ``[B, L, H_v]`` from ``a [B, L, H_v]`` and ``A_log, dt_bias [H_v]``;
    g <= 0, so the decay alpha = exp(g) lies in (0, 1]. With the reference's casts: A_log and a are rounded to
    float32 first, dt_bias is not (``Qwen3_5GatedDeltaNet.forward``); without them a float64 model's logits moved
    by 8.9e-7 from transformers' (tests/test_hybrid.py)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias)


def rule_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the delta rule runs in, and its state's: float32 for a float32, float16 or bfloat16 model (as
    transformers' functions cast), float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * silu(gate)`` over the last axis (transformers' ``Qwen3_5RMSNormGated``): the norm in
    float32, the weight (starting at 1) applied in x's dtype, the gate in float32, the result in x's dtype.
    x, gate: ``[..., d_v]``."""

    def forward(self, x, gate):
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer. ``forward(x [B, L, hidden], cache, keep)`` -> ``[B, L, hidden]``.

    ``cache`` (a ``RecurrentLayerCache``) gives the convolution and delta-rule states before ``x`` and
    receives the new ones; ``keep [B, L]`` (1 = real token) zeroes the inputs of padded positions.
    """

    chunk_size = 64  # transformers' torch_chunk_gated_delta_rule default, which Qwen3_5GatedDeltaNet uses

    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        hidden, conv_dim = config.hidden_size, config.conv_dim
        self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)  # the output gate of each value head
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)  # beta = sigmoid(b): write strength
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)  # the decay's input
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False,
                                padding=config.linear_conv_kernel_dim - 1)  # weight [conv_dim, 1, K]; called by hand
        self.act_fn = activation(config.hidden_act)  # transformers applies hidden_act after the convolution
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log())  # transformers' init
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def forward(self, x, cache: RecurrentLayerCache | None = None, keep: torch.Tensor | None = None):
        if keep is not None:  # padded positions contribute nothing (transformers' apply_mask_to_padding_states)
            x = x * keep.unsqueeze(-1).to(x.dtype)
        batch, length, _ = x.shape
        qkv, conv_state = causal_conv1d(self.in_proj_qkv(x).transpose(1, 2), self.conv1d.weight.squeeze(1),
                                        None if cache is None else cache.conv_state, self.act_fn)
        q, k, v = qkv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, length, self.num_k_heads, self.head_k_dim).transpose(1, 2)  # [B, H_k, L, d_k]
        k = k.reshape(batch, length, self.num_k_heads, self.head_k_dim).transpose(1, 2)
        v = v.reshape(batch, length, self.num_v_heads, self.head_v_dim).transpose(1, 2)  # [B, H_v, L, d_v]
        groups = self.num_v_heads // self.num_k_heads
        q, k = expand_key_heads(q, groups), expand_key_heads(k, groups)  # [B, H_v, L, d_k]
        beta = self.in_proj_b(x).sigmoid().transpose(1, 2)  # [B, H_v, L]
        g = log_decay(self.A_log, self.in_proj_a(x), self.dt_bias).transpose(1, 2)  # [B, H_v, L]
        q, k, v, g, beta = (t.to(rule_dtype(x.dtype)) for t in (q, k, v, g, beta))
        state = None if cache is None else cache.recurrent_state
        if state is not None and length == 1:  # one new token: one step of the recurrence
            out, state = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True)
        else:  # a prompt, or a later piece of it: chunks, from the carried state
            out, state = gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=state,
                                                  use_qk_l2norm=True)
        if cache is not None:
            cache.conv_state, cache.recurrent_state = conv_state, state
        z = self.in_proj_z(x).view(batch, length, self.num_v_heads, self.head_v_dim)
        out = self.norm(out.to(x.dtype).transpose(1, 2), z)  # [B, L, H_v, d_v]
        return self.out_proj(out.reshape(batch, length, self.value_dim))


# ----------------------------------------------------------------------------- the gated attention

def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn the first ``cos.shape[-1]`` numbers of each head of ``x [..., L, head_dim]``; leave the rest."""
    rot = cos.shape[-1]
    return torch.cat([apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


def gate_output(context: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output ``[B, L, H * head_dim]`` times ``sigmoid(gate)`` of the same shape, per number."""
    return context * torch.sigmoid(gate)


class GatedAttention(nn.Module):
    """Grouped-query attention with QK-norm, partial rotary and a sigmoid output gate.

    ``forward(x [B, L, hidden], cos, sin [L, rotary_dim] or [B, 1, L, rotary_dim], mask, cache)`` ->
    ``[B, L, hidden]``. ``mask`` (True = may attend) broadcasts to ``[B, L, S]``; a query that may see no key
    gets zeros (``tfcore.scaled_dot_product_attention``). ``cache`` is a ``LayerCache``.
    """

    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, 2 * self.num_heads * self.head_dim, bias=bias)  # per head: query, then gate
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask=None, cache: LayerCache | None = None):
        batch, length, _ = x.shape
        q, gate = self.q_proj(x).view(batch, length, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # [B, H, L, head_dim]
        k = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        context, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=False)  # scaled by head_dim ** -0.5
        context = context.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.o_proj(gate_output(context, gate.reshape(batch, length, -1)))


# ----------------------------------------------------------------------------- the cache

class RecurrentLayerCache:
    """One linear layer's cache: ``conv_state [B, conv_dim, kernel - 1]`` (the convolution's last inputs) and
    ``recurrent_state [B, H_v, d_k, d_v]`` (the delta rule's state); both None until first used."""

    def __init__(self):
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.recurrent_state) if t is not None)


class HybridCache:
    """Per layer (``cache[i]``) a ``LayerCache`` (attention layers: keys and values, growing with the sequence)
    or a ``RecurrentLayerCache`` (linear layers: a fixed size). ``capacity`` is handed to the ``LayerCache``s.
    ``length`` counts the positions seen; ``batch`` and ``dtype`` are those of the first call."""

    def __init__(self, layer_types: list[str], capacity: int | None = None):
        if not isinstance(layer_types, (list, tuple)) or not layer_types or set(layer_types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types must be a non-empty list of {LINEAR!r} and {FULL!r}, got {layer_types!r}; "
                             f"make the cache with model.new_cache()")
        self.layer_types = list(layer_types)
        self.layers = [LayerCache(capacity) if kind == FULL else RecurrentLayerCache() for kind in layer_types]
        self.length = 0
        self.batch: int | None = None
        self.dtype: torch.dtype | None = None
        self.padded = False  # whether a padded position is held (set by tfcore.gpt.positions_and_mask)

    def __getitem__(self, index: int):
        return self.layers[index]

    def kv_nbytes(self) -> int:
        """The bytes of the attention layers' keys and values (they grow with the sequence)."""
        return sum(t.numel() * t.element_size() for c in self.layers if isinstance(c, LayerCache)
                   for t in (c.keys, c.values) if t is not None)

    def state_nbytes(self) -> int:
        """The bytes of the linear layers' convolution and delta-rule states (fixed, whatever the length)."""
        return sum(c.nbytes() for c in self.layers if isinstance(c, RecurrentLayerCache))

    def nbytes(self) -> int:
        """Every byte held: keys and values plus states (a cache with a capacity reserves more)."""
        return self.kv_nbytes() + self.state_nbytes()


def state_bytes(config: Qwen35Config, length: int, batch: int = 1, dtype_bytes: int = 2) -> dict[str, int]:
    """What a ``HybridCache`` holds after ``length`` positions of ``batch`` sequences, in a model whose numbers
    take ``dtype_bytes`` bytes (2: bfloat16): ``{"linear_state", "kv", "all_attention_kv"}``.

    - ``linear_state``: every linear layer's convolution state (``conv_dim x (kernel - 1)`` numbers) and delta
      state (``H_v x d_k x d_v`` numbers, kept in float32 at least, as transformers keeps it);
    - ``kv``: the attention layers' keys and values (``2 x H_kv x head_dim`` numbers per position);
    - ``all_attention_kv``: the same if every layer were an attention layer.
    """
    if not isinstance(config, Qwen35Config):
        raise TypeError(f"config must be a Qwen35Config, got {type(config).__name__}")
    length, batch, dtype_bytes = _whole("length", length, 0), _whole("batch", batch, 1), _whole("dtype_bytes", dtype_bytes, 1)
    linear = config.layer_types.count(LINEAR)
    conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * dtype_bytes
    delta = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * max(dtype_bytes, 4)
    kv_layer = 2 * config.num_key_value_heads * config.head_dim * length * dtype_bytes
    return {"linear_state": batch * linear * (conv + delta),
            "kv": batch * (config.num_hidden_layers - linear) * kv_layer,
            "all_attention_kv": batch * config.num_hidden_layers * kv_layer}


# ----------------------------------------------------------------------------- the model

class HybridDecoderLayer(nn.Module):
    """Pre-norm block: ``x + mixer(norm(x))``, then ``x + SwiGLU(norm(x))``; the mixer is a ``GatedDeltaNet``
    (``linear_attn``) or a ``GatedAttention`` (``self_attn``), as ``layer_types`` says."""

    def __init__(self, config: Qwen35Config, layer: int):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = SwiGLU(SimpleNamespace(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                                          mlp_bias=False, hidden_act=config.hidden_act))
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask=None, cache=None, keep=None):
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR:
            h = self.linear_attn(h, cache, keep)
        else:
            h = self.self_attn(h, cos, sin, mask, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35(nn.Module):
    """Token embeddings, N hybrid blocks, a final zero-centred RMSNorm and the output layer (tied to the
    embeddings when the config says so).

    ``forward(input_ids [B, L], cache=None, attention_mask=None)`` -> logits ``[B, L, vocab_size]``. With a
    cache (``model.new_cache()``) ``input_ids`` holds the positions that follow the cached ones, for the same
    batch. ``attention_mask [B, P + L]`` (1 = real token, 0 = padding, over the ``P`` cached positions and the
    ``L`` new ones) runs a batch padded on the left; a cache holding padding needs it at every later call.
    """

    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rotary_frequencies(config.rotary_dim, config.rope_theta), persistent=False)
        init_weights_(self)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, capacity: int | None = None) -> HybridCache:
        return HybridCache(self.config.layer_types, capacity)

    def _check_cache(self, cache, input_ids):
        if cache is None:
            return
        if not isinstance(cache, HybridCache) or cache.layer_types != self.config.layer_types:
            got = cache.layer_types if isinstance(cache, HybridCache) else type(cache).__name__
            raise ValueError(f"cache must be a HybridCache with this model's layer_types {self.config.layer_types}, "
                             f"got {got}; make it with model.new_cache()")
        if cache.batch is not None and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 \
                and input_ids.shape[0] != cache.batch:
            raise ValueError(f"this cache holds {cache.batch} sequences, but input_ids has {input_ids.shape[0]} "
                             f"rows: a cache continues the batch it started with; use model.new_cache() for "
                             f"another batch")
        dtype = self.embed_tokens.weight.dtype
        if cache.dtype is not None and cache.dtype != dtype:
            raise ValueError(f"this cache was filled by a {cache.dtype} model, and this model computes in {dtype}: "
                             f"use model.new_cache()")

    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self._check_cache(cache, input_ids)
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1] == 0:
            raise ValueError("input_ids holds no position ([B, 0]): pass at least one token")
        positions, mask = positions_and_mask(input_ids, cache, self.config.vocab_size, self.max_positions,
                                             attention_mask)
        batch, length = input_ids.shape
        # transformers zeroes the padded inputs of a linear layer in multi-token calls only (a new token is real)
        keep = None if attention_mask is None or length == 1 else attention_mask[:, -length:].to(input_ids.device)
        x = self.embed_tokens(input_ids)
        # angles in float32, then in the model's dtype, as transformers' rotary embedding returns them
        cos, sin = (t.to(x.dtype) for t in rotary_cos_sin(positions, self.inv_freq))  # [L, rot] or [B, L, rot]
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, L, rot]: the same angles for every head
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, None if cache is None else cache[i], keep)
        if cache is not None:
            cache.length += length
            cache.batch, cache.dtype = batch, x.dtype
        return self.lm_head(self.norm(x))

    @classmethod
    def from_transformers(cls, model) -> "Qwen35":
        """A ``Qwen35`` holding the weights of a ``transformers.Qwen3_5ForCausalLM``, in eval mode, in the
        reference's dtype and on its device.

        Scope: the text model with a dense MLP and the default rotation (``rope_type`` "default"; the three
        equal position rows of text make its mrope the plain rotation), and every other option of
        ``Qwen3_5TextConfig``: the sizes, ``layer_types``, grouped value heads, both linear head widths, the
        kernel, ``partial_rotary_factor``, ``rope_theta``, ``rms_norm_eps``, ``hidden_act``,
        ``attention_bias``, ``tie_word_embeddings``; checked in float32 and float64 (tests/test_hybrid.py).
        Refused: a vision-language ``Qwen3_5ForConditionalGeneration`` (TypeError: load its text model as a
        ``Qwen3_5ForCausalLM``), the mixture-of-experts ``qwen3_5_moe`` (TypeError), a model without an output
        layer (TypeError), and any rotary scaling (ValueError). ``attention_dropout`` acts in training only.
        """
        hf = getattr(model, "config", None)
        kind = getattr(hf, "model_type", None)
        if kind != "qwen3_5_text":
            hint = {"qwen3_5": "a vision-language model: load its language part as a Qwen3_5ForCausalLM "
                               "(Qwen3_5ForCausalLM.from_pretrained reads the text_config)",
                    "qwen3_5_moe": "its feed-forward layers are mixtures of experts, which tfcore.hybrid does not "
                                   "build (tfcore.moe builds Mixtral's)"}.get(kind, "")
            raise TypeError(f"expected a transformers Qwen3_5ForCausalLM (model_type 'qwen3_5_text'), got "
                            f"{type(model).__name__} ({kind!r}){'; ' + hint if hint else ''}")
        if not isinstance(getattr(model, "lm_head", None), nn.Linear):
            raise TypeError(f"expected a Qwen3_5ForCausalLM, with its output layer (lm_head), got "
                            f"{type(model).__name__}; wrap the text model in Qwen3_5ForCausalLM")
        rope = dict(hf.rope_parameters or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rotary scaling {rope['rope_type']!r} is not implemented in tfcore.hybrid, which covers "
                             f"the default rotation only (rope_type 'default'): compare such a model with "
                             f"transformers itself")
        config = Qwen35Config(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads, head_dim=hf.head_dim, hidden_act=hf.hidden_act,
            max_position_embeddings=hf.max_position_embeddings, rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope.get("rope_theta", 10_000.0), partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
            tie_word_embeddings=hf.tie_word_embeddings, attention_bias=hf.attention_bias,
            linear_conv_kernel_dim=hf.linear_conv_kernel_dim, linear_key_head_dim=hf.linear_key_head_dim,
            linear_value_head_dim=hf.linear_value_head_dim, linear_num_key_heads=hf.linear_num_key_heads,
            linear_num_value_heads=hf.linear_num_value_heads, layer_types=list(hf.layer_types))
        reference = next(model.parameters())
        ours = cls(config).to(device=reference.device, dtype=reference.dtype)
        state = {name.removeprefix("model."): tensor for name, tensor in model.state_dict().items()
                 if "rotary_emb" not in name}
        ours.load_state_dict(state, strict=True)
        return ours.eval()


__all__ = ["GatedAttention", "GatedDeltaNet", "GatedRMSNorm", "HybridCache", "HybridDecoderLayer", "Qwen35",
           "Qwen35Config", "RecurrentLayerCache", "apply_partial_rotary", "causal_conv1d", "expand_key_heads",
           "gate_output", "log_decay", "rule_dtype", "state_bytes"]
