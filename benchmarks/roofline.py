"""A decoder's passes held against the roofline: counted FLOPs and bytes, measured seconds, and the
bound of the same run's peaks (chapter 23).

Key ``roofline``. The model is the benchmark's 20M GPT (``GENERATION_MODELS["20M"]``: GPT-2's
wiring, 384 wide, 10 layers, 6 heads, vocabulary 8192; ``tfcore.GPT`` with random weights, float32),
run with ``torch.no_grad()``. At the start the key measures this run's peaks at its thread count
with ``benchmarks/peaks.py`` (the product of two 2048 x 2048 matrices in each dtype, 512 x 512 for
float16 on the CPU, median of 3; a sum over 256 MiB, median of 5); every row holds its pass
against them. FLOPs and bytes come from ``tfcore.cost.forward_cost``: every operation reads its
inputs and writes its output once, attention fused as tfcore runs it (its scores never stored).

Rows, by ``kind``:

- ``"peak"``: the peaks the bounds use: ``what`` ("matmul" or "read"), ``dtype``,
  ``flops_per_second`` or ``bytes_per_second``, ``threads``.
- ``"prefill"``: a pass over ``batch`` rows of ``new`` tokens with no cache (``cached`` 0): batch 1
  and 8 at 1, 4, 16, 64, 128, 256 and 512 tokens, batch 64 up to 256 tokens. Left out: the lengths
  between, and batch 64 at 512 tokens (1.6 TFLOP a pass: about 17 s at the 95 GFLOP/s that a
  busy 2-core machine gave in development, 7.5 s at the committed run's 218, with its warm-up a
  large share of the key's time). The repeats fall
  from 15 to 1 as a pass's FLOPs at the peak rate grow past 0.02, 0.3 and 1.5 seconds.
- ``"overhead"``: a GPT with the same operations (10 layers, 6 heads) at tiny sizes (48 wide,
  vocabulary 64), one cached step after 16 positions, batch 1: what a pass costs when its FLOPs
  and bytes are next to nothing (the per-operation cost of running the operations one by one).
- ``"decode"``: one cached step, one new token per row after ``cached`` positions (16, 128, 511),
  batch 1, 8 and 64; the cache has room for one more position and is cut back after each step.
- ``"intervention"``: at a decode point (batch 1, 128 cached) and a prefill point (batch 1, 128
  tokens), (i) the weights' bytes halved, or quartered: the whole model in bfloat16 or float16,
  or tfcore's int8 weights (``tfcore.quantization.quantize_linears``, float32 activations);
  (ii) the FLOPs doubled at nearly the same weight bytes: batch 2 at the decode point, 256 tokens
  at the prefill point. ``baseline`` names the float32 row at the same point, ``time_ratio``,
  ``flops_ratio`` and ``bytes_ratio`` are this row's over the baseline's: the resource whose
  ratio the time follows is the one that binds. The two float32 baselines are repeated here with
  ``intervention`` "baseline" (ratios 1); the others' ``intervention`` is "fewer weight bytes" or
  "more FLOPs". bfloat16 and float16 also change the peak FLOP/s (each row's bound uses its own).
- ``"technique"``: the book's techniques as measured pairs, ``technique`` naming the pair and
  ``variant`` the side: ``"kv cache"`` (a cached step at 511 cached positions against the full
  recompute of the 512 positions, batch 1; both rows also in the grid above), ``"grouped-query
  attention"`` (a small ``tfcore.Llama``, 8 heads of 48, a decode step at 1024 cached positions,
  batch 8, with 8 key/value heads and with 1: ``variant`` "multi-head, H_kv = H" and "multi-query,
  H_kv = 1"), ``"mixture of experts"`` (a small ``tfcore.Mixtral``,
  8 experts of 512 with 2 per token, against a dense Llama of its active size, one SwiGLU of
  1024, and of its total size, one of 4096; decode steps at 64 cached positions, batch 1 and 64).
- ``"cost only"``: no time; the counted FLOPs and bytes of passes timed under the key
  ``speculative`` (chapter 22's target: its cached pass over 1..7 new tokens after 40 positions,
  and its forward pass over 8 x 128 tokens in float32 and with int8 weights), for chapter 23 to
  join with those times (``what`` as there).

Every timed row has: ``kind``, ``what`` (a label), ``model``, ``batch``, ``new``, ``cached``,
``dtype`` (weights and activations), ``weights`` ("int8" or the dtype), ``flops``,
``matmul_flops``, ``bytes``, ``weight_bytes``, ``cache_bytes`` (read and written),
``activation_bytes``, ``intensity`` (FLOPs per byte), ``seconds`` (median of ``repeats``, wall
clock), ``achieved_flops_per_second`` and ``achieved_bytes_per_second`` (flops or bytes over
seconds), ``peak_flops_per_second`` (the run's matmul peak in the dtype that computes: float32 for
int8 weights) and ``bytes_per_second`` (the run's read bandwidth), ``compute_seconds``,
``memory_seconds``, ``bound_seconds`` (their maximum), ``binds`` ("compute" or "memory"),
``bound_fraction`` (bound_seconds / seconds: 1 at the roofline), ``threads``; and from run.py,
``device``. Units: FLOPs, bytes, seconds, FLOP/s, bytes/s.
"""

