"""Test-wide settings: no network, no progress bars. Set before anything imports the HF libraries."""

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("TFCORE_CHECKPOINT", None)  # the tests are about the embedded default

ROOT = Path(__file__).resolve().parents[1]
