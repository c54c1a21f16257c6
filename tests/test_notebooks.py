"""The stored notebooks: listed in the book, executed, clean, in sync with tfcore, and really checked
by nbval. Every check is also run on a broken notebook, to show that it can fail."""

from __future__ import annotations

import ast
import inspect
import json
import textwrap

import nbformat
import pytest
import yaml
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from notebook_checks import (LINE_LENGTH, ROOT, colab_problems, hygiene_problems, nbval, sync_problems,
                             toc_notebooks, width_problems)

NOTEBOOKS = sorted(ROOT.glob("notebooks/*.ipynb"))
REPO_URL = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found in notebooks/"


def test_every_notebook_is_in_the_toc_and_every_toc_entry_exists():
    on_disk = {p.relative_to(ROOT).as_posix() for p in NOTEBOOKS}
    listed = toc_notebooks()
    assert not listed - on_disk, f"_toc.yml lists notebooks that do not exist: {listed - on_disk}"
    assert not on_disk - listed, f"notebooks missing from _toc.yml: {on_disk - listed}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_hygiene(path):
    assert hygiene_problems(path) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_agrees_with_tfcore(path):
    assert sync_problems(path) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_line_fits_the_code_column(path):
    assert width_problems(path) == []


def test_the_code_is_formatted_to_the_code_column():
    """ruff's formatter at the book's line length (tools/fit_code.py runs it and splits what it
    cannot) leaves every chapter as it is."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "ruff", "format", "--isolated", "--check", "--target-version=py310",
                             f"--line-length={LINE_LENGTH}", *map(str, NOTEBOOKS)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_opens_on_colab(path):
    assert colab_problems(path, REPO_URL) == []


def install_cells(paths) -> dict[str, list[str]]:
    """Each distinct Colab install cell (the first code cell), with the chapters that carry it."""
    found: dict[str, list[str]] = {}
    for path in paths:
        cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        found.setdefault(cells[0].source if cells else "", []).append(path.name)
    return found


def test_every_install_cell_is_the_same_and_names_this_repository():
    """A fork changes the repository URL in `_config.yml` and in one cell copied to every chapter:
    this test then names every chapter still to change."""
    found = install_cells(NOTEBOOKS)
    assert len(found) == 1, "the chapters' install cells differ: " + "; ".join(
        f"{len(names)} chapter(s) like {names[0]}" for names in found.values())
    assert f"git+{REPO_URL}" in next(iter(found)), f"the install cell does not name {REPO_URL} (_config.yml)"


# --- the same checks, shown to fail on broken notebooks -------------------------------------

def test_install_cells_that_differ_are_told_apart(tmp_path):
    first = _notebook(tmp_path, _executed(f'pip("git+{REPO_URL}")', 1), name="01_a.ipynb")
    fork = _notebook(tmp_path, _executed('pip("git+https://github.com/someone/fork")', 1), name="02_b.ipynb")
    assert len(install_cells([first, first])) == 1
    assert len(install_cells([first, fork])) == 2


def _notebook(tmp_path, *cells, name="broken.ipynb"):
    nb = new_notebook(cells=list(cells))
    path = tmp_path / name
    nbformat.write(nb, path)
    return path


def _executed(source, count, *outputs):
    cell = new_code_cell(source, execution_count=count)
    cell.outputs = list(outputs)
    return cell


def _ignored(cell):
    cell.metadata["tags"] = ["nbval-ignore-output"]
    return cell


def test_a_line_wider_than_the_code_column_is_found(tmp_path):
    fits = _executed("x = 1", 1, new_output("stream", name="stdout", text="✓ fits\n"))
    assert width_problems(_notebook(tmp_path, new_markdown_cell("# T"), fits)) == []
    wide_code = _executed("x = 1  # " + "y" * 80, 1)
    wide_output = _executed("x = 1", 1, new_output("stream", name="stdout", text="z" * 80 + "\n"))
    wide_block = new_markdown_cell("# T\n\n```python\n" + "w" * 80 + "\n```\n")
    dropdown = new_markdown_cell("```{dropdown} Why\n" + "prose " * 20 + "\n```\n")
    found = width_problems(_notebook(tmp_path, wide_block, dropdown, wide_code, wide_output))
    assert [p.split(":")[0] for p in found] == ["code cell 1", "code cell 2", "markdown cell 1"], found
    assert "code line" in found[0] and "output line" in found[1]


def test_hygiene_accepts_uncompared_outputs_that_are_checked_claims_or_views(tmp_path):
    checked = _ignored(_executed("print(table); tfcore.check('low', loss < 1, measured=loss)", 1, new_output(
        "stream", name="stdout", text="loss 0.31\n✓ low  [this run: 0.31]\n")))
    view = _ignored(_executed("viz.head_view('a b', 'c d')", 2))
    assert hygiene_problems(_notebook(tmp_path, new_markdown_cell("# Title"), checked, view)) == []


def test_hygiene_accepts_a_clean_notebook(tmp_path):
    path = _notebook(tmp_path, new_markdown_cell("# Title"),
                     _executed("print(1)", 1, new_output("stream", name="stdout", text="1\n")))
    assert hygiene_problems(path) == []


@pytest.mark.parametrize("broken, expected", [
    ([new_markdown_cell("no title"), _executed("x = 1", 1)], "title"),
    ([new_markdown_cell("# T"), new_code_cell("x = 1")], "not executed in order"),
    ([new_markdown_cell("# T"), _executed("x = 1", 2), _executed("y = 2", 1)], "not executed in order"),
    ([new_markdown_cell("# T"), _executed("x = 1", 1), new_code_cell("")], "empty code cell"),
    ([new_markdown_cell("# T"), new_markdown_cell("RESULTS_PLACEHOLDER"), _executed("x = 1", 1)], "unfinished text"),
    ([new_markdown_cell("# T"), _executed("1/0", 1, new_output("error", ename="ZeroDivisionError",
                                                               evalue="", traceback=[]))], "error"),
    ([new_markdown_cell("# T"), _executed("import warnings", 1,
                                          new_output("stream", name="stderr", text="careful\n"))], "stderr"),
    ([new_markdown_cell("# T"), _executed("print(path)", 1, new_output(
        "stream", name="stdout", text="/root/project/.venv/lib/python3.11/site-packages/x.py\n"))], "local path"),
    ([new_markdown_cell("# T"), _executed("path", 1, new_output(
        "execute_result", data={"text/plain": "'/home/reader/book'"}, execution_count=1))], "local path"),
    ([new_markdown_cell("# T"), _executed("t = time.perf_counter()\nprint(time.perf_counter() - t)", 1,
                                          new_output("stream", name="stdout", text="0.42\n"))], "reads the clock"),
    ([new_markdown_cell("# T"), _executed("t = time.thread_time()\nprint('steps', 3)", 1,
                                          new_output("stream", name="stdout", text="steps 3\n"))], "reads the clock"),
    ([new_markdown_cell("# T"), _executed("from torch.utils import benchmark\nbenchmark.Timer('f()').timeit(3)", 1,
                                          new_output("stream", name="stdout", text="0.42\n"))], "reads the clock"),
    ([new_markdown_cell("# T"), _executed("print('trained in under two minutes:', s < 120)", 1, new_output(
        "stream", name="stdout", text="trained in under two minutes: True\n"))], "wall-clock verdict"),
    ([new_markdown_cell("# T"), _executed("check", 1, new_output(
        "stream", name="stdout", text="✓ close  [this run: [[0.1, 0.2]] 0.3]\n"))], "cannot mask"),
    ([new_markdown_cell("# T"), _ignored(_executed("print(table)", 1, new_output(
        "stream", name="stdout", text="loss 0.31\n")))], "states no claim"),
    ([new_markdown_cell("# T"), _executed("big", 1, new_output(
        "execute_result", data={"text/plain": "x" * 1_000_001}, execution_count=1))], "over the 1,000,000"),
])
def test_hygiene_finds_each_problem(tmp_path, broken, expected):
    problems = hygiene_problems(_notebook(tmp_path, *broken))
    assert any(expected in p for p in problems), problems


def test_hygiene_accepts_a_clock_that_prints_only_claims(tmp_path):
    source = "t = time.perf_counter()\nseconds = time.perf_counter() - t\ntfcore.check('fast', seconds < 9, measured=seconds)"
    path = _notebook(tmp_path, new_markdown_cell("# T"), _executed(source, 1, new_output(
        "stream", name="stdout", text="✓ fast  [this run: 0.001]\n")))
    assert hygiene_problems(path) == []


def test_toc_check_sees_a_missing_entry(tmp_path):
    toc = tmp_path / "_toc.yml"
    toc.write_text("format: jb-book\nroot: book/intro\nchapters:\n  - file: notebooks/01_a\n"
                   "  - file: notebooks/02_b\n")
    assert toc_notebooks(toc) == {"notebooks/01_a.ipynb", "notebooks/02_b.ipynb"}


def _setup_copy() -> str:
    """tfcore.setup's own code, with another docstring and an added comment."""
    import tfcore

    source = textwrap.dedent(inspect.getsource(tfcore.setup))
    docstring = ast.get_docstring(ast.parse(source).body[0], clean=False)
    source = source.replace(docstring, "A different docstring does not matter.")
    return source.replace("    random.seed(seed)", "    # comments do not matter either\n    random.seed(seed)")


