"""Positions, embeddings and the encoder stack (chapters 6 and 7).

Shapes: ``input_ids [B, L]`` (integers) -> hidden states ``[B, L, hidden]``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import _whole, padding_mask
from .layers import TransformerEncoderLayer


def check_input_ids(input_ids, vocab_size: int, max_positions: int) -> None:
    """Raise a clear error for ids that an embedding table would reject with an index error."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids (torch.long), got dtype {input_ids.dtype}; "
                        f"use the tokenizer's input_ids, or input_ids.long()")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a batch of shape [B, L], got shape {tuple(input_ids.shape)}; "
                         f"for a single sentence use input_ids.unsqueeze(0)")
    if input_ids.shape[1] > max_positions:
        raise ValueError(f"the sequence has {input_ids.shape[1]} tokens but max_position_embeddings is "
                         f"{max_positions}; truncate it, e.g. tokenizer(..., truncation=True, "
                         f"max_length={max_positions})")
    if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}) (vocab_size), got values from "
                         f"{int(input_ids.min())} to {int(input_ids.max())}; was the text encoded with "
                         f"this model's tokenizer?")


def sinusoidal_positions(max_len: int, d_model: int) -> torch.Tensor:
    """The fixed encodings of "Attention Is All You Need", ``[max_len, d_model]``.

    ``PE[pos, 2i] = sin(pos / 10000^(2i/d))`` and ``PE[pos, 2i+1] = cos(pos / 10000^(2i/d))``:
    ``d_model`` is even (a sine and a cosine per frequency) and ``max_len`` >= 1.
    """
    max_len = _whole("max_len (the number of positions to encode)", max_len, 1)
    if _whole("d_model (an even width)", d_model, 2) % 2:
        raise ValueError(f"sinusoidal_positions needs an even d_model (a sine and a cosine per frequency), "
                         f"got {d_model!r}: use an even width")
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    encoding = torch.zeros(max_len, d_model)
    encoding[:, 0::2] = torch.sin(position * frequency)
    encoding[:, 1::2] = torch.cos(position * frequency)
    return encoding


class Embeddings(nn.Module):
    """Token + learned position (+ token type) embeddings, then LayerNorm (post-LN only) and dropout.

    In the post-LN arrangement (``config.norm_first=False``) the embeddings end with a LayerNorm,
    as BERT's do, so that BERT's weights load one to one (chapter 7). That LayerNorm is BERT's
    choice, not a consequence of post-LN: the original post-LN Transformer (Vaswani et al.,
    2017) has none, and the BERT paper gives no reason for it. The pre-LN arrangement, like
    GPT-2, has none: there the first layer's ``layer_norm_1`` already normalises the embeddings
    on their way into attention.

    ``forward(input_ids [B, L], token_type_ids [B, L] = zeros)`` -> ``[B, L, hidden]``.
    Token types (sentence A / B) are BERT's; a config with ``type_vocab_size=0`` has none.
    """

    def __init__(self, config):
        super().__init__()
        self.vocab_size, self.max_positions = config.vocab_size, config.max_position_embeddings
        self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        types = getattr(config, "type_vocab_size", 0)
        self.token_type_embeddings = nn.Embedding(types, config.hidden_size) if types else None
        post_ln = not getattr(config, "norm_first", True)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if post_ln else None
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids=None):
        check_input_ids(input_ids, self.vocab_size, self.max_positions)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        embeddings = self.token_embeddings(input_ids) + self.position_embeddings(positions)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            types = self.token_type_embeddings.num_embeddings
            if token_type_ids.shape != input_ids.shape or token_type_ids.min() < 0 or token_type_ids.max() >= types:
                raise ValueError(f"token_type_ids must have the shape of input_ids {tuple(input_ids.shape)} "
                                 f"and values in [0, {types}) (type_vocab_size)")
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.layer_norm is not None:
            embeddings = self.layer_norm(embeddings)
        return self.dropout(embeddings)


class TransformerEncoder(nn.Module):
    """Embeddings, then ``config.num_hidden_layers`` encoder layers, then (pre-LN only) a LayerNorm.

    A pre-LN layer adds its sublayers' outputs to a residual stream that is never normalised
    itself, so its scale grows with depth; the final LayerNorm brings the output back to the
    scale every layer's input had. A post-LN stack (BERT, ``config.norm_first=False``) already
    ends with a LayerNorm and has no final one.

    ``forward(input_ids [B, L], attention_mask [B, L] = None, token_type_ids = None,
    output_attentions=False)`` -> hidden states ``[B, L, hidden]``; with ``output_attentions``,
    ``(hidden_states, attentions)``, one ``[B, heads, L, L]`` per layer, as transformers returns.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(TransformerEncoderLayer(config) for _ in range(config.num_hidden_layers))
        pre_ln = getattr(config, "norm_first", True)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if pre_ln else None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_attentions=False):
        x = self.embeddings(input_ids, token_type_ids)
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(attention_mask.shape)}")
        mask = None if attention_mask is None else padding_mask(attention_mask)
        attentions = []
        for layer in self.layers:
            if output_attentions:
                x, weights = layer(x, mask, output_attentions=True)
                attentions.append(weights)
            else:
                x = layer(x, mask)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return (x, tuple(attentions)) if output_attentions else x

    @classmethod
    def from_pretrained(cls, name: str | None = None) -> "TransformerEncoder":
        """An encoder holding a pretrained BERT's weights (default: the embedded checkpoint).

        Configured as BERT is: post-LN, exact GELU, the checkpoint's ``layer_norm_eps``, token
        types. Every weight is placed by name (see ``checkpoint.bert_to_tfcore``); eval mode.
        """
        from .checkpoint import bert_to_tfcore, load_pretrained

        bert = load_pretrained(name)
        config = bert.config
        if config.hidden_act != "gelu":
            raise ValueError(f"tfcore's encoder uses the exact GELU; this checkpoint uses {config.hidden_act!r}")
        config.norm_first = False  # BERT is post-LN
        encoder = cls(config)
        encoder.load_state_dict(bert_to_tfcore(bert.state_dict()), strict=True)
        return encoder.eval()
