"""The book builds with warnings as errors, and the pages show the stored, nbval-verified outputs."""

from __future__ import annotations

import re
from html import escape
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from notebook_checks import ROOT, toc_files, toc_notebooks
from views import views

from conftest import build


def test_no_cdn_in_the_built_book(html):
    """Everything a page loads comes from the book: no CDN URL anywhere in the HTML."""
    offenders = [p.relative_to(html).as_posix() for p in html.rglob("*.html")
                 if re.search(r"cdnjs|jsdelivr|cdn\.mathjax", p.read_text())]
    assert offenders == []
    assert (html / "mathjax" / "tex-mml-chtml.js").is_file()


def test_every_toc_page_is_built(html):
    pages = [html / (page + ".html") for page in toc_files()]
    assert len(pages) >= 14, "the table of contents is missing pages"
    for page in pages:
        assert page.is_file() and page.stat().st_size > 10_000, page


def test_chapters_are_numbered_in_reading_order():
    notebooks = [f for f in toc_files() if f.startswith("notebooks/")]
    titles = [nbformat.read(ROOT / (f + ".ipynb"), as_version=4).cells[0].source.splitlines()[0]
              for f in notebooks]
    numbers = [int(re.match(r"# (\d+)\. ", t).group(1)) for t in titles]
    assert numbers == list(range(1, len(notebooks) + 1)), titles
    assert all(Path(f).name.startswith(f"{n:02d}_") for f, n in zip(notebooks, numbers))


def test_previous_and_next_links_follow_the_table_of_contents(html):
    pages = toc_files()
    for before, page, after in zip(pages, pages[1:], pages[2:]):
        text = (html / (page + ".html")).read_text()
        previous = re.search(r'class="left-prev"\s+href="([^"]+)"', text)
        following = re.search(r'class="right-next"\s+href="([^"]+)"', text)
        assert previous and (html / page).parent.joinpath(previous.group(1)).resolve() == (html / (before + ".html")).resolve(), page
        assert following and (html / page).parent.joinpath(following.group(1)).resolve() == (html / (after + ".html")).resolve(), page


def test_landing_page_shows_the_chapter_map(html):
    page = (html / "book" / "intro.html").read_text()
    assert re.search(r'<img[^>]+src="../_images/chapter_map\.svg"', page)
    svg = (ROOT / "book" / "chapter_map.svg").read_text()
    for number in range(1, len(toc_notebooks()) + 1):
        assert f"{number}. " in svg or f">{number}." in svg


def test_landing_page_shows_the_start_box_the_drawing_and_the_models_page(html):
    page = (html / "book" / "intro.html").read_text()
    assert re.search(r'<div class="tip admonition">\s*<p class="admonition-title">Start here', page)
    assert 'href="https://colab.research.google.com/github/' in page
    assert "└→ 19 ┬→ 20" in page and 'href="models.html"' in page
    # "What checks it": a sample checked claim, and the link to the README's full list of checks
    assert "✓ the held-out accuracy is at least 0.98  [this run: 0.992]" in page
    assert 'href="https://github.com/transformer-anatomy/transformer-anatomy#the-two-commands"' in page
    models = (html / "book" / "models.html").read_text()
    assert "GPT2LMHeadModel" in models and "MistralForCausalLM" in models and "Chapter 28." in models


