"""The built book in a real browser (Debian's Chromium through Playwright), with the network cut.

For every page of the table of contents: no console errors, every bertviz view draws SVG (the
neuron views expanded to their query/key detail), every math block is typeset by the MathJax the
book serves, every matplotlib figure is loaded and non-empty, every internal link resolves.
With SCREENSHOTS=1 in the environment, a full-page screenshot of each page goes to screenshots/
(git-ignored) for review; they are off by default, since they took about half of the test's time
and nothing checks them.

Every visit navigates one tab (a fresh document each time, with listeners of its own).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import CHROMIUM
from notebook_checks import ROOT, toc_files
from views import views

SHOTS = ROOT / "screenshots"
DRAWN = "document.querySelectorAll(`#${id} svg *`).length"  # a JavaScript expression of id
# Every URL but the book's own files: matched in the browser, so only these requests reach Python
OUTSIDE = re.compile(r"^(?!file://)")
MIN_DRAWN = 20  # SVG elements a view that has drawn shows at least

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Debian's chromium is not installed (make test installs it with apt-get where apt is available)")


def pages(html: Path) -> list[Path]:
    return [html / (page + ".html") for page in toc_files()]


@pytest.fixture(scope="module")
def tab(browser):
    """The one tab that every visit navigates: opening a tab (a context and a renderer) per page
    cost about half the walk's CPU time."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    yield page
    page.close()


class Visit:
    """One page, loaded offline in ``tab``: what it logged and what it tried to fetch from outside.
    ``close()`` detaches the listeners, so the next visit's page counts only its own."""

    def __init__(self, tab, path: Path):
        self.page = tab
        self.errors, self.outside = [], []
        self._listeners = {"console": lambda m: m.type == "error" and self.errors.append(m.text),
                           "pageerror": lambda e: self.errors.append(str(e))}
        for event, listener in self._listeners.items():
            self.page.on(event, listener)
        self.page.route(OUTSIDE, self._route)
        self.page.goto(path.as_uri(), wait_until="load")
        self.page.wait_for_function("() => !window.MathJax || !window.MathJax.startup || "
                                    "window.MathJax.startup.promise.then(() => true)", timeout=30_000)
        ids = [view["root_div_id"] for view in views(path.read_text())]
        if ids:  # the views draw in requirejs callbacks, after "load": wait until each has drawn
            from playwright.sync_api import TimeoutError as Timeout

            try:
                self.page.wait_for_function(f"ids => ids.every(id => {DRAWN} >= {MIN_DRAWN})", arg=ids,
                                            timeout=15_000)
            except Timeout:
                pass  # the tests count what was drawn and name the view
        else:
            self.page.wait_for_timeout(100)  # a late console error still has time to show

    def _route(self, route):  # only requests for outside the book get here (OUTSIDE)
        self.outside.append(route.request.url)
        route.abort()

    def close(self):
        for event, listener in self._listeners.items():
            self.page.remove_listener(event, listener)
        self.page.unroute(OUTSIDE, self._route)


def _expand_neuron_view(page, div_id: str) -> int:
    """Click the '+' of the first token (the view then shows the query, key, q x k and softmax
    columns) and hover that token; return how many elements the expanded view shows (0 if hidden)."""
    return page.evaluate("""id => {
        const root = document.getElementById(id);
        const expanded = root.querySelector('#expanded');
        if (!expanded || expanded.getAttribute('visibility') !== 'hidden') return 0;  // starts collapsed
        root.querySelector('#collapsed rect[width="16"]').dispatchEvent(new MouseEvent('click'));
        root.querySelector('#expanded rect[width="16"]').parentNode.dispatchEvent(new MouseEvent('mouseover'));
        return expanded.getAttribute('visibility') === 'visible' ? expanded.querySelectorAll('*').length : 0;
    }""", div_id)


def _internal_links(page, path: Path) -> list[str]:
    broken = []
    for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.getAttribute('href'))"):
        parts = urlsplit(href)
        if parts.scheme or href.startswith(("mailto:", "javascript:")) or not (parts.path or parts.fragment):
            continue
        target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            broken.append(href)
        elif parts.fragment and target.suffix == ".html" and \
                not re.search(rf'id="{re.escape(unquote(parts.fragment))}"', target.read_text()):
            broken.append(href)
    return broken


def _sideways(page) -> list[str]:
    """The code blocks and text outputs that scroll sideways at this width (dropdowns opened
    first; a cell hidden behind a toggle is checked on the stored notebook instead, by
    tests/test_notebooks.py's width test)."""
    return page.evaluate("""() => {
        document.querySelectorAll('details').forEach(d => { d.open = true; });
        return [...document.querySelectorAll('div.cell_input pre, div.cell_output pre, div.highlight pre')]
            .filter(p => p.clientWidth > 0 && p.scrollWidth > p.clientWidth + 1)
            .map(p => p.textContent.split('\\n').reduce((a, b) => (b.length > a.length ? b : a), '').slice(0, 60));
    }""")


