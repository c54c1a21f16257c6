"""Attention alone and the layers around it (chapter 13; chapter 4 reads ``attention``).

Keys:

- ``attention``: attention alone, batch 1, 12 heads of 64, by several implementations (kernels on
  q, k, v and whole multi-head modules on x, chapter 4's per-head version among them);
- ``layers``: one layer of each kind, 768 wide, batch 1: self-attention, an LSTM, a convolution;
- ``additive``: additive (Bahdanau) attention against scaled dot-product attention, one head of 64
  (``AdditiveAttention`` is chapter 13's class, which tests/test_benchmarks.py compares);
- ``encoder_parts``: one encoder layer of BERT-base's and of the embedded model's sizes, batch 1,
  cut into its projections, its feed-forward, the L x L part of attention, and whole.

Every time is ``median_time``'s: the median of several calls after warm-up, ``torch.no_grad()``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .common import LENGTHS, REPEATS, SMOKE_LENGTHS, SMOKE_REPEATS, median_time


class PerHeadAttention(nn.Module):
    """Chapter 4's teaching version: one AttentionHead module per head, concatenated."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        import tfcore

        self.heads = nn.ModuleList(tfcore.AttentionHead(hidden, hidden // heads) for _ in range(heads))
        self.output_linear = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.output_linear(torch.cat([head(x) for head in self.heads], dim=-1))


class AdditiveAttention(nn.Module):
    """Additive attention (Bahdanau et al.), the same code as chapter 13's.

    The score of a query and a key is ``vᵀ tanh(W_q query + W_k key)``: one small network applied
    to every (query, key) pair. ``forward(query [B, Lq, query_dim], key [B, Lk, key_dim],
    value [B, Lk, dv], mask)`` -> ``(output [B, Lq, dv], weights [B, Lq, Lk])``, with tfcore's
    masks (1/True = attend) and all-zero weights for a query whose keys are all blocked.
    """

    def __init__(self, query_dim: int, key_dim: int, attention_dim: int):
        super().__init__()
        self.w_q = nn.Linear(query_dim, attention_dim, bias=False)
        self.w_k = nn.Linear(key_dim, attention_dim, bias=False)
        self.v = nn.Linear(attention_dim, 1, bias=False)

    def forward(self, query, key, value, mask=None):
        if query.dim() != 3 or key.dim() != 3 or query.shape[-1] != self.w_q.in_features \
                or key.shape[-1] != self.w_k.in_features or key.shape[:2] != value.shape[:2] \
                or query.shape[0] != key.shape[0]:
            raise ValueError(f"expected query [B, Lq, {self.w_q.in_features}], key [B, Lk, {self.w_k.in_features}] "
                             f"and value [B, Lk, dv], got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        # [B, Lq, 1, d_a] + [B, 1, Lk, d_a] -> [B, Lq, Lk, d_a]: a vector of d_a numbers for every pair
        pairs = torch.tanh(self.w_q(query).unsqueeze(2) + self.w_k(key).unsqueeze(1))
        scores = self.v(pairs).squeeze(-1)  # [B, Lq, Lk]
        if mask is None:
            weights = scores.softmax(dim=-1)
        else:  # as tfcore does: the most negative float, not -inf, then zeros for a fully blocked query
            allowed = mask.to(torch.bool)
            weights = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min).softmax(dim=-1)
            weights = weights.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
        return weights @ value, weights


def attention_alone(lengths, repeats, device) -> list[dict]:
    """Batch 1, 12 heads of 64: the kernels on q, k, v, and whole multi-head modules on x."""
    import tfcore
    from transformers import BertConfig

    heads, d = 12, 64
    rows = []
    for length in lengths:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, heads, length, d, device=device) for _ in range(3))
        x = torch.randn(1, length, heads * d, device=device)
        config = BertConfig(hidden_size=heads * d, num_attention_heads=heads, attention_probs_dropout_prob=0.0)
        fused = tfcore.MultiHeadAttention(config).to(device).eval()
        per_head = PerHeadAttention(heads * d, heads).to(device).eval()
        torch_mha = nn.MultiheadAttention(heads * d, heads, batch_first=True).to(device).eval()

        def sdpa_math():
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v)

        cases = {
            "tfcore, no weights": lambda: tfcore.scaled_dot_product_attention(q, k, v, need_weights=False),
            "tfcore, with weights": lambda: tfcore.scaled_dot_product_attention(q, k, v),
            "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
            "torch sdpa, math backend": sdpa_math,
            "module: per-head (chapter 4)": lambda: per_head(x),
            "module: tfcore fused": lambda: fused(x),
            "module: tfcore fused, with weights": lambda: fused(x, return_weights=True),
            "module: torch MultiheadAttention": lambda: torch_mha(x, x, x, need_weights=False),
        }
        for name, fn in cases.items():
            rows.append({"what": name, "length": length, "seconds": median_time(fn, repeats)})
    return rows


