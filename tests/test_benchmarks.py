"""The benchmark: a smoke run of the script, and the targets checked on the committed full run."""

import json
import statistics
import subprocess
import sys

import pytest

from notebook_checks import ROOT

RESULTS = ROOT / "tfcore" / "data" / "benchmark_results.json"
ATTENTION_CASES = {"tfcore, no weights", "tfcore, with weights", "torch sdpa", "torch sdpa, math backend",
                   "module: per-head (chapter 4)", "module: tfcore fused", "module: tfcore fused, with weights",
                   "module: torch MultiheadAttention"}

LAYER_CASES = {"self-attention", "LSTM", "Conv1d, kernel 3"}
ENCODER_PARTS = {"projections", "feed-forward", "attention, L x L part", "whole layer"}
ALLOCATION_CASES = {"plain (tfcore, with weights)", "preallocated buffers", "fresh pages only"}
FLASH_CPU_CASES = {"plain (tfcore, with weights)", "tiled (tfcore.flash)", "torch sdpa"}
DECODING_SINGLE_CASES = {"tfcore.generate", "transformers generate", "static cache"}
DECODING_KERNEL_CASES = {"F.linear", "addmm, weight stored [in, out]", "oneDNN packed"}
ROOFLINE_KINDS = {"peak", "prefill", "decode", "overhead", "intervention", "technique", "cost only"}
ROOFLINE_FIELDS = {"kind", "what", "model", "batch", "new", "cached", "dtype", "weights", "flops", "matmul_flops",
                   "bytes", "weight_bytes", "cache_bytes", "activation_bytes", "intensity", "seconds", "repeats",
                   "achieved_flops_per_second", "achieved_bytes_per_second", "peak_flops_per_second",
                   "bytes_per_second", "compute_seconds", "memory_seconds", "bound_seconds", "binds",
                   "bound_fraction", "threads", "device"}
ROOFLINE_TECHNIQUES = {("kv cache", "cached step"), ("kv cache", "full recompute"),
                       ("grouped-query attention", "multi-head, H_kv = H"),
                       ("grouped-query attention", "multi-query, H_kv = 1")} | {
    ("mixture of experts", v) for v in ("mixture of 8 experts, 2 per token", "dense, active size", "dense, total size")}


