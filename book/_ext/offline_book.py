"""A Sphinx extension for a book that works offline and stays light.

- sphinx-thebe (which Jupyter Book always loads) adds scripts for a "live code" button that this
  book does not use. They name a CDN and, in this version, declare ``THEBE_JS_URL`` twice, which
  is a console error on every page. We drop them from every page.
- Every bertviz view in a notebook carries its own copy of require.js, d3 and jQuery (deflated,
  about 180 KB), because on Colab each output is shown alone. In the book, a page with views
  loads them once, from one file of the site (``_tfcore/viz.js``, written by ``tfcore.viz``), so
  the browser fetches them once for the whole book.
- The page "The GPT in your browser" runs chapter 14's GPT in plain JavaScript (``book_gpt/``).
  Its data, the weights in 16-bit floats and the tokenizer, are written here from tfcore's
  shipped files (``tfcore.browser.page_data_script``) into ``_tfcore/book_gpt/``, beside the
  script and its stylesheet: never committed a second time.
"""

import re
from pathlib import Path

SITE_SCRIPT = "_tfcore/viz.js"
BOOK_GPT = "_tfcore/book_gpt"  # the page's script, stylesheet and data


def _drop_thebe(app, pagename, templatename, context, doctree):
    def is_thebe(script) -> bool:
        text = str(getattr(script, "filename", script) or "") + str(getattr(script, "attributes", {}).get("body", ""))
        return "thebe" in text.lower()

    if "script_files" in context:
        context["script_files"] = [s for s in context["script_files"] if not is_thebe(s)]


def _serve_view_libraries_once(app, pagename, templatename, context, doctree):
    from tfcore.viz import LOADER_MARK

    body = context.get("body", "")
    if LOADER_MARK not in body:
        return
    loader = re.compile(r"<script>" + re.escape(LOADER_MARK) + r".*?</script>\n?", re.DOTALL)
    tag = f'<script src="{context["pathto"](SITE_SCRIPT, 1)}"></script>\n'
    first = [True]

    def replace(_match) -> str:  # the first view's loader becomes the site's script; the others go
        if first[0]:
            first[0] = False
            return tag
        return ""

    context["body"] = loader.sub(replace, body)


def _write_site_script(app, exception):
    if exception is None and app.builder.format == "html":
        from tfcore.viz import site_script

        target = Path(app.outdir) / SITE_SCRIPT
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(site_script(), encoding="utf-8")


def _write_book_gpt(app, exception):
    if exception is None and app.builder.format == "html":
        import shutil

        from tfcore.browser import DATA_SCRIPT, page_data_script

        target = Path(app.outdir) / BOOK_GPT
        target.mkdir(parents=True, exist_ok=True)
        for source in (Path(__file__).parent / "book_gpt").iterdir():
            shutil.copyfile(source, target / source.name)
        (target / DATA_SCRIPT).write_text(page_data_script(), encoding="utf-8")


def _add_static(app):
    """The book's own stylesheet (static/code_column.css: the code column's font size)."""
    app.config.html_static_path.append(str(Path(__file__).parent / "static"))


def setup(app):
    app.connect("builder-inited", _add_static)
    app.add_css_file("code_column.css")
    app.connect("html-page-context", _drop_thebe, priority=900)
    app.connect("html-page-context", _serve_view_libraries_once)
    app.connect("build-finished", _write_site_script)
    app.connect("build-finished", _write_book_gpt)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