def layers(lengths, repeats, device, width: int = 768, heads: int = 12) -> list[dict]:
    """One layer of each kind, ``width`` wide, batch 1, on ``[1, L, width]``: self-attention (tfcore's
    fused module, no weights), an LSTM, and a convolution of kernel 3 that keeps the length."""
    import tfcore
    from transformers import BertConfig

    config = BertConfig(hidden_size=width, num_attention_heads=heads, attention_probs_dropout_prob=0.0)
    attention = tfcore.MultiHeadAttention(config).to(device).eval()
    lstm = nn.LSTM(width, width, batch_first=True).to(device).eval()
    conv = nn.Conv1d(width, width, kernel_size=3, padding=1).to(device).eval()
    rows = []
    for length in lengths:
        torch.manual_seed(0)
        x = torch.randn(1, length, width, device=device)
        cases = {"self-attention": lambda: attention(x),
                 "LSTM": lambda: lstm(x),
                 "Conv1d, kernel 3": lambda: conv(x.transpose(1, 2)).transpose(1, 2)}  # Conv1d wants [B, width, L]
        for name, fn in cases.items():
            rows.append({"what": name, "length": length, "width": width, "seconds": median_time(fn, repeats)})
    return rows


def additive(lengths, repeats, device, d: int = 64) -> list[dict]:
    """One head: additive attention (attention width d) against scaled dot-product attention with its
    weights (tfcore's plain path, as additive attention forms its weights too), on ``[1, L, d]``."""
    import tfcore

    module = AdditiveAttention(d, d, d).to(device).eval()
    rows = []
    for length in lengths:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, length, d, device=device) for _ in range(3))
        cases = {"additive attention": lambda: module(q, k, v),
                 "scaled dot-product attention": lambda: tfcore.scaled_dot_product_attention(q, k, v)}
        for name, fn in cases.items():
            rows.append({"what": name, "length": length, "width": d, "attention_dim": d,
                         "seconds": median_time(fn, repeats)})
    return rows


def encoder_parts(lengths, repeats, device) -> list[dict]:
    """One encoder layer, batch 1, of two sizes (BERT-base's, the embedded model's), cut into parts:
    the four projections (query, key, value, output), the feed-forward, the L x L part of attention
    (scores, softmax, weights times values: the fused kernel, as the encoder uses it), and the whole
    layer (with its layer norms and residuals), each on its own input of the right shape."""
    import tfcore
    from transformers import BertConfig

    sizes = {"bert-base": BertConfig(), "embedded": tfcore.load_config()}
    rows = []
    for model, config in sizes.items():
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
        layer = tfcore.TransformerEncoderLayer(config).to(device).eval()
        attention, hidden, heads = layer.attention, config.hidden_size, config.num_attention_heads
        for length in lengths:
            torch.manual_seed(0)
            x = torch.randn(1, length, hidden, device=device)
            q, k, v = (torch.randn(1, heads, length, hidden // heads, device=device) for _ in range(3))
            cases = {"projections": lambda: [linear(x) for linear in (attention.query, attention.key, attention.value,
                                                                       attention.output_linear)],
                     "feed-forward": lambda: layer.feed_forward(x),
                     "attention, L x L part": lambda: tfcore.scaled_dot_product_attention(q, k, v, need_weights=False),
                     "whole layer": lambda: layer(x)}
            for name, fn in cases.items():
                rows.append({"what": name, "model": model, "hidden": hidden, "intermediate": config.intermediate_size,
                             "heads": heads, "length": length, "seconds": median_time(fn, repeats)})
    return rows


def measures(args: argparse.Namespace) -> dict:
    """This module's keys: key -> function(device) -> rows, with the sizes of a full or a smoke run."""
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    repeats = SMOKE_REPEATS if args.smoke else REPEATS
    part_lengths = [16, 32] if args.smoke else [128, 512, 1024, 2048, 4096]
    additive_lengths = [L for L in lengths if L <= 1024]  # its [1, L, L, 64] intermediate: 256 MiB at 1024
    return {
        "attention": lambda device: attention_alone(lengths, repeats, device),
        "layers": lambda device: layers(lengths, repeats, device),
        "additive": lambda device: additive(additive_lengths, repeats, device),
        "encoder_parts": lambda device: encoder_parts(part_lengths, repeats, device),
    }
