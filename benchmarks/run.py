"""What attention costs: time and memory of attention and of the encoder, measured in one process.

    .venv/bin/python benchmarks/run.py                 # full run (about ten minutes on 2 CPU cores)
    .venv/bin/python benchmarks/run.py --smoke         # seconds: tiny sizes, one repeat, for the test suite
    .venv/bin/python benchmarks/run.py --out DIR       # write results.json and results.png into DIR

The committed results live in ``tfcore/data/benchmark_results.json`` (so that they ship with tfcore
and read the same on Colab: ``tfcore.load_benchmark_results()``), the plot in
``benchmarks/results.png``; ``--out DIR`` writes both into DIR instead.

Every timing is the median of several repeats after warm-up, with ``torch.no_grad()`` and a
fixed thread count. Memory is measured in a fresh subprocess per point (a smoke run measures its
few points one after the other in one fresh subprocess per key): after a warm-up pass,
the peak resident memory is reset (Linux's /proc/self/clear_refs) and we record how far one more
pass raises it above the memory in use (VmHWM - VmRSS), on the CPU, or
``torch.cuda.max_memory_allocated`` on a GPU. Chapter 13 reads the committed results.

What is timed, by key of results.json:

- ``attention``: attention alone, batch 1, 12 heads of 64, by several implementations;
- ``encoder``: the pretrained encoder, tfcore against transformers' ``BertModel``, same weights;
- ``memory``: the rise of the peak memory of one pass;
- ``layers``: one layer of each kind, 768 wide, batch 1: self-attention, an LSTM, a convolution;
- ``additive``: additive (Bahdanau) attention against scaled dot-product attention, one head of 64;
- ``encoder_parts``: one encoder layer of BERT-base's and of the embedded model's sizes, batch 1,
  cut into its projections, its feed-forward, the L x L part of attention, and whole.
- ``allocation`` (CPU, one thread, then two): why ``attention``'s path with weights steps between
  512 and 1024 tokens. tfcore's plain attention, batch 1, 12 heads of 64, against the same
  arithmetic written into buffers allocated once, and against allocating two fresh L x L tensors
  and touching one float per page (the kernel maps and zeroes each page on its first touch): time
  and minor page faults per call (``getrusage``, around the timed calls; medians), every variant
  and length taking turns. ``machine`` records (here ``machine_allocation``) hold the CPU's caches
  (from /sys), the page size and the C library, so a step can be held against them.

Generation (chapter 15), timed with PyTorch's own harness, ``torch.utils.benchmark.Timer``, the
implementations taking turns so that a change in the machine's load hits them alike:

- ``generation``: greedy generation of 256 tokens after a 16-token prompt, batch 1, with the KV
  cache, by ``tfcore.generate`` and by transformers' ``generate`` on the same GPT-2 weights, for a
  model of about 1M parameters and one of about 20M;
- ``cache``: the same 1M model generating up to 512 tokens, with and without the cache;
- ``per_token``: the cost of one new token at a given position: one cached step, against one
  full forward pass over every position so far.

Decoding faster (chapter 21):

- ``speculative``: the book-prose target of chapter 21 (``tfcore.speculative.load_decoding_model``)
  generating 96 greedy tokens after 16 with its KV cache (``tfcore.generate``), against speculative
  greedy decoding with the draft proposing k = 1..6 tokens per round (the same tokens asserted),
  and the draft alone; with each k, the proposals accepted and checked. The target's cached pass
  over 1 to 7 new tokens after 40 cached positions (201 turns, median). Then the target's forward
  pass over 8 blocks of 128 tokens with float32 weights, with tfcore's int8 weights
  (``tfcore.quantization``) and with ``torch.ao.quantization.quantize_dynamic`` (CPU). With
  ``--threads 1`` on the CPU these are timed on the thread's CPU time (``time.thread_time``), so
  that a busy machine's waits are not counted; each row records its ``clock``.

FlashAttention (chapter 17):

- ``flash``: attention by tfcore's plain path (with its L x L weights), tfcore's tiled
  ``tfcore.flash.flash_attention`` (pure PyTorch) and PyTorch's fused SDPA, batch 1, 4 heads of 64:
  forward time and the rise of the peak memory of one pass. CPU: float32, 512 to 8192 tokens.
  CUDA: float32 and float16, up to 32768 tokens, SDPA also forced onto each of its backends
  (``sdpa_kernel(SDPBackend.FLASH_ATTENTION / EFFICIENT_ATTENTION / MATH)``); a case that a backend
  refuses, or that runs out of memory, is recorded with ``refused`` instead of a time.

``--only generation,cache,per_token`` (or ``--only allocation``, ``--only flash``, ``--only speculative``) measures just those
keys and writes them, with their own ``machine`` record, into the existing results.json, leaving the
other keys as they were. ``--devices cuda`` measures on the GPU only and keeps the key's CPU rows;
its machine record is then ``machine_<key>_cuda``. On a GPU machine, chapter 17's rows:

    .venv/bin/python benchmarks/run.py --only flash --devices cuda            # about 2 minutes on an H100
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "tfcore" / "data" / "benchmark_results.json"  # the committed run


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


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


GENERATION_MODELS = {  # name -> GPT-2 sizes: about 1.1M and 21M parameters
    "1M": dict(n_embd=128, n_layer=4, n_head=4, vocab_size=2048),
    "20M": dict(n_embd=384, n_layer=10, n_head=6, vocab_size=8192),
}
SMOKE_MODELS = {"tiny": dict(n_embd=32, n_layer=2, n_head=2, vocab_size=128)}


def _gpt2_pair(sizes: dict, positions: int, device):
    """A random transformers GPT-2 and tfcore's port of it (same weights), in eval mode."""
    import tfcore
    from transformers import GPT2Config, GPT2LMHeadModel

    reference = GPT2LMHeadModel(GPT2Config(n_positions=positions, bos_token_id=None, eos_token_id=None,
                                           **sizes)).to(device).eval()
    with torch.no_grad():  # weights large enough that greedy decoding does not repeat one token
        for name, parameter in reference.named_parameters():
            if parameter.dim() == 2:
                std = {"transformer.wte.weight": 0.3, "transformer.wpe.weight": 1.0}.get(name, parameter.shape[0] ** -0.5)
                parameter.normal_(0, std)  # Conv1D weights are [in, out]: std 1/sqrt(fan-in)
    return reference, tfcore.GPT.from_transformers(reference).to(device)


