"""A Sphinx extension for a book that works offline.

sphinx-thebe (which Jupyter Book always loads) adds scripts for a "live code" button that this
book does not use. They name a CDN and, in this version, declare ``THEBE_JS_URL`` twice, which
is a console error on every page. We drop them from every page.
"""


def _drop_thebe(app, pagename, templatename, context, doctree):
    def is_thebe(script) -> bool:
        text = str(getattr(script, "filename", script) or "") + str(getattr(script, "attributes", {}).get("body", ""))
        return "thebe" in text.lower()

    if "script_files" in context:
        context["script_files"] = [s for s in context["script_files"] if not is_thebe(s)]


def setup(app):
    app.connect("html-page-context", _drop_thebe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