@pytest.mark.parametrize("notebook", sorted(toc_notebooks()))
def test_page_shows_the_stored_outputs_and_figures(html, notebook):
    page = (html / Path(notebook).with_suffix(".html")).read_text()
    nb = nbformat.read(ROOT / notebook, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    images = re.findall(r'<img alt="[^"]*" src="(\.\./_images/[^"]+\.png)"', page)
    assert len(images) == len(figures)
    for src in images:
        assert (html / "notebooks" / src).resolve().stat().st_size > 5_000, src
    # Every line of printed text appears on the page, HTML-escaped.
    for text in (o.text for o in outputs if o.output_type == "stream"):
        for line in filter(None, (l.strip() for l in text.splitlines())):
            assert escape(line, quote=False) in page, line


def test_the_colab_install_cell_is_not_on_the_pages(html):
    """Each notebook keeps its Colab install cell (tagged remove-cell); a reader of the book has
    nothing to install, so the page does not show it."""
    for notebook in sorted(toc_notebooks()):
        source = nbformat.read(ROOT / notebook, as_version=4).cells
        assert any('"google.colab" in sys.modules' in c.source for c in source if c.cell_type == "code")
        page = (html / Path(notebook).with_suffix(".html")).read_text()
        assert "google.colab" not in page and "pip install" not in page, notebook


def test_colab_button_opens_the_chapter(html):
    for notebook in sorted(toc_notebooks()):
        page = (html / Path(notebook).with_suffix(".html")).read_text()
        assert f"https://colab.research.google.com/github/" in page
        assert re.search(rf'colab\.research\.google\.com/github/[^"]+/blob/main/{re.escape(notebook)}"', page)


def test_the_build_fails_on_a_notebook_without_a_title(tmp_path):
    (tmp_path / "_config.yml").write_text("title: t\nexecute:\n  execute_notebooks: 'off'\n")
    (tmp_path / "_toc.yml").write_text("format: jb-book\nroot: intro\nchapters:\n  - file: untitled\n")
    (tmp_path / "intro.md").write_text("# Intro\n")
    nb = new_notebook(cells=[new_markdown_cell("no heading here"), new_code_cell("1")],
                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                               "language": "python"},
                                "language_info": {"name": "python"}})
    nbformat.write(nb, tmp_path / "untitled.ipynb")
    result = build(tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode != 0
    assert "WARNING" in log and "'untitled' that doesn't have a title" in log


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^(\S.*?)\s+# run every test$", readme, re.MULTILINE).group(1)
    ci_lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines()
                if l.strip() and not l.startswith(("#", "set "))]
    assert ci_lines == [command]


def _stored_views(notebook: str) -> list[dict]:
    nb = nbformat.read(ROOT / notebook, as_version=4)
    return views("".join(o.get("data", {}).get("text/html", "")
                         for c in nb.cells if c.cell_type == "code" for o in c.outputs))


@pytest.mark.parametrize("notebook", sorted(toc_notebooks()))
def test_page_carries_every_attention_view_of_its_notebook(html, notebook):
    page = (html / Path(notebook).with_suffix(".html")).read_text()
    built, stored = views(page), _stored_views(notebook)
    assert sorted(v["root_div_id"] for v in built) == sorted(v["root_div_id"] for v in stored)
    if built:  # the libraries bertviz's scripts need come once, from the book itself, not a CDN
        from tfcore.viz import LOADER_MARK, site_script

        assert LOADER_MARK not in page and "cdnjs" not in page
        [src] = re.findall(r'<script src="([^"]*_tfcore/viz\.js)"></script>', page)
        assert (html / Path(notebook).parent / src).resolve().read_text() == site_script()


def test_no_page_is_over_1_mb(html):
    """What a reader downloads: every page of the book (the site's scripts apart). The notebooks'
    own limit is part of the hygiene check (tests/notebook_checks.py)."""
    from notebook_checks import MAX_BYTES

    pages = list(html.rglob("*.html"))
    assert len(pages) >= 14
    assert [(p.relative_to(html).as_posix(), p.stat().st_size) for p in pages if p.stat().st_size > MAX_BYTES] == []


def test_the_book_shows_every_kind_of_attention_view(html):
    kinds = [v["kind"] for nb in sorted(toc_notebooks())
             for v in views((html / Path(nb).with_suffix(".html")).read_text())]
    assert {"neuron", "head", "model"} <= set(kinds), kinds


def test_the_command_that_opens_the_chapters_starts():
    """How to run the book says `.venv/bin/jupyter lab notebooks/`: jupyterlab is pinned, and it starts."""
    import subprocess
    import sys

    assert ".venv/bin/jupyter lab notebooks/" in (ROOT / "book" / "how_to_run.md").read_text()
    jupyter = Path(sys.executable).with_name("jupyter")
    result = subprocess.run([str(jupyter), "lab", "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and re.fullmatch(r"\d+\.\d+\.\d+\s*", result.stdout), result.stderr[-2000:]
