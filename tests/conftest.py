"""Test-wide settings: no network, no progress bars. Set before anything imports the HF libraries."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("TFCORE_CHECKPOINT", None)  # the tests are about the embedded default

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")  # Debian's; never a downloaded browser


def build(source: Path) -> subprocess.CompletedProcess:
    """``jupyter-book build SOURCE -W --keep-going``: warnings are errors."""
    jupyter_book = Path(sys.executable).with_name("jupyter-book")
    return subprocess.run([str(jupyter_book), "build", str(source), "-W", "--keep-going"],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def html() -> Path:
    """A fresh build of the book, shared by the page checks and the browser test."""
    shutil.rmtree(ROOT / "_build", ignore_errors=True)
    result = build(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "WARNING" not in result.stdout + result.stderr
    return ROOT / "_build" / "html"


@pytest.fixture(scope="session")
def browser():
    """Debian's Chromium, headless, through Playwright: one for the browser tests of a worker."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield chromium
        chromium.close()