def test_smoke_run_writes_results_and_plot(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--threads", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"date", "torch", "transformers", "torch_threads", "platform", "caches", "page_bytes", "libc"} <= set(results["machine"])
    assert all({"level", "type", "size"} <= set(cache) for cache in results["machine"]["caches"])
    # a full run records its machine under every key's name too: chapter 13 reads machine_allocation
    assert results["machine_allocation"] == results["machine_flash"] == results["machine"]
    assert {r["what"] for r in results["attention"]} == ATTENTION_CASES
    assert all(r["seconds"] > 0 for r in results["attention"] + results["encoder"])
    assert {r["what"] for r in results["encoder"]} == {"tfcore encoder", "BertModel (eager)", "BertModel (sdpa)"}
    assert all(r["max_abs_difference_to_sdpa"] < 1e-4 for r in results["encoder"])  # same weights, same outputs
    assert {r["what"] for r in results["memory"]} == {"attention, with weights", "attention, no weights", "encoder"}
    assert all(r["peak_bytes"] >= 0 and r["length"] == 16 for r in results["memory"]) and (tmp_path / "results.png").stat().st_size > 10_000
    assert {r["what"] for r in results["layers"]} == LAYER_CASES
    assert {r["what"] for r in results["additive"]} == {"additive attention", "scaled dot-product attention"}
    assert {(r["model"], r["what"]) for r in results["encoder_parts"]} == {
        (model, part) for model in ("bert-base", "embedded") for part in ENCODER_PARTS}
    assert all(r["seconds"] > 0 for r in results["layers"] + results["additive"] + results["encoder_parts"])
    assert {r["what"] for r in results["generation"]} == {"tfcore.generate", "transformers generate"}
    assert all(r["same_tokens"] for r in results["generation"])  # same weights, same greedy tokens
    assert {r["what"] for r in results["cache"]} == {r["what"] for r in results["per_token"]} == {"with cache", "without cache"}
    assert all(r["seconds"] > 0 for r in results["generation"] + results["cache"] + results["per_token"])
    assert {r["what"] for r in results["allocation"]} == ALLOCATION_CASES
    assert all(r["same_output"] and r["seconds"] > 0 and r["threads"] == 1 for r in results["allocation"])
    cpu_flash = [r for r in results["flash"] if r["device"] == "cpu"]
    assert {r["what"] for r in cpu_flash} == FLASH_CPU_CASES
    assert all(r["refused"] is None and r["seconds"] > 0 and r["peak_bytes"] >= 0 and r["dtype"] == "float32"
               for r in cpu_flash)
    speculative = {r["what"]: r for r in results["speculative"]}
    assert {"target greedy (cached)", "draft greedy (cached)", "speculative, k=1", "speculative, k=3",
            "target forward, float32", "target forward, int8 weights (tfcore)"} <= set(speculative)
    assert all(r["same_tokens"] for what, r in speculative.items() if what.startswith("speculative"))
    passes = [r for r in results["speculative"] if r["part"] == "pass"]
    assert sorted(r["new_tokens"] for r in passes) == list(range(1, 8)) and all(r["seconds"] > 0 for r in passes)
    # chapter 23: the machine's peaks and the roofline rows (schemas in benchmarks/peaks.py and roofline.py)
    assert {(r["what"], r["dtype"]) for r in results["peaks"]} == {("matmul", "float32"), ("matmul", "bfloat16"),
                                                                  ("matmul", "float16"), ("read", "float32"),
                                                                  ("copy", "float32")}
    assert all(r["seconds"] > 0 and r["threads"] == 1 for r in results["peaks"])
    roofline = results["roofline"]
    assert {r["kind"] for r in roofline} == ROOFLINE_KINDS
    timed = [r for r in roofline if r["kind"] not in ("peak", "cost only")]
    assert all(ROOFLINE_FIELDS <= set(r) and r["seconds"] > 0 and r["flops"] > 0 and r["bytes"] > 0 for r in timed)
    assert all(r["bound_seconds"] == max(r["compute_seconds"], r["memory_seconds"]) for r in timed)
    interventions = {r["what"]: r for r in roofline if r["kind"] == "intervention"}
    assert {r["intervention"] for r in interventions.values()} == {"fewer weight bytes", "more FLOPs", "baseline"}
    assert all(interventions[r["baseline"]]["intervention"] == "baseline" for r in interventions.values())
    assert {(r["technique"], r["variant"]) for r in roofline if r["kind"] == "technique"} == ROOFLINE_TECHNIQUES
    costed = {r["what"] for r in roofline if r["kind"] == "cost only"}
    assert costed <= {r["what"] for r in results["speculative"]} and len(costed) == 9  # joined with its times
    # chapter 23: decoding against the bandwidth bound, kernels, profile, batches (schema in benchmarks/decoding.py)
    decoding = results["decoding"]
    assert {r["part"] for r in decoding} == {"single", "kernel", "profile", "batched"}
    single = [r for r in decoding if r["part"] == "single"]
    assert {r["what"] for r in single} == DECODING_SINGLE_CASES and all(r["same_tokens"] for r in single)
    assert all(r["bound_seconds_per_token"] == r["weight_bytes"] / r["read_bytes_per_second"]
               and r["fraction_of_bound"] == r["bound_seconds_per_token"] / r["seconds_per_token"] for r in single)
    import torch

    from tfcore.static_decoding import PackedLinear

    onednn = PackedLinear(torch.zeros(2, 2)).packed  # float32 on a CPU with oneDNN
    assert {r["what"] for r in decoding if r["part"] == "kernel"} == DECODING_KERNEL_CASES - (
        set() if onednn else {"oneDNN packed"})
    for what in ("tfcore.generate", "static cache"):
        shares = [r["share"] for r in decoding if r["part"] == "profile" and r["what"] == what and r["op"] != "all ops"]
        assert abs(sum(shares) - 1) < 1e-9
    batched = [r for r in decoding if r["part"] == "batched"]
    assert [r["batch"] for r in batched] == [1, 2] and all(r["same_tokens"] for r in batched)
    assert batched[1]["prompt_lengths"] == [8, 4]  # left padding exercised
    # chapter 20: a hybrid's cached step against its all-attention twin (schema in benchmarks/hybrid.py)
    hybrid = results["hybrid"]
    assert {(r["model"], r["position"]) for r in hybrid} == {(m, p) for m in ("hybrid", "all attention") for p in (8, 24)}
    assert all(r["seconds"] > 0 and r["cache_bytes"] > 0 for r in hybrid)
    held = {(r["model"], r["position"]): r["cache_bytes"] for r in hybrid}
    # the hybrid's cache grows by its one attention layer's keys and values, the twin's by four layers'
    assert 4 * (held["hybrid", 24] - held["hybrid", 8]) == held["all attention", 24] - held["all attention", 8] > 0
    # chapter 27: time per training step against the number of processes (schema in benchmarks/distributed.py)
    _check_distributed_smoke(results["distributed"])


def _check_distributed_smoke(rows):
    from tfcore.distributed import SCHEMES

    steps = {(r["scheme"], r["processes"]): r for r in rows if r["kind"] == "step"}
    assert set(steps) == {("single", 1), ("local", 2), ("bucketed, no overlap", 2)} | {
        (s, p) for s in SCHEMES for p in (1, 2)}
    collectives = {r["scheme"]: r for r in rows if r["kind"] == "collective"}
    many = ("all_reduce per parameter", "all_reduce of one element, per parameter")
    assert set(collectives) == {"all_reduce", "all_gather", "reduce_scatter", *many}
    assert all(collectives[m]["messages"] == 16 * 2 + 4 for m in many)  # 2 blocks of 16 tensors, and 4
    assert collectives["all_reduce"]["messages"] == 1 and collectives[many[1]]["elements"] == 16 * 2 + 4
    assert all(r["processes"] == 2 and r["seconds"] == r["comm_seconds"] > 0 for r in collectives.values())
    assert all(r["seconds"] > 0 and r["global_batch"] == 4 and r["parameters"] == rows[0]["parameters"] > 0
               for r in rows)
    # our schemes' collectives in a step, counted, in units of one collective on all the parameters
    counts = {s: steps[s, 2]["comm_collectives"] for s in ("ddp", "bucketed", "zero1", "fsdp")}
    assert counts["ddp"] == counts["bucketed"] == pytest.approx({"all_reduce": 1, "all_gather": 0, "reduce_scatter": 0})
    assert counts["zero1"] == pytest.approx({"all_reduce": 0, "all_gather": 1, "reduce_scatter": 1})
    assert counts["fsdp"]["all_reduce"] == 0 and counts["fsdp"]["all_gather"] == pytest.approx(
        2 * counts["fsdp"]["reduce_scatter"]) and counts["fsdp"]["reduce_scatter"] >= 1 - 1e-12
    for (scheme, p), r in steps.items():
        if p == 2 and scheme in counts:
            assert r["comm_seconds"] == pytest.approx(sum(n * collectives[op]["seconds"] for op, n in counts[scheme].items()))
        else:
            assert r["comm_seconds"] is None
    bucketed = steps["bucketed", 2]
    assert bucketed["buckets"] >= 2 and all(0 <= n <= bucketed["buckets"] for n in bucketed["buckets_done_before_wait"])
    timeline = bucketed["timeline"]
    assert len(timeline["launched"]) == len(timeline["waited"]) == bucketed["buckets"]
    assert max(timeline["launched"]) <= timeline["backward_end"] <= min(timeline["waited"])


def test_distributed_rows_take_the_slowest_rank_then_the_median():
    """A step's time is the slowest rank's, and the row's the median over steps after the warm-up: taking the
    median per rank first, or keeping the warm-up, gives other numbers on this input."""
    from benchmarks.distributed import WARMUP, slowest_median

    assert WARMUP == 2
    # runs[k][rank][step]: two runs of two ranks, 2 warm-up steps (9 s) then 3 timed steps
    runs = [[[9, 9, 4, 1, 1], [9, 9, 1, 4, 1]], [[9, 9, 1, 1, 4], [9, 9, 1, 1, 1]]]
    assert slowest_median(runs) == 2.5  # the slowest rank of each timed step: 4 4 1 | 1 1 4
    per_rank_first = max(statistics.median(steps[WARMUP:]) for run in runs for steps in run)
    with_warmup = statistics.median(max(step) for run in runs for step in zip(*run))
    assert (per_rank_first, with_warmup) == (1, 4)


def _seconds(rows, what, **where):
    [row] = [r for r in rows if r["what"] == what and r["device"] == "cpu" and all(r[k] == v for k, v in where.items())]
    return row["seconds"]


@pytest.fixture(scope="module")
def committed():
    return json.loads(RESULTS.read_text())


@pytest.mark.parametrize("length", [512, 2048])
def test_committed_attention_meets_the_targets(committed, length):
    rows = committed["attention"]
    assert committed["machine"]["torch_threads"] == 2
    fast = _seconds(rows, "tfcore, no weights", length=length) / _seconds(rows, "torch sdpa", length=length)
    weights = _seconds(rows, "tfcore, with weights", length=length) / _seconds(rows, "torch sdpa, math backend", length=length)
    assert fast <= 1.1, fast
    assert weights <= 1.1, weights


@pytest.mark.parametrize("batch, length", [(8, 128), (1, 512)])
def test_committed_encoder_meets_the_target(committed, batch, length):
    rows = committed["encoder"]
    ours = _seconds(rows, "tfcore encoder", batch=batch, length=length)
    best = min(_seconds(rows, f"BertModel ({impl})", batch=batch, length=length) for impl in ("eager", "sdpa"))
    assert ours / best <= 1.05, ours / best


def test_committed_run_has_the_rows_chapter_13_reads(committed):
    lengths = {r["length"] for r in committed["attention"]}
    cpu = [r for r in committed["layers"] if r["device"] == "cpu"]
    assert {(r["what"], r["length"]) for r in cpu} == {(what, n) for what in LAYER_CASES for n in lengths}
    assert {r["length"] for r in committed["additive"]} == {n for n in lengths if n <= 1024}
    parts = {(r["model"], r["what"], r["length"]) for r in committed["encoder_parts"] if r["device"] == "cpu"}
    assert {length for _, _, length in parts} >= {512, 1024, 2048, 4096}
    assert len(parts) == 2 * len(ENCODER_PARTS) * len({length for _, _, length in parts})


def test_committed_allocation_rows_chapter_13_reads(committed):
    """Chapter 13's test of the step: the same arithmetic into preallocated buffers, and page faults."""
    rows = {(r["what"], r["length"], r["threads"]): r for r in committed["allocation"] if r["device"] == "cpu"}
    assert set(rows) == {(what, n, t) for what in ALLOCATION_CASES for n in (256, 512, 1024, 2048) for t in (1, 2)}
    assert committed["machine_allocation"]["caches"]
    assert all(r["same_output"] for r in rows.values())
    for n in (1024, 2048):  # above glibc's 32 MiB ceiling: two fresh tensors per plain call, none preallocated
        for t in (1, 2):
            plain = rows["plain (tfcore, with weights)", n, t]
            assert 0.95 <= plain["page_faults"] / (2 * plain["tensor_bytes"] / plain["page_bytes"]) <= 1.05
            assert rows["preallocated buffers", n, t]["page_faults"] == 0


@pytest.mark.parametrize("model", ["1M", "20M"])
def test_committed_generation_is_not_slower_than_transformers(committed, model):
    rows = [r for r in committed["generation"] if r["model"] == model and r["device"] == "cpu"]
    assert committed["machine_generation"]["torch_threads"] == 2
    assert {(r["prompt"], r["new_tokens"]) for r in rows} == {(16, 256)}
    assert all(r["same_tokens"] and r["distinct_new_tokens"] >= 5 for r in rows)  # equal, and not one token repeated
    ratio = _seconds(rows, "tfcore.generate") / _seconds(rows, "transformers generate")
    assert ratio <= 1.0, ratio
    parameters = rows[0]["parameters"]
    assert (0.8e6 <= parameters <= 1.5e6) if model == "1M" else (15e6 <= parameters <= 25e6), parameters


def test_committed_cache_speedup_at_512_tokens(committed):
    rows = [r for r in committed["cache"] if r["device"] == "cpu" and r["total_tokens"] == 512]
    speedup = _seconds(rows, "without cache") / _seconds(rows, "with cache")
    assert speedup >= 5, speedup


def test_committed_run_has_the_rows_chapter_15_reads(committed):
    rows = [r for r in committed["per_token"] if r["device"] == "cpu"]
    positions = {r["position"] for r in rows}
    assert {(r["model"], r["what"], r["position"]) for r in rows} == {
        (model, what, p) for model in ("1M", "20M") for what in ("with cache", "without cache") for p in positions}
    assert max(positions) == 511 and len(positions) >= 5


def _class_without_docstring(source, name):
    import ast

    [node] = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name]
    node.body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body  # drop the docstring
    return ast.dump(node)