from __future__ import annotations

import argparse
import copy

import torch

from .peaks import _median_seconds, matmul_row, memory_row

GPT_20M = dict(n_embd=384, n_layer=10, n_head=6, vocab_size=8192)  # GENERATION_MODELS["20M"] in generation.py
SMOKE_GPT = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=128)

FULL = dict(
    prefill={1: [1, 4, 16, 64, 128, 256, 512], 8: [1, 4, 16, 64, 128, 256, 512], 64: [1, 4, 16, 64, 128, 256]},
    decode=dict(batches=[1, 8, 64], cached=[16, 128, 511]),
    decode_point=(1, 128), prefill_point=(1, 128),
    gqa=dict(batch=8, cached=1024, heads=8, head_dim=48), moe=dict(cached=64, batches=[1, 64], expert=512),
    max_positions=1024, kv_cache=511, overhead_cached=16, repeats=dict(small=15, large=5, huge=3, one=1), matmul_size=2048, read_bytes=256 * 2**20,
)
SMOKE = dict(
    prefill={1: [1, 4], 2: [1, 4]}, decode=dict(batches=[1, 2], cached=[4]),
    decode_point=(1, 4), prefill_point=(1, 4),
    gqa=dict(batch=2, cached=8, heads=4, head_dim=8), moe=dict(cached=4, batches=[1, 2], expert=16),
    max_positions=64, kv_cache=3, overhead_cached=4, repeats=dict(small=1, large=1, huge=1, one=1), matmul_size=64, read_bytes=2**20,
)


def _gpt_config(sizes: dict, positions: int):
    import tfcore

    return tfcore.GPTConfig(vocab_size=sizes["vocab_size"], max_position_embeddings=positions,
                            hidden_size=sizes["n_embd"], num_hidden_layers=sizes["n_layer"],
                            num_attention_heads=sizes["n_head"], hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)


def _build(cls, config, device):
    torch.manual_seed(0)  # drawn on the CPU, then moved (PITFALLS: CUDA draws differ)
    return cls(config).eval().to(device)


def _filled_cache(model, batch: int, cached: int, kv_heads: int, head_dim: int, dtype, device):
    """A cache of ``cached`` random positions with room for one more: the step's cost does not
    depend on the cached values."""
    cache = model.new_cache(capacity=cached + 1)
    generator = torch.Generator().manual_seed(1)
    for layer in cache.layers:
        k, v = (torch.randn(batch, kv_heads, cached, head_dim, generator=generator).to(device=device, dtype=dtype)
                for _ in range(2))
        layer.append(k, v)
    return cache


def _kv_sizes(config):
    from tfcore.cost import _attention_sizes

    _, kv_heads, head_dim = _attention_sizes(config)
    return kv_heads, head_dim


