"""Freeze the book's own prose into ``tfcore/data/book_prose.txt``: the corpus of chapter 14.

The text of every markdown cell of chapters 1-13 and of the prose pages in ``book/``, with code
blocks, admonition fences, HTML, images and link targets taken out (link texts stay). Chapter 14
trains a small GPT on it, so it is frozen here, once: later edits to the prose must not change
chapter 14's vocabulary or its data. The text is this book's, under its MIT licence.

Run from the repository root: ``.venv/bin/python tools/book_prose.py --overwrite``. Without that
flag (or with any other argument) it writes nothing: the file is frozen, and chapter 14's
outputs depend on it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tfcore" / "data" / "book_prose.txt"


def clean(markdown: str) -> str:
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)  # code blocks and admonition fences' bodies stay out
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", text)  # images
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)  # links: keep the text
    text = re.sub(r"^:[a-z-]+:.*$", "", text, flags=re.M)  # directive options
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def main() -> None:
    documents = []
    for path in sorted((ROOT / "notebooks").glob("[01][0-9]_*.ipynb")):
        number = int(path.name[:2])
        if number > 13:
            continue
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        prose = "\n\n".join(clean("".join(c["source"])) for c in cells if c["cell_type"] == "markdown")
        documents.append((path.stem, prose))
    for name in ("intro", "how_to_run"):
        documents.append((f"book/{name}", clean((ROOT / "book" / f"{name}.md").read_text(encoding="utf-8"))))
    OUT.write_text("\n\n".join(f"=== {name} ===\n\n{text}" for name, text in documents) + "\n", encoding="utf-8")
    print(f"{OUT.relative_to(ROOT)}: {len(documents)} documents, {OUT.stat().st_size:,} bytes")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Freeze the book's prose into tfcore/data/book_prose.txt.")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the frozen corpus (chapter 14's data and vocabulary change with it)")
    if not parser.parse_args().overwrite:
        parser.error(f"{OUT.relative_to(ROOT)} is frozen; pass --overwrite to rebuild it on purpose")
    main()