def _take_turns(statements: dict, repeats: int, env: dict, timer=time.perf_counter) -> dict:
    """Median seconds of each statement, measured in turns with torch.utils.benchmark.Timer (on the
    wall clock, or on ``timer``: ``time.thread_time`` counts only this thread's CPU time)."""
    from torch.utils import benchmark

    timers = {name: benchmark.Timer(stmt, globals=env, num_threads=torch.get_num_threads(), timer=timer)
              for name, stmt in statements.items()}
    for timer in timers.values():  # warm-up
        timer.timeit(1)
    times = {name: [] for name in statements}
    for _ in range(repeats):
        for name, timer in timers.items():
            times[name].append(timer.timeit(1).median)
    return {name: statistics.median(values) for name, values in times.items()}


def generation(models: dict, prompt: int, new_tokens: int, repeats: int, device) -> list[dict]:
    import tfcore

    rows = []
    for name, sizes in models.items():
        reference, ours = _gpt2_pair(sizes, 512, device)
        ids = torch.randint(0, sizes["vocab_size"], (1, prompt), device=device)
        mask = torch.ones_like(ids)  # every prompt token is real (else generate masks those equal to pad_token_id)
        env = {"tfcore": tfcore, "ours": ours, "reference": reference, "ids": ids, "mask": mask, "n": new_tokens}
        tokens = tfcore.generate(ours, ids, new_tokens)
        same = torch.equal(tokens, reference.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0))
        seconds = _take_turns({"tfcore.generate": "tfcore.generate(ours, ids, n)",
                               "transformers generate": "reference.generate(ids, attention_mask=mask, max_new_tokens=n, "
                                                        "min_new_tokens=n, do_sample=False, pad_token_id=0)"},
                              repeats, env)
        parameters = sum(p.numel() for p in ours.parameters())
        distinct = len(set(tokens[0, prompt:].tolist()))  # a varied output gives same_tokens its teeth
        rows += [{"what": what, "model": name, "parameters": parameters, "prompt": prompt, "new_tokens": new_tokens,
                  "seconds": t, "same_tokens": same, "distinct_new_tokens": distinct} for what, t in seconds.items()]
    return rows