def test_the_benchmark_times_chapter_13s_additive_attention():
    notebook = json.loads((ROOT / "notebooks" / "13_what_attention_costs.ipynb").read_text())
    [cell] = [c for c in notebook["cells"] if "".join(c["source"]).startswith("class AdditiveAttention")]
    benchmark = (ROOT / "benchmarks" / "attention.py").read_text()
    assert _class_without_docstring("".join(cell["source"]), "AdditiveAttention") == \
        _class_without_docstring(benchmark, "AdditiveAttention")


def test_committed_flash_rows_chapter_17_reads(committed):
    """Chapter 17: plain, tiled and fused attention on the CPU, 512 to 8192 tokens; CUDA rows, when
    present, are labelled with their dtype and the GPU's name, and a refused case has no time."""
    rows = {(r["what"], r["length"]): r for r in committed["flash"] if r["device"] == "cpu"}
    assert set(rows) == {(what, n) for what in FLASH_CPU_CASES for n in (512, 1024, 2048, 4096, 8192)}
    assert committed["machine_flash"]["torch_threads"] == 2
    assert all(r["refused"] is None and r["seconds"] > 0 for r in rows.values())
    plain, tiled = rows["plain (tfcore, with weights)", 8192], rows["tiled (tfcore.flash)", 8192]
    assert tiled["peak_bytes"] <= plain["peak_bytes"] / 10
    cuda = [r for r in committed["flash"] if r["device"] == "cuda"]
    if cuda:
        record = committed.get("machine_flash_cuda", committed["machine_flash"])
        assert record["cuda"]
        assert {r["dtype"] for r in cuda} == {"float32", "float16"}
        assert all((r["seconds"] is None) == (r["refused"] is not None) for r in cuda)