class Roofline:
    """The run's peaks, and the timing and costing of one pass."""

    def __init__(self, device: str, sizes: dict):
        self.device, self.sizes = device, sizes
        threads = torch.get_num_threads()
        self.matmul = {dtype: matmul_row(device, dtype, threads, self._matmul_size(dtype), 3)["flops_per_second"]
                       for dtype in (torch.float32, torch.bfloat16, torch.float16)}
        self.read = memory_row("read", device, threads, sizes["read_bytes"], 5)["bytes_per_second"]
        self.threads = threads

    def _matmul_size(self, dtype):
        size = self.sizes["matmul_size"]
        return size // 4 if (dtype == torch.float16 and self.device == "cpu") else size  # its slow path on the CPU

    def peak_rows(self) -> list[dict]:
        rows = [dict(kind="peak", what="matmul", dtype=str(d).removeprefix("torch."), flops_per_second=f,
                     threads=self.threads) for d, f in self.matmul.items()]
        return rows + [dict(kind="peak", what="read", dtype="float32", bytes_per_second=self.read, threads=self.threads)]

    def point(self, net, config, batch: int, new: int, cached: int, dtype=torch.float32,
              weights: str | None = None, **labels) -> dict:
        """Time one pass of ``net`` (``batch`` rows of ``new`` tokens after ``cached`` random
        positions) and hold it against the counted cost and the run's peaks. The repeats depend on
        the pass's FLOPs at the peak rate: fewer for longer passes, so that the key's run stays
        within a few minutes."""
        from tfcore.cost import forward_cost, roofline

        cost = forward_cost(config, batch, new, cached, dtype, weights, use_cache=cached > 0)
        peak = self.matmul[dtype]
        estimate = cost["flops"] / peak  # seconds at the peak rate
        repeats = self.sizes["repeats"]["small" if estimate < 0.02 else "large" if estimate < 0.3 else
                                        "huge" if estimate < 1.5 else "one"]
        generator = torch.Generator().manual_seed(2)
        ids = torch.randint(0, config.vocab_size, (batch, new), generator=generator).to(self.device)
        if cached:
            kv_heads, head_dim = _kv_sizes(config)
            cache = _filled_cache(net, batch, cached, kv_heads, head_dim, dtype, self.device)

            def run():
                net(ids, cache=cache)
                for layer in cache.layers:  # back to `cached` positions; the room stays
                    layer.keys, layer.values = layer.keys[..., :cached, :], layer.values[..., :cached, :]
        else:
            def run():
                net(ids)
        seconds = _median_seconds(run, self.device, repeats)
        bound = roofline(cost["flops"], cost["bytes"], peak, self.read)
        return dict(labels, batch=batch, new=new, cached=cached, dtype=str(dtype).removeprefix("torch."),
                    weights=weights or str(dtype).removeprefix("torch."), flops=cost["flops"],
                    matmul_flops=cost["matmul_flops"], bytes=cost["bytes"], weight_bytes=cost["weight_bytes"],
                    cache_bytes=cost["cache_read_bytes"] + cost["cache_write_bytes"],
                    activation_bytes=cost["activation_bytes"], intensity=cost["intensity"], seconds=seconds,
                    repeats=repeats, achieved_flops_per_second=cost["flops"] / seconds,
                    achieved_bytes_per_second=cost["bytes"] / seconds, peak_flops_per_second=peak,
                    bytes_per_second=self.read, compute_seconds=bound["compute_seconds"],
                    memory_seconds=bound["memory_seconds"], bound_seconds=bound["bound_seconds"],
                    binds=bound["binds"], bound_fraction=bound["bound_seconds"] / seconds, threads=self.threads)


def _compared(row: dict, baseline: dict) -> dict:
    return row | dict(baseline=baseline["what"], time_ratio=row["seconds"] / baseline["seconds"],
                      flops_ratio=row["flops"] / baseline["flops"], bytes_ratio=row["bytes"] / baseline["bytes"])


