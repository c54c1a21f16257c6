"""Fit the chapters' code to the book's code column: ``python tools/fit_code.py [NOTEBOOK ...]``.

The built book shows about 80 characters of code at 1280 px; a wider line hides behind a
horizontal scroll bar. This tool (1) runs ``ruff format`` at the book's line length, (2) splits
the string literals that still overflow into adjacent literals at word boundaries (Python joins
them at compile time, so the program does not change), (3) moves an overflowing end-of-line
comment above its line and wraps overflowing comment lines, and (4) formats again. What is left
over (a long URL, a docstring line) is reported for a hand edit. ``tests/test_notebooks.py``
checks the result (``code_width_problems``); the tool itself is never needed to run the book.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from notebook_checks import LINE_LENGTH  # noqa: E402  (the one place the width is set)

# Python 3.10 is the oldest the book supports: ruff must not write 3.12-only f-strings.
RUFF = [sys.executable, "-m", "ruff", "format", "--isolated", "--target-version=py310",
        f"--line-length={LINE_LENGTH}", "--quiet"]


def _pieces(body: str, first: int, rest: int, fstring: bool) -> list[str]:
    """Split a literal's body at spaces (never inside an f-string's braces) into pieces of at most
    ``first`` characters, then ``rest``; each piece keeps its trailing space."""
    cuts, depth, i = [], 0, 0
    while i < len(body):
        ch = body[i]
        if fstring and ch in "{}" and body[i:i + 2] in ("{{", "}}"):
            i += 2
            continue
        if fstring and ch == "{":
            depth += 1
        elif fstring and ch == "}":
            depth -= 1
        elif ch == " " and depth == 0 and i + 1 < len(body) and body[i + 1] != " ":
            cuts.append(i + 1)
        i += 1
    pieces, start, limit = [], 0, first
    while len(body) - start > limit:
        fits = [c for c in cuts if start < c <= start + limit]
        if not fits:
            break
        pieces.append(body[start:fits[-1]])
        start, limit = fits[-1], rest
    pieces.append(body[start:])
    return pieces


def split_long_strings(source: str) -> str:
    """Split every one-line string literal that ends past the line length into adjacent literals,
    one per line; a literal outside brackets is wrapped in parentheses."""
    lines = source.split("\n")
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    depth, edits = 0, []
    for tok in tokens:
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        if (tok.type != tokenize.STRING or tok.start[0] != tok.end[0]
                or len(lines[tok.start[0] - 1]) <= LINE_LENGTH or tok.end[1] <= LINE_LENGTH - 3):
            continue
        m = re.fullmatch(r"([rRbBfFuU]*)('|\")(.*)\2", tok.string, re.S)
        if not m or m.group(2) * 3 == tok.string[len(m.group(1)):len(m.group(1)) + 3]:
            continue  # a triple-quoted string: left for a hand edit
        prefix, quote, body = m.groups()
        row, col = tok.start
        indent = len(lines[row - 1]) - len(lines[row - 1].lstrip()) + 4
        wrap = depth == 0
        start = indent if wrap else col
        room = LINE_LENGTH - len(prefix) - 2
        # room for a closing ")" or "," after the last piece
        pieces = _pieces(body, room - start - 2, room - start - 2, "f" in prefix.lower())
        if len(pieces) < 2:
            continue
        quoted = []
        for piece in pieces:
            keep = prefix if ("{" in piece or "}" in piece or "f" not in prefix.lower()) else prefix.replace("f", "").replace("F", "")
            quoted.append(f"{keep}{quote}{piece}{quote}")
        pad = "\n" + " " * start
        text = pad.join(quoted)
        if wrap:
            text = "(" + pad + text + "\n" + " " * (indent - 4) + ")"
        edits.append((row, col, tok.end[1], text))
    for row, col, end, text in sorted(edits, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + text + line[end:]
    return "\n".join(lines)


def _refill_comment_blocks(source: str) -> str:
    """Refill a block of whole-line comments (same indent, plain prose) that holds an overflowing
    line, so that the wrapped comment reads as one paragraph, not a ragged one."""
    lines, out, i = source.split("\n"), [], 0
    comment = re.compile(r"(\s*)# (?!%|noqa|teaching version)(.*)")
    while i < len(lines):
        m = comment.fullmatch(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines) and (n := comment.fullmatch(lines[j])) and n.group(1) == m.group(1):
            j += 1
        block = lines[i:j]
        texts = [comment.fullmatch(line).group(2) for line in block]
        if any(len(line) > LINE_LENGTH for line in block) and _plain(texts):
            out.extend(_wrap(" ".join(t.strip() for t in texts), m.group(1) + "# ", m.group(1) + "# "))
        else:
            out.extend(block)
        i = j
    return "\n".join(out)


def fit_comments(source: str) -> str:
    """Move an overflowing end-of-line comment above its line; wrap an overflowing comment line
    (a block of whole-line comments is refilled as one paragraph first)."""
    source = _refill_comment_blocks(source)
    out = []
    try:
        comments = {tok.start[0]: tok for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                    if tok.type == tokenize.COMMENT}
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    for row, line in enumerate(source.split("\n"), 1):
        tok = comments.get(row)
        after_backslash = bool(out) and out[-1].endswith("\\")
        if (tok is None or len(line) <= LINE_LENGTH or after_backslash
                or tok.string.startswith(("#!", "# %", "# noqa"))):
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()))
        code = line[:tok.start[1]].rstrip()
        text = tok.string.lstrip("#").strip()
        wrapped = textwrap.wrap(text, LINE_LENGTH - len(indent) - 2, break_long_words=False,
                                break_on_hyphens=False)
        out.extend(f"{indent}# {w}" for w in wrapped)
        if code.strip():
            out.append(code)
    return "\n".join(out)


def _plain(paragraph: list[str]) -> bool:
    """Prose that may be refilled: no list item, table, literal block or aligned columns."""
    return not any(re.match(r"\s*([-*+]|\d+[.)]|>>>|\||\.\.)\s", line) or "  " in line.strip()
                   or line.rstrip().endswith("::") for line in paragraph)


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, LINE_LENGTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


def fit_docstrings(source: str) -> str:
    """Refill a docstring paragraph that holds an overflowing line; in a list, table or aligned
    paragraph only the overflowing lines are broken at a space."""
    lines = source.split("\n")
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    for tok in reversed(tokens):
        if tok.type != tokenize.STRING or not tok.string.lstrip("rRbBuU").startswith(('"""', "'''")):
            continue
        first, last = tok.start[0] - 1, tok.end[0] - 1
        if all(len(line) <= LINE_LENGTH for line in lines[first:last + 1]):
            continue
        out, para = [], []

        def flush():
            lead = lambda line: " " * (len(line) - len(line.lstrip()))  # noqa: E731
            if not any(len(line) > LINE_LENGTH for line in para):
                out.extend(para)
            elif _plain(para):
                out.extend(_wrap(" ".join(p.strip() for p in para), lead(para[0]), lead(para[-1])))
            else:
                for line in para:
                    out.extend(_wrap(line.strip(), lead(line), lead(line)) if len(line) > LINE_LENGTH
                               else [line])
            para.clear()

        for line in lines[first:last + 1]:
            if line.strip():
                para.append(line)
            else:
                flush()
                out.append(line)
        flush()
        lines[first:last + 1] = out
    return "\n".join(lines)