def test_committed_speculative_rows_chapter_22_reads(committed):
    rows = {r["what"]: r for r in committed["speculative"] if r["device"] == "cpu"}
    ks = [rows[f"speculative, k={k}"] for k in range(1, 7)]
    assert all(r["same_tokens"] and 0 <= r["accepted"] <= r["checked"] <= r["proposed"] for r in ks)
    best = max(rows["target greedy (cached)"]["seconds"] / r["seconds"] for r in ks)
    assert best >= 1.5, best  # the target: 1.5x over plain cached greedy, same tokens
    assert {"target forward, float32", "target forward, int8 weights (tfcore)"} <= set(rows)
    # §22.5 puts the cost of the target's cached pass over k + 1 tokens into Leviathan et al.'s formula
    passes = {r["new_tokens"]: r for r in committed["speculative"] if r["device"] == "cpu" and r["part"] == "pass"}
    assert sorted(passes) == list(range(1, 8)) and all(r["cached"] == 40 and r["seconds"] > 0 for r in passes.values())


def test_committed_distributed_rows_chapter_27_reads(committed):
    from benchmarks.distributed import FULL
    from tfcore.distributed import SCHEMES

    rows = [r for r in committed["distributed"] if r["device"] == "cpu"]
    steps = {(r["scheme"], r["processes"]) for r in rows if r["kind"] == "step"}
    references = {("single", 1)} | {(s, p) for s in ("local", "bucketed, no overlap") for p in (2, 4)}
    assert steps == references | {(s, p) for s in SCHEMES for p in FULL["processes"]}
    collectives = {(r["scheme"], r["processes"]) for r in rows if r["kind"] == "collective"}
    names = ("all_reduce", "all_gather", "reduce_scatter", "all_reduce per parameter",
             "all_reduce of one element, per parameter")
    assert collectives == {(c, p) for c in names for p in (2, 4)}
    per_parameter = [r for r in rows if r["scheme"] in names[3:]]
    assert all(r["messages"] == 16 * 4 + 4 for r in per_parameter)  # 4 blocks of 16 tensors, and 4
    assert {r["elements"] for r in per_parameter} == {4_224_512, 68}
    assert all(r["seconds"] > 0 and r["global_batch"] == 8 and r["sequence_length"] == 64 for r in rows)
    assert {r["parameters"] for r in rows} == {4_224_512}
    assert committed["machine_distributed"]["cpu_count"] == 2  # chapter 27 says "on a 2-core CPU"
    bucketed = [r for r in rows if r["scheme"] == "bucketed" and r["processes"] == 2]
    assert len(bucketed) == 1 and len(bucketed[0]["buckets_done_before_wait"]) > 0
    assert len(bucketed[0]["timeline"]["launched"]) == bucketed[0]["buckets"]  # chapter 27 draws it