def test_every_page_renders_offline(html, tab):
    SHOTS.mkdir(exist_ok=True)
    found = {"pages": 0, "math": 0, "figures": 0, "neuron": 0, "head": 0, "model": 0}
    problems = []
    for path in pages(html):
        name = path.relative_to(html).as_posix()
        visit = Visit(tab, path)
        page = visit.page
        found["pages"] += 1
        problems += [f"{name}: console error: {e}" for e in visit.errors]
        problems += [f"{name}: tried to fetch {u}" for u in visit.outside]

        math = page.eval_on_selector_all(".math", "els => els.map(e => !!e.querySelector('mjx-container'))")
        found["math"] += len(math)
        problems += [f"{name}: {math.count(False)} of {len(math)} math blocks not typeset"] if not all(math) else []

        figures = page.eval_on_selector_all(
            "img[src*='_images/']", "els => els.map(e => e.complete && e.naturalWidth > 100 && e.naturalHeight > 50)")
        found["figures"] += len(figures)
        problems += [f"{name}: {figures.count(False)} figures missing or empty"] if not all(figures) else []

        for view in views(path.read_text()):
            found[view["kind"]] += 1
            div = view["root_div_id"]
            drawn = page.evaluate(f"id => {DRAWN}", div)
            if drawn < MIN_DRAWN:
                problems.append(f"{name}: {view['kind']} view {div} drew {drawn} SVG elements")
            if view["kind"] == "neuron" and _expand_neuron_view(page, div) < 20:
                problems.append(f"{name}: neuron view {div} did not expand to its query/key detail")

        problems += [f"{name}: broken internal link {href}" for href in _internal_links(page, path)]
        problems += [f"{name}: a code block or output scrolls sideways at 1280 px: {line!r}..."
                     for line in _sideways(page)]
        if os.environ.get("SCREENSHOTS") == "1":
            page.screenshot(path=str(SHOTS / (name.replace("/", "__") + ".png")), full_page=True)
        visit.close()

    assert problems == [], "\n".join(problems)
    # Not vacuous: the book has pages, math, figures and every kind of view.
    assert found["pages"] == len(toc_files()) >= 14, found
    assert found["math"] > 0 and found["figures"] > 10, found
    assert min(found["neuron"], found["head"], found["model"]) >= 1, found


def test_a_code_line_wider_than_the_column_is_found(html, tab):
    """The sideways check is not vacuous: a line widened in a chapter's first code cell is found."""
    path = next(p for p in pages(html) if p.parent.name == "notebooks")
    visit = Visit(tab, path)
    visit.page.evaluate("""() => { const pre = document.querySelector('div.cell_input pre');
                                  pre.append('\\n' + 'x = 1  # ' + 'y'.repeat(300)); }""")
    assert any("y" * 40 in line for line in _sideways(visit.page))
    visit.close()


def _stored_view_outputs() -> list[tuple[str, str]]:
    """Every bertviz view stored in a notebook, as (notebook, the output's HTML)."""
    import nbformat

    found = []
    for notebook in sorted(ROOT.glob("notebooks/*.ipynb")):
        for cell in nbformat.read(notebook, as_version=4).cells:
            for output in cell.get("outputs", []):
                html = output.get("data", {}).get("text/html", "")
                if views(html):
                    found.append((notebook.name, html))
    return found


def test_each_stored_view_draws_alone_offline(tab, tmp_path):
    """As on Colab, where each output is a page of its own: the view's own deflated copy of the
    libraries and of its data must be enough, with the network cut."""
    outputs = _stored_view_outputs()
    problems, kinds = [], []
    for i, (notebook, html) in enumerate(outputs):
        path = tmp_path / f"view{i}.html"
        path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{html}</body></html>")
        visit = Visit(tab, path)
        [view] = views(html)
        kinds.append(view["kind"])
        drawn = visit.page.evaluate(f"id => {DRAWN}", view["root_div_id"])
        problems += [f"{notebook}: {view['kind']} view: console error: {e}" for e in visit.errors]
        problems += [f"{notebook}: {view['kind']} view: tried to fetch {u}" for u in visit.outside]
        if drawn < MIN_DRAWN:
            problems.append(f"{notebook}: {view['kind']} view drew {drawn} SVG elements alone")
        visit.close()
    assert problems == [], "\n".join(problems)
    assert {"neuron", "head", "model"} <= set(kinds), kinds
