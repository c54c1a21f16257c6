"""Gemma 3's text model, built from the book's parts (chapter 18).

What changes from Llama (chapter 16), as ``transformers``' ``Gemma3ForCausalLM`` (5.23) computes it:

- interleaved layers: ``layer_types`` lists, per layer, ``"sliding_attention"`` (local: the last
  ``sliding_window`` positions, itself included) or ``"full_attention"`` (global, causal);
- rotary angles with a different base per kind of layer (10,000 local, 1,000,000 global by default);
- QK-norm: an RMSNorm over each head's query and key (``q_norm``, ``k_norm``) before the rotation;
- scores scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- RMSNorm scaled by ``1 + weight`` (the weight starts at 0), computed in float32;
- "sandwich" norms: each sub-layer's output is normalised again before it joins the residual stream;
- the gated feed-forward with the tanh GELU (``gelu_pytorch_tanh``) in place of SiLU;
- token embeddings multiplied by ``sqrt(hidden_size)``; the output layer tied to them;
- optional tanh soft-capping of the attention scores and of the final logits (Gemma 2's; None in
  Gemma 3's configs). ``Gemma3ForCausalLM`` (5.23) applies ``final_logit_softcapping`` but never
  passes ``attn_logit_softcapping`` to its attention: ``from_transformers`` does the same.

Every module carries ``transformers``' name (without the ``model.`` prefix), so the state dict
loads key for key. Shapes: ``input_ids [B, L]`` -> logits ``[B, L, vocab_size]``.

A batch of prompts of different lengths, padded on the left, runs with an ``attention_mask [B, T]``
(1 = real token, 0 = padding; ``T`` counts the cached columns and the new ones): each row takes its
own rotary positions from the mask, no query sees a padded key, and the window counts *columns*,
padding included, as transformers 5.23 measures it (``key_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from .attention import _whole
from .encoder import check_input_ids
from .gpt import check_attention_mask, mask_positions
from .llama import RMSNorm, SwiGLU, apply_rotary, init_weights_, rotary_cos_sin, rotary_frequencies
from .sliding import RollingKVCache, position_mask

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class GemmaConfig:
    """The sizes of a Gemma 3 text model, with ``transformers``' field names. ``layer_types``
    defaults to Gemma 3's pattern: five local layers, then one global, repeated."""

    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_base_freq: float = 10_000.0  # local layers
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    layer_types: list[str] | None = field(default=None)
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _whole(name, getattr(self, name), 1)
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: rotary embeddings turn pairs of numbers")
        for name in ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar"):
            if not _positive(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(self, name) is not None and not _positive(getattr(self, name)):
                raise ValueError(f"{name} must be a positive cap (or None for no soft-capping), got "
                                 f"{getattr(self, name)!r}")
        if self.layer_types is None:
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must list {self.num_hidden_layers} entries, each {SLIDING!r} or "
                             f"{FULL!r}; got {self.layer_types}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.sliding_window is None:
            raise ValueError("sliding_window must be a whole number ≥ 1, got None")
        _whole("sliding_window", self.sliding_window, 1)

    def window(self, layer: int) -> int | None:
        """The window of layer ``layer``: ``sliding_window`` for a local layer, None for a global one."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` (the weight starts at 0), in float32 throughout.
    ``[..., dim]`` in and out."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def _positive(value) -> bool:
    """Whether ``value`` is a finite number > 0 (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def key_mask(query_columns: torch.Tensor, key_columns: torch.Tensor, window: int | None,
             real: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query may see, True = may attend: ``[1, Lq, Lk]``, or ``[B, Lq, Lk]`` with ``real``.

    ``query_columns [Lq]`` and ``key_columns [Lk]`` are columns of the (padded) batch, as the ring
    buffer stores them. Causal and, with a ``window``, the last ``window`` columns
    (``sliding.position_mask``): transformers 5.23 measures the window in columns, padding
    included (``masking_utils.sliding_window_overlay`` compares ``q_idx`` and ``kv_idx``, not the
    ``position_ids``; a mask with a gap inside a row tells the two apart, tests/test_batched_decoding.py).
    ``real [B, T]`` (bool, True = real token, ``T`` > every key column) blocks every padded key.
    """
    mask = position_mask(query_columns, key_columns, window)  # [1, Lq, Lk]
    if real is not None:
        mask = mask & real[:, key_columns].unsqueeze(1)  # [B, Lq, Lk]: no query sees a padded key
    return mask


def zero_empty_rows(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``weights [B, H, Lq, Lk]`` with zeros in each row whose ``mask`` row (``[1|B, Lq, Lk]``,
    True = may attend) allows no key: the softmax of a row of -inf is NaN, and a NaN would reach
    the real tokens through the next layer's values (0 x NaN = NaN)."""
    return weights.masked_fill(~mask.any(dim=-1, keepdim=True).unsqueeze(1), 0.0)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``: squashes ``x`` into ``(-cap, cap)``; no change when ``cap`` is None.
    ``cap`` is a finite number > 0 (a cap of 0 would give NaN)."""
    if cap is None:
        return x
    if not _positive(cap):
        raise ValueError(f"the soft-cap must be a finite number > 0 (or None for no cap), got {cap!r}")
    return cap * torch.tanh(x / cap)


class GemmaAttention(nn.Module):
    """Grouped-query attention with QK-norm, Gemma's score scale and optional soft-capping.

    ``forward(x [B, L, hidden], cos, sin [L, head_dim] or [B, 1, L, head_dim], positions [L], cache,
    index, real)`` -> ``[B, L, hidden]``. ``positions`` are the new tokens' columns (their
    positions when nothing is padded). The mask ``[1, L, L_keys]`` is built inside from the query
    and key columns (``key_mask``, with this layer's window); with a ``RollingKVCache``, ``index``
    names this layer's cache. ``real [B, T]`` (bool, 0 = padding, over the cached and new columns)
    blocks the padded keys; a padded query that sees no key gets zeros. ``max_logit`` keeps the
    largest allowed score of the last call (chapter 18).
    """

    def __init__(self, config: GemmaConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        self.window = config.window(layer)
        self.scaling = config.query_pre_attn_scalar ** -0.5
        self.softcap = config.attn_logit_softcapping
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.max_logit = None

    def forward(self, x, cos, sin, positions, cache: RollingKVCache | None = None, index: int = 0,
                real: torch.Tensor | None = None):
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)  # QK-norm: each head's query and key, before the rotation
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        key_positions = positions
        if cache is not None:
            k, v, key_positions = cache.append(index, k, v, positions)
        mask = key_mask(positions, key_positions, self.window, real)  # [1 or B, L, L_keys]
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = softcap((q * self.scaling) @ k.transpose(-2, -1), self.softcap)  # [B, H, L, L_keys]
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))  # without padding the diagonal is allowed
        self.max_logit = scores.detach().amax()  # the largest score seen in this call (chapter 18 plots it)
        weights = scores.softmax(dim=-1)
        if real is not None:  # a padded query may see no key at all
            weights = zero_empty_rows(weights, mask)
        context = weights @ v
        return self.o_proj(context.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class GemmaDecoderLayer(nn.Module):
    """``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``: a norm before and after each sub-layer."""

    def __init__(self, config: GemmaConfig, layer: int):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, layer)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = SwiGLU(SimpleNamespace(hidden_size=hidden, intermediate_size=config.intermediate_size,
                                          mlp_bias=False, hidden_act=config.hidden_activation))
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x, cos, sin, positions, cache=None, index=0, real=None):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, positions, cache,
                                                             index, real))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma(nn.Module):
    """Scaled token embeddings, N Gemma blocks (local and global as ``layer_types`` says), a final
    RMSNorm and the output layer, tied to the embeddings when the config says so.

    ``forward(input_ids [B, L], cache=None, attention_mask=None)`` -> logits ``[B, L, vocab_size]``.
    With a cache (``model.new_cache()``, a ``RollingKVCache``), ``input_ids`` holds the positions
    that follow. ``attention_mask [B, P + L]`` (1 = real token, 0 = padding, over the ``P`` cached
    columns and the ``L`` new ones; transformers' convention) runs a padded batch: rotary
    positions per row (``tfcore.gpt.mask_positions``), padded keys blocked (``key_mask``). A cache
    filled with padding needs the mask at every later call.
    """

    def __init__(self, config: GemmaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # sqrt(hidden) rounded to float32, as transformers keeps it (a float32 buffer, upcast in a
        # float64 model): the exact value differs by about 1e-8 relative, which a float64 check sees
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32).item()
        self.register_buffer("global_inv_freq", rotary_frequencies(config.head_dim, config.rope_theta), persistent=False)
        self.register_buffer("local_inv_freq", rotary_frequencies(config.head_dim, config.rope_local_base_freq),
                             persistent=False)
        init_weights_(self)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, capacity: int | None = None) -> RollingKVCache:
        """A ring buffer of ``sliding_window`` slots per local layer, a growing cache per global layer.
        ``forward`` takes any ``RollingKVCache`` whose every layer keeps at least that layer's window."""
        return RollingKVCache([self.config.window(i) for i in range(len(self.layers))], capacity)

    def forward(self, input_ids: torch.Tensor, cache: RollingKVCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if cache is not None:
            # a layer's cache may keep more than its window (None keeps every position: the mask is
            # built from positions), never less: a ring smaller than the window forgets keys it needs
            windows = [self.config.window(i) for i in range(len(self.layers))]
            if not isinstance(cache, RollingKVCache) or len(cache.windows) != len(windows) or any(
                    kept is not None and (needed is None or kept < needed)
                    for kept, needed in zip(cache.windows, windows)):
                got = cache.windows if isinstance(cache, RollingKVCache) else type(cache).__name__
                raise ValueError(f"cache must be a RollingKVCache with one entry per layer that keeps at least "
                                 f"the layer's window {windows} (None keeps every position), got {got}; make "
                                 f"it with model.new_cache()")
        past = 0 if cache is None else cache.length
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and past + input_ids.shape[1] > self.max_positions:
            raise ValueError(f"positions {past}..{past + input_ids.shape[1] - 1} do not fit: the model has "
                             f"{self.max_positions} positions (max_position_embeddings); use a shorter "
                             f"prompt or generate fewer tokens")
        check_input_ids(input_ids, self.config.vocab_size, self.max_positions)
        columns = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)  # what the ring stores
        real, positions = None, columns  # nothing padded: a token's position is its column
        if attention_mask is not None:
            real = check_attention_mask(attention_mask, input_ids, past).to(input_ids.device)  # [B, P + L]
            positions = mask_positions(real, input_ids.shape[1])  # [B, L]: each row counts its real tokens
        elif getattr(cache, "padded", False):
            raise ValueError("this cache holds padded columns, but attention_mask is None: pass the mask over "
                             "the cached and new columns, [B, P + L], extended with a 1 per new token, as "
                             "tfcore.generate does")
        x = self.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=self.embed_tokens.weight.dtype)
        # angles in float32, then in the model's dtype (as transformers returns them: bfloat16 stays bfloat16)
        rotary = {kind: tuple(t.to(x.dtype) for t in rotary_cos_sin(positions, inv_freq))
                  for kind, inv_freq in ((SLIDING, self.local_inv_freq), (FULL, self.global_inv_freq))}
        if positions.dim() == 2:  # [B, L, head_dim] -> [B, 1, L, head_dim]: the same angles for every head
            rotary = {kind: (cos.unsqueeze(1), sin.unsqueeze(1)) for kind, (cos, sin) in rotary.items()}
        for i, layer in enumerate(self.layers):
            x = layer(x, *rotary[self.config.layer_types[i]], columns, cache, i, real)
        if cache is not None:
            cache.length += input_ids.shape[1]
            cache.padded = getattr(cache, "padded", False) or (real is not None and not bool(real.all()))
        return softcap(self.lm_head(self.norm(x)), self.config.final_logit_softcapping)

    @classmethod
    def from_transformers(cls, model) -> "Gemma":
        """A ``Gemma`` holding the weights of a ``transformers.Gemma3ForCausalLM``, in eval mode.

        It computes what the reference computes: ``Gemma3ForCausalLM`` (transformers 5.23) ignores
        ``attn_logit_softcapping`` (its attention never receives it), so the port leaves it out too.

        Scope: the text model with the default rotation in both kinds of layer, and every other
        option (window, layer pattern, both bases, ``query_pre_attn_scalar``, ``rms_norm_eps``,
        attention biases, tied or untied output layer, the final soft-cap); checked in float64
        within 1e-10 (tests/test_gemma.py). Refused with an error: any ``rope_scaling`` (which
        transformers applies to the global layers only; the released 128K models use one) and
        ``use_bidirectional_attention``. The reference's dtype and device are kept.
        """
        hf = model.config
        if getattr(hf, "model_type", None) != "gemma3_text":
            raise TypeError(f"expected a transformers Gemma3ForCausalLM (model_type 'gemma3_text'), got "
                            f"{type(model).__name__} ({getattr(hf, 'model_type', None)!r})")
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an encoder-style Gemma) is not implemented in "
                             "tfcore.Gemma; it builds the causal model")
        rope = hf.rope_parameters
        for kind in (SLIDING, FULL):
            if rope[kind].get("rope_type", "default") != "default":
                raise ValueError(f"rotary scaling {rope[kind]['rope_type']!r} of the {kind} layers is not "
                                 f"implemented in tfcore.Gemma, which covers the default rotation only (rope_type 'default' in "
                                 f"both kinds of layer): compare such a model with transformers itself")
        config = GemmaConfig(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                             intermediate_size=hf.intermediate_size, num_hidden_layers=hf.num_hidden_layers,
                             num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
                             head_dim=hf.head_dim, hidden_activation=hf.hidden_activation,
                             max_position_embeddings=hf.max_position_embeddings, rms_norm_eps=hf.rms_norm_eps,
                             rope_theta=rope[FULL]["rope_theta"], rope_local_base_freq=rope[SLIDING]["rope_theta"],
                             query_pre_attn_scalar=hf.query_pre_attn_scalar, sliding_window=hf.sliding_window,
                             layer_types=list(hf.layer_types), final_logit_softcapping=hf.final_logit_softcapping,
                             attn_logit_softcapping=None,  # read by transformers' config, never applied
                             tie_word_embeddings=hf.tie_word_embeddings, attention_bias=hf.attention_bias)
        reference = next(model.parameters())
        gemma = cls(config).to(device=reference.device, dtype=reference.dtype)  # the reference's device and dtype
        state = {name.removeprefix("model."): tensor for name, tensor in model.state_dict().items()
                 if "rotary_emb" not in name}
        gemma.load_state_dict(state, strict=True)
        return gemma.eval()