def roofline_rows(device: str, sizes: dict, gpt_sizes: dict) -> list[dict]:
    import tfcore
    from tfcore.quantization import quantize_linears

    machine = Roofline(device, sizes)
    rows = machine.peak_rows()
    config = _gpt_config(gpt_sizes, sizes["max_positions"])
    gpt = _build(tfcore.GPT, config, device)
    name = "20M GPT" if gpt_sizes == GPT_20M else "tiny GPT"

    def timed(kind, model, cfg, batch, new, cached, dtype=torch.float32, weights=None, what=None, model_name=name,
              **labels):
        what = what or (f"{kind}, batch {batch}, " + (f"{new} tokens" if not cached else f"{cached} cached"))
        return machine.point(model, cfg, batch, new, cached, dtype, weights, kind=kind, what=what,
                             model=model_name, **labels)

    grid = {}
    with torch.no_grad():
        for batch, lengths in sizes["prefill"].items():
            for new in lengths:
                grid["prefill", batch, new] = timed("prefill", gpt, config, batch, new, 0)
        for batch in sizes["decode"]["batches"]:
            for cached in sizes["decode"]["cached"]:
                grid["decode", batch, cached] = timed("decode", gpt, config, batch, 1, cached)
        rows += list(grid.values())

        # (i) fewer weight bytes, (ii) more FLOPs at the same weight bytes, at a decode and a prefill point
        (db, dc), (pb, pn) = sizes["decode_point"], sizes["prefill_point"]
        decode_base = grid.get(("decode", db, dc)) or timed("decode", gpt, config, db, 1, dc)
        prefill_base = grid.get(("prefill", pb, pn)) or timed("prefill", gpt, config, pb, pn, 0)
        variants = [("bfloat16 weights", torch.bfloat16, None), ("float16 weights", torch.float16, None),
                    ("int8 weights (tfcore)", torch.float32, "int8")]
        for label, dtype, weights in variants:
            model = quantize_linears(copy.deepcopy(gpt)) if weights else copy.deepcopy(gpt).to(dtype)
            for base, (batch, new, cached) in ((decode_base, (db, 1, dc)), (prefill_base, (pb, pn, 0))):
                where = "decode" if cached else "prefill"
                row = timed("intervention", model, config, batch, new, cached, dtype, weights,
                            what=f"{where}, {label}", intervention="fewer weight bytes")
                rows.append(_compared(row, base))
            del model
        doubled = [(decode_base, ("decode", 2 * db, 1, dc), f"decode, batch {2 * db}"),
                   (prefill_base, ("prefill", pb, 2 * pn, 0), f"prefill, {2 * pn} tokens")]
        for base, (kind, batch, new, cached), label in doubled:
            key = (kind, batch, new if kind == "prefill" else cached)
            row = dict(grid[key]) if key in grid else timed(kind, gpt, config, batch, new, cached)
            rows.append(_compared(row | dict(kind="intervention", what=label, intervention="more FLOPs"), base))
        for base in (decode_base, prefill_base):
            rows.append(_compared(dict(base) | dict(kind="intervention", intervention="baseline"), base))

        tiny_sizes = dict(gpt_sizes, n_embd=8 * gpt_sizes["n_head"], vocab_size=64)
        tiny_config = _gpt_config(tiny_sizes, sizes["max_positions"])
        tiny = _build(tfcore.GPT, tiny_config, device)
        rows.append(timed("overhead", tiny, tiny_config, 1, 1, sizes["overhead_cached"],
                          what="decode, same operations at tiny sizes", model_name="tiny GPT, same operations"))
        rows += _techniques(sizes, grid, timed, gpt, config, name, device)
    rows += _speculative_costs()
    return rows