def _safely(change, source: str) -> str:
    """``change(source)``, or ``source`` unchanged if the result is no longer valid Python."""
    changed = change(source)
    try:
        compile(_without_magics(changed), "<cell>", "exec")
    except SyntaxError:
        return source
    return changed


def _without_magics(source: str) -> str:
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))


def _fits_here(cell) -> bool:
    """A code cell the book shows (the Colab install cell, tagged remove-cell, is the same in
    every chapter and stays as it is), and not a cell magic or shell command."""
    return (cell.cell_type == "code" and "remove-cell" not in cell.metadata.get("tags", [])
            and not cell.source.lstrip().startswith(("%%", "!")))


def fit(path: Path) -> list[str]:
    """Fit one notebook in place; return its code lines still wider than the line length."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # an end-of-line comment moves above its line before ruff splits it
        if _fits_here(cell):
            cell.source = _safely(fit_comments, cell.source)
    nbformat.write(nb, path)
    for _ in range(3):
        subprocess.run(RUFF + [str(path)], check=True)
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if _fits_here(cell):
                cell.source = _safely(lambda s: fit_docstrings(fit_comments(split_long_strings(s))), cell.source)
        nbformat.write(nb, path)
    subprocess.run(RUFF + [str(path)], check=True)
    nb = nbformat.read(path, as_version=4)
    return [f"{path.name}, code cell {i}: {line.strip()[:60]}... ({len(line)} characters)"
            for i, cell in enumerate((c for c in nb.cells if c.cell_type == "code"), 1)
            for line in cell.source.split("\n") if len(line) > LINE_LENGTH]


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    left = [line for path in paths for line in fit(path)]
    print("\n".join(left) or "every code line fits")
    print(f"{len(left)} line(s) left for a hand edit")
