"""Checks on the stored notebooks, written as functions that return a list of problems.

The tests in test_notebooks.py run them on the book's notebooks (expecting no problems) and on
small broken notebooks made for the purpose (expecting each problem to be found).
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]
# Outputs must not reveal where the book was executed.
UNFINISHED = re.compile(r"\b[A-Z]+_PLACEHOLDER\b|\bTODO\b|\bTBD\b|\bFIXME\b")
ANSI_COLOURS = re.compile(r"\x1b\[[0-9;]*m")
LOCAL_PATHS = re.compile(r"(/home/|/root/|/Users/|/tmp/|/work/|site-packages|[A-Z]:\\\\)")


def toc_files(toc_path: Path = ROOT / "_toc.yml") -> list[str]:
    """Every page of the table of contents, root first, in reading order (no file extension)."""
    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                yield node["file"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    toc = yaml.safe_load(toc_path.read_text())
    return [toc["root"]] + list(walk(toc.get("parts", toc.get("chapters", []))))


def toc_notebooks(toc_path: Path = ROOT / "_toc.yml") -> set[str]:
    """The notebook files (relative to the root) that the table of contents lists."""
    return {f + ".ipynb" for f in toc_files(toc_path) if f.startswith("notebooks/")}


def code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _output_texts(cell):
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            yield out.text
        for mime, value in out.get("data", {}).items():
            if mime.startswith("text/") or mime in ("application/javascript",):
                yield value if isinstance(value, str) else "".join(value)


# The book's code column at 1280 px leaves 652 px inside a code block's padding: 77 characters of
# the theme's 14 px monospace, 83 of the 13 px that book/_ext/static/code_column.css sets. A code
# line or a text output line wider than this hides behind a scroll bar (the browser test checks it).
LINE_LENGTH = 79
MAX_BYTES = 1_000_000  # what a reader downloads: a notebook, or a page of the book
# Code that reads the clock. What it measures depends on the machine and its load, so such a cell
# may print only claims (tfcore.check lines, with the value inside "[this run: ...]").
CLOCK = re.compile(r"\bperf_counter\b|\btime\.time\(|\btime\.monotonic\b|\btimeit\b|^\s*%%?time|"
                   r"\bthread_time\b|\bprocess_time\b|\butils\.benchmark\b|\bbenchmark\.Timer\b", re.MULTILINE)
CLAIM_LINE = re.compile(r"^(✓|–) ")
# The sanitize rule that masks a trajectory value (tests/sanitize.cfg, [this-run]).
THIS_RUN = re.compile(r"\[this run: (?:[^\[\]\n]|\[[^\[\]\n]*\])*\]")
WALL_CLOCK_VERDICT = re.compile(r"(under|within|less than|faster than)[\w ]*(second|minute|ms\b)s?\W*(True|False)", re.IGNORECASE)


VIEW = re.compile(r"\bviz\.\w+_view\(")  # a bertviz view: its div id is random; the browser test draws it


def hygiene_problems(path: Path) -> list[str]:
    """Executed top to bottom, no errors or stderr, no local paths, a title, under 1 MB, no clock
    reading in a compared output, and no output left uncompared that states no checked claim."""
    nb = nbformat.read(path, as_version=4)
    problems = []
    size = path.stat().st_size
    if size > MAX_BYTES:
        problems.append(f"the notebook is {size:,} bytes, over the {MAX_BYTES:,} a reader should download")
    first = nb.cells[0] if nb.cells else None
    if first is None or first.cell_type != "markdown" or not first.source.startswith("# "):
        problems.append("the first cell is not a markdown title ('# ...')")
    for cell in nb.cells:
        if cell.cell_type == "markdown" and UNFINISHED.search(cell.source):
            problems.append(f"unfinished text in a markdown cell: {UNFINISHED.search(cell.source).group(0)!r}")
    cells = code_cells(nb)
    for cell in cells:
        if not cell.source.strip():
            problems.append("an empty code cell")
    counts = [c.execution_count for c in cells]
    if counts != list(range(1, len(cells) + 1)):
        problems.append(f"code cells not executed in order from 1 in one run: {counts}")
    for i, cell in enumerate(cells, 1):
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                problems.append(f"code cell {i} stores an error: {out.get('ename')}")
            if out.output_type == "stream" and out.name == "stderr":
                problems.append(f"code cell {i} stores stderr output: {out.text[:80]!r}")
        if "nbval-ignore-output" in cell.metadata.get("tags", []) and not VIEW.search(cell.source):
            printed = [line for text in _output_texts(cell) for line in text.splitlines()]
            if not any(CLAIM_LINE.match(line) for line in printed):
                problems.append(f"code cell {i}'s output is not compared (nbval-ignore-output) and states no "
                                f"claim: nothing checks it; add a tfcore.check, or compare the output")
        if CLOCK.search(cell.source):
            printed = [line for text in _output_texts(cell) for line in text.splitlines() if line.strip()]
            unchecked = [line for before, line in zip([""] + printed, printed)
                         if not CLAIM_LINE.match(line) and not (_continues_a_claim(before, line))]
            if unchecked:
                problems.append(f"code cell {i} reads the clock and prints {unchecked[0]!r}: a time depends on "
                                f"the machine; print only claims (tfcore.check) about it")
        for text in _output_texts(cell):
            if WALL_CLOCK_VERDICT.search(text):
                problems.append(f"code cell {i} stores a wall-clock verdict {WALL_CLOCK_VERDICT.search(text).group(0)!r}")
            for line in text.splitlines():
                if "[this run:" in line and "[this run:" in THIS_RUN.sub("", line):
                    problems.append(f"code cell {i} prints a [this run: ...] value that the sanitize rule cannot mask "
                                    f"(brackets nested more than one deep, or no closing bracket): {line[:120]!r}")
            match = LOCAL_PATHS.search(text)
            if match:
                problems.append(f"code cell {i} output shows a local path near {text[max(0, match.start() - 30):match.end() + 30]!r}")
    return problems


def width_problems(path: Path, width: int = LINE_LENGTH) -> list[str]:
    """Every line the built book shows in a code block fits its code column: the code of each cell
    the book shows (not the Colab install cell, tagged ``remove-cell``), the code blocks of the
    prose, and every text output. ``tools/fit_code.py`` fits the code; outputs are fitted by hand
    (``tfcore.check`` wraps its claims)."""
    nb = nbformat.read(path, as_version=4)
    problems = []
    for i, cell in enumerate(code_cells(nb), 1):
        if "remove-cell" in cell.metadata.get("tags", []):
            continue
        wide = [line for line in cell.source.splitlines() if len(line) > width]
        if wide:
            problems.append(f"code cell {i}: {len(wide)} code line(s) wider than {width} characters, "
                            f"e.g. {wide[0][:50]!r}... ({len(wide[0])}): run tools/fit_code.py")
        if "remove-output" in cell.metadata.get("tags", []):
            continue
        lines = [line for text in _output_texts(cell) if not text.lstrip().startswith("<")
                 for line in ANSI_COLOURS.sub("", text).splitlines()]
        wide = [line for line in lines if len(line) > width]
        if wide:
            problems.append(f"code cell {i}: {len(wide)} output line(s) wider than {width} characters, "
                            f"e.g. {wide[0][:50]!r}... ({len(wide[0])})")
    for j, cell in enumerate((c for c in nb.cells if c.cell_type == "markdown"), 1):
        # a fence with a language or none is a code block; "```{dropdown}" and the like hold prose
        blocks = re.findall(r"^```[\w-]*\n(.*?)^```", cell.source, re.MULTILINE | re.DOTALL)
        wide = [line for block in blocks for line in block.splitlines() if len(line) > width]
        if wide:
            problems.append(f"markdown cell {j}: a code block line wider than {width} characters: "
                            f"{wide[0][:50]!r}... ({len(wide[0])})")
    return problems


def _continues_a_claim(before: str, line: str) -> bool:
    """A printed claim wraps at LINE_LENGTH: its continuation lines start with two spaces."""
    return line.startswith("  ") and (CLAIM_LINE.match(before) is not None or before.startswith("  "))


def _normalized(node: ast.AST) -> str:
    """The AST without docstrings (comments never reach the AST)."""
    node = ast.parse(ast.unparse(node))  # a fresh copy
    for sub in ast.walk(node):
        body = getattr(sub, "body", None)
        if (isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)):
            sub.body = body[1:] or [ast.Pass()]
    return ast.dump(node, include_attributes=False)


def _cell_python(source: str) -> str:
    """Cell source as plain Python (IPython magics translated)."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def teaching_marker(name: str) -> re.Pattern:
    """``name`` as tfcore spells it: ``NAME`` or ``keras_transformer.NAME``."""
    return re.compile(rf"#\s*teaching version of tfcore\.{re.escape(name)}\b", re.IGNORECASE)


