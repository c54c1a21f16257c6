"""The machine's measured peaks: matrix-multiply FLOP/s and memory bandwidth (chapter 23).

Key ``peaks``. Chapter 23 holds a decoder's passes against these two numbers (``benchmarks/roofline.py``
measures them again in its own run, with the functions below, so that its bounds come from the same
run). Each row, by ``what``:

- ``"matmul"``: a square product ``[n, n] @ [n, n]`` in ``dtype``: ``size`` (n), ``flops`` (2 n³),
  ``seconds`` (median of ``repeats`` after a warm-up), ``flops_per_second`` (flops / seconds);
  float32, bfloat16 and float16 (on the CPU: a smaller n for float16, whose product this CPU runs
  on a slow path, so that a row stays under a second), at 1 thread and at the run's thread count
  (``threads``; CUDA: ``threads`` is the CPU's, which the GPU does not use).
- ``"read"``: ``x.sum()`` over a float32 tensor of ``bytes`` bytes (256 MiB, 8 times the 32 MiB
  last-level cache of the 2-core machine, which the machine record's ``caches`` lists): ``seconds``
  (median), ``bytes_per_second`` (bytes / seconds).
- ``"copy"``: ``y.copy_(x)``, both of ``bytes / 2`` bytes: ``bytes`` counts each byte read and each
  byte written once (2 x 128 MiB); ``bytes_per_second``.

Every row also has ``dtype`` (str), ``threads``, ``repeats`` and, from run.py, ``device``. The
functions ``matmul_flops_per_second(device, dtype, threads)`` and ``read_bytes_per_second(device,
threads)`` return one number each (FLOP/s, bytes/s), for other keys to use.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

MATMUL_SIZES = {"cpu": {torch.float32: 2048, torch.bfloat16: 2048, torch.float16: 512},
                "cuda": {torch.float32: 8192, torch.bfloat16: 8192, torch.float16: 8192}}
SMOKE_MATMUL_SIZE = 64
READ_BYTES, SMOKE_READ_BYTES = 256 * 2**20, 2**20
REPEATS, SMOKE_REPEATS = 7, 1


def _sync(device: str) -> None:
    """Wait for the GPU's queued work (``"cuda"`` or ``"cuda:N"``) before reading the clock."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class _Threads:
    """``torch.set_num_threads(threads)`` inside the block, the previous count restored after it
    (``threads=None`` leaves the count as it is)."""

    def __init__(self, threads: int | None):
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a whole number >= 1 (or None for the current count), got {threads!r}")
        self.threads, self.before = threads, None

    def __enter__(self):
        self.before = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def _median_seconds(fn, device: str, repeats: int) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls, after one warm-up call,
    synchronising a CUDA device before each clock reading."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a whole number >= 1, got {repeats!r}")
    with torch.no_grad():
        fn()
        _sync(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _check_device(device) -> str:
    device = str(device)
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch.cuda.is_available() is False here; use 'cpu'")
    return device


def matmul_row(device: str = "cpu", dtype: torch.dtype = torch.float32, threads: int | None = None,
               size: int | None = None, repeats: int = REPEATS) -> dict:
    """One ``"matmul"`` row (see the module's docstring); ``size`` defaults to ``MATMUL_SIZES``."""
    device = _check_device(device)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    n = size if size is not None else MATMUL_SIZES[device.split(":")[0]][dtype]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"size must be a whole number >= 1, got {n!r}")
    generator = torch.Generator().manual_seed(0)  # drawn on the CPU, then moved (PITFALLS: CUDA draws differ)
    a, b = (torch.randn(n, n, generator=generator).to(device=device, dtype=dtype) for _ in range(2))
    with _Threads(threads):
        seconds = _median_seconds(lambda: a @ b, device, repeats)
        used = torch.get_num_threads()
    flops = 2 * n ** 3
    return dict(what="matmul", dtype=str(dtype).removeprefix("torch."), threads=used, size=n, flops=flops,
                seconds=seconds, flops_per_second=flops / seconds, repeats=repeats)


def memory_row(what: str = "read", device: str = "cpu", threads: int | None = None, nbytes: int = READ_BYTES,
               repeats: int = REPEATS) -> dict:
    """One ``"read"`` (``x.sum()`` over ``nbytes``) or ``"copy"`` (``nbytes / 2`` copied: ``nbytes``
    read and written) row."""
    device = _check_device(device)
    if what not in ("read", "copy"):
        raise ValueError(f"what must be 'read' or 'copy', got {what!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 8:
        raise ValueError(f"nbytes must be a whole number of bytes >= 8, got {nbytes!r}")
    numbers = nbytes // 4 if what == "read" else nbytes // 8
    x = torch.ones(numbers, device=device)
    if what == "read":
        fn, moved = x.sum, x.nbytes
    else:
        y = torch.empty_like(x)
        fn, moved = (lambda: y.copy_(x)), 2 * x.nbytes
    with _Threads(threads):
        seconds = _median_seconds(fn, device, repeats)
        used = torch.get_num_threads()
    return dict(what=what, dtype="float32", threads=used, bytes=moved, seconds=seconds,
                bytes_per_second=moved / seconds, repeats=repeats)


def matmul_flops_per_second(device: str = "cpu", dtype: torch.dtype = torch.float32, threads: int | None = None,
                            size: int | None = None, repeats: int = REPEATS) -> float:
    """The measured FLOP/s of a large square product in ``dtype`` on ``device`` with ``threads`` CPU
    threads (None: the current count)."""
    return matmul_row(device, dtype, threads, size, repeats)["flops_per_second"]


def read_bytes_per_second(device: str = "cpu", threads: int | None = None, nbytes: int = READ_BYTES,
                          repeats: int = REPEATS) -> float:
    """The measured bytes per second of reading ``nbytes`` (a sum over a float32 tensor, 256 MiB by
    default: far larger than the last-level cache) on ``device`` with ``threads`` CPU threads."""
    return memory_row("read", device, threads, nbytes, repeats)["bytes_per_second"]


def peaks(threads: int, device: str, smoke: bool = False) -> list[dict]:
    """Every row of the key: each dtype's product, the read and the copy, at 1 thread and at ``threads``."""
    repeats = SMOKE_REPEATS if smoke else REPEATS
    nbytes = SMOKE_READ_BYTES if smoke else READ_BYTES
    rows = []
    for count in dict.fromkeys([1, threads]):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            rows.append(matmul_row(device, dtype, count, SMOKE_MATMUL_SIZE if smoke else None, repeats))
        rows += [memory_row(what, device, count, nbytes, repeats) for what in ("read", "copy")]
    return rows


def measures(args: argparse.Namespace) -> dict:
    """This module's key: ``peaks`` -> function(device) -> rows."""
    return {"peaks": lambda device: peaks(args.threads, device, args.smoke)}