def cache_speedup(sizes: dict, name: str, prompt: int, total: int, repeats: int, device) -> list[dict]:
    import tfcore

    _, ours = _gpt2_pair(sizes, total, device)
    ids = torch.randint(0, sizes["vocab_size"], (1, prompt), device=device)
    env = {"tfcore": tfcore, "ours": ours, "ids": ids, "n": total - prompt}
    seconds = _take_turns({"with cache": "tfcore.generate(ours, ids, n)",
                           "without cache": "tfcore.generate(ours, ids, n, use_cache=False)"}, repeats, env)
    return [{"what": what, "model": name, "prompt": prompt, "total_tokens": total, "seconds": t}
            for what, t in seconds.items()]


def per_token(models: dict, positions, repeats: int, device) -> list[dict]:
    """One new token after ``position`` earlier ones: a cached step against a full forward pass."""
    rows = []
    for name, sizes in models.items():
        _, ours = _gpt2_pair(sizes, max(positions) + 1, device)
        for position in positions:
            ids = torch.randint(0, sizes["vocab_size"], (1, position + 1), device=device)
            cache = ours.new_cache()
            with torch.no_grad():
                ours(ids[:, :position], cache=cache)
            saved = [(layer.keys, layer.values) for layer in cache.layers]

            def cached_step(ours=ours, ids=ids, cache=cache, saved=saved):
                with torch.no_grad():
                    ours(ids[:, -1:], cache=cache)
                for layer, (keys, values) in zip(cache.layers, saved):  # back to `position` entries
                    layer.keys, layer.values = keys, values

            def full_pass(ours=ours, ids=ids):
                with torch.no_grad():
                    ours(ids)

            seconds = _take_turns({"with cache": "cached_step()", "without cache": "full_pass()"}, repeats,
                                  {"cached_step": cached_step, "full_pass": full_pass})
            rows += [{"what": what, "model": name, "position": position, "seconds": t}
                     for what, t in seconds.items()]
    return rows


def speculative(ks, new_tokens: int, repeats: int, pass_repeats: int, device) -> list[dict]:
    """Chapter 21: the book-prose target's cached greedy decoding, against speculative greedy decoding
    with the draft proposing k tokens per round (same tokens asserted); the target's cached pass
    over 1..7 new tokens (``pass_repeats`` turns, median); and the target's forward pass with
    float32 and with int8 weights."""
    import copy
    import warnings

    import tfcore
    from tfcore.quantization import quantize_linears
    from tfcore.speculative import decoding_data, load_decoding_model, speculative_generate, truncate_cache

    # On the CPU, this thread's CPU time (run with --threads 1): a busy, shared machine does not
    # count the moments the thread waits (as chapter 20 times its layers)
    clock = {"timer": time.thread_time} if device == "cpu" and torch.get_num_threads() == 1 else {}
    target, draft = (load_decoding_model(name)[0].to(device) for name in ("target", "draft"))
    data = decoding_data()
    ids = data["test"][0][:1, :16].to(device)  # the first 16 tokens of the held-out chapter
    reference = tfcore.generate(target, ids, new_tokens)
    env = {"tfcore": tfcore, "target": target, "draft": draft, "ids": ids, "n": new_tokens,
           "speculative_generate": speculative_generate}
    statements = {"target greedy (cached)": "tfcore.generate(target, ids, n)",
                  "draft greedy (cached)": "tfcore.generate(draft, ids, n)"}
    details = {}
    for k in ks:
        tokens, stats = speculative_generate(target, draft, ids, new_tokens, k=k, return_stats=True)
        assert torch.equal(tokens, reference), f"speculative greedy with k={k} differs from the target's greedy tokens"
        statements[f"speculative, k={k}"] = f"speculative_generate(target, draft, ids, n, k={k})"
        checked = sum(m + (m < p) for m, p in zip(stats["accepted"], stats["proposed"]))
        details[f"speculative, k={k}"] = {"k": k, "same_tokens": True, "accepted": sum(stats["accepted"]),
                                          "proposed": sum(stats["proposed"]), "checked": checked,
                                          "rounds": len(stats["accepted"]), "target_calls": stats["target_calls"],
                                          "draft_calls": stats["draft_calls"]}
    seconds = _take_turns(statements, repeats, env, **clock)
    rows = [{"what": what, "part": "decoding", "new_tokens": new_tokens, "prompt": ids.shape[1], "seconds": t,
             "tokens_per_second": new_tokens / t, **details.get(what, {})} for what, t in seconds.items()]
    # The target's cached pass over 1..7 new tokens after 40 cached positions: what a round of k
    # proposals costs the target (k + 1 tokens) against one plain cached step (1 token).
    context = data["test"][0][:1, :47].to(device)
    cache = target.new_cache(capacity=128)
    with torch.no_grad():
        target(context[:, :40], cache=cache)

    def cached_pass(n):
        with torch.no_grad():
            target(context[:, 40:40 + n], cache=cache)
        truncate_cache(cache, 40)  # back to the 40 cached positions

    passes = {f"target cached pass, {n} new tokens": n for n in range(1, 8)}
    seconds = _take_turns({what: f"cached_pass({n})" for what, n in passes.items()}, pass_repeats,
                          {"cached_pass": cached_pass}, **clock)
    rows += [{"what": what, "part": "pass", "new_tokens": passes[what], "cached": 40, "seconds": t}
             for what, t in seconds.items()]
    batch = data["test"][0][:8].to(device)  # [8, 128]: a forward pass over 8 blocks of the held-out chapter
    small = quantize_linears(copy.deepcopy(target))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in torch 2.13, still present
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        dynamic = copy.deepcopy(target)
        dynamic.blocks = quantize_dynamic(dynamic.blocks, {torch.nn.Linear: per_channel_dynamic_qconfig},
                                          dtype=torch.qint8)
    forward = {"target forward, float32": target, "target forward, int8 weights (tfcore)": small}
    if device == "cpu":  # quantize_dynamic runs on the CPU only
        forward["target forward, int8 dynamic (torch quantize_dynamic)"] = dynamic
    seconds = _take_turns({what: f"models[{what!r}](batch)" for what in forward}, repeats,
                          {"models": forward, "batch": batch}, **clock)
    rows += [{"what": what, "part": "forward", "batch": list(batch.shape), "seconds": t} for what, t in seconds.items()]
    return [row | {"clock": "thread CPU time" if clock else "wall"} for row in rows]


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


