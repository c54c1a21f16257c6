"""The cost of a token, measured: greedy decoding against the memory-bandwidth bound, where a
decoding step's time goes, and batched decoding's throughput (chapter 23). Key ``decoding``.

A decoding step of batch 1 reads every weight once and does 2 FLOPs per weight: far too little
arithmetic per byte for the multiply units to be the limit (``tfcore.cost``, ``benchmarks/roofline.py``).
Its bound is then the weights' bytes over the memory's read bandwidth, which this run measures
itself (``benchmarks.peaks.read_bytes_per_second``, a sum over 256 MiB) at the same thread count,
just before the rows that use it.

Models: ``benchmarks.generation.GENERATION_MODELS`` (random GPT-2 weights, the same pair of
transformers ``GPT2LMHeadModel`` and ``tfcore.GPT``); float32. Times: the median wall-clock time
of ``repeats`` whole calls, the variants taking turns (``_take_turns``), under ``torch.no_grad()``.

Rows, by ``part`` (every row also has ``device``, from run.py, and ``dtype``, ``threads``, ``clock``):

- ``"single"``: greedy decoding of ``new_tokens`` (256) after a ``prompt`` (16 tokens), batch 1,
  at 1 thread and at the run's thread count (CUDA: the run's count only). ``what``:
  ``"tfcore.generate"`` (KV cache), ``"transformers generate"`` (``do_sample=False``,
  ``min_new_tokens = max_new_tokens``), ``"static cache"`` (``tfcore.static_decoding.static_generate``,
  eager; on the CPU in float32 with oneDNN-reordered weights), and on CUDA ``"static cache, CUDA graph"``
  (each step a replay of one recorded step). Fields: ``model``, ``parameters``, ``batch`` (1),
  ``prompt``, ``new_tokens``, ``repeats``; ``seconds`` (one whole call: prompt, every step and,
  for the static cache, building the decoder), ``seconds_per_token`` (seconds / new_tokens),
  ``tokens_per_second`` (new_tokens / seconds); ``weight_bytes`` (bytes of the weights one step
  reads: ``tfcore.cost.forward_cost(config, batch=1, new=1, ...)["weight_bytes"]``: every linear
  layer, norm and bias, the output layer once, one row of each embedding), ``read_bytes_per_second``
  (this run's measured read bandwidth at ``threads``), ``bound_seconds_per_token`` (weight_bytes /
  read_bytes_per_second: no step can be faster), ``fraction_of_bound`` (bound_seconds_per_token /
  seconds_per_token: 1 = at the bound); ``same_tokens`` (bool: the tokens equal tfcore.generate's;
  for tfcore.generate, transformers'), ``distinct_new_tokens`` (how many different new tokens:
  a varied output gives same_tokens its teeth).
- ``"kernel"`` (CPU): one linear layer of the 20M model at one row (a decoding step's
  matrix-vector product), its weight read from memory (copies cycled, 128 MiB in all, 4 times the
  last-level cache). ``what``: ``"F.linear"`` (tfcore's ``nn.Linear``, weight ``[out, in]``),
  ``"addmm, weight stored [in, out]"`` (transformers' GPT-2 ``Conv1D``: ``torch.addmm(bias, x, weight)``)
  or ``"oneDNN packed"`` (``tfcore.static_decoding.PackedLinear``); ``layer`` (``"query"``,
  ``"query, key and value (fused)"``, ``"attention output"``, ``"feed-forward up"``,
  ``"feed-forward down"``, ``"output layer"``, and ``"8 x 8 (the cost of a call)"``, a weight so
  small that the time is the call's fixed cost), ``out_features``, ``in_features``, ``weight_bytes``,
  ``seconds`` (median per product), ``bytes_per_second`` (weight_bytes / seconds), ``repeats``.
- ``"profile"`` (CPU): where one greedy call's time goes, by PyTorch operation
  (``torch.profiler``, self CPU time; the profiler's own cost inflates small operations), for the
  20M model at the run's thread count. ``what``: ``"tfcore.generate"`` or ``"static cache"``;
  ``op`` (an ATen operation, ``"other ops"`` for those under 1% summed, ``"all ops"`` for the
  total), ``self_seconds_per_token``, ``calls_per_token``, ``share`` (of ``"all ops"``),
  ``new_tokens``; the ``"all ops"`` row also has ``wall_seconds_per_token`` (the same call without
  the profiler, one run).
- ``"batched"``: ``tfcore.generate(model, ids, new_tokens, attention_mask=mask)`` on the 20M model,
  ``batch`` left-padded prompts of ``prompt_lengths`` (4 to 16 tokens; row 0 unpadded) padded to
  ``prompt`` (16), ``new_tokens`` (64) each, at the run's thread count. ``what``:
  ``"tfcore.generate, left-padded"``; ``seconds`` (one call, median of ``repeats``),
  ``seconds_per_step`` (seconds / new_tokens), ``tokens_per_second`` (batch x new_tokens / seconds),
  ``speedup_over_batch_1`` (tokens_per_second / batch 1's), ``same_tokens`` (bool: every row's
  new tokens equal decoding that prompt alone, unpadded, with tfcore.generate),
  ``weight_bytes``, ``read_bytes_per_second``, ``bound_seconds_per_token`` (weight_bytes /
  read_bytes_per_second / batch: the weights' share per token once a step serves ``batch`` rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import _sync, _take_turns
from .generation import GENERATION_MODELS, SMOKE_MODELS, _gpt2_pair
from .peaks import read_bytes_per_second

BATCHES, SMOKE_BATCHES = [1, 2, 4, 8, 16, 32, 64], [1, 2]
KERNEL_BYTES, SMOKE_KERNEL_BYTES = 128 * 2**20, 2**20


class _Threads:
    """``torch.set_num_threads(threads)`` inside the block, the previous count restored after it."""

    def __init__(self, threads: int):
        self.threads = threads

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.threads)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def _weight_bytes(model) -> int:
    """Bytes of the weights one decoding step of batch 1 reads (``tfcore.cost``'s count)."""
    from tfcore.cost import forward_cost

    dtype = model.token_embeddings.weight.dtype
    return forward_cost(model.config, batch=1, new=1, cached=0, dtype=dtype)["weight_bytes"]


def _bandwidth(device: str, threads: int, smoke: bool) -> float:
    return read_bytes_per_second(device, threads, **({"nbytes": 2**20, "repeats": 1} if smoke else {}))


def single(models: dict, prompt: int, new_tokens: int, repeats: int, device: str, thread_counts,
           smoke: bool = False) -> list[dict]:
    """The ``"single"`` rows (see the module's docstring)."""
    import tfcore
    from tfcore.static_decoding import static_generate

    rows = []
    pairs = {name: _gpt2_pair(sizes, 512, device) for name, sizes in models.items()}
    for threads in thread_counts:
        with _Threads(threads):
            for name, sizes in models.items():
                reference, ours = pairs[name]
                bandwidth = _bandwidth(device, threads, smoke)  # just before this model's rows
                generator = torch.Generator().manual_seed(0)  # drawn on the CPU (PITFALLS: CUDA draws differ)
                ids = torch.randint(0, sizes["vocab_size"], (1, prompt), generator=generator).to(device)
                mask = torch.ones_like(ids)  # all real (else generate masks the tokens equal to pad_token_id)
                env = {"tfcore": tfcore, "static_generate": static_generate, "ours": ours, "reference": reference,
                       "ids": ids, "mask": mask, "n": new_tokens}
                statements = {"tfcore.generate": "tfcore.generate(ours, ids, n)",
                              "transformers generate": "reference.generate(ids, attention_mask=mask, max_new_tokens=n, "
                                                       "min_new_tokens=n, do_sample=False, pad_token_id=0)",
                              "static cache": "static_generate(ours, ids, n)"}
                if device == "cuda":
                    statements["static cache, CUDA graph"] = "static_generate(ours, ids, n, graph='cuda-graph')"
                tokens = {what: eval(statement, env) for what, statement in statements.items()}
                seconds = _take_turns(statements, repeats, env)
                weight_bytes = _weight_bytes(ours)
                bound = weight_bytes / bandwidth
                distinct = len(set(tokens["tfcore.generate"][0, prompt:].tolist()))
                for what, t in seconds.items():
                    other = "transformers generate" if what == "tfcore.generate" else "tfcore.generate"
                    rows.append({"part": "single", "what": what, "model": name,
                                 "parameters": sum(p.numel() for p in ours.parameters()), "threads": threads,
                                 "batch": 1, "prompt": prompt, "new_tokens": new_tokens, "repeats": repeats,
                                 "seconds": t, "seconds_per_token": t / new_tokens, "tokens_per_second": new_tokens / t,
                                 "weight_bytes": weight_bytes, "read_bytes_per_second": bandwidth,
                                 "bound_seconds_per_token": bound, "fraction_of_bound": bound / (t / new_tokens),
                                 "same_tokens": torch.equal(tokens[what], tokens[other]),
                                 "distinct_new_tokens": distinct, "dtype": "float32", "clock": "wall"})
    return rows


def _per_call_seconds(fn, copies: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds of ``fn(i)`` for i over ``copies`` weight copies."""
    for i in range(copies):  # warm-up
        fn(i)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(copies):
            fn(i)
        times.append((time.perf_counter() - start) / copies)
    return statistics.median(times)


def kernels(sizes: dict, repeats: int, thread_counts, total_bytes: int) -> list[dict]:
    """The ``"kernel"`` rows: each linear layer of a step, one row, F.linear against oneDNN packed."""
    import torch.nn.functional as F

    from tfcore.static_decoding import PackedLinear

    hidden, vocab = sizes["n_embd"], sizes["vocab_size"]
    layers = {"query": (hidden, hidden), "query, key and value (fused)": (3 * hidden, hidden),
              "attention output": (hidden, hidden), "feed-forward up": (4 * hidden, hidden),
              "feed-forward down": (hidden, 4 * hidden), "output layer": (vocab, hidden),
              "8 x 8 (the cost of a call)": (8, 8)}
    generator = torch.Generator().manual_seed(0)
    rows = []
    for layer, (out_features, in_features) in layers.items():
        weight_bytes = out_features * in_features * 4
        # together far larger than the last-level cache (but for 8 x 8, whose time is the call's own)
        copies = min(max(4, total_bytes // weight_bytes), 1024)
        weights = [torch.randn(out_features, in_features, generator=generator) for _ in range(copies)]
        bias = torch.randn(out_features, generator=generator)
        packed = [PackedLinear(w, bias) for w in weights]
        x = torch.randn(1, 1, in_features, generator=generator)
        stored_in_out = [w.t().contiguous() for w in weights]  # transformers' Conv1D keeps [in, out]
        variants = {"F.linear": lambda i, x=x, w=weights, b=bias: F.linear(x, w[i], b),
                    "addmm, weight stored [in, out]":
                        lambda i, x=x, w=stored_in_out, b=bias: torch.addmm(b, x[0], w[i])}
        if packed[0].packed:
            variants["oneDNN packed"] = lambda i, x=x, linears=packed: linears[i](x)
        for threads in thread_counts:
            with _Threads(threads), torch.no_grad():
                times = {what: [] for what in variants}
                for _ in range(repeats):  # the variants take turns
                    for what, fn in variants.items():
                        times[what].append(_per_call_seconds(fn, copies, 1))
            rows += [{"part": "kernel", "what": what, "layer": layer, "out_features": out_features,
                      "in_features": in_features, "threads": threads, "weight_bytes": weight_bytes,
                      "seconds": statistics.median(t), "bytes_per_second": weight_bytes / statistics.median(t),
                      "repeats": repeats, "dtype": "float32", "clock": "wall"} for what, t in times.items()]
    return rows


def profile(sizes: dict, name: str, prompt: int, new_tokens: int, threads: int) -> list[dict]:
    """The ``"profile"`` rows: self CPU time by operation of one greedy call, per new token."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    import tfcore
    from tfcore.static_decoding import static_generate

    _, ours = _gpt2_pair(sizes, 512, "cpu")
    ids = torch.randint(0, sizes["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(0))
    calls = {"tfcore.generate": lambda: tfcore.generate(ours, ids, new_tokens),
             "static cache": lambda: static_generate(ours, ids, new_tokens)}
    rows = []
    with _Threads(threads):
        for what, call in calls.items():
            call()  # warm-up
            start = time.perf_counter()
            call()
            wall = (time.perf_counter() - start) / new_tokens
            with profiler(activities=[ProfilerActivity.CPU]) as prof:
                call()
            events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
            total = sum(e.self_cpu_time_total for e in events) * 1e-6  # the profiler counts microseconds
            base = {"part": "profile", "what": what, "model": name, "threads": threads, "prompt": prompt,
                    "new_tokens": new_tokens, "dtype": "float32", "clock": "profiler"}
            rows.append(base | {"op": "all ops", "self_seconds_per_token": total / new_tokens,
                                "calls_per_token": sum(e.count for e in events) / new_tokens, "share": 1.0,
                                "wall_seconds_per_token": wall})
            other = {"seconds": 0.0, "count": 0}
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total):
                seconds = e.self_cpu_time_total * 1e-6
                if seconds / total < 0.01:
                    other["seconds"] += seconds
                    other["count"] += e.count
                    continue
                rows.append(base | {"op": e.key, "self_seconds_per_token": seconds / new_tokens,
                                    "calls_per_token": e.count / new_tokens, "share": seconds / total})
            rows.append(base | {"op": "other ops", "self_seconds_per_token": other["seconds"] / new_tokens,
                                "calls_per_token": other["count"] / new_tokens, "share": other["seconds"] / total})
    return rows


def _left_padded(batch: int, padded: int, vocab: int, device: str):
    """``batch`` prompts of 4 to ``padded`` tokens (row 0 the longest), left-padded with id 0:
    ``(ids [batch, padded], mask [batch, padded], lengths)``."""
    generator = torch.Generator().manual_seed(1)
    lengths = [padded] + [4 + (5 * i) % (padded - 3) for i in range(1, batch)]
    ids = torch.zeros(batch, padded, dtype=torch.long)
    mask = torch.zeros(batch, padded, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, padded - length:] = torch.randint(1, vocab, (length,), generator=generator)
        mask[row, padded - length:] = 1
    return ids.to(device), mask.to(device), lengths


def batched(sizes: dict, name: str, batches, padded: int, new_tokens: int, repeats: int, device: str,
            smoke: bool = False) -> list[dict]:
    """The ``"batched"`` rows (see the module's docstring)."""
    import tfcore

    threads = torch.get_num_threads()
    _, ours = _gpt2_pair(sizes, 512, device)
    ids, mask, lengths = _left_padded(max(batches), padded, sizes["vocab_size"], device)
    # each prompt alone, unpadded: the tokens every batch's rows must equal
    alone = [tfcore.generate(ours, ids[row:row + 1, padded - length:], new_tokens)[0, length:]
             for row, length in enumerate(lengths)]
    bandwidth = _bandwidth(device, threads, smoke)
    weight_bytes = _weight_bytes(ours)
    env = {"tfcore": tfcore, "ours": ours, "n": new_tokens}
    statements, same = {}, {}
    for batch in batches:
        env[f"ids_{batch}"], env[f"mask_{batch}"] = ids[:batch], mask[:batch]
        out = tfcore.generate(ours, ids[:batch], new_tokens, attention_mask=mask[:batch])
        same[batch] = all(torch.equal(out[row, padded:], alone[row]) for row in range(batch))
        statements[batch] = f"tfcore.generate(ours, ids_{batch}, n, attention_mask=mask_{batch})"
    seconds = _take_turns(statements, repeats, env)
    rows = []
    for batch, t in seconds.items():
        rows.append({"part": "batched", "what": "tfcore.generate, left-padded", "model": name, "threads": threads,
                     "batch": batch, "prompt": padded, "prompt_lengths": lengths[:batch], "new_tokens": new_tokens,
                     "repeats": repeats, "seconds": t, "seconds_per_step": t / new_tokens,
                     "tokens_per_second": batch * new_tokens / t,
                     "speedup_over_batch_1": (batch * new_tokens / t) / (batches[0] * new_tokens / seconds[batches[0]]),
                     "same_tokens": same[batch], "weight_bytes": weight_bytes, "read_bytes_per_second": bandwidth,
                     "bound_seconds_per_token": weight_bytes / bandwidth / batch, "dtype": "float32", "clock": "wall"})
    return rows


def decoding(args: argparse.Namespace, device: str) -> list[dict]:
    """Every row of the key on ``device``: single, kernel and profile (CPU), batched."""
    smoke = args.smoke
    models = SMOKE_MODELS if smoke else GENERATION_MODELS
    largest = list(models)[-1]
    prompt, new_tokens = (4, 8) if smoke else (16, 256)
    thread_counts = list(dict.fromkeys([1, args.threads])) if device == "cpu" else [args.threads]
    rows = single(models, prompt, new_tokens, 1 if smoke else 5, device, thread_counts, smoke)
    if device == "cpu":
        rows += kernels(models[largest], 1 if smoke else 5, thread_counts,
                        SMOKE_KERNEL_BYTES if smoke else KERNEL_BYTES)
        rows += profile(models[largest], largest, prompt, new_tokens, args.threads)
    rows += batched(models[largest], largest, SMOKE_BATCHES if smoke else BATCHES, 8 if smoke else 16,
                    4 if smoke else 64, 1 if smoke else 3, device, smoke)
    _sync(device)
    return rows


def measures(args: argparse.Namespace) -> dict:
    """This module's key: ``decoding`` -> function(device) -> rows, with a full or a smoke run's sizes."""
    return {"decoding": lambda device: decoding(args, device)}
