"""Multi-head latent attention (MLA), as DeepSeek-V2 and DeepSeek-V3 define it (chapter 19).

Each token's hidden state is compressed to one latent vector ``c_KV`` of ``kv_lora_rank`` numbers
(normalised by an RMSNorm), and the keys and values of every head are expanded from it. Position
enters through a separate, *decoupled* rotary key of ``qk_rope_head_dim`` numbers, one per token,
shared by all the heads. The cache keeps only these two vectors per token and layer. The queries
go through a low-rank bottleneck of their own (``q_lora_rank``, with its RMSNorm).

The *absorbed* form never expands the cache: the key up-projection ``W_UK`` is applied to the query
(``q_nope W_UK``, a vector of ``kv_lora_rank`` numbers per head) and the value up-projection
``W_UV`` to the attention output, so the scores and the weighted sum run on the latents directly.

Modules carry the names of transformers' ``DeepseekV3ForCausalLM`` (without ``model.``), so its
state dict loads into ``DeepseekV3`` key for key. Only dense layers (no mixture of experts) and the
default rotary frequencies are built here: ``from_transformers`` refuses experts and any rotary
scaling, YaRN included (the released DeepSeek-V3 uses it, and transformers then multiplies the
softmax scale by ``mscale**2``). Every other option is covered, checked in float64 within 1e-10
(tests/test_mla.py).

Shapes: ``B`` batch, ``L`` new positions, ``S`` all positions (cached and new), ``H`` heads,
``r = kv_lora_rank``; queries ``[B, H, L, qk_nope_head_dim + qk_rope_head_dim]``, latents
``[B, S, r]``, rotary keys ``[B, S, qk_rope_head_dim]``.

A batch of prompts of different lengths, padded on the left, runs with an ``attention_mask [B, S]``
(1 = real token, 0 = padding): the cache keeps the padded latents as they are, the mask blocks them
at every step, and each row takes its rotary positions from the mask (``tfcore.gpt.positions_and_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .attention import _broadcast_mask, _whole
from .gpt import positions_and_mask
from .llama import RMSNorm, SwiGLU, apply_rotary, init_weights_, rotary_cos_sin, rotary_frequencies


@dataclass
class DeepseekV3Config:
    """The sizes of a dense DeepSeek-V3, with transformers' field names. The defaults are
    DeepSeek-V3's (DeepSeek-AI, 2024, §4.2, and transformers' ``DeepseekV3Config``);
    ``q_lora_rank=None`` projects the queries with one matrix (``q_proj``)."""

    vocab_size: int = 129280
    max_position_embeddings: int = 4096
    hidden_size: int = 7168
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 18432
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False  # SwiGLU reads it; DeepSeek's feed-forward layers have no biases
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "max_position_embeddings", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "intermediate_size"):
            _whole(name, getattr(self, name), 1)
        if self.q_lora_rank is not None:
            _whole("q_lora_rank (or None for one query matrix)", self.q_lora_rank, 1)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even: rotary embeddings "
                             f"turn pairs of numbers")

    @property
    def qk_head_dim(self) -> int:
        """The width of a query or key head: its content part plus its rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``: the width of the full query·key dot
        product (DeepSeek-V2, eq. 19), in both the expanded and the absorbed form."""
        return self.qk_head_dim ** -0.5


# transformers 5.23 builds the two latent norms (q_a_layernorm, kv_a_layernorm) with
# DeepseekV3RMSNorm's default epsilon, whatever rms_norm_eps says; the block norms read
# rms_norm_eps. Checked in float64 (tests/test_mla.py): with rms_norm_eps = 1e-3, reading it in the
# latent norms too moves the logits by about 5e-4.
LATENT_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...]`` on the last axis.

    DeepSeek rotates neighbouring pairs ``(x0, x1), (x2, x3), ...``; after this reordering they
    sit at ``(i, i + d/2)``, the layout of ``tfcore.apply_rotary`` (Llama's). The last axis has an
    even length.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] % 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a tensor whose last axis holds pairs (an even length), got {got}")
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotation of ``x [..., L, d]``: interleaved pairs, turned as Llama turns halves.

    The output is in the de-interleaved order, as transformers writes it; queries and keys get the
    same order, so their dot products are those of the interleaved rotation.
    """
    return apply_rotary(deinterleave(x), cos, sin)