def encoder(shapes, repeats, device) -> list[dict]:
    """The pretrained encoder: tfcore against transformers' BertModel, eager and sdpa, same weights."""
    import tfcore
    from transformers import AutoModel

    from tfcore.checkpoint import resolve

    ours = tfcore.TransformerEncoder.from_pretrained().to(device)
    path, _ = resolve(None)
    theirs = {impl: AutoModel.from_pretrained(path, attn_implementation=impl, local_files_only=True).to(device).eval()
              for impl in ("eager", "sdpa")}
    rows = []
    for batch, length in shapes:
        torch.manual_seed(0)
        ids = torch.randint(1000, 30000, (batch, length), device=device)
        mask = torch.ones_like(ids)
        with torch.no_grad():  # same weights, same outputs
            difference = (ours(ids, mask) - theirs["sdpa"](input_ids=ids, attention_mask=mask).last_hidden_state).abs().max()
        cases = {"tfcore encoder": lambda: ours(ids, mask)}
        for impl, model in theirs.items():
            cases[f"BertModel ({impl})"] = lambda model=model: model(input_ids=ids, attention_mask=mask)
        for name, fn in cases.items():
            rows.append({"what": name, "batch": batch, "length": length, "seconds": median_time(fn, repeats),
                         "max_abs_difference_to_sdpa": float(difference)})
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


