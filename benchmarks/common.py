"""What the keys' measurements share: the timers, the fresh processes, chapter 13's lengths and repeats.

No chapter reads it directly.

- ``median_time``: the median of ``repeats`` calls after warm-up, in ``torch.no_grad()`` (the
  ``attention``, ``encoder``, ``layers``, ``additive`` and ``encoder_parts`` keys);
- ``_take_turns``: ``torch.utils.benchmark.Timer`` medians, the statements taking turns
  (``generation``, ``cache``, ``per_token``, ``speculative``);
- ``_in_fresh_processes``: re-invokes ``benchmarks/run.py`` with a hidden flag, one fresh process
  per point, and reads back the JSON row each prints (``memory``, ``flash``);
- ``_status_bytes`` (Linux's /proc/self/status) and ``_sync`` (CUDA).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RUN = Path(__file__).resolve().parent / "run.py"  # the entry point, which the fresh processes run

# chapter 13's keys: attention, memory, layers and additive take these lengths (additive up to
# 1024); attention, encoder, layers, additive and encoder_parts these repeats
LENGTHS, SMOKE_LENGTHS = [64, 128, 256, 512, 1024, 2048], [16, 32]
REPEATS, SMOKE_REPEATS = 7, 1  # a smoke run checks that every row is written, not its median


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


def _status_bytes(field: str) -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _in_fresh_processes(flag: str, points: list[tuple], one_process: bool = False) -> list[dict]:
    """Run ``benchmarks/run.py FLAG POINT...``, a fresh process for each point, and return the
    JSON row that each point prints (its last line of output).

    ``one_process`` (smoke runs only) measures all the points one after the other in one fresh
    process: a smoke run checks that such a process starts, measures and reports, and each start
    costs seconds of imports (about 5 s of CPU time for the encoder's). A full run never sets it.
    """
    rows = []
    for group in [points] if one_process else [[point] for point in points]:
        command = [sys.executable, str(RUN)] + [str(part) for point in group for part in (flag, *point)]
        out = subprocess.run(command, capture_output=True, text=True, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
        rows += [json.loads(line) for line in out.stdout.strip().splitlines()[-len(group):]]
    return rows


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
