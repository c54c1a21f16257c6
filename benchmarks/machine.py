"""The machine record that every run writes beside its rows (``machine``, ``machine_<key>``).

Chapters 4, 13, 15, 17, 20, 22, 23 and 27 read it.

``machine(threads)``: date, platform, processor, CPU count, torch threads, Python, torch and
transformers versions, the GPU's name; ``caches()``, the page size, the C library and transparent
huge pages, so that a step in a timing can be held against them.
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
from pathlib import Path

import torch


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