def _page_faults() -> int:
    """Minor page faults of this process so far: a fresh page touched for the first time is one."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def allocation(lengths, repeats, device, threads: int = 1, heads: int = 12, d: int = 64) -> list[dict]:
    """tfcore's attention with weights (the ``attention`` row "tfcore, with weights"), the same
    arithmetic into buffers allocated once, and the fresh memory of the plain path alone (two
    L x L tensors, one float written per page): seconds and page faults per call, on ``threads``
    threads.
    Every round runs every variant at every length, so that a change in the machine's load hits
    them all alike.

    On the GPU PyTorch's caching allocator keeps freed blocks, so this is measured on the CPU only.
    """
    import tfcore

    if device != "cpu":
        return []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    every_page = resource.getpagesize() // 4  # float32 numbers per page

    def variants(length):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, heads, length, d) for _ in range(3))
        scaled, output = torch.empty_like(q), torch.empty_like(q)
        scores, weights = torch.empty(1, heads, length, length), torch.empty(1, heads, length, length)

        def plain():
            return tfcore.scaled_dot_product_attention(q, k, v)

        def preallocated():  # the same operations as tfcore's plain path, each into its buffer
            torch.div(q, math.sqrt(d), out=scaled)
            torch.matmul(scaled, k.transpose(-2, -1), out=scores)
            torch.softmax(scores, dim=-1, out=weights)
            torch.matmul(weights, v, out=output)
            return output, weights

        def fresh_pages():  # what the plain path allocates, with no arithmetic: one float per page
            a, b = torch.empty(1, heads, length, length), torch.empty(1, heads, length, length)
            a.view(-1)[::every_page].fill_(0.0)
            b.view(-1)[::every_page].fill_(0.0)
            return a, b

        return {"plain (tfcore, with weights)": plain, "preallocated buffers": preallocated,
                "fresh pages only": fresh_pages}

    try:
        with torch.no_grad():
            cases = {length: variants(length) for length in lengths}
            same = {length: all(torch.allclose(x, y, atol=1e-5) for x, y in
                                zip(fns["plain (tfcore, with weights)"](), fns["preallocated buffers"]()))
                    for length, fns in cases.items()}
            for fns in cases.values():
                for fn in fns.values():  # warm-up: the allocator settles
                    fn()
            times = {(length, name): [] for length, fns in cases.items() for name in fns}
            faults = {key: [] for key in times}
            for _ in range(repeats):  # the faults are counted around the very calls that are timed
                for length, fns in cases.items():
                    for name, fn in fns.items():
                        first_fault, start = _page_faults(), time.perf_counter()
                        fn()
                        times[length, name].append(time.perf_counter() - start)
                        faults[length, name].append(_page_faults() - first_fault)
    finally:
        torch.set_num_threads(before)
    return [{"what": name, "length": length, "heads": heads, "head_dim": d, "threads": threads,
             "seconds": statistics.median(times[length, name]),
             "page_faults": int(statistics.median(faults[length, name])),
             "tensor_bytes": heads * length * length * 4, "page_bytes": resource.getpagesize(),
             "same_output": same[length]} for length, name in times]


def _status_bytes(field: str) -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _memory_point(kind: str, length: int, device: str) -> dict:
    """One forward pass in this (fresh) process; the rise of its peak memory."""
    import tfcore

    tfcore.setup(seed=0)
    heads, d = 12, 64
    if kind == "encoder":
        model = tfcore.TransformerEncoder.from_pretrained().to(device)
        ids = torch.randint(1000, 30000, (1, length), device=device)
        run = lambda: model(ids)  # noqa: E731
    else:
        q, k, v = (torch.randn(1, heads, length, d, device=device) for _ in range(3))
        need = kind == "attention, with weights"
        run = lambda: tfcore.scaled_dot_product_attention(q, k, v, need_weights=need)  # noqa: E731
    with torch.no_grad():
        run()  # warm-up: allocator pools and one-time buffers
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            peak = torch.cuda.max_memory_allocated() - base
        else:  # Linux: reset the peak resident memory (VmHWM), then read how far one pass raises it
            Path("/proc/self/clear_refs").write_text("5")
            base = _status_bytes("VmRSS")
            run()
            peak = _status_bytes("VmHWM") - base
    return {"what": kind, "length": length, "peak_bytes": max(int(peak), 0),
            "weights_bytes": heads * length * length * 4}


def _in_fresh_processes(flag: str, points: list[tuple], one_process: bool = False) -> list[dict]:
    """Run this script as ``run.py FLAG POINT...``, a fresh process for each point, and return the
    JSON row that each point prints (its last line of output).

    ``one_process`` (smoke runs only) measures all the points one after the other in one fresh
    process: a smoke run checks that such a process starts, measures and reports, and each start
    costs seconds of imports (about 5 s of CPU time for the encoder's). A full run never sets it.
    """
    rows = []
    for group in [points] if one_process else [[point] for point in points]:
        command = [sys.executable, __file__] + [str(part) for point in group for part in (flag, *point)]
        out = subprocess.run(command, capture_output=True, text=True, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
        rows += [json.loads(line) for line in out.stdout.strip().splitlines()[-len(group):]]
    return rows


def memory(lengths, device, one_process: bool = False) -> list[dict]:
    points = [(kind, length, device) for kind in ("attention, with weights", "attention, no weights", "encoder")
              for length in lengths if not (kind == "encoder" and length > 512)]  # BERT has 512 positions
    return _in_fresh_processes("--memory-point", points, one_process)


FLASH_HEADS, FLASH_HEAD_DIM = 4, 64
FLASH_BLOCKS = {"cpu": 256, "cuda": 256}  # rows of queries and of keys per block of tfcore.flash's loop


def _flash_cases(device: str, dtype: torch.dtype, q, k, v) -> dict:
    """What the ``flash`` key times: name -> (function, SDPA backend or None). On the CPU the three
    implementations; on CUDA also SDPA forced onto each of its backends."""
    from tfcore.flash import flash_attention
    import tfcore

    block = FLASH_BLOCKS[device]
    cases = {"plain (tfcore, with weights)": (lambda: tfcore.scaled_dot_product_attention(q, k, v), None),
             "tiled (tfcore.flash)": (lambda: flash_attention(q, k, v, block_q=block, block_k=block), None),
             "torch sdpa": (lambda: F.scaled_dot_product_attention(q, k, v), None)}
    if device == "cuda":
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
            cases[f"torch sdpa, {backend.name.lower()} backend"] = (
                lambda: F.scaled_dot_product_attention(q, k, v), backend)
    return cases


def _flash_inputs(length: int, device: str, dtype: torch.dtype):
    torch.manual_seed(0)  # drawn on the CPU, then moved: the same numbers on every device
    return tuple(torch.randn(1, FLASH_HEADS, length, FLASH_HEAD_DIM).to(device=device, dtype=dtype) for _ in range(3))


def _flash_memory_point(what: str, length: int) -> dict:
    """CPU, in this (fresh) process: how far one forward pass raises the peak resident memory."""
    q, k, v = _flash_inputs(length, "cpu", torch.float32)
    fn, _ = _flash_cases("cpu", torch.float32, q, k, v)[what]
    with torch.no_grad():
        fn()  # warm-up
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the memory in use now
        base = _status_bytes("VmRSS")
        fn()
        peak = _status_bytes("VmHWM") - base
    return {"peak_bytes": max(int(peak), 0)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _flash_seconds(cases: dict, repeats: int, device: str) -> dict:
    """Median seconds per case (``None`` for a case that raised: its error's first line instead).
    The cases take turns, ``repeats`` rounds after a warm-up round, so that a change in the
    machine's load hits them alike."""
    times, refused = {name: [] for name in cases}, {}
    for round_ in range(repeats + 1):
        for name, fn in cases.items():
            if name in refused:
                continue
            try:
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as error:  # a backend that refuses, or no memory
                refused[name] = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            if name in refused:  # outside the except block: the failed call's tensors are released by now
                if device == "cuda":
                    torch.cuda.empty_cache()
                continue
            if round_:  # round 0 is the warm-up
                times[name].append(time.perf_counter() - start)
    return {name: (None, refused[name]) if name in refused else (statistics.median(times[name]), None) for name in cases}


def _cuda_peak(fn) -> int | None:
    """The rise of ``torch.cuda.max_memory_allocated`` over what was allocated before one call."""
    peak = None
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        pass
    torch.cuda.empty_cache()
    return peak


def flash(lengths, repeats: int, device: str, one_process: bool = False) -> list[dict]:
    """Attention by tfcore's plain path (with its L x L weights), tfcore's tiled ``flash_attention``
    and PyTorch's SDPA, batch 1, FLASH_HEADS heads of FLASH_HEAD_DIM: forward time (median of
    ``repeats`` rounds after a warm-up round, the cases taking turns, ``torch.no_grad()``) and the
    rise of the peak memory of one pass.

    CPU: float32; the memory in a fresh subprocess per point (Linux's /proc, as ``memory``; with
    ``one_process``, a smoke run's, one fresh subprocess per length for all its cases).
    CUDA: float32 and float16, SDPA also forced onto each backend with ``sdpa_kernel``; time with
    ``torch.cuda.synchronize()`` before and after each call, memory as
    ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, above what was
    allocated before. A case that fails (a backend that refuses the dtype or size, or memory that
    runs out) is recorded with ``refused`` (the error's first line) and no time. Every row holds
    its dtype and block size.
    """
    rows = []
    dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.float16]
    for dtype in dtypes:
        for length in lengths:
            q, k, v = _flash_inputs(length, device, dtype)
            cases = {what: fn if backend is None else (lambda fn=fn, backend=backend: _with_backend(fn, backend))
                     for what, (fn, backend) in _flash_cases(device, dtype, q, k, v).items()}
            with torch.no_grad():
                seconds = _flash_seconds(cases, repeats, device)
                on_cpu = []  # rows whose memory a fresh process measures, after the timings of this length
                for what, fn in cases.items():
                    row = {"what": what, "length": length, "batch": 1, "heads": FLASH_HEADS, "head_dim": FLASH_HEAD_DIM,
                           "dtype": str(dtype).removeprefix("torch."),
                           "block": FLASH_BLOCKS[device] if "tiled" in what else None,
                           "weights_bytes": FLASH_HEADS * length * length * q.element_size(),
                           "seconds": seconds[what][0], "refused": seconds[what][1], "peak_bytes": None}
                    if row["refused"] is None and device == "cuda":
                        row["peak_bytes"] = _cuda_peak(fn)
                    elif row["refused"] is None:
                        on_cpu.append(row)
                    rows.append(row)
                points = [(row["what"], length) for row in on_cpu]
                for row, measured in zip(on_cpu, _in_fresh_processes("--flash-memory-point", points, one_process)):
                    row |= measured
            del q, k, v, cases
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _with_backend(fn, backend):
    with sdpa_kernel(backend):
        return fn()


def caches() -> list[dict]:
    """The first CPU's caches, from Linux's /sys (empty elsewhere): level, type, size, shared by which CPUs."""
    found = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        read = lambda name: (index / name).read_text().strip() if (index / name).exists() else None  # noqa: E731
        found.append({"level": read("level"), "type": read("type"), "size": read("size"),
                      "shared_cpu_list": read("shared_cpu_list")})
    return found


def machine(threads: int) -> dict:
    import transformers

    huge_pages = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return {"caches": caches(), "page_bytes": resource.getpagesize(), "libc": " ".join(platform.libc_ver()),
            "transparent_hugepage": huge_pages.read_text().strip() if huge_pages.exists() else None,
            "date": datetime.date.today().isoformat(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": threads, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ((left, right), (low_left, low_right)) = plt.subplots(2, 2, figsize=(12, 9))
    threads = results["machine"]["torch_threads"]
    for name in dict.fromkeys(r["what"] for r in results["attention"]):
        points = [(r["length"], r["seconds"] * 1e3) for r in results["attention"] if r["what"] == name]
        left.loglog(*zip(*points), marker="o", label=name)
    left.set_xlabel("sequence length")
    left.set_ylabel("milliseconds (median)")
    left.set_title(f"Attention, batch 1, 12 heads x 64, {threads} threads")
    left.legend(fontsize=7)
    for name in dict.fromkeys(r["what"] for r in results["memory"]):
        points = [(r["length"], r["peak_bytes"] / 2**20) for r in results["memory"] if r["what"] == name and r["peak_bytes"]]
        if points:
            right.loglog(*zip(*points), marker="o", label=f"peak rise: {name}")
    weights = sorted({(r["length"], r["weights_bytes"] / 2**20) for r in results["memory"]})
    right.loglog(*zip(*weights), "k--", label="size of the weights, 12 x L x L floats")
    right.set_xlabel("sequence length")
    right.set_ylabel("MiB")
    right.set_title("Memory of one forward pass")
    right.legend(fontsize=7)
    for part, style in (("layers", "-"), ("additive", ":")):
        for name in dict.fromkeys(r["what"] for r in results[part]):
            points = [(r["length"], r["seconds"] * 1e3) for r in results[part] if r["what"] == name]
            width = results[part][0]["width"]
            low_left.loglog(*zip(*points), style, marker="o", label=f"{name}, {width} wide")
    low_left.set_xlabel("sequence length")
    low_left.set_ylabel("milliseconds (median)")
    low_left.set_title(f"One layer, batch 1, {threads} threads")
    low_left.legend(fontsize=7)
    for model, style in zip(dict.fromkeys(r["model"] for r in results["encoder_parts"]), ("-", "--")):
        rows = [r for r in results["encoder_parts"] if r["model"] == model]
        for color, name in enumerate(dict.fromkeys(r["what"] for r in rows)):
            points = [(r["length"], r["seconds"] * 1e3) for r in rows if r["what"] == name]
            low_right.loglog(*zip(*points), style, color=f"C{color}", marker="o",
                             label=f"{model} ({rows[0]['hidden']} wide): {name}")
    low_right.set_xlabel("sequence length")
    low_right.set_ylabel("milliseconds (median)")
    low_right.set_title("One encoder layer and its parts, batch 1")
    low_right.legend(fontsize=7)
    for ax in (left, right, low_left, low_right):  # the measured lengths as plain numbers
        ax.set_xticks(sorted({x for line in ax.get_lines() for x in line.get_xdata()}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and repeats, for the tests")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for results.json and results.png (default: the committed files)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", help="comma-separated keys to measure, merged into the existing results.json")
    parser.add_argument("--devices", help="comma-separated devices to measure (default: cpu, and cuda when "
                        "available); with --only, the rows of the other devices under those keys are kept")
    # a full run passes one point per process; a smoke run repeats the flag, its points measured in turn
    parser.add_argument("--memory-point", nargs=3, action="append", metavar=("KIND", "LENGTH", "DEVICE"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--flash-memory-point", nargs=2, action="append", metavar=("WHAT", "LENGTH"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_point:
        for kind, length, device in args.memory_point:
            print(json.dumps(_memory_point(kind, int(length), device)), flush=True)
        return
    if args.flash_memory_point:
        for what, length in args.flash_memory_point:
            print(json.dumps(_flash_memory_point(what, int(length))), flush=True)
        return

    import tfcore

    tfcore.setup(seed=0)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if args.devices:
        unknown_devices = set(args.devices.split(",")) - set(devices)
        if unknown_devices:
            parser.error(f"devices {sorted(unknown_devices)} are not available here; choose from {devices}")
        devices = args.devices.split(",")
    lengths = [16, 32] if args.smoke else [64, 128, 256, 512, 1024, 2048]
    repeats = 1 if args.smoke else 7  # a smoke run checks that every row is written, not its median
    shapes = [(1, 16)] if args.smoke else [(8, 128), (1, 512)]
    part_lengths = [16, 32] if args.smoke else [128, 512, 1024, 2048, 4096]
    additive_lengths = [L for L in lengths if L <= 1024]  # its [1, L, L, 64] intermediate: 256 MiB at 1024
    models = SMOKE_MODELS if args.smoke else GENERATION_MODELS
    prompt, new_tokens, total = (4, 8, 16) if args.smoke else (16, 256, 512)
    token_positions = [4, 12] if args.smoke else [16, 64, 128, 256, 384, 511]
    smallest = next(iter(models))
    measures = {
        "attention": lambda device: attention_alone(lengths, repeats, device),
        "encoder": lambda device: encoder(shapes, repeats, device),
        # a fresh process per point; a smoke run measures one length, its three points in one fresh process
        "memory": lambda device: memory(lengths[:1] if args.smoke else lengths, device, one_process=args.smoke),
        "layers": lambda device: layers(lengths, repeats, device),
        "additive": lambda device: additive(additive_lengths, repeats, device),
        "encoder_parts": lambda device: encoder_parts(part_lengths, repeats, device),
        "generation": lambda device: generation(models, prompt, new_tokens, 1 if args.smoke else 7, device),
        "cache": lambda device: cache_speedup(models[smallest], smallest, prompt, total, 1 if args.smoke else 3, device),
        "per_token": lambda device: per_token(models, token_positions, 1 if args.smoke else 15, device),
        "allocation": lambda device: [row for threads in ([1] if args.smoke else [1, 2]) for row in allocation(
            [16, 32] if args.smoke else [256, 512, 1024, 2048], 1 if args.smoke else 25, device, threads)],
        "speculative": lambda device: speculative([1, 3] if args.smoke else [1, 2, 3, 4, 5, 6], 16 if args.smoke else 96,
                                                  1 if args.smoke else 9, 1 if args.smoke else 201, device),
        "flash": lambda device: flash([32] if args.smoke else [512, 1024, 2048, 4096, 8192] + (
            [16384, 32768] if device == "cuda" else []), 1 if args.smoke else 5, device, one_process=args.smoke),
    }
    keys = list(measures) if not args.only else args.only.split(",")
    unknown = set(keys) - set(measures)
    if unknown:
        parser.error(f"unknown keys {sorted(unknown)}; choose from {sorted(measures)}")
    json_path, png_path = (RESULTS, HERE / "results.png") if args.out is None else (
        args.out / "results.json", args.out / "results.png")
    if args.only:
        results = json.loads(json_path.read_text())
        # measuring on some devices only (--devices cuda): keep the other devices' rows, and record
        # this machine under its own name (machine_flash_cuda), beside the one that measured the rest
        suffix = "" if args.devices is None or "cpu" in devices else "_" + "_".join(devices)
        for key in keys:
            results[key] = [r for r in results.get(key, []) if args.devices and r["device"] not in devices]
            results[f"machine_{key}{suffix}"] = machine(args.threads)
    else:
        # a full run: one machine record, also under each key's own name, which the chapters read
        # (chapter 13 reads machine_allocation and machine_flash, written alone by --only runs)
        record = machine(args.threads)
        results = {"machine": record} | {f"machine_{key}": record for key in keys} | {key: [] for key in keys}
    for device in devices:
        for key in keys:
            results[key] += [r | {"device": device} for r in measures[key](device)]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, png_path)
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