def test_chapter_13s_additive_attention_refuses_mismatched_batches():
    """A query batch of 1 against keys of batch 2 broadcast silently to a batch of 2 before the check on
    the batch axis (found by review F10); now it is a clear error, and matching shapes still run."""
    import torch
    from torch import nn

    notebook = json.loads((ROOT / "notebooks" / "13_what_attention_costs.ipynb").read_text())
    [cell] = [c for c in notebook["cells"] if "".join(c["source"]).startswith("class AdditiveAttention")]
    namespace = {"torch": torch, "nn": nn}
    exec("".join(cell["source"]), namespace)
    attention = namespace["AdditiveAttention"](8, 8, 16)
    key = value = torch.randn(2, 5, 8)
    assert attention(torch.randn(2, 5, 8), key, value)[0].shape == (2, 5, 8)
    with pytest.raises(ValueError, match=r"expected query \[B, Lq, 8\]"):
        attention(torch.randn(1, 5, 8), key, value)


def test_peaks_measure_on_the_threads_asked_and_refuse_bad_input():
    import torch

    from benchmarks.peaks import matmul_row, memory_row

    before = torch.get_num_threads()
    row = matmul_row("cpu", torch.float32, threads=1, size=32, repeats=1)
    assert row["threads"] == 1 and row["flops"] == 2 * 32 ** 3 and torch.get_num_threads() == before
    assert memory_row("copy", "cpu", 1, 2**16, 1)["bytes"] == 2**16  # read and written, half each
    with pytest.raises(ValueError, match="threads"):
        matmul_row("cpu", threads=0)
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        memory_row("read", "tpu")
    with pytest.raises(ValueError, match="'read' or 'copy'"):
        memory_row("write")


