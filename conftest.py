"""pytest-xdist settings for the whole repository (tests/ and the notebooks that nbval collects).

`make test` runs two workers (``pytest -n 2``), one per core of the CI machine.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker (the notebook kernels inherit it): with two threads each, each
    # worker's threads wait on the other's and both crawl.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests that share the built book: the `html` fixture builds it into the one `_build` folder.
BOOK_TESTS = {"tests/test_book.py", "tests/test_browser.py", "tests/test_gpt_page.py"}


def _rank(nodeid: str) -> int:
    """The longest units first (chapters 8, 25 and 10 train for one to two and a half minutes
    each), then the other runs of whole chapters and the built book, then the notebooks, then
    everything else, so that no worker is left alone with a long unit at the end while the
    other core idles (each worker has one thread)."""
    longest = ("08_", "25_", "10_")
    if any(nodeid.startswith(f"tests/test_robustness.py::test_chapter_keeps_its_claims_under_another_seed[{c}")
           for c in longest):
        return 0
    if any(nodeid.startswith(f"notebooks/{c}") for c in longest):
        return 1
    if nodeid.startswith("tests/test_robustness.py::test_chapter_") or nodeid.split("::")[0] in BOOK_TESTS:
        return 2  # whole chapters again, and the book's build and browser walk (one unit)
    if nodeid.startswith("notebooks/"):
        return 3
    return 4


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: _rank(item.nodeid))  # stable: a notebook's cells keep their order


def pytest_xdist_make_scheduler(config, log):
    """Send what must run in one process to one worker as a unit: all cells of a notebook, which
    nbval runs in order in one kernel, and the tests of the built book. Every other test is a
    unit of its own. (nbval's cells ignore ``xdist_group`` marks: it defines their node ids.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.endswith(".ipynb"):
                return path
            return "book" if path in BOOK_TESTS else nodeid

    config.option.loadscopereorder = False  # keep the order above (xdist would sort by test count)
    return Scheduling(config, log)
