"""The decoder and the encoder-decoder model, with greedy and beam-search decoding (chapters 9-10).

Shapes: ``src [B, Ls]`` and ``tgt [B, Lt]`` token ids; hidden states ``[B, L, d_model]``.
Masks hold 1 where attention is allowed: ``src_mask [B, 1, Ls]`` (padding) and
``tgt_mask [1 or B, Lt, Lt]`` (causal, the default).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import BertConfig

from .attention import MultiHeadAttention, causal_mask
from .encoder import check_input_ids, sinusoidal_positions
from .layers import FeedForward, TransformerEncoderLayer


class ScaledEmbedding(nn.Module):
    """Token embeddings times √d_model, plus fixed sinusoidal positions, then dropout."""

    def __init__(self, vocab_size: int, config, max_len: int = 512):
        super().__init__()
        self.vocab_size, self.max_len, self.d_model = vocab_size, max_len, config.hidden_size
        self.token_embeddings = nn.Embedding(vocab_size, config.hidden_size)
        self.register_buffer("positions", sinusoidal_positions(max_len, config.hidden_size), persistent=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, ids):
        check_input_ids(ids, self.vocab_size, self.max_len)
        x = self.token_embeddings(ids) * math.sqrt(self.d_model) + self.positions[: ids.shape[1]]
        return self.dropout(x)


class TransformerDecoderLayer(nn.Module):
    """Masked self-attention, cross-attention on the encoder's output, feed-forward; pre-LN.

    ``forward(x [B, Lt, d], memory [B, Ls, d], src_mask, tgt_mask)`` -> ``[B, Lt, d]``. In the
    cross-attention the queries come from the decoder (``x``) and the keys and values from
    ``memory``: each target position asks which source positions it needs.
    """

    def __init__(self, config):
        super().__init__()
        self.self_attention = MultiHeadAttention(config)
        self.cross_attention = MultiHeadAttention(config)
        self.feed_forward = FeedForward(config)
        self.layer_norm_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layer_norm_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layer_norm_3 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, memory, src_mask=None, tgt_mask=None):
        h = self.layer_norm_1(x)
        x = x + self.dropout(self.self_attention(h, mask=tgt_mask))
        x = x + self.dropout(self.cross_attention(self.layer_norm_2(x), memory, mask=src_mask))
        return x + self.feed_forward(self.layer_norm_3(x))


class TransformerDecoder(nn.Module):
    """``config.num_hidden_layers`` decoder layers and a final LayerNorm (pre-LN needs one)."""

    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(TransformerDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x, memory, src_mask=None, tgt_mask=None):
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


class Generator(nn.Module):
    """Linear to the target vocabulary, then log-softmax: ``[B, Lt, d]`` -> ``[B, Lt, tgt_vocab]``."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size)

    def forward(self, hidden):
        return self.proj(hidden).log_softmax(dim=-1)


class EncoderDecoder(nn.Module):
    """The original Transformer: a pre-LN encoder, a decoder, and a generator.

    ``forward(src, tgt, src_mask=None, tgt_mask=None)`` -> decoder hidden states ``[B, Lt, d]``;
    ``tgt_mask`` defaults to the causal mask. ``generator(hidden)`` gives log-probabilities.
    """

    def __init__(self, config, src_vocab: int, tgt_vocab: int):
        super().__init__()
        self.src_embed = ScaledEmbedding(src_vocab, config)
        self.tgt_embed = ScaledEmbedding(tgt_vocab, config)
        self.encoder_layers = nn.ModuleList(TransformerEncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.encoder_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = TransformerDecoder(config)
        self.generator = Generator(config.hidden_size, tgt_vocab)

    def encode(self, src, src_mask=None):
        x = self.src_embed(src)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def decode(self, memory, src_mask, tgt, tgt_mask=None):
        if tgt_mask is None:
            tgt_mask = causal_mask(tgt.shape[1], device=tgt.device)
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)