def _roofline(committed):
    assert "roofline" in committed, "no roofline rows: run .venv/bin/python benchmarks/run.py --only peaks,roofline"
    assert committed["machine_roofline"]["torch_threads"] == 2
    return [r for r in committed["roofline"] if r["device"] == "cpu"]


def test_committed_roofline_claims_of_chapter_23(committed):
    rows = _roofline(committed)
    timed = [r for r in rows if r["kind"] in ("prefill", "decode")]
    # the 20M GPT's weights (84 MB in float32) do not fit the last-level cache: no pass beats its bound
    assert all(r["bound_fraction"] <= 1.1 for r in timed), max(r["bound_fraction"] for r in timed)
    assert all(r["binds"] == "memory" for r in timed if r["kind"] == "decode" and r["batch"] == 1)
    assert all(r["binds"] == "compute" for r in timed if r["kind"] == "prefill" and r["batch"] * r["new"] >= 1024)
    step = {r["what"]: r for r in rows if r["kind"] == "intervention"}
    assert step["prefill, 256 tokens"]["time_ratio"] > 1.5  # twice the FLOPs, about twice the time
    assert step["decode, batch 2"]["time_ratio"] < 1.6  # twice the FLOPs, same weights: not twice the time
    kv = {r["variant"]: r["seconds"] for r in rows if r.get("technique") == "kv cache"}
    assert kv["full recompute"] > 5 * kv["cached step"]



def _decoding(committed, part):
    assert "decoding" in committed, "no decoding rows: run .venv/bin/python benchmarks/run.py --only decoding"
    assert committed["machine_decoding"]["torch_threads"] == 2
    return [r for r in committed["decoding"] if r["device"] == "cpu" and r["part"] == part]