SETUP_COPY = _setup_copy()

SETUP_DRIFTED = '''
def setup(seed=0):
    torch.manual_seed(seed)
    return torch.device("cpu")
'''


def test_sync_accepts_tfcore_own_code(tmp_path):
    assert "A different docstring" in SETUP_COPY and "# comments do not" in SETUP_COPY
    path = _notebook(tmp_path, new_markdown_cell("# T"), _executed(SETUP_COPY, 1))
    assert sync_problems(path) == []


def test_sync_rejects_a_drifted_copy(tmp_path):
    path = _notebook(tmp_path, new_markdown_cell("# T"), _executed(SETUP_DRIFTED, 1))
    problems = sync_problems(path)
    assert len(problems) == 1 and "differs from tfcore.setup" in problems[0], problems


def test_sync_accepts_a_marked_teaching_version(tmp_path):
    marked = "# Teaching version of tfcore.setup: only torch is seeded here.\n" + SETUP_DRIFTED
    path = _notebook(tmp_path, new_markdown_cell("# T"), _executed(marked, 1))
    assert sync_problems(path) == []


def test_sync_sees_through_magics(tmp_path):
    path = _notebook(tmp_path, new_markdown_cell("# T"), _executed("%matplotlib inline\n" + SETUP_DRIFTED, 1))
    assert len(sync_problems(path)) == 1