def make_model(src_vocab: int, tgt_vocab: int, N: int = 2, d_model: int = 512, d_ff: int = 2048,
               h: int = 8, dropout: float = 0.1, verbose: bool = True) -> EncoderDecoder:
    """An ``EncoderDecoder`` with ``N`` layers each side, Xavier-initialised; prints its size."""
    config = BertConfig(hidden_size=d_model, num_hidden_layers=N, num_attention_heads=h,
                        intermediate_size=d_ff, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, layer_norm_eps=1e-5, norm_first=True)
    model = EncoderDecoder(config, src_vocab, tgt_vocab)
    for parameter in model.parameters():
        if parameter.dim() > 1:
            nn.init.xavier_uniform_(parameter)
    if verbose:
        print(f"make_model: {sum(p.numel() for p in model.parameters()):,} parameters")
    return model


@torch.no_grad()
def greedy_decode(model, src, src_mask, max_len: int, start_symbol: int) -> torch.Tensor:
    """Pick the most probable next token, step by step: ``[B, max_len]``, starting with ``start_symbol``."""
    memory = model.encode(src, src_mask)
    ys = torch.full((src.shape[0], 1), start_symbol, dtype=torch.long, device=src.device)
    for _ in range(max_len - 1):
        log_probs = model.generator(model.decode(memory, src_mask, ys)[:, -1])
        ys = torch.cat([ys, log_probs.argmax(dim=-1, keepdim=True)], dim=1)
    return ys


@torch.no_grad()
def sequence_log_prob(model, src, src_mask, tgt, end_symbol: int | None = None) -> torch.Tensor:
    """log P(tgt[:, 1:] | src, tgt[:, 0]) under the model, summed over positions: ``[B]``.

    With ``end_symbol``, each sequence counts up to and including its first ``end_symbol``.
    """
    tokens = tgt[:, 1:]
    log_probs = model.generator(model(src, tgt[:, :-1], src_mask))
    per_token = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if end_symbol is not None:
        ends_before = (tokens == end_symbol).long().cumsum(dim=1) - (tokens == end_symbol).long()
        per_token = per_token.masked_fill(ends_before > 0, 0.0)
    return per_token.sum(dim=-1)


@torch.no_grad()
def beam_search(model, src, src_mask, max_len: int, start_symbol: int, beam_size: int = 4,
                end_symbol: int | None = None, return_scores: bool = False):
    """Keep the ``beam_size`` most probable partial sequences at every step; return the best one.

    Scores are summed log-probabilities (no length penalty). A beam that has produced
    ``end_symbol`` is finished: it keeps its score and stops growing. Returns ``[B, ≤max_len]``
    token ids (shorter items padded with ``end_symbol``), and their scores ``[B]`` when
    ``return_scores`` is set.
    """
    results, scores = [], []
    for b in range(src.shape[0]):
        mask_b = None if src_mask is None else src_mask[b:b + 1]
        memory = model.encode(src[b:b + 1], mask_b)
        beams = torch.full((1, 1), start_symbol, dtype=torch.long, device=src.device)
        beam_scores = torch.zeros(1, device=src.device)
        finished = torch.zeros(1, dtype=torch.bool, device=src.device)
        for _ in range(max_len - 1):
            if finished.all():
                break
            k = beams.shape[0]
            hidden = model.decode(memory.expand(k, -1, -1), None if mask_b is None else mask_b.expand(k, -1, -1), beams)
            log_probs = model.generator(hidden[:, -1])  # [k, V]
            if end_symbol is not None:  # a finished beam may only "continue" with end_symbol, at no cost
                log_probs[finished] = -math.inf
                log_probs[finished, end_symbol] = 0.0
            candidates = (beam_scores[:, None] + log_probs).flatten()
            beam_scores, flat = candidates.topk(min(beam_size, candidates.numel()))
            vocab = log_probs.shape[1]
            beams = torch.cat([beams[flat // vocab], (flat % vocab).unsqueeze(1)], dim=1)
            finished = beams[:, -1] == end_symbol if end_symbol is not None else finished[flat // vocab]
        best = beams[0]
        if end_symbol is not None and (best == end_symbol).any():
            best = best[: int((best == end_symbol).nonzero()[0]) + 1]
        results.append(best)
        scores.append(beam_scores[0])
    length = max(len(r) for r in results)
    pad = end_symbol if end_symbol is not None else 0
    out = torch.full((len(results), length), pad, dtype=torch.long, device=src.device)
    for b, r in enumerate(results):
        out[b, : len(r)] = r
    return (out, torch.stack(scores)) if return_scores else out
