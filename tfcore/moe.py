"""Mixture of experts (chapter 21): routers, top-k gates, experts, shared experts, load balancing,
expert capacity.

A *router* (``gate``, a matrix ``[E, hidden]``) scores the ``E`` experts for each token; the ``k``
best run, and their outputs are summed weighted by the *gates*. Two orders of the gate computation
are in use:

- Mixtral (Jiang et al., 2024): ``softmax`` over all ``E`` logits, keep the top ``k`` probabilities,
  renormalise them to sum to 1 (``softmax_topk``);
- DeepSeek-V3 (DeepSeek-AI, 2024): ``sigmoid`` scores; the top ``k`` are chosen on the scores plus a
  bias (``e_score_correction_bias``, for choosing only), inside the ``topk_group`` best of ``n_group``
  groups; the chosen *scores* are normalised to sum to 1 and multiplied by ``routed_scaling_factor``
  (``sigmoid_topk``). Shared experts run on every token and are added with no gate.

Every expert is a ``tfcore.SwiGLU``. transformers 5 stores a layer's experts fused, as 3-D tensors
``experts.gate_up_proj [E, 2 I, hidden]`` and ``experts.down_proj [E, hidden, I]``; ``split_experts``
turns them into ``experts.{e}.gate_proj.weight`` etc. Every other name (``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``) is transformers' own.

Shapes: ``N`` tokens (batch and positions flattened), ``E`` experts, ``k`` experts per token.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .llama import Llama, LlamaConfig, SwiGLU, init_weights_
from .mla import DeepseekV3, DeepseekV3Config

# ----------------------------------------------------------------------------------------------
# Gates


def _check_gate_inputs(logits, k, bias) -> int:
    """``logits [N, E]`` floating point, ``k`` a whole number in 1..E, ``bias`` None or ``[E]``;
    returns ``E``."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a floating-point [N, E] tensor (tokens by experts), got {got}; "
                         f"flatten the batch first, logits.reshape(-1, E)")
    num_experts = logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= num_experts:
        raise ValueError(f"k (experts per token) must be a whole number between 1 and the {num_experts} "
                         f"experts, got {k!r}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (num_experts,)):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must hold one number per expert, shape ({num_experts},), got {got}")
    return num_experts


def softmax_topk(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None):
    """Mixtral's gates. ``logits [N, E]`` -> ``weights [N, k]`` (each row sums to 1), ``indices [N, k]``.

    Softmax over all ``E`` experts, top ``k`` probabilities, divided by their sum. ``bias [E]`` (not
    Mixtral's; used in chapter 21's training runs) is added to the probabilities for choosing only.
    """
    _check_gate_inputs(logits, k, bias)
    probs = logits.float().softmax(dim=-1)
    choice = probs if bias is None else probs + bias
    indices = choice.topk(k, dim=-1).indices
    weights = probs.gather(1, indices)
    return weights / weights.sum(dim=-1, keepdim=True), indices


