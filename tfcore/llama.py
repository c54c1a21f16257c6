"""The modern decoder block, wired as Llama: RMSNorm, rotary positions, SwiGLU, grouped-query
attention (chapter 16).

Every module is named as in transformers' ``LlamaForCausalLM`` (without its ``model.`` prefix), so
its state dict loads into ours key for key.

Shapes: ``input_ids [B, L]`` -> logits ``[B, L, vocab_size]``; queries ``[B, H, L, head_dim]``,
keys and values ``[B, H_kv, L, head_dim]`` with ``H_kv`` dividing ``H``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import nn

from .attention import scaled_dot_product_attention
from .cache import KVCache, LayerCache
from .gpt import activation, positions_and_mask


@dataclass
class LlamaConfig:
    """The sizes of a Llama, with transformers' field names. ``num_key_value_heads`` defaults to
    ``num_attention_heads`` (multi-head attention) and ``head_dim`` to hidden / heads."""

    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 11008
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # transformers' rope_parameters when rope_type is not "default"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                                 f"({self.num_attention_heads}); choose another size or set head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                             f"num_key_value_heads ({self.num_key_value_heads}): each key/value head must "
                             f"serve the same number of query heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: rotary embeddings turn pairs of numbers")


class RMSNorm(nn.Module):
    """Divide each vector by its root mean square, then scale: no mean subtracted, no bias.

    ``x / sqrt(mean(x²) + eps) * weight``, computed in float32. ``[..., hidden]`` in and out.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_frequencies(head_dim: int, theta: float = 10000.0, scaling: dict | None = None) -> torch.Tensor:
    """The angle per position of each of the ``head_dim / 2`` rotated pairs: ``θ^(-2i/head_dim)``.

    ``scaling`` is transformers' ``rope_parameters`` for the "linear" and "llama3" variants, which
    slow the low frequencies down so that a model reaches past its training length.
    ``head_dim`` is a whole, even number ≥ 2 (the numbers turn in pairs), ``theta`` positive.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be an even whole number >= 2: rotary embeddings turn pairs of "
                         f"numbers, got {head_dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or not 0 < theta < math.inf:
        raise ValueError(f"theta (the base of the rotary angles) must be a positive number, got {theta!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"scaling must be a dict like transformers' rope_parameters (or None), "
                         f"got {type(scaling).__name__}")
    kind = (scaling or {}).get("rope_type", "default")
    needed = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [key for key in needed.get(kind, ()) if key not in scaling]
    if missing:
        raise ValueError(f"rotary scaling {kind!r} needs {', '.join(needed[kind])}; missing {', '.join(missing)}")
    if kind in needed and not scaling["factor"] > 0:
        raise ValueError(f"the rotary scaling factor must be positive, got {scaling['factor']!r}")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        slowed = torch.where(wavelength > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * slowed / factor + smooth * slowed
        medium = (wavelength >= old_len / high) & (wavelength <= old_len / low)
        inv_freq = torch.where(medium, smoothed, slowed)
    elif kind != "default":
        raise ValueError(f"rotary scaling {kind!r} is not implemented in tfcore; it supports "
                         f"'default', 'linear' and 'llama3'")
    return inv_freq


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor):
    """``cos``, ``sin`` of shape ``[L, head_dim]`` for the given positions ``[L]``; per row,
    ``[B, L, head_dim]`` for positions ``[B, L]`` (a padded batch, whose rows start at different
    columns: add a heads axis, ``cos.unsqueeze(1)``, before turning ``[B, H, L, head_dim]``).

    Number ``i`` of a head vector is paired with number ``i + head_dim/2`` (transformers' layout),
    so each angle appears twice: once for each half. The angles are computed in float32 whatever
    the dtype of ``inv_freq``, as transformers' ``LlamaRotaryEmbedding`` computes them: in a
    float64 model, angles computed in float64 moved the logits by about 3e-6 from theirs.
    """
    angles = positions.float()[..., None] * inv_freq.float()  # [(B,) L, head_dim / 2], in float32
    angles = torch.cat([angles, angles], dim=-1)  # [(B,) L, head_dim]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last axis: a quarter turn of every pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair of ``x [..., L, head_dim]`` by its position's angle."""
    return x * cos + rotate_half(x) * sin


class SwiGLU(nn.Module):
    """The gated feed-forward: ``down(silu(gate(x)) * up(x))``. ``[B, L, hidden]`` in and out."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = activation(config.hidden_act)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with ``H`` query heads sharing ``H_kv`` key/value heads.

    ``H_kv = H`` is multi-head attention, ``1 < H_kv < H`` grouped-query attention, ``H_kv = 1``
    multi-query attention. Rotary embeddings turn the queries and keys (never the values). The
    cache holds ``H_kv`` heads: that is the memory grouped-query attention saves.

    ``forward(x [B, L, hidden], cos, sin [L, head_dim] or [B, 1, L, head_dim], mask, cache)`` ->
    ``[B, L, hidden]``.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x, cos, sin, mask=None, cache: LayerCache | None = None):
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            # Key/value head j serves query heads j*group .. (j+1)*group - 1. Rather than copy the keys
            # and values out to every query head, stack each group's queries as the rows of one head,
            # [B, H, L, d] -> [B, H_kv, group * L, d] (row g*L + l is head j*group + g at position l),
            # so that a step reads each cached key and value once (chapter 23 measures it).
            q = q.reshape(batch, self.num_kv_heads, group * length, self.head_dim)
            if mask is not None and mask.shape[-2] > 1:  # one row per position: one per stacked row
                mask = mask.repeat(*[1] * (mask.dim() - 2), group, 1)
        context, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=False)
        context = context.reshape(batch, self.num_heads, length, self.head_dim)
        return self.o_proj(context.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


def init_weights_(model: nn.Module, std: float = 0.02) -> nn.Module:
    """Draw every ``Linear`` and ``Embedding`` weight of ``model`` from N(0, std²) and zero every
    bias: transformers' initialisation of its decoders (``initializer_range``), which the models
    built on this block (Llama, Gemma, DeepSeek-V3) share."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    return model


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(RMSNorm(x))``, then ``x + SwiGLU(RMSNorm(x))``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, mask=None, cache: LayerCache | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Token embeddings (no position embeddings: the rotary angles carry position), N Llama
    blocks, a final RMSNorm and the output layer (``lm_head``, tied only if the config says so).

    ``forward(input_ids [B, L], cache=None, attention_mask=None)`` -> logits ``[B, L, vocab_size]``;
    ``attention_mask [B, P + L]`` (0 = padding, over the ``P`` cached positions and the ``L``
    new ones) runs a padded batch, each row with its own positions (``tfcore.gpt.positions_and_mask``).
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rotary_frequencies(config.head_dim, config.rope_theta, config.rope_scaling),
                             persistent=False)
        init_weights_(self)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return KVCache(len(self.layers), capacity=capacity)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        positions, mask = positions_and_mask(input_ids, cache, self.config.vocab_size, self.max_positions,
                                             attention_mask)
        x = self.embed_tokens(input_ids)
        # angles in float32, then in the model's dtype, as transformers' LlamaRotaryEmbedding returns
        # them (a bfloat16 model stays in bfloat16; a float64 one gets the float32 angles unchanged)
        cos, sin = (t.to(x.dtype) for t in rotary_cos_sin(positions, self.inv_freq))  # [L, head_dim] or [B, L, head_dim]
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, L, head_dim]: the same for every head
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, None if cache is None else cache[i])
        return self.lm_head(self.norm(x))

    @classmethod
    def from_transformers(cls, model) -> "Llama":
        """A ``Llama`` holding the weights of a ``transformers.LlamaForCausalLM``, in eval mode and
        in the reference's dtype.

        Scope: every size of ``LlamaConfig`` (``head_dim`` and ``num_key_value_heads`` included),
        ``hidden_act`` (the names in ``tfcore.gpt.ACTIVATIONS``), ``rms_norm_eps``, ``rope_theta``,
        ``attention_bias``, ``mlp_bias``, ``tie_word_embeddings``, and ``rope_parameters`` of type
        "default", "linear" and "llama3"; checked equal to transformers in float64 within 1e-10
        with all of these off their defaults (``tests/test_modern_decoder.py``). Refused with a
        ValueError: the other rotary scalings ("dynamic", "yarn", "longrope", "proportional").
        """
        hf = model.config
        if getattr(hf, "model_type", None) != "llama":
            raise TypeError(f"expected a transformers LlamaForCausalLM, got {type(model).__name__}")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        config = LlamaConfig(vocab_size=hf.vocab_size, max_position_embeddings=hf.max_position_embeddings,
                             hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
                             num_attention_heads=hf.num_attention_heads,
                             num_key_value_heads=hf.num_key_value_heads, head_dim=hf.head_dim,
                             intermediate_size=hf.intermediate_size, hidden_act=hf.hidden_act,
                             rms_norm_eps=hf.rms_norm_eps, rope_theta=theta,
                             rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
                             tie_word_embeddings=hf.tie_word_embeddings, attention_bias=hf.attention_bias,
                             mlp_bias=hf.mlp_bias)
        llama = cls(config).to(next(model.parameters()).dtype)  # float64 stays float64
        state = {name.removeprefix("model."): tensor for name, tensor in model.state_dict().items()
                 if "rotary_emb" not in name}
        llama.load_state_dict(state, strict=True)
        return llama.eval()
