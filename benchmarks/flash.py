"""FlashAttention: plain, tiled and fused attention, time and peak memory (chapter 17; chapter 13 reads it too).

Plain is tfcore's path with its L x L weights, tiled is ``tfcore.flash.flash_attention`` (pure
PyTorch), fused is PyTorch's SDPA.

Key ``flash``: batch 1, 4 heads of 64; CPU float32, 512 to 8192 tokens, the memory of each point
in a fresh process (``run.py --flash-memory-point``, which calls ``_flash_memory_point``); CUDA
float32 and float16 up to 32768 tokens, SDPA also forced onto each backend, a refused case
recorded with ``refused`` instead of a time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .common import _in_fresh_processes, _status_bytes, _sync


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


def measures(args: argparse.Namespace) -> dict:
    """This module's key: key -> function(device) -> rows, with the sizes of a full or a smoke run."""
    return {"flash": lambda device: flash([32] if args.smoke else [512, 1024, 2048, 4096, 8192] + (
        [16384, 32768] if device == "cuda" else []), 1 if args.smoke else 5, device, one_process=args.smoke)}