class LatentLayerCache:
    """One layer's cache: the normalised latent ``[B, S, r]`` and the rotary key ``[B, S, rope]``
    of every position seen. Nothing per head is kept: the keys and values are expanded from these."""

    def __init__(self, capacity: int | None = None):
        if capacity is not None:
            _whole("capacity (or None for a cache that grows)", capacity, 1)
        self.latent: torch.Tensor | None = None
        self.k_rope: torch.Tensor | None = None
        self.capacity = capacity
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor):
        """Add the new positions' ``latent [B, L, r]`` and ``k_rope [B, L, rope]``; return all of them."""
        for name, t in (("latent", latent), ("k_rope", k_rope)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a 3-D [B, L, width] tensor, got {got}")
        if latent.shape[:2] != k_rope.shape[:2]:
            raise ValueError(f"latent {tuple(latent.shape)} and k_rope {tuple(k_rope.shape)} must hold the "
                             f"same batch and positions (the first two axes)")
        if self.k_rope is not None and k_rope.shape[-1] != self.k_rope.shape[-1]:
            raise ValueError(f"the cache holds rotary keys of width {self.k_rope.shape[-1]}; new ones of "
                             f"width {k_rope.shape[-1]} do not continue them: use model.new_cache()")
        held = None if self.latent is None else (self.latent.shape[0], self.latent.shape[-1])
        if held is not None and (latent.shape[0], latent.shape[-1]) != held:
            raise ValueError(f"the cache holds latents of shape {tuple(self.latent.shape)} ([B, S, r]); new "
                             f"latents of shape {tuple(latent.shape)} do not continue them: use model.new_cache()")
        start, end = len(self), len(self) + latent.shape[1]
        if self.capacity is None:
            if self.latent is None:
                self.latent, self.k_rope = latent, k_rope
            else:
                self.latent = torch.cat([self.latent, latent], dim=1)
                self.k_rope = torch.cat([self.k_rope, k_rope], dim=1)
            return self.latent, self.k_rope
        if end > self.capacity:
            raise ValueError(f"the cache has room for {self.capacity} positions (capacity); {end} do not fit")
        if self._room is None:  # [B, capacity, r] and [B, capacity, rope], written in place
            self._room = (latent.new_empty(latent.shape[0], self.capacity, latent.shape[-1]),
                          k_rope.new_empty(k_rope.shape[0], self.capacity, k_rope.shape[-1]))
        self._room[0][:, start:end], self._room[1][:, start:end] = latent, k_rope
        self.latent, self.k_rope = self._room[0][:, :end], self._room[1][:, :end]
        return self.latent, self.k_rope


class LatentCache:
    """One ``LatentLayerCache`` per layer (``cache[i]``). ``padded`` records that a padded position
    was cached, so that ``DeepseekV3`` refuses a later call without the ``attention_mask`` that marks it."""

    def __init__(self, num_layers: int, capacity: int | None = None):
        _whole("num_layers", num_layers, 1)
        self.layers = [LatentLayerCache(capacity) for _ in range(num_layers)]
        self.padded = False  # whether a padded position is held (set by the model)

    def __getitem__(self, index: int) -> LatentLayerCache:
        return self.layers[index]

    @property
    def length(self) -> int:
        """The number of positions cached: the position the next token will take."""
        return len(self.layers[0]) if self.layers else 0

    def nbytes(self) -> int:
        """The bytes of every cached latent and rotary key (not the room a capacity reserves)."""
        return sum(t.numel() * t.element_size() for c in self.layers for t in (c.latent, c.k_rope) if t is not None)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_nope [B, H, L, nope]`` times ``W_UK [H, nope, r]`` per head -> ``[B, H, L, r]``.

    The key of head h is ``W_UK[h] c``, so ``q·k = q W_UK[h] c = (W_UK[h]ᵀ q)·c``: the query
    meets the latent directly.
    """
    if q_nope.dim() != 4 or w_uk.dim() != 3 or q_nope.shape[1] != w_uk.shape[0] \
            or q_nope.shape[-1] != w_uk.shape[1]:
        raise ValueError(f"q_nope [B, H, L, nope] and W_UK [H, nope, r] must agree on H and nope, got "
                         f"{tuple(q_nope.shape)} and {tuple(w_uk.shape)} (up_projections() gives W_UK)")
    return torch.einsum("bhln,hnr->bhlr", q_nope, w_uk)


def absorb_output(context_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The weighted sum of latents ``[B, H, L, r]`` times ``W_UV [H, v, r]`` -> ``[B, H, L, v]``."""
    if context_latent.dim() != 4 or w_uv.dim() != 3 or context_latent.shape[1] != w_uv.shape[0] \
            or context_latent.shape[-1] != w_uv.shape[-1]:
        raise ValueError(f"context_latent [B, H, L, r] and W_UV [H, v, r] must agree on H and r, got "
                         f"{tuple(context_latent.shape)} and {tuple(w_uv.shape)} (up_projections() gives W_UV)")
    return torch.einsum("bhlr,hvr->bhlv", context_latent, w_uv)


def attend(q, k, v, scale: float, mask=None):
    """``softmax(q kᵀ · scale) v`` with a 1/True-means-attend mask, written out so that a FLOP
    counter sees its two matrix products. ``q [B, H, L, d]``, ``k [B, H|1, S, d]``, ``v [B, H|1, S, dv]``.
    A query whose keys are all masked gets zero weights (and a zero output), as in tfcore.attention.
    ``scale`` is a positive number."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[-1] != k.shape[-1] \
            or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"q [B, H, L, d], k [B, H|1, S, d] and v [B, H|1, S, dv] must agree on d and S, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale must be a positive number (e.g. config.softmax_scale), got {scale!r}")
    scores = (q @ k.transpose(-2, -1)) * scale  # [B, H, L, S]
    if mask is None:
        return scores.softmax(dim=-1) @ v
    allowed = _broadcast_mask(mask, torch.empty(scores.shape, device="meta"))  # [1, L, S] -> [1, 1, L, S]
    weights = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min).softmax(dim=-1)
    return weights.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0) @ v


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's attention. ``forward(x [B, L, hidden], cos, sin [L, rope] or per row [B, L, rope],
    mask, cache, absorbed)`` -> ``[B, L, hidden]``. ``mask`` (True = may attend) broadcasts to
    ``[B, L, S]``; a query whose keys are all masked gets zeros (``attend``).

    - queries: ``q_b_proj(RMSNorm(q_a_proj(x)))`` (or ``q_proj(x)``), ``H`` heads of ``nope + rope``;
    - ``kv_a_proj_with_mqa(x)`` gives the latent (``r`` numbers, then RMSNorm) and the rotary key
      (``rope`` numbers, one for all heads: multi-query attention for the position part);
    - ``kv_b_proj`` expands the latent to ``H`` heads of ``nope`` key numbers and ``v`` value numbers.
    With ``absorbed=True`` the keys and values are never expanded (see ``absorb_query``).
    """

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.config = config
        self.num_heads, self.kv_lora_rank = config.num_attention_heads, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        bias, hidden = config.attention_bias, config.hidden_size
        q_width = config.num_attention_heads * config.qk_head_dim  # H heads of nope + rope numbers
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_lora_rank + config.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.scaling = config.softmax_scale

    def rotate(self, x, cos, sin):
        """The rotary part of queries or keys, in the layout the config names."""
        return apply_rotary_interleaved(x, cos, sin) if self.config.rope_interleave else apply_rotary(x, cos, sin)

    def queries(self, x):
        """``[B, L, hidden]`` -> ``q_nope [B, H, L, nope]``, ``q_rope [B, H, L, rope]`` (not yet rotated)."""
        q = self.q_proj(x) if self.config.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*x.shape[:2], self.num_heads, self.nope + self.rope).transpose(1, 2)
        return q.split([self.nope, self.rope], dim=-1)

    def compress(self, x):
        """``[B, L, hidden]`` -> the normalised latent ``[B, L, r]`` and the rotary key ``[B, L, rope]``."""
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        return self.kv_a_layernorm(latent), k_rope

    def up_projections(self):
        """``W_UK [H, nope, r]`` and ``W_UV [H, v, r]``: the rows of ``kv_b_proj`` per head."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w.split([self.nope, self.v_dim], dim=1)

    def expand(self, latent, k_rope):
        """Latents ``[B, S, r]`` and rotary keys ``[B, S, rope]`` -> keys ``[B, H, S, nope + rope]``
        and values ``[B, H, S, v]``; every head gets the same rotary key."""
        batch, length, _ = latent.shape
        kv = self.kv_b_proj(latent).view(batch, length, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope[:, None].expand(batch, self.num_heads, length, self.rope)
        return torch.cat([k_nope, k_rope], dim=-1), values

    def forward(self, x, cos, sin, mask=None, cache: LatentLayerCache | None = None, absorbed: bool = False):
        hidden = self.config.hidden_size
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != hidden:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [B, L, {hidden}] (hidden_size), got {got}")
        batch, length, _ = x.shape
        q_nope, q_rope = self.queries(x)
        latent, k_rope = self.compress(x)
        q_cos, q_sin = (cos.unsqueeze(1), sin.unsqueeze(1)) if cos.dim() == 3 else (cos, sin)  # per row: a heads axis
        q_rope, k_rope = self.rotate(q_rope, q_cos, q_sin), self.rotate(k_rope, cos, sin)
        if cache is not None:
            latent, k_rope = cache.append(latent, k_rope)  # [B, S, r], [B, S, rope]
        if absorbed:
            w_uk, w_uv = self.up_projections()
            q = torch.cat([absorb_query(q_nope, w_uk), q_rope], dim=-1)  # [B, H, L, r + rope]
            k = torch.cat([latent, k_rope], dim=-1)[:, None]  # [B, 1, S, r + rope]: one for all heads
            context = absorb_output(attend(q, k, latent[:, None], self.scaling, mask), w_uv)  # [B, H, L, v]
        else:
            keys, values = self.expand(latent, k_rope)
            context = attend(torch.cat([q_nope, q_rope], dim=-1), keys, values, self.scaling, mask)
        return self.o_proj(context.transpose(1, 2).reshape(batch, length, self.num_heads * self.v_dim))


class DeepseekV3DecoderLayer(nn.Module):
    """Pre-norm block: ``x + MLA(RMSNorm(x))``, then ``x + SwiGLU(RMSNorm(x))`` (a dense layer)."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, mask=None, cache=None, absorbed=False):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, absorbed)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3(nn.Module):
    """Llama's stack (chapter 16) with multi-head latent attention in every block.

    ``forward(input_ids [B, L], cache=None, absorbed=None, attention_mask=None)`` -> logits
    ``[B, L, vocab_size]``; ``absorbed=None`` uses the attribute ``model.absorbed`` (False until
    set), so that ``tfcore.generate`` can run either form. ``attention_mask [B, P + L]`` (1 = real
    token, 0 = padding, over the ``P`` cached positions and the ``L`` new ones; transformers'
    convention) runs a padded batch; a cache holding padding needs the mask at every later call.
    """

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq = rotary_frequencies(config.qk_rope_head_dim, config.rope_theta)  # only the rotary part turns
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.absorbed = False
        init_weights_(self)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, capacity: int | None = None) -> LatentCache:
        return LatentCache(len(self.layers), capacity=capacity)

    def forward(self, input_ids: torch.Tensor, cache: LatentCache | None = None, absorbed: bool | None = None,
                attention_mask: torch.Tensor | None = None):
        absorbed = self.absorbed if absorbed is None else absorbed
        layers = getattr(cache, "layers", None)
        if cache is not None and (not isinstance(layers, list) or len(layers) != len(self.layers)):
            got = f"a cache of {len(layers)} layers" if isinstance(layers, list) else type(cache).__name__
            raise ValueError(f"cache must hold one layer per block ({len(self.layers)}), got {got}; make "
                             f"it with model.new_cache()")
        if attention_mask is None and getattr(cache, "padded", False):
            raise ValueError("this cache holds padded positions, but attention_mask is None: pass the mask over "
                             "the cached and new positions, [B, P + L], extended with a 1 per new token, as "
                             "tfcore.generate does")
        positions, mask = positions_and_mask(input_ids, cache, self.config.vocab_size, self.max_positions,
                                             attention_mask)
        x = self.embed_tokens(input_ids)
        # angles in float32, then in the model's dtype (as transformers returns them: bfloat16 stays bfloat16)
        cos, sin = (t.to(x.dtype) for t in rotary_cos_sin(positions, self.inv_freq))  # [L, rope], or [B, L, rope]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, None if cache is None else cache[i], absorbed)
        if cache is not None and attention_mask is not None and not bool(attention_mask.bool().all()):
            cache.padded = True
        return self.lm_head(self.norm(x))

    @classmethod
    def from_transformers(cls, model) -> "DeepseekV3":
        """A ``DeepseekV3`` holding the weights of a dense ``transformers.DeepseekV3ForCausalLM``, in eval mode.

        ``num_key_value_heads`` is not read: MLA expands the one latent to every head. (transformers'
        eager attention needs it equal to ``num_attention_heads``; its default is 128, DeepSeek-V3's.)
        """
        hf = model.config
        if getattr(hf, "model_type", None) != "deepseek_v3":
            raise TypeError(f"expected a transformers DeepseekV3ForCausalLM, got {type(model).__name__}")
        if hf.first_k_dense_replace < hf.num_hidden_layers:
            raise ValueError(f"layers {hf.first_k_dense_replace}..{hf.num_hidden_layers - 1} are mixtures of experts, "
                             f"which tfcore.mla does not build: set first_k_dense_replace = num_hidden_layers "
                             f"({hf.num_hidden_layers}) for a dense model")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rotary scaling {rope['rope_type']!r} is not built in tfcore.mla (nor YaRN's "
                             f"softmax-scale correction, which multiplies the scale by mscale**2 in transformers): "
                             f"it covers the default rotation only; load a configuration with rope_type "
                             f"'default', or compare such a model with transformers itself")
        config = DeepseekV3Config(
            vocab_size=hf.vocab_size, max_position_embeddings=hf.max_position_embeddings, hidden_size=hf.hidden_size,
            num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
            q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, intermediate_size=hf.intermediate_size,
            hidden_act=hf.hidden_act, rms_norm_eps=hf.rms_norm_eps, rope_theta=rope.get("rope_theta", 10000.0),
            rope_interleave=bool(hf.rope_interleave), attention_bias=hf.attention_bias,
            tie_word_embeddings=hf.tie_word_embeddings)
        reference = next(model.parameters())
        ours = cls(config).to(device=reference.device, dtype=reference.dtype)  # the reference's device and dtype
        state = {name.removeprefix("model."): tensor for name, tensor in model.state_dict().items()
                 if "rotary_emb" not in name}
        ours.load_state_dict(state, strict=True)
        return ours.eval()


def latent_cache_bytes_per_token(config: DeepseekV3Config, bytes_per_number: int = 2) -> int:
    """What MLA caches per token: ``layers x (kv_lora_rank + qk_rope_head_dim)`` numbers, each of
    ``bytes_per_number`` bytes (a whole number ≥ 1: 2 for bfloat16)."""
    if not isinstance(config, DeepseekV3Config):
        raise TypeError(f"config must be a DeepseekV3Config, got {type(config).__name__}")
    _whole("bytes_per_number", bytes_per_number, 1)
    return config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * bytes_per_number


__all__ = ["DeepseekV3", "DeepseekV3Config", "DeepseekV3DecoderLayer", "LatentCache", "LatentLayerCache",
           "MultiHeadLatentAttention", "absorb_output", "absorb_query", "apply_rotary_interleaved", "attend",
           "deinterleave", "latent_cache_bytes_per_token"]
