"""Re-execute notebooks in place, top to bottom in a fresh kernel, as nbval will.

    python tools/execute_notebooks.py                      # every notebook in notebooks/
    python tools/execute_notebooks.py notebooks/01_*.ipynb # some of them

Run it through `make execute` so that the offline environment variables are set. The stored
outputs are what the book publishes and what nbval compares against, so commit the result.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
    start = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - start


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        print(f"{path}: executed in {execute(path):.1f} s", flush=True)