@pytest.mark.parametrize("threads", [1, 2])
def test_committed_static_decoding_reaches_about_half_the_bandwidth_bound(committed, threads):
    """What chapter 23 reads from the committed run: greedy decoding of the 20M GPT, same tokens by
    every path, and the static cache at about half of the bound that the run measures at the same
    thread count (the weights' bytes over the read bandwidth), well above both generates.

    Issue 28's target was 60% of that bound; the committed run gives 0.52 (one thread) and 0.54
    (two), so the target is not met on this CPU: at one row the products read 17-34 GB/s against
    the 38-48 GB/s of a plain read (the key's "kernel" rows), and a step's small operations and
    attention (its "profile" rows) add about a millisecond that more threads do not shrink. This
    test checks the measured claim, not the target."""
    rows = {r["what"]: r for r in _decoding(committed, "single") if r["model"] == "20M" and r["threads"] == threads}
    assert set(rows) == DECODING_SINGLE_CASES and all(r["same_tokens"] for r in rows.values())
    assert rows["tfcore.generate"]["distinct_new_tokens"] >= 5
    fractions = {what: round(r["fraction_of_bound"], 3) for what, r in rows.items()}
    assert fractions["static cache"] >= 0.45, fractions
    assert fractions["static cache"] > 1.4 * max(fractions["tfcore.generate"], fractions["transformers generate"]), fractions


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("model", ["1M", "20M"])
def test_committed_decoding_is_not_slower_than_transformers(committed, model, threads):
    rows = {r["what"]: r for r in _decoding(committed, "single") if r["model"] == model and r["threads"] == threads}
    ratio = rows["tfcore.generate"]["seconds"] / rows["transformers generate"]["seconds"]
    assert ratio <= 1.0, ratio


def test_committed_batched_decoding_throughput(committed):
    """Batch 32 reaches 10 times the tokens per second of batch 1, every row's tokens equal to its
    prompt decoded alone."""
    rows = {r["batch"]: r for r in _decoding(committed, "batched")}
    assert sorted(rows) == [1, 2, 4, 8, 16, 32, 64] and all(r["same_tokens"] for r in rows.values())
    assert len(set(rows[64]["prompt_lengths"])) >= 5 and rows[64]["prompt_lengths"][0] == rows[64]["prompt"]
    speedup = rows[32]["tokens_per_second"] / rows[1]["tokens_per_second"]
    assert speedup >= 10, speedup


def test_committed_decoding_rows_chapter_23_reads(committed):
    kernel = {(r["what"], r["layer"], r["threads"]) for r in _decoding(committed, "kernel")}
    layers = {layer for _, layer, _ in kernel}
    assert kernel == {(what, layer, t) for what in DECODING_KERNEL_CASES for layer in layers for t in (1, 2)}
    assert len(layers) == 7
    profile = _decoding(committed, "profile")
    for what in ("tfcore.generate", "static cache"):
        ops = {r["op"]: r for r in profile if r["what"] == what}
        assert {"all ops", "other ops"} <= set(ops) and ops["all ops"]["wall_seconds_per_token"] > 0
        assert abs(sum(r["share"] for op, r in ops.items() if op != "all ops") - 1) < 1e-9
    single = _decoding(committed, "single")
    assert {(r["model"], r["threads"]) for r in single} == {(m, t) for m in ("1M", "20M") for t in (1, 2)}


def test_committed_hybrid_rows_chapter_20_reads(committed):
    """Chapter 20 reads the hybrid's step times and cache bytes: both models at every position, and the bytes
    each cache held equal to what ``tfcore.hybrid.state_bytes`` counts for the same sizes (float32)."""
    from benchmarks.hybrid import FULL
    from tfcore.hybrid import Qwen35Config, state_bytes

    rows = [r for r in committed["hybrid"] if r["device"] == "cpu"]
    assert {(r["model"], r["position"]) for r in rows} == {
        (m, p) for m in ("hybrid", "all attention") for p in (128, 512, 2048, 8192)}
    for r in rows:
        layers = ["full_attention"] * r["num_hidden_layers"] if r["model"] == "all attention" else None
        config = Qwen35Config(**FULL, layer_types=layers)
        counted = state_bytes(config, r["position"], dtype_bytes=4)
        assert r["cache_bytes"] == counted["linear_state"] + counted["kv"] and r["seconds"] > 0
