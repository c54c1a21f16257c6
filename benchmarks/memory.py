"""The rise of the peak memory of one pass, and what allocating it costs (chapter 13; 17 reads ``memory``).

Keys:

- ``memory``: attention (with and without its weights) and the pretrained encoder: the rise of the
  peak memory of one forward pass, each point in a fresh process (``run.py --memory-point``, which
  calls ``_memory_point``): after a warm-up pass, the peak resident memory is reset (Linux's
  /proc/self/clear_refs) and we record how far one more pass raises it above the memory in use
  (VmHWM - VmRSS), or ``torch.cuda.max_memory_allocated`` on a GPU;
- ``allocation`` (CPU, one thread, then two): why ``attention``'s path with weights steps between
  512 and 1024 tokens: tfcore's plain attention against the same arithmetic into buffers allocated
  once and against fresh pages only; time and minor page faults per call (``getrusage``).
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import time
from pathlib import Path

import torch

from .common import LENGTHS, SMOKE_LENGTHS, _in_fresh_processes, _status_bytes


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


def memory(lengths, device, one_process: bool = False) -> list[dict]:
    points = [(kind, length, device) for kind in ("attention, with weights", "attention, no weights", "encoder")
              for length in lengths if not (kind == "encoder" and length > 512)]  # BERT has 512 positions
    return _in_fresh_processes("--memory-point", points, one_process)


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


def measures(args: argparse.Namespace) -> dict:
    """This module's keys: key -> function(device) -> rows, with the sizes of a full or a smoke run."""
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    return {
        # a fresh process per point; a smoke run measures one length, its three points in one fresh process
        "memory": lambda device: memory(lengths[:1] if args.smoke else lengths, device, one_process=args.smoke),
        "allocation": lambda device: [row for threads in ([1] if args.smoke else [1, 2]) for row in allocation(
            [16, 32] if args.smoke else [256, 512, 1024, 2048], 1 if args.smoke else 25, device, threads)],
    }