def test_sync_covers_the_keras_module(tmp_path):
    from tfcore import keras_transformer

    source = inspect.getsource(keras_transformer.FeedForwardLayer)
    drifted = source.replace("approximate=False", "approximate=True")
    assert drifted != source
    same = _notebook(tmp_path, new_markdown_cell("# T"), _executed(source, 1))
    assert sync_problems(same) == []
    path = _notebook(tmp_path, new_markdown_cell("# T"), _executed(drifted, 1))
    problems = sync_problems(path)
    assert len(problems) == 1 and "differs from tfcore.keras_transformer.FeedForwardLayer" in problems[0], problems
    marked = "# teaching version of tfcore.keras_transformer.FeedForwardLayer\n" + drifted
    path = _notebook(tmp_path, new_markdown_cell("# T"), _executed(marked, 1))
    assert sync_problems(path) == []


def test_every_sanitize_rule_is_read_by_nbval():
    import re

    from nbval.plugin import get_sanitize_patterns

    text = (ROOT / "tests" / "sanitize.cfg").read_text()
    patterns = get_sanitize_patterns(text)
    assert len(patterns) == text.count("\n[")  # a rule nbval cannot parse is dropped without a word

    def sanitize(s):
        for regex, replace in patterns:
            s = re.sub(regex, replace, s)
        return s

    # A trajectory value is masked whole, even with a list or a "[CLS]" key inside it; the text
    # around it is still compared.
    assert sanitize("✓ a  [this run: [CLS] 0.98, pooler [0.9, 0.1]] (of 54)") == "✓ a [this run: ...] (of 54)"
    assert sanitize("✓ a  [this run: 0.98] b") == "✓ a [this run: ...] b"
    # A short value stays on the claim's line, a long one gets a line of its own: both compare
    # equal, while a changed word of the claim still does not.
    same_line = "✓ the gap is below 1e-4 (|ours - theirs| < 1e-4)  [this run: 3e-06]"
    own_line = "✓ the gap is below 1e-4 (|ours - theirs| < 1e-4)\n  [this run: 3.0517578125e-06, worst 7]"
    assert sanitize(same_line) == sanitize(own_line) == "✓ the gap is below 1e-4 (|ours - theirs| < 1e-4) [this run: ...]"
    assert sanitize(own_line.replace("below", "above")) != sanitize(same_line)

    cpu = "tensor([[0.1000, 0.2000]])\ntensor([1, 2], dtype=torch.int32)"
    gpu = "tensor([[0.1000, 0.2000]],\n       device='cuda:0')\ntensor([1, 2], device='cuda:0', dtype=torch.int32)"
    assert sanitize(gpu) == sanitize(cpu) == cpu


