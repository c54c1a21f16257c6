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

What is timed, by key of results.json (the module of ``benchmarks/`` that measures it in brackets):

- ``attention`` (attention.py): attention alone, batch 1, 12 heads of 64, by several implementations;
- ``encoder`` (encoder.py): the pretrained encoder, tfcore against transformers' ``BertModel``, same weights;
- ``memory`` (memory.py): the rise of the peak memory of one pass;
- ``layers`` (attention.py): one layer of each kind, 768 wide, batch 1: self-attention, an LSTM, a convolution;
- ``additive`` (attention.py): additive (Bahdanau) attention against scaled dot-product attention, one head of 64;
- ``encoder_parts`` (attention.py): one encoder layer of BERT-base's and of the embedded model's sizes, batch 1,
  cut into its projections, its feed-forward, the L x L part of attention, and whole.
- ``allocation`` (memory.py) (CPU, one thread, then two): why ``attention``'s path with weights steps between
  512 and 1024 tokens. tfcore's plain attention, batch 1, 12 heads of 64, against the same
  arithmetic written into buffers allocated once, and against allocating two fresh L x L tensors
  and touching one float per page (the kernel maps and zeroes each page on its first touch): time
  and minor page faults per call (``getrusage``, around the timed calls; medians), every variant
  and length taking turns. ``machine`` records (here ``machine_allocation``) hold the CPU's caches
  (from /sys), the page size and the C library, so a step can be held against them.

Generation (chapter 15), timed with PyTorch's own harness, ``torch.utils.benchmark.Timer``, the
implementations taking turns so that a change in the machine's load hits them alike:

- ``generation`` (generation.py): greedy generation of 256 tokens after a 16-token prompt, batch 1, with the KV
  cache, by ``tfcore.generate`` and by transformers' ``generate`` on the same GPT-2 weights, for a
  model of about 1M parameters and one of about 20M;
- ``cache`` (generation.py): the same 1M model generating up to 512 tokens, with and without the cache;
- ``per_token`` (generation.py): the cost of one new token at a given position: one cached step, against one
  full forward pass over every position so far.

Decoding faster (chapter 22):

- ``speculative`` (speculative.py): the book-prose target of chapter 22 (``tfcore.speculative.load_decoding_model``)
  generating 96 greedy tokens after 16 with its KV cache (``tfcore.generate``), against speculative
  greedy decoding with the draft proposing k = 1..6 tokens per round (the same tokens asserted),
  and the draft alone; with each k, the proposals accepted and checked. The target's cached pass
  over 1 to 7 new tokens after 40 cached positions (201 turns, median). Then the target's forward
  pass over 8 blocks of 128 tokens with float32 weights, with tfcore's int8 weights
  (``tfcore.quantization``) and with ``torch.ao.quantization.quantize_dynamic`` (CPU). With
  ``--threads 1`` on the CPU these are timed on the thread's CPU time (``time.thread_time``), so
  that a busy machine's waits are not counted; each row records its ``clock``.

FlashAttention (chapter 17):

- ``flash`` (flash.py): attention by tfcore's plain path (with its L x L weights), tfcore's tiled
  ``tfcore.flash.flash_attention`` (pure PyTorch) and PyTorch's fused SDPA, batch 1, 4 heads of 64:
  forward time and the rise of the peak memory of one pass. CPU: float32, 512 to 8192 tokens.
  CUDA: float32 and float16, up to 32768 tokens, SDPA also forced onto each of its backends
  (``sdpa_kernel(SDPBackend.FLASH_ATTENTION / EFFICIENT_ATTENTION / MATH)``); a case that a backend
  refuses, or that runs out of memory, is recorded with ``refused`` instead of a time.

The cost of a token (chapter 23):

- ``peaks`` (peaks.py): the machine's measured peaks, at 1 thread and at the run's thread count: the
  FLOP/s of a large square product in float32, bfloat16 and float16, and the bytes per second of
  a sum over 256 MiB (far past the last-level cache) and of a copy.
- ``roofline`` (roofline.py): the 20M GPT's passes (prompts of 1 to 512 tokens at batch 1, 8 and 64;
  cached steps after 16 to 511 positions), each with its FLOPs and bytes counted by ``tfcore.cost``,
  its median time and the roofline bound of the same run's peaks; interventions (fewer weight bytes,
  more FLOPs) and the book's techniques (KV cache, grouped-query attention, experts) as measured pairs.
  About two minutes on 2 CPU cores, with ``peaks``:

    .venv/bin/python benchmarks/run.py --only peaks,roofline

