"""pytest-xdist settings for the whole repository (tests/ and the notebooks that nbval collects).

`make test` runs two workers (``pytest -n 2``), one per core of the CI machine.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker (the notebook kernels inherit it): with two threads each, each
    # worker's threads wait on the other's and both crawl.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests that share the built book: the `html` fixture builds it into the one `_build` folder.
BOOK_TESTS = {"tests/test_book.py", "tests/test_browser.py"}


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

    return Scheduling(config, log)