def _techniques(sizes, grid, timed, gpt, config, name, device) -> list[dict]:
    import tfcore

    rows = []
    last = sizes["kv_cache"]  # a cached step after `last` positions, against a pass over last + 1
    cached_step = grid.get(("decode", 1, last)) or timed("decode", gpt, config, 1, 1, last)
    recompute = grid.get(("prefill", 1, last + 1)) or timed("prefill", gpt, config, 1, last + 1, 0)
    for row, variant in ((cached_step, "cached step"), (recompute, "full recompute")):
        rows.append(dict(row) | dict(kind="technique", technique="kv cache", variant=variant))

    gqa = sizes["gqa"]
    hidden = gqa["heads"] * gqa["head_dim"]
    for kv_heads in (gqa["heads"], 1):
        cfg = tfcore.LlamaConfig(vocab_size=config.vocab_size, max_position_embeddings=gqa["cached"] + 1,
                                 hidden_size=hidden, num_hidden_layers=config.num_hidden_layers,
                                 num_attention_heads=gqa["heads"], num_key_value_heads=kv_heads,
                                 intermediate_size=config.intermediate_size)
        model = _build(tfcore.Llama, cfg, device)
        variant = "multi-head, H_kv = H" if kv_heads == gqa["heads"] else "multi-query, H_kv = 1"
        rows.append(timed("technique", model, cfg, gqa["batch"], 1, gqa["cached"], what=f"decode, Llama, {variant}",
                          model_name=f"Llama, {gqa['heads']} heads of {gqa['head_dim']}",
                          technique="grouped-query attention", variant=variant))
        del model

    moe = sizes["moe"]
    common = dict(vocab_size=config.vocab_size, max_position_embeddings=moe["cached"] + 1,
                  hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
                  num_attention_heads=config.num_attention_heads)
    experts, k = 8, 2
    models = [("mixture of 8 experts, 2 per token", tfcore.Mixtral,
               tfcore.MixtralConfig(**common, intermediate_size=moe["expert"], num_local_experts=experts,
                                    num_experts_per_tok=k, num_key_value_heads=config.num_attention_heads)),
              ("dense, active size", tfcore.Llama, tfcore.LlamaConfig(**common, intermediate_size=k * moe["expert"])),
              ("dense, total size", tfcore.Llama, tfcore.LlamaConfig(**common, intermediate_size=experts * moe["expert"]))]
    for variant, cls, cfg in models:
        model = _build(cls, cfg, device)
        for batch in moe["batches"]:
            rows.append(timed("technique", model, cfg, batch, 1, moe["cached"], what=f"decode, {variant}, batch {batch}",
                              model_name=variant, technique="mixture of experts", variant=variant))
        del model
    return rows


def _speculative_costs() -> list[dict]:
    """The counted cost of the passes the key ``speculative`` times (chapter 22's target)."""
    import tfcore
    from tfcore.cost import forward_cost
    from tfcore.speculative import DECODING_MODELS

    config = tfcore.GPTConfig(**DECODING_MODELS["target"]["config"])
    passes = [(f"target cached pass, {n} new tokens", 1, n, 40, None) for n in range(1, 8)]
    passes += [("target forward, float32", 8, 128, 0, None), ("target forward, int8 weights (tfcore)", 8, 128, 0, "int8")]
    rows = []
    for what, batch, new, cached, weights in passes:
        cost = forward_cost(config, batch, new, cached, torch.float32, weights, use_cache=cached > 0)
        rows.append(dict(kind="cost only", what=what, model="chapter 22's target", batch=batch, new=new, cached=cached,
                         dtype="float32", weights=weights or "float32", flops=cost["flops"],
                         matmul_flops=cost["matmul_flops"], bytes=cost["bytes"], weight_bytes=cost["weight_bytes"],
                         cache_bytes=cost["cache_read_bytes"] + cost["cache_write_bytes"],
                         activation_bytes=cost["activation_bytes"], intensity=cost["intensity"]))
    return rows


def measures(args: argparse.Namespace) -> dict:
    """This module's key: ``roofline`` -> function(device) -> rows."""
    sizes, gpt_sizes = (SMOKE, SMOKE_GPT) if args.smoke else (FULL, GPT_20M)
    return {"roofline": lambda device: roofline_rows(device, sizes, gpt_sizes)}


__all__ = ["FULL", "GPT_20M", "Roofline", "measures", "roofline_rows"]