@functools.lru_cache(maxsize=None)
def _exports(package) -> dict[str, tuple[str, ast.AST]]:
    """Each function or class a package exports: its name -> (the name after ``tfcore.``, its AST).

    Read once per package and process (``inspect.getsource`` parses a class's whole module: about
    2 s for tfcore); the caller must not change the dict it gets."""
    prefix = package.__name__.partition(".")[2]
    exported = {}
    for name in package.__all__:
        obj = getattr(package, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            exported[name] = (f"{prefix}.{name}" if prefix else name, ast.parse(inspect.getsource(obj)).body[0])
    return exported


def sync_problems(path: Path, *packages) -> list[str]:
    """A name that tfcore exports and the notebook defines again must be tfcore's own code, or be
    marked in its cell with a comment '# teaching version of tfcore.NAME'. In a notebook that uses
    Keras, the names of ``tfcore.keras_transformer`` too ('# teaching version of
    tfcore.keras_transformer.NAME')."""
    nb = nbformat.read(path, as_version=4)
    if not packages:
        import tfcore

        packages = (tfcore,)
        if any("keras" in cell.source for cell in code_cells(nb)):  # chapter 9's torch DecoderLayer is not Keras'
            from tfcore import keras_transformer

            packages += (keras_transformer,)
    exported = {}
    for package in packages:
        exported |= _exports(package)
    problems = []
    for i, cell in enumerate(code_cells(nb), 1):
        tree = ast.parse(_cell_python(cell.source))
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name not in exported:
                continue
            qualified, original = exported[node.name]
            if _normalized(node) == _normalized(original):
                continue
            if teaching_marker(qualified).search(cell.source):
                continue
            problems.append(
                f"code cell {i} defines {node.name}, which differs from tfcore.{qualified}: make it "
                f"the same code, or mark the cell '# teaching version of tfcore.{qualified}'")
    return problems


def colab_problems(path: Path, repo_url: str) -> list[str]:
    """The first code cell installs tfcore from this book's repository, only on Colab, and is
    removed from the built book (tag ``remove-cell``): a reader of the page has nothing to install."""
    nb = nbformat.read(path, as_version=4)
    cells = code_cells(nb)
    source = cells[0].source if cells else ""
    problems = []
    if 'if "google.colab" in sys.modules' not in source:
        problems.append("the first code cell does not guard its installs with the Colab check")
    if f"git+{repo_url}" not in source:
        problems.append(f"the first code cell does not install tfcore from {repo_url}")
    if cells and "remove-cell" not in cells[0].metadata.get("tags", []):
        problems.append("the first code cell (the Colab install) is not tagged 'remove-cell' for the book")
    return problems


if __name__ == "__main__":  # handy by hand: python tests/notebook_checks.py notebooks/*.ipynb
    for arg in sys.argv[1:]:
        for problem in hygiene_problems(Path(arg)) + sync_problems(Path(arg)):
            print(f"{arg}: {problem}")


def execute(path: Path, env: dict | None = None, timeout: int = 600) -> str | None:
    """Run a notebook top to bottom in a fresh kernel, comparing no output; return None when every
    cell ran, else the failing cell's error (its traceback, uncoloured).

    This is what a run under another seed or checkpoint must show: every claim the book makes is
    an assert (``tfcore.check``), so a claim that fails raises. It is ``nbval --nbval-lax`` without
    a pytest process of its own to start (about 2.5 s a notebook), stopping at the first error
    (nbval goes on to the next cells). ``env`` is added to the environment of the kernel;
    ``timeout`` is per cell, in seconds. The stored notebook is not changed.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute(env=os.environ | (env or {}))
    except CellExecutionError as error:
        return ANSI_COLOURS.sub("", str(error))
    return None


def nbval(*paths: Path, lax: bool = False, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run nbval on notebooks in a fresh pytest, outside this project's pytest config.

    Strict by default (every stored output compared, after tests/sanitize.cfg). ``lax=True``
    compares no output: a run passes when no cell raises (``execute`` does the same in this
    process, faster). ``env`` is added to the environment of the kernel.
    """
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--color=no", "--nbval-lax" if lax else "--nbval",
               "--nbval-current-env", "--nbval-sanitize-with", str(ROOT / "tests" / "sanitize.cfg"),
               "--nbval-cell-timeout", "600", *(str(p) for p in paths)]
    result = subprocess.run(command, cwd=paths[0].parent, capture_output=True, text=True, timeout=timeout,
                            env=os.environ | (env or {}))
    result.stdout = ANSI_COLOURS.sub("", result.stdout)  # tracebacks from the kernel are coloured
    return result