- ``decoding`` (decoding.py): greedy decoding of 256 tokens, batch 1, by ``tfcore.generate``, transformers'
  ``generate`` and ``tfcore.static_decoding`` (a preallocated cache, fixed shapes; on CUDA also as a
  CUDA graph), against the bound of the weights' bytes over the read bandwidth measured in the same
  run, at 1 thread and at the run's count; each linear layer at one row: F.linear, transformers'
  ``[in, out]`` layout and oneDNN's reordered weights; a profile of a call by operation; and
  ``tfcore.generate``'s tokens per second for 1 to 64 left-padded prompts, each row's tokens
  checked against its prompt decoded alone. About three minutes on 2 idle CPU cores (estimated
  from its parts' times; 13 minutes on the busy 2-core machine where it was written):

    .venv/bin/python benchmarks/run.py --only decoding

Attention without a growing cache (chapter 20):

- ``hybrid`` (hybrid.py): one cached decoding step, batch 1, after 128 to 8192 positions, of a
  ``tfcore.hybrid.Qwen35`` with three Gated DeltaNet layers to one attention layer and of the same
  model made all-attention (random weights, 8 layers, 256 wide), with the bytes each cache holds.

    .venv/bin/python benchmarks/run.py --only hybrid --threads 1

Training across processes (chapter 27):

- ``distributed`` (distributed.py): strong scaling on the CPU: one global batch (8 sequences of 64
  tokens) of a 4.2M-parameter GPT, one training step (AdamW) by each of ``tfcore.distributed.SCHEMES``
  on 1, 2 and 4 processes of one thread each (gloo, loopback), by one process without any process
  group, and by p processes each on its share with no collective; the median of the slowest rank's
  step; the all-reduce, all-gather and reduce-scatter of the model's size alone, on 2 and 4 processes:

    .venv/bin/python benchmarks/run.py --only distributed --threads 1

``--only generation,cache,per_token`` (or ``--only allocation``, ``--only flash``, ``--only speculative``) measures just those
keys and writes them, with their own ``machine`` record, into the existing results.json, leaving the
other keys as they were. ``--devices cuda`` measures on the GPU only and keeps the key's CPU rows;
its machine record is then ``machine_<key>_cuda``. On a GPU machine, chapter 17's rows:

    .venv/bin/python benchmarks/run.py --only flash --devices cuda            # about 2 minutes on an H100

The code is the package ``benchmarks``, one module per group of keys, each beginning with a
docstring that says what it measures and which chapter reads it; this file is its entry point.
``common.py`` holds what they share (``median_time``, ``_take_turns``, ``_in_fresh_processes``,
``_sync``, the lengths and repeats of chapter 13's keys), ``machine.py`` the machine record and
``plot.py`` results.png.

To add a key: a new module ``benchmarks/<name>.py`` with a function ``measures(args)`` that returns
``{key: function(device) -> list of row dicts}`` (``args`` is this command line: ``args.smoke`` asks
for tiny sizes and one repeat, the sizes of a full run being the module's own), then one line
``"key": "<name>",`` in ``KEYS`` below. A full run
measures the keys in ``KEYS``'s order, ``--only key`` that key alone; each row gets its ``device``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "tfcore" / "data" / "benchmark_results.json"  # the committed run

# ``python benchmarks/run.py`` puts benchmarks/ first on sys.path
# (https://docs.python.org/3/library/sys.html#sys.path), where attention.py, memory.py or plot.py
# would stand for any top-level module of those names: the modules are imported as the package
# ``benchmarks``, from the repository's root, instead.
sys.path[:] = [HERE.parent.as_posix()] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

from benchmarks import flash, machine, memory, plot  # noqa: E402

# key of results.json -> the module of benchmarks/ whose measures(args) measures it, in the order
# a full run measures them (and results.json lists them)
KEYS = {
    "attention": "attention",
    "encoder": "encoder",
    "memory": "memory",
    "layers": "attention",
    "additive": "attention",
    "encoder_parts": "attention",
    "generation": "generation",
    "cache": "generation",
    "per_token": "generation",
    "allocation": "memory",
    "speculative": "speculative",
    "flash": "flash",
    "peaks": "peaks",
    "roofline": "roofline",
    "decoding": "decoding",
    "hybrid": "hybrid",
    "distributed": "distributed",
}


def registered_measures(args: argparse.Namespace) -> dict:
    """Key -> function(device) -> rows, in ``KEYS``'s order, from each key's module's ``measures(args)``."""
    found = {name: importlib.import_module(f"benchmarks.{name}").measures(args) for name in dict.fromkeys(KEYS.values())}
    problems = [f"KEYS names benchmarks/{name}.py for {key!r}, which its measures(args) does not return"
                for key, name in KEYS.items() if key not in found[name]]
    problems += [f"benchmarks/{name}.py's measures(args) returns {key!r}, for which KEYS names another module or none"
                 for name, keys in found.items() for key in keys if KEYS.get(key) != name]
    if problems:
        raise ValueError("; ".join(problems) + ". In benchmarks/run.py, KEYS needs one line \"key\": \"module\" "
                         "for each key, naming the module whose measures(args) returns it")
    return {key: found[name][key] for key, name in KEYS.items()}


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
            print(json.dumps(memory._memory_point(kind, int(length), device)), flush=True)
        return
    if args.flash_memory_point:
        for what, length in args.flash_memory_point:
            print(json.dumps(flash._flash_memory_point(what, int(length))), flush=True)
        return

    import tfcore

    tfcore.setup(seed=0)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if args.devices:
        unknown_devices = set(args.devices.split(",")) - set(devices)
        if unknown_devices:
            parser.error(f"devices {sorted(unknown_devices)} are not available here; choose from {devices}")
        devices = args.devices.split(",")
    measures = registered_measures(args)
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
            results[f"machine_{key}{suffix}"] = machine.machine(args.threads)
    else:
        # a full run: one machine record, also under each key's own name, which the chapters read
        # (chapter 13 reads machine_allocation and machine_flash, written alone by --only runs)
        record = machine.machine(args.threads)
        results = {"machine": record} | {f"machine_{key}": record for key in keys} | {key: [] for key in keys}
    for device in devices:
        for key in keys:
            results[key] += [r | {"device": device} for r in measures[key](device)]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    plot.plot(results, png_path)
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