def sigmoid_topk(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None, n_group: int = 1,
                 topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
    """DeepSeek-V3's gates. ``logits [N, E]`` -> ``weights [N, k]``, ``indices [N, k]``.

    ``scores = sigmoid(logits)``; the experts are chosen on ``scores + bias``, only inside the
    ``topk_group`` groups (of ``n_group`` equal groups) whose two best biased scores sum highest;
    the gates are the chosen *unbiased* scores, divided by their sum (``norm_topk_prob``), times
    ``routed_scaling_factor``.
    """
    num_experts = _check_gate_inputs(logits, k, bias)
    num_tokens = logits.shape[0]
    if isinstance(n_group, bool) or not isinstance(n_group, numbers.Integral) or n_group < 1 \
            or num_experts % n_group:
        raise ValueError(f"{num_experts} experts do not split into n_group={n_group!r} equal groups")
    if isinstance(topk_group, bool) or not isinstance(topk_group, numbers.Integral) \
            or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group (groups kept) must be a whole number between 1 and n_group={n_group}, "
                         f"got {topk_group!r}")
    if k > topk_group * (num_experts // n_group):
        raise ValueError(f"k={k} experts cannot be chosen inside topk_group={topk_group} groups of "
                         f"{num_experts // n_group}: raise topk_group or lower k")
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    per_group = choice.view(num_tokens, n_group, num_experts // n_group)
    group_scores = per_group.topk(min(2, num_experts // n_group), dim=-1).values.sum(dim=-1)  # [N, n_group]
    groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)  # [N, n_group]
    allowed = allowed[:, :, None].expand_as(per_group).reshape(num_tokens, num_experts)
    indices = choice.masked_fill(~allowed, float("-inf")).topk(k, dim=-1, sorted=False).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, indices


# ----------------------------------------------------------------------------------------------
# Experts and the sparse block


def expert_config(hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
    """What ``tfcore.SwiGLU`` reads from a config: one expert's sizes."""
    return SimpleNamespace(hidden_size=hidden_size, intermediate_size=intermediate_size, mlp_bias=False,
                           hidden_act=hidden_act)


class Experts(nn.ModuleList):
    """``E`` SwiGLU experts. ``forward(x [N, hidden], indices [N, k], weights [N, k])`` -> ``[N, hidden]``.

    Each expert gathers the rows routed to it (in any of the ``k`` slots), runs on them alone, and
    adds its output, times that row's gate, back into those rows (``index_add_``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__(SwiGLU(expert_config(hidden_size, intermediate_size, hidden_act)) for _ in range(num_experts))

    def forward(self, x, indices, weights):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            rows, slot = torch.where(indices == e)  # the tokens sent to expert e, and in which of their k slots
            if len(rows):
                out.index_add_(0, rows, expert(x[rows]) * weights[rows, slot, None].to(x.dtype))
        return out


def tokens_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``indices [N, k]`` -> ``[E]``: how many (token, slot) pairs each expert received."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, numbers.Integral) or num_experts < 1:
        raise ValueError(f"num_experts must be a whole number >= 1, got {num_experts!r}")
    if not isinstance(indices, torch.Tensor) or indices.is_floating_point() or indices.is_complex() \
            or indices.dtype == torch.bool:
        got = indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"indices must be an integer tensor of expert numbers, got {got}")
    if indices.numel() and not 0 <= int(indices.min()) <= int(indices.max()) < num_experts:
        raise ValueError(f"expert indices must lie in [0, num_experts={num_experts}), got values from "
                         f"{int(indices.min())} to {int(indices.max())} (a dropped pair's -1 is not counted: "
                         f"count the routing before dropping)")
    return torch.bincount(indices.flatten(), minlength=num_experts)


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """The most (token, slot) pairs one expert takes in a batch of ``num_tokens`` tokens: Switch's
    expert capacity (Fedus et al., 2022, §2.2), ``capacity_factor`` times the even share
    ``num_tokens * top_k / num_experts``, rounded down (``top_k = 1`` in Switch)."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    return math.floor(capacity_factor * num_tokens * top_k / num_experts)


def within_capacity(indices: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """``indices [N, k]`` -> ``keep [N, k]`` (bool): each expert keeps the first ``capacity`` pairs
    sent to it and drops the rest. The order is every token's first choice before any second choice,
    and token order within a choice (for ``k = 1`` the order of transformers'
    ``SwitchTransformersTop1Router``). An expert with load ``n`` drops ``max(0, n - capacity)``."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if indices.numel() and not 0 <= int(indices.min()) <= int(indices.max()) < num_experts:
        raise ValueError(f"expert indices must lie in [0, {num_experts})")
    num_tokens, k = indices.shape
    queue = indices.T.reshape(-1)  # [k N]: all first choices, then all second choices
    position = F.one_hot(queue, num_experts).cumsum(0).gather(1, queue[:, None])[:, 0]  # 1-based, per expert
    return (position <= capacity).view(k, num_tokens).T


class SparseMoeBlock(nn.Module):
    """The feed-forward layer as a mixture of experts. ``[B, L, hidden]`` in and out.

    ``gate`` (the router, ``[E, hidden]``), ``experts`` (``E`` SwiGLUs), and for DeepSeek-V3
    ``shared_experts`` (one SwiGLU as wide as ``n_shared_experts`` experts, added with no gate) and
    the buffer ``gate.e_score_correction_bias``. ``gating`` is ``"softmax"`` (Mixtral) or
    ``"sigmoid"`` (DeepSeek-V3). After each forward, ``router_logits [N, E]`` and ``indices [N, k]``
    hold the last routing (for the auxiliary loss and the load counts).

    ``capacity_factor`` (off by default, as in Mixtral and DeepSeek-V3's inference code): each
    expert takes at most ``expert_capacity(N, E, k, capacity_factor)`` pairs of a forward pass; a pair
    over it is dropped (that expert does not run on that token, and ``dropped [N, k]`` marks it). A
    token whose every pair is dropped gets zeros from this layer: the residual carries it on.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, gating: str = "softmax",
                 n_shared_experts: int = 0, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, hidden_act: str = "silu", choice_bias: bool | None = None,
                 capacity_factor: float | None = None):
        super().__init__()
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive or None (no capacity), got {capacity_factor}")
        if gating not in ("softmax", "sigmoid"):
            raise ValueError(f"gating must be 'softmax' (Mixtral) or 'sigmoid' (DeepSeek-V3), got {gating!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.top_k, self.gating = num_experts, top_k, gating
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        if choice_bias if choice_bias is not None else gating == "sigmoid":
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.experts = Experts(num_experts, hidden_size, intermediate_size, hidden_act)
        if n_shared_experts:
            self.shared_experts = SwiGLU(expert_config(hidden_size, intermediate_size * n_shared_experts, hidden_act))
        self.capacity_factor = capacity_factor
        self.router_logits = self.indices = self.dropped = None

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.gate, "e_score_correction_bias", None)

    def route(self, x):
        """``x [N, hidden]`` -> router logits ``[N, E]``, gates ``[N, k]``, expert indices ``[N, k]``."""
        if self.gating == "softmax":  # transformers: logits in the model's dtype, softmax in float32
            logits = F.linear(x, self.gate.weight)
            weights, indices = softmax_topk(logits, self.top_k, self.bias)
        else:  # DeepSeek-V3: logits in float32
            logits = F.linear(x.float(), self.gate.weight.float())
            weights, indices = sigmoid_topk(logits, self.top_k, self.bias, self.n_group, self.topk_group,
                                            self.norm_topk_prob, self.routed_scaling_factor)
        return logits, weights, indices

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, hidden]
        self.router_logits, weights, self.indices = self.route(flat)
        indices = self.indices
        if self.capacity_factor is not None:
            capacity = expert_capacity(flat.shape[0], self.num_experts, self.top_k, self.capacity_factor)
            self.dropped = ~within_capacity(indices, self.num_experts, capacity)
            indices = indices.masked_fill(self.dropped, -1)  # -1: no expert runs on a dropped pair
        out = self.experts(flat, indices, weights).view(shape)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out


def split_experts(state: dict) -> dict:
    """transformers' fused experts -> one SwiGLU per expert, every other name unchanged.

    ``...experts.gate_up_proj [E, 2I, hidden]`` -> ``...experts.{e}.gate_proj.weight`` (first ``I`` rows)
    and ``...experts.{e}.up_proj.weight``; ``...experts.down_proj [E, hidden, I]`` -> ``...experts.{e}.down_proj.weight``.
    """
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, fused in enumerate(tensor):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = fused.chunk(2, dim=0)
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                out[f"{prefix}{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """Every ``SparseMoeBlock`` of ``model``, in order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


# ----------------------------------------------------------------------------------------------
# Mixtral: Llama with a sparse feed-forward layer


@dataclass
class MixtralConfig(LlamaConfig):
    """Llama's sizes plus the experts: ``num_local_experts`` SwiGLUs of ``intermediate_size``, ``k =
    num_experts_per_tok`` per token. Defaults: Mixtral 8x7B's (transformers' ``MixtralConfig``)."""

    vocab_size: int = 32000
    max_position_embeddings: int = 32768
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    intermediate_size: int = 14336
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    choice_bias: bool = False  # a bias for choosing (DeepSeek-V3's balancing), off in Mixtral


class Mixtral(Llama):
    """``tfcore.Llama`` whose every feed-forward layer is a ``SparseMoeBlock`` with softmax gates.
    ``forward(input_ids [B, L], cache=None, attention_mask=None)`` -> logits ``[B, L, vocab_size]``
    (Llama's forward; padded tokens are routed too, and no real token sees them)."""

    def __init__(self, config: MixtralConfig):
        super().__init__(config)
        for layer in self.layers:
            layer.mlp = SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                                       config.intermediate_size, "softmax", hidden_act=config.hidden_act,
                                       choice_bias=config.choice_bias)
        init_weights_(self)

    @classmethod
    def from_transformers(cls, model) -> "Mixtral":
        """A ``Mixtral`` holding the weights of a ``transformers.MixtralForCausalLM``, in eval mode and
        in the reference's dtype.

        Scope: every size of ``MixtralConfig``, ``hidden_act``, ``rms_norm_eps``, ``rope_theta``,
        ``tie_word_embeddings``; checked equal to transformers in float64 within 1e-10 with these off
        their defaults (``tests/test_moe.py``). Refused: a rotary scaling, a sliding window.
        """
        hf = model.config
        if getattr(hf, "model_type", None) != "mixtral":
            raise TypeError(f"expected a transformers MixtralForCausalLM, got {type(model).__name__}")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rotary scaling {rope['rope_type']!r} is not built in tfcore.moe; use the default")
        if getattr(hf, "sliding_window", None):
            raise ValueError(f"sliding_window={hf.sliding_window} is not built in tfcore.moe.Mixtral; set it to None")
        config = MixtralConfig(
            vocab_size=hf.vocab_size, max_position_embeddings=hf.max_position_embeddings, hidden_size=hf.hidden_size,
            num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads, head_dim=getattr(hf, "head_dim", None),
            intermediate_size=hf.intermediate_size, hidden_act=hf.hidden_act, rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope.get("rope_theta", 1e6), tie_word_embeddings=hf.tie_word_embeddings,
            num_local_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok)
        ours = cls(config).to(next(model.parameters()).dtype)  # float64 stays float64
        state = {name.removeprefix("model."): t for name, t in model.state_dict().items() if "rotary_emb" not in name}
        ours.load_state_dict(split_experts(state), strict=True)
        return ours.eval()


# ----------------------------------------------------------------------------------------------
# DeepSeek-V3 with experts: chapter 19's latent attention, experts from layer first_k_dense_replace on


@dataclass
class DeepseekV3MoEConfig(DeepseekV3Config):
    """``tfcore.mla.DeepseekV3Config`` plus the experts, with transformers' field names and
    DeepSeek-V3's defaults: layers ``first_k_dense_replace`` and up are mixtures of ``n_routed_experts``
    SwiGLUs of ``moe_intermediate_size`` (``num_experts_per_tok`` per token) and ``n_shared_experts``."""

    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3


class DeepseekV3WithExperts(DeepseekV3):
    """``tfcore.mla.DeepseekV3`` whose layers from ``first_k_dense_replace`` on have a
    ``SparseMoeBlock`` (sigmoid gates, group-limited, with shared experts) as feed-forward layer.

    ``forward(input_ids, cache=None, absorbed=None, attention_mask=None)`` is DeepseekV3's: padded
    tokens are routed too, and no real token sees them. A ``capacity_factor`` set on its blocks (off,
    as built) is shared by every token of a forward pass, padded ones included: a batch then no
    longer equals each prompt decoded alone (at factor 1.0, on the batch of
    tests/test_batched_decoding.py: no row, the unpadded one included; logits up to 9.8 apart)."""

    def __init__(self, config: DeepseekV3MoEConfig):
        super().__init__(config)
        for layer in self.layers[config.first_k_dense_replace:]:
            layer.mlp = SparseMoeBlock(config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
                                       config.moe_intermediate_size, "sigmoid", config.n_shared_experts,
                                       config.n_group, config.topk_group, config.norm_topk_prob,
                                       config.routed_scaling_factor, config.hidden_act)
        init_weights_(self)

    @classmethod
    def from_transformers(cls, model) -> "DeepseekV3WithExperts":
        """A ``DeepseekV3WithExperts`` holding the weights of a ``transformers.DeepseekV3ForCausalLM``,
        in eval mode and in the reference's dtype.

        Scope: chapter 19's attention options plus every option of the experts (``n_routed_experts``,
        ``num_experts_per_tok``, ``n_shared_experts``, ``n_group``, ``topk_group``, ``norm_topk_prob``,
        ``routed_scaling_factor``, ``first_k_dense_replace``); checked equal in float64 within 1e-10
        with these off their defaults (``tests/test_moe.py``). Refused: a rotary scaling (YaRN).
        """
        hf = model.config
        if getattr(hf, "model_type", None) != "deepseek_v3":
            raise TypeError(f"expected a transformers DeepseekV3ForCausalLM, got {type(model).__name__}")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rotary scaling {rope['rope_type']!r} is not built in tfcore; use the default")
        config = DeepseekV3MoEConfig(
            vocab_size=hf.vocab_size, max_position_embeddings=hf.max_position_embeddings, hidden_size=hf.hidden_size,
            num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
            q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, intermediate_size=hf.intermediate_size,
            hidden_act=hf.hidden_act, rms_norm_eps=hf.rms_norm_eps, rope_theta=rope.get("rope_theta", 10000.0),
            rope_interleave=bool(hf.rope_interleave), attention_bias=hf.attention_bias,
            tie_word_embeddings=hf.tie_word_embeddings, n_routed_experts=hf.n_routed_experts,
            num_experts_per_tok=hf.num_experts_per_tok, n_shared_experts=hf.n_shared_experts,
            moe_intermediate_size=hf.moe_intermediate_size, n_group=hf.n_group, topk_group=hf.topk_group,
            norm_topk_prob=hf.norm_topk_prob, routed_scaling_factor=hf.routed_scaling_factor,
            first_k_dense_replace=hf.first_k_dense_replace)
        ours = cls(config).to(next(model.parameters()).dtype)  # float64 stays float64
        state = {name.removeprefix("model."): t for name, t in model.state_dict().items() if "rotary_emb" not in name}
        ours.load_state_dict(split_experts(state), strict=True)
        return ours.eval()


# ----------------------------------------------------------------------------------------------
# Load balancing


def load_balancing_loss(router_logits, top_k: int) -> torch.Tensor:
    """Switch's auxiliary loss (Fedus et al., 2022, eqs. 4-6), for top-``k`` routing.

    ``router_logits``: one ``[N, E]`` tensor per layer (or one tensor). With every layer's tokens
    pooled, ``f_i`` is the fraction of tokens that chose expert ``i`` among their ``k`` (the ``f_i`` sum
    to ``k``) and ``P_i`` the mean softmax probability of expert ``i``; the loss is ``E * sum_i f_i P_i``,
    ``k`` when both are uniform. ``f`` has no gradient; ``P`` carries it to the router.
    """
    layers = list(router_logits) if isinstance(router_logits, (list, tuple)) else [router_logits]
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in layers]
    if not layers or not all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.is_floating_point()
                             for t in layers) or len({shape[-1] for shape in shapes}) != 1:
        raise ValueError(f"router_logits must be floating-point [N, E] tensors, one per layer, all with the "
                         f"same number of experts E; got {shapes or 'nothing'}")
    logits = torch.cat(layers)
    num_experts = logits.shape[-1]
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be a whole number between 1 and the {num_experts} experts, got {top_k!r}")
    probs = logits.float().softmax(dim=-1)  # [N, E]
    chosen = probs.topk(top_k, dim=-1).indices  # [N, k]
    f = F.one_hot(chosen, num_experts).sum(dim=1).float().mean(dim=0)  # [E], sums to k
    return num_experts * (f * probs.mean(dim=0)).sum()


@torch.no_grad()
def update_choice_bias(block: SparseMoeBlock, rate: float) -> torch.Tensor:
    """DeepSeek-V3's balancing without an auxiliary loss (DeepSeek-AI, 2024, §2.1.2): after a step,
    raise the choice bias of every expert that got fewer tokens than the mean by ``rate``, lower it
    for those that got more. Returns the load ``[E]`` of the last forward."""
    load = tokens_per_expert(block.indices, block.num_experts).float()
    block.bias.add_(rate * torch.sign(load.mean() - load))
    return load


__all__ = ["DeepseekV3MoEConfig", "DeepseekV3WithExperts", "Experts", "Mixtral", "MixtralConfig",
           "SparseMoeBlock", "expert_capacity", "expert_config", "load_balancing_loss", "moe_blocks",
           "sigmoid_topk", "softmax_topk", "split_experts", "tokens_per_expert", "update_choice_bias",
           "within_capacity"]
