"""A decoder-only Transformer wired as GPT-2, built from the book's own parts (chapter 14).

GPT-2 is the pre-LN encoder layer of chapter 5 run under the causal mask of chapter 3, with
learned positions, a final LayerNorm and an output layer that shares the token embeddings.

Shapes: ``input_ids [B, L]`` -> logits ``[B, L, vocab_size]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .attention import causal_mask
from .cache import KVCache
from .encoder import check_input_ids
from .layers import TransformerEncoderLayer

ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),  # exact, erf-based: BERT
    "gelu_new": lambda: nn.GELU(approximate="tanh"),  # GPT-2's tanh approximation
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
    "silu": lambda: nn.SiLU(),
}


def check_attention_mask(attention_mask, input_ids: torch.Tensor, past: int = 0) -> torch.Tensor:
    """The tokenizer's ``attention_mask`` (1 = real token, 0 = padding), checked and returned as bool.

    It covers the ``past`` cached positions and the ``L`` new ones: ``[B, past + L]`` for
    ``input_ids [B, L]`` (transformers' convention). Integers or bools holding 0 and 1 only.
    """
    batch, length = input_ids.shape
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor of 0/1 (1 = real token), got "
                        f"{type(attention_mask).__name__}; pass the tokenizer's attention_mask")
    if tuple(attention_mask.shape) != (batch, past + length):
        raise ValueError(f"attention_mask must be [B, cached + new positions] = [{batch}, {past + length}] "
                         f"({past} cached, {length} new), got {tuple(attention_mask.shape)}; extend it with "
                         f"a 1 for every token fed to the model, as tfcore.generate does")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(f"attention_mask must hold integers or bools (1 = real token, 0 = padding), got "
                        f"{attention_mask.dtype}; use attention_mask.long()")
    if attention_mask.dtype != torch.bool and not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token); it holds other "
                         "values: pass the tokenizer's attention_mask, not the input_ids")
    return attention_mask.to(torch.bool)


def mask_positions(real: torch.Tensor, length: int) -> torch.Tensor:
    """The positions ``[B, length]`` of the last ``length`` tokens of ``real [B, T]`` (bool, True = real).

    A real token's position is the number of real tokens before it in its row, so a left-padded
    prompt starts at 0 as it would alone; padding takes position 0 (harmless: no real token sees
    it), as transformers' ``generate`` builds ``position_ids`` (``cumsum(mask) - 1``, then 0 where
    the mask is 0; ``GenerationMixin._prepare_position_ids_for_generation``, 5.23).
    """
    positions = real.long().cumsum(dim=-1) - 1
    return positions.masked_fill(~real, 0)[:, real.shape[1] - length:]


def positions_and_mask(input_ids, cache: KVCache | None, vocab_size: int, max_positions: int,
                       attention_mask: torch.Tensor | None = None):
    """Check ``input_ids [B, L]`` and return the positions of its tokens and the attention mask.

    With a cache of ``P`` positions the new tokens take positions ``P .. P + L - 1`` and may see
    all ``P + L`` keys (``[1, L, P + L]``); one new token may see every key, so it needs no mask
    (None). A clear error when ``P + L`` exceeds the model's ``max_positions``.

    With an ``attention_mask [B, P + L]`` (1 = real token, 0 = padding; see
    ``check_attention_mask``) the positions are per row, ``[B, L]`` (``mask_positions``), and the
    mask ``[B, L, P + L]`` also blocks every padded key; a padded query may then see no key at
    all, and attention gives it zeros. Without one (None) every position is real: positions
    ``[L]``, as above; a cache that holds padding (``cache.padded``) then refuses the call.
    """
    past = 0 if cache is None else cache.length
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and past + input_ids.shape[1] > max_positions:
        raise ValueError(f"positions {past}..{past + input_ids.shape[1] - 1} do not fit: the model has "
                         f"{max_positions} positions (max_position_embeddings); use a shorter prompt "
                         f"or generate fewer tokens")
    check_input_ids(input_ids, vocab_size, max_positions)
    length = input_ids.shape[1]
    if attention_mask is None:
        if getattr(cache, "padded", False):
            raise ValueError("this cache holds padded positions, but attention_mask is None: pass the mask over "
                             "the cached and new positions, [B, P + L], extended with a 1 per new token, as "
                             "tfcore.generate does")
        positions = torch.arange(past, past + length, device=input_ids.device)
        mask = None if (cache is not None and length == 1) else causal_mask(length, input_ids.device, past)
        return positions, mask
    real = check_attention_mask(attention_mask, input_ids, past).to(input_ids.device)  # [B, P + L]
    if cache is not None and not bool(real.all()):
        cache.padded = True  # from now on the cache holds padding: every later call needs the mask
    mask = real.unsqueeze(1)  # [B, 1, P + L]: no query sees a padded key
    if not (cache is not None and length == 1):
        mask = mask & causal_mask(length, input_ids.device, past)  # [B, L, P + L]
    return mask_positions(real, length), mask


def activation(name: str) -> nn.Module:
    """The activation module that a transformers config names (``hidden_act``/``activation_function``)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; tfcore supports {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


@dataclass
class GPTConfig:
    """The sizes of a GPT. The field names are the ones tfcore's layers read (BERT's names);
    GPT-2's own names are in the comments. ``intermediate_size`` defaults to 4 x ``hidden_size``."""

    vocab_size: int = 50257
    max_position_embeddings: int = 1024  # n_positions
    hidden_size: int = 768  # n_embd
    num_hidden_layers: int = 12  # n_layer
    num_attention_heads: int = 12  # n_head
    intermediate_size: int | None = None  # n_inner
    hidden_act: str = "gelu_new"  # activation_function
    layer_norm_eps: float = 1e-5  # layer_norm_epsilon
    hidden_dropout_prob: float = 0.1  # embd_pdrop and resid_pdrop
    attention_probs_dropout_prob: float = 0.1  # attn_pdrop
    tie_word_embeddings: bool = True
    norm_first: bool = True  # pre-LN, always, in GPT-2

    def __post_init__(self):
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if not self.norm_first:
            raise ValueError("GPT-2 is pre-LN: norm_first must be True")


class GPT(nn.Module):
    """Token and learned position embeddings, N pre-LN causal blocks, a final LayerNorm, and a
    linear layer to the vocabulary whose weight is the token embedding matrix (tied).

    Initialised as GPT-2: every weight normal(0, 0.02), biases 0, LayerNorms 1 and 0, and the two
    residual output projections of each block scaled down to std 0.02/sqrt(2N) (N blocks).

    ``forward(input_ids [B, L], cache=None, attention_mask=None)`` -> logits ``[B, L, vocab_size]``.
    With a cache (``model.new_cache()``), ``input_ids`` holds only the positions that follow the
    cached ones. ``attention_mask [B, P + L]`` (0 = padding, over the ``P`` cached positions and
    the ``L`` new ones) runs a padded batch: see ``positions_and_mask``.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)  # wte
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)  # wpe
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # built with the exact GELU (FeedForward refuses any other), then GPT-2's tanh GELU swapped in
        exact = replace(config, hidden_act="gelu")
        self.blocks = nn.ModuleList(TransformerEncoderLayer(exact) for _ in range(config.num_hidden_layers))
        for block in self.blocks:
            block.feed_forward.gelu = activation(config.hidden_act)  # GPT-2: the tanh GELU
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # ln_f
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.token_embeddings.weight
        self.apply(self._init_weights)
        self._scale_residual_projections()

    @staticmethod
    def _init_weights(module):
        """normal(0, 0.02) for linear and embedding weights, zero biases (GPT-2's first step)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @torch.no_grad()
    def _scale_residual_projections(self):
        """GPT-2's second step (Radford et al., 2019, section 2.3): the two layers of each block that
        write into the residual stream, attention's output projection and the feed-forward's second
        linear layer (GPT-2's ``c_proj``), are scaled by 1/sqrt(2 x num_hidden_layers), so that their
        std is 0.02/sqrt(2N), as in transformers' ``GPT2PreTrainedModel._init_weights``. Scaling the
        weights already drawn keeps the random stream: later draws are the same with or without it.
        """
        factor = (2 * len(self.blocks)) ** -0.5
        for block in self.blocks:
            block.attention.output_linear.weight.mul_(factor)
            block.feed_forward.linear_2.weight.mul_(factor)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return KVCache(len(self.blocks), capacity=capacity)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        positions, mask = positions_and_mask(input_ids, cache, self.config.vocab_size, self.max_positions,
                                             attention_mask)
        x = self.dropout(self.token_embeddings(input_ids) + self.position_embeddings(positions))
        for i, block in enumerate(self.blocks):
            x = block(x, mask, cache=None if cache is None else cache[i])
        return self.lm_head(self.final_layer_norm(x))

    @classmethod
    def from_transformers(cls, model) -> "GPT":
        """A ``GPT`` holding the weights of a ``transformers.GPT2LMHeadModel``, in eval mode.

        GPT-2 stores its linear layers as ``Conv1D`` with the weight transposed (``[in, out]``),
        and its query, key and value projections as one ``c_attn`` of width 3 x hidden: we
        transpose (keeping GPT-2's memory layout: each weight is a transposed view of an [in, out] copy),
        and cut ``c_attn`` into three. The port keeps the reference's dtype.

        Scope: every size of ``GPT2Config`` (``n_inner`` included), ``activation_function`` (the
        names in ``ACTIVATIONS``), ``layer_norm_epsilon``, ``tie_word_embeddings``, the dropout
        rates (carried over; an eval-mode comparison does not exercise them), and
        ``reorder_and_upcast_attn`` (the same attention, rounded otherwise); checked equal to
        transformers in float64 within 1e-10 with all of these but ``reorder_and_upcast_attn``
        off their defaults, and with that one on in float32 within 1e-4 (transformers raises on
        it in float64; ``tests/test_modern_decoder.py``). Refused with a ValueError:
        ``scale_attn_weights=False``, ``scale_attn_by_inverse_layer_idx=True``,
        ``add_cross_attention=True``, and an ``embd_pdrop`` other than ``resid_pdrop`` (one rate,
        ``hidden_dropout_prob``, serves both).
        """
        hf = model.config
        if getattr(hf, "model_type", None) != "gpt2" or not hasattr(model, "transformer"):
            raise TypeError(f"expected a transformers GPT2LMHeadModel, got {type(model).__name__}")
        for flag, wanted in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True),
                             ("add_cross_attention", False)):
            if getattr(hf, flag, wanted) != wanted:
                raise ValueError(f"tfcore.GPT does not implement GPT-2's {flag}={not wanted}; only "
                                 f"the standard GPT-2 wiring ({flag}={wanted}) can be ported")
        if hf.embd_pdrop != hf.resid_pdrop:
            raise ValueError(f"tfcore.GPT has one dropout rate for the embeddings and the residual branches "
                             f"(hidden_dropout_prob), but this GPT-2 has embd_pdrop={hf.embd_pdrop} and "
                             f"resid_pdrop={hf.resid_pdrop}; set them equal (the released GPT-2 configs do) "
                             f"to port it")
        config = GPTConfig(vocab_size=hf.vocab_size, max_position_embeddings=hf.n_positions,
                           hidden_size=hf.n_embd, num_hidden_layers=hf.n_layer, num_attention_heads=hf.n_head,
                           intermediate_size=hf.n_inner, hidden_act=hf.activation_function,
                           layer_norm_eps=hf.layer_norm_epsilon, hidden_dropout_prob=hf.resid_pdrop,
                           attention_probs_dropout_prob=hf.attn_pdrop,
                           tie_word_embeddings=getattr(hf, "tie_word_embeddings", True))
        dtype = next(model.parameters()).dtype
        gpt = cls(config).to(dtype)  # in the reference's dtype: a float64 GPT-2 is not rounded to 32 bits
        source = model.transformer
        hidden = config.hidden_size

        def linear(target: nn.Linear, weight, bias):  # Conv1D [in, out] -> Linear [out, in]
            # The weight [out, in] is the transpose of a copy of Conv1D's [in, out] storage: the same
            # numbers, kept in GPT-2's memory layout, so each product runs the kernel transformers runs.
            # At one row (a decode step) MKL read this layout faster than a contiguous [out, in]:
            # benchmarks/decoding.py's "kernel" rows, and chapter 23.
            target.weight = nn.Parameter(weight.detach().clone().t())
            target.bias.copy_(bias)

        with torch.no_grad():
            gpt.token_embeddings.weight.copy_(source.wte.weight)
            gpt.position_embeddings.weight.copy_(source.wpe.weight)
            for block, h in zip(gpt.blocks, source.h):
                block.layer_norm_1.load_state_dict(h.ln_1.state_dict())
                w, b = h.attn.c_attn.weight, h.attn.c_attn.bias
                for i, part in enumerate((block.attention.query, block.attention.key, block.attention.value)):
                    linear(part, w[:, i * hidden:(i + 1) * hidden], b[i * hidden:(i + 1) * hidden])
                linear(block.attention.output_linear, h.attn.c_proj.weight, h.attn.c_proj.bias)
                block.layer_norm_2.load_state_dict(h.ln_2.state_dict())
                linear(block.feed_forward.linear_1, h.mlp.c_fc.weight, h.mlp.c_fc.bias)
                linear(block.feed_forward.linear_2, h.mlp.c_proj.weight, h.mlp.c_proj.bias)
            gpt.final_layer_norm.load_state_dict(source.ln_f.state_dict())
            if not config.tie_word_embeddings:
                gpt.lm_head.weight.copy_(model.lm_head.weight)
        return gpt.eval()
