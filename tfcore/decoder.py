"""The decoder and the encoder-decoder model, with greedy and beam-search decoding (chapters 9-11).

Shapes: ``src [B, Ls]`` and ``tgt [B, Lt]`` token ids; hidden states ``[B, L, d_model]``.
Masks hold 1 where attention is allowed: ``src_mask [B, 1, Ls]`` (padding) and
``tgt_mask [1 or B, Lt, Lt]`` (causal, the default).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import MultiHeadAttention, _whole, causal_mask
from .cache import KVCache
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

    def forward(self, ids, start: int = 0):
        """``ids [B, L]`` at positions ``start .. start + L - 1`` -> ``[B, L, d_model]``."""
        if start + (ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 0) > self.max_len:
            raise ValueError(f"positions {start}..{start + ids.shape[1] - 1} are past the model's "
                             f"{self.max_len} positions (max_len); generate fewer tokens")
        check_input_ids(ids, self.vocab_size, self.max_len)
        x = self.token_embeddings(ids) * math.sqrt(self.d_model) + self.positions[start: start + ids.shape[1]]
        return self.dropout(x)


class TransformerDecoderLayer(nn.Module):
    """Masked self-attention, cross-attention on the encoder's output, feed-forward; pre-LN.

    Always pre-LN with the exact GELU: a config asking for ``norm_first=False`` or another
    ``hidden_act`` is refused. Equal to ``torch.nn.TransformerDecoderLayer(norm_first=True,
    activation="gelu", batch_first=True)`` holding the same weights (``tests/test_decoder.py``).

    ``forward(x [B, Lt, d], memory [B, Ls, d], src_mask, tgt_mask)`` -> ``[B, Lt, d]``. In the
    cross-attention the queries come from the decoder (``x``) and the keys and values from
    ``memory``: each target position asks which source positions it needs. ``self_cache`` and
    ``cross_cache`` (``tfcore.LayerCache``, chapter 15) let ``x`` hold only the new positions.
    """

    def __init__(self, config):
        super().__init__()
        if getattr(config, "norm_first", True) is not True:
            raise ValueError("TransformerDecoderLayer is pre-LN only; config.norm_first=False (post-LN) "
                             "is not built: leave norm_first unset or set it to True")
        if getattr(config, "hidden_act", "gelu") != "gelu":
            raise ValueError(f"TransformerDecoderLayer's feed-forward uses the exact GELU only, got "
                             f"hidden_act={config.hidden_act!r}: leave hidden_act at 'gelu'")
        self.self_attention = MultiHeadAttention(config)
        self.cross_attention = MultiHeadAttention(config)
        self.feed_forward = FeedForward(config)
        self.layer_norm_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layer_norm_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layer_norm_3 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, memory, src_mask=None, tgt_mask=None, self_cache=None, cross_cache=None):
        h = self.layer_norm_1(x)
        x = x + self.dropout(self.self_attention(h, mask=tgt_mask, cache=self_cache))
        x = x + self.dropout(self.cross_attention(self.layer_norm_2(x), memory, mask=src_mask, cache=cross_cache))
        return x + self.feed_forward(self.layer_norm_3(x))


class TransformerDecoder(nn.Module):
    """``config.num_hidden_layers`` decoder layers and a final LayerNorm (pre-LN needs one)."""

    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(TransformerDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x, memory, src_mask=None, tgt_mask=None, cache: KVCache | None = None):
        for i, layer in enumerate(self.layers):
            caches = (None, None) if cache is None else (cache.layers[i], cache.cross[i])
            x = layer(x, memory, src_mask, tgt_mask, *caches)
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
    ``decode(..., cache=model.new_cache())`` decodes incrementally (chapter 15): ``tgt`` then holds
    only the positions not yet in the cache. ``src_vocab`` and ``tgt_vocab`` are whole numbers >= 1.
    """

    def __init__(self, config, src_vocab: int, tgt_vocab: int):
        _whole("src_vocab (the source vocabulary's size, the number of token ids)", src_vocab, 1)
        _whole("tgt_vocab (the target vocabulary's size, the number of token ids)", tgt_vocab, 1)
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

    def decode(self, memory, src_mask, tgt, tgt_mask=None, cache: KVCache | None = None):
        past = 0 if cache is None else cache.length
        if tgt_mask is None and not (cache is not None and tgt.shape[1] == 1):
            tgt_mask = causal_mask(tgt.shape[1], device=tgt.device, past=past)
        return self.decoder(self.tgt_embed(tgt, start=past), memory, src_mask, tgt_mask, cache)

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty cache for ``decode``: self- and cross-attention keys and values for each layer."""
        return KVCache(len(self.decoder.layers), cross_attention=True, capacity=capacity)

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)


def make_model(src_vocab: int, tgt_vocab: int, N: int = 2, d_model: int = 512, d_ff: int = 2048,
               h: int = 8, dropout: float = 0.1, verbose: bool = True) -> EncoderDecoder:
    """An ``EncoderDecoder`` with ``N`` layers each side, Xavier-initialised; prints its size.

    ``src_vocab`` and ``tgt_vocab`` (the vocabulary sizes) are whole numbers >= 1; ``d_model`` is
    even (the sinusoidal positions) and divisible by ``h``."""
    from transformers import BertConfig  # here, not at the top: ``import tfcore`` need not load transformers

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


def _check_search(src, src_mask, max_len, beam_size=1, alpha=0.0) -> None:
    """The preconditions greedy_decode and beam_search share, checked before any work."""
    if not (isinstance(src, torch.Tensor) and src.dim() == 2 and src.shape[1] > 0):
        shape = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
        raise ValueError(f"src must be token ids of shape [B, Ls] with Ls >= 1, got {shape}")
    if src_mask is not None and tuple(src_mask.shape) != (src.shape[0], 1, src.shape[1]):
        raise ValueError(f"src_mask must have shape [B, 1, Ls] = {(src.shape[0], 1, src.shape[1])}, "
                         f"got {tuple(src_mask.shape)}: build it as (src != PAD).unsqueeze(1)")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len counts the start symbol too and must be a whole number >= 1, got {max_len!r}")
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be a whole number >= 1 (1 is greedy decoding), got {beam_size!r}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha, the length penalty's exponent, must be a finite number >= 0 "
                         f"(0: no penalty), got {alpha!r}")


@torch.no_grad()
def greedy_decode(model, src, src_mask, max_len: int, start_symbol: int, use_cache: bool = False) -> torch.Tensor:
    """Pick the most probable next token, step by step: ``[B, max_len]``, starting with ``start_symbol``.

    With ``use_cache=True`` each step feeds the decoder only the newest token and reuses the keys
    and values of the earlier ones (chapter 15); the cross-attention's keys and values of the
    memory are computed once. The tokens are the same either way.
    """
    _check_search(src, src_mask, max_len)
    memory = model.encode(src, src_mask)
    ys = torch.full((src.shape[0], 1), start_symbol, dtype=torch.long, device=src.device)
    cache = model.new_cache(capacity=max(max_len - 1, 1)) if use_cache else None  # a capacity is >= 1
    for _ in range(max_len - 1):
        tgt = ys[:, -1:] if use_cache else ys
        log_probs = model.generator(model.decode(memory, src_mask, tgt, cache=cache)[:, -1])
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


def length_penalty(length: torch.Tensor, alpha: float) -> torch.Tensor:
    """GNMT's length penalty (Wu et al., 2016): ``((5 + length) / 6) ** alpha``; 1 when ``alpha == 0``.

    Beam search ranks a sequence by ``log P / length_penalty``. Every extra token lowers log P, so
    plain beam search (``alpha = 0``) favours short sequences; ``alpha > 0`` divides a long
    sequence's (negative) score by more, which offsets that.
    """
    return ((5.0 + length.float()) / 6.0) ** alpha


@torch.no_grad()
def beam_search(model, src, src_mask, max_len: int, start_symbol: int, beam_size: int = 4,
                end_symbol: int | None = None, return_scores: bool = False, alpha: float = 0.0):
    """Keep the ``beam_size`` best partial sequences at every step; return the best one.

    All items of the batch are searched at once: the beams are ``[B, k, t]``. A sequence is ranked
    by its summed log-probability divided by ``length_penalty(its length, alpha)``, the length
    counting the tokens after ``start_symbol`` up to and including ``end_symbol``; ``alpha = 0``
    (the default) ranks by log-probability alone. A beam that has produced ``end_symbol`` is
    finished: it keeps its score and length and stops growing. Returns ``[B, <=max_len]`` token ids
    (shorter items padded with ``end_symbol``), and, with ``return_scores``, each one's summed
    log-probability ``[B]`` (not divided by the penalty).
    """
    _check_search(src, src_mask, max_len, beam_size, alpha)
    B, k, device = src.shape[0], beam_size, src.device
    memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)            # [B*k, Ls, d]
    mask = None if src_mask is None else src_mask.repeat_interleave(k, dim=0)
    beams = torch.full((B, k, 1), start_symbol, dtype=torch.long, device=device)
    log_p = torch.full((B, k), -math.inf, device=device)
    log_p[:, 0] = 0.0                      # one live beam at first; the others can never win
    lengths = torch.zeros(B, k, dtype=torch.long, device=device)
    finished = torch.zeros(B, k, dtype=torch.bool, device=device)
    for _ in range(max_len - 1):
        if finished.all():
            break
        hidden = model.decode(memory, mask, beams.flatten(0, 1))[:, -1]
        next_log_p = model.generator(hidden).view(B, k, -1)                   # [B, k, V]
        vocab = next_log_p.shape[-1]
        if end_symbol is not None and not 0 <= end_symbol < vocab:
            raise ValueError(f"end_symbol {end_symbol} is not a token of the target vocabulary [0, {vocab})")
        if end_symbol is not None:  # a finished beam may only "continue" with end_symbol, at no cost
            next_log_p[finished] = -math.inf
            next_log_p[finished, end_symbol] = 0.0
        candidates = log_p[..., None] + next_log_p                             # [B, k, V]
        new_lengths = (lengths + ~finished)[..., None].expand(-1, -1, vocab)
        rank = candidates / length_penalty(new_lengths, alpha)
        _, flat = rank.flatten(1).topk(k, dim=1)                               # [B, k]
        source_beam, token = flat // vocab, flat % vocab
        log_p = candidates.flatten(1).gather(1, flat)
        lengths = new_lengths.flatten(1).gather(1, flat)
        beams = torch.cat([beams.gather(1, source_beam[..., None].expand(-1, -1, beams.shape[2])),
                           token[..., None]], dim=2)
        finished = finished.gather(1, source_beam) | (token == end_symbol if end_symbol is not None else False)
    results = []
    for best in beams[:, 0]:  # topk sorts: beam 0 ranks first
        if end_symbol is not None and (best == end_symbol).any():
            best = best[: int((best == end_symbol).nonzero()[0]) + 1]
        results.append(best)
    length = max(len(r) for r in results)
    out = torch.full((B, length), end_symbol if end_symbol is not None else 0, dtype=torch.long, device=device)
    for b, r in enumerate(results):
        out[b, : len(r)] = r
    return (out, log_p[:, 0]) if return_scores else out


@torch.no_grad()
def cross_attention_weights(model, src, tgt, src_mask=None) -> torch.Tensor:
    """The cross-attention weights of every decoder layer while the model reads ``tgt``.

    Returns ``[B, layers, heads, Lt, Ls]``: row ``t`` says which source positions target position
    ``t`` drew on when predicting token ``t + 1``. Each layer's ``cross_attention`` is called again
    on the inputs it received (caught by a forward pre-hook), this time asking for its weights.
    """
    calls = []

    def remember(module, args, kwargs):
        calls.append((module, args, kwargs))

    hooks = [layer.cross_attention.register_forward_pre_hook(remember, with_kwargs=True)
             for layer in model.decoder.layers]
    try:
        model(src, tgt, src_mask)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([module(*args, **{**kwargs, "return_weights": True})[1]
                        for module, args, kwargs in calls], dim=1)