def test_colab_check_rejects_an_unguarded_install(tmp_path):
    path = _notebook(tmp_path, new_markdown_cell("# T"), _executed("!pip install tfcore", 1))
    assert len(colab_problems(path, REPO_URL)) == 3


def test_colab_check_wants_the_install_cell_out_of_the_book(tmp_path):
    source = f'import sys\nif "google.colab" in sys.modules:\n    !pip install "tfcore[book] @ git+{REPO_URL}"'
    cell = _executed(source, 1)
    path = _notebook(tmp_path, new_markdown_cell("# T"), cell)
    assert colab_problems(path, REPO_URL) == ["the first code cell (the Colab install) is not tagged 'remove-cell' for the book"]
    cell.metadata["tags"] = ["remove-cell"]
    path = _notebook(tmp_path, new_markdown_cell("# T"), cell, name="tagged.ipynb")
    assert colab_problems(path, REPO_URL) == []


# --- nbval itself: a changed stored output must make it fail ---------------------------------

def test_nbval_fails_when_a_stored_output_changes(tmp_path):
    source = ROOT / "notebooks" / "01_text_to_tensors.ipynb"
    nb = json.loads(source.read_text())
    # Keep the cells up to the first tokenization output, which holds the ids of the chapter.
    cut = next(i for i, c in enumerate(nb["cells"])
               if any("2051, 10029, 2066, 2019, 8612" in "".join(o.get("text", ""))
                      for o in c.get("outputs", [])))
    nb["cells"] = nb["cells"][:cut + 1]
    control = tmp_path / "control" / "ch01.ipynb"
    control.parent.mkdir()
    control.write_text(json.dumps(nb))

    changed_nb = json.loads(json.dumps(nb))
    output = next(o for o in changed_nb["cells"][cut]["outputs"] if "2051" in "".join(o["text"]))
    output["text"] = [line.replace("2051,", "2052,") for line in output["text"]]
    changed = tmp_path / "changed" / "ch01.ipynb"
    changed.parent.mkdir()
    changed.write_text(json.dumps(changed_nb))

    passed = nbval(control)
    assert passed.returncode == 0, passed.stdout[-3000:]
    failed = nbval(changed)
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert "2052" in failed.stdout and "1 failed" in failed.stdout, failed.stdout[-3000:]
