"""Reproducible, quiet notebooks: one call seeds everything and picks the device."""

from __future__ import annotations

import json
import logging
import os
import random
import warnings
from pathlib import Path

import numpy as np
import torch


SEED_ENV_VAR = "TFCORE_SEED"
BENCHMARK_RESULTS = Path(__file__).parent / "data" / "benchmark_results.json"


def shifted(seed: int) -> int:
    """``seed`` plus ``$TFCORE_SEED`` (0 when unset).

    Every seed the book sets goes through here (``setup`` and the training loops' batch order),
    so ``TFCORE_SEED=1`` re-runs every chapter on another trajectory: the cheapest stand-in for
    another CPU or a GPU, whose last digits differ. The data sets keep their own seeds.
    ``seed`` is an integer; the sum must lie in 0 .. 2**32 - 1, the range NumPy accepts.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an integer, got {seed!r} ({type(seed).__name__})")
    offset = os.environ.get(SEED_ENV_VAR, "0").strip() or "0"
    try:
        total = int(seed) + int(offset)
    except ValueError:
        raise ValueError(f"${SEED_ENV_VAR} must be an integer (an offset added to every seed), "
                         f"got {offset!r}") from None
    if not 0 <= total < 2**32:
        raise ValueError(f"the seed {seed} plus ${SEED_ENV_VAR} ({offset}) is {total}, outside 0 .. 2**32 - 1 "
                         f"(NumPy's range): use a smaller seed or offset")
    return total


def setup(seed: int = 0) -> torch.device:
    """Seed ``random``, NumPy and torch, silence Hugging Face chatter, and pick a device.

    - Seeds: ``random.seed``, ``np.random.seed`` and ``torch.manual_seed`` (all CUDA devices too),
      with ``shifted(seed)``: ``seed`` plus ``$TFCORE_SEED`` when that is set.
    - Quiet: no Hugging Face progress bars ("Loading weights", downloads), transformers logs only
      errors, and Python warnings are filtered, so that notebook outputs hold only what we print.
    - Printing: tensors print with 4 decimals and no scientific notation, so that last-digit float
      noise cannot change a stored output.

    Returns ``torch.device("cuda")`` when a GPU is available, else ``torch.device("cpu")``.
    """
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import huggingface_hub.utils
    import transformers

    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    seed = shifted(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    torch.set_printoptions(precision=4, sci_mode=False)

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_benchmark_results() -> dict:
    """The committed benchmark run that chapters 4, 13, 15, 17, 20, 22, 23 and 27 read.

    ``benchmarks/run.py`` writes it.

    It ships inside tfcore, so a chapter reads the same file on a clone, an installed package or
    Colab, with no network. Keys: ``machine`` (and ``machine_<key>`` for keys re-measured alone),
    then one list of rows per measurement (``attention``, ``memory``, ``allocation``, ...).
    """
    return json.loads(BENCHMARK_RESULTS.read_text())
