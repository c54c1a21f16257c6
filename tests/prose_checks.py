"""Checks on the book's prose: cross-references that resolve, and chapters a reader can finish.

- Every "chapter N", "chapters N and M", "§N.M", "§§N.M-N.K", "section N.M" in the markdown of the
  notebooks and of ``book/*.md`` must name a heading that exists (``# N. Title``,
  ``## N.M Title``, ``### N.M.K Title``). A paper's own section is cited right after the paper
  ("Vaswani et al. (2017, §3.2.2)", "Radford et al., 2019, section 2.3", "their §3.2.1") or
  followed by "of the paper", and is not ours to check.
- Every markdown link to a notebook must name a file that exists, and a link whose text says
  "chapter N" must point to chapter N's notebook.
- A chapter's main path (its markdown outside ``{dropdown}`` boxes, code blocks left out) is at
  most ``MAX_MAIN_PATH_WORDS`` words, and it has at most ``MAX_MAIN_PATH_CODE_CELLS`` code cells
  (a cell tagged ``hide-cell`` or ``remove-cell``, or an exercise's ``# Solution``, is off the main
  path): deep dives fold away.
- Each chapter's reading time (``reading_minutes``: the main path's prose at ``WORDS_PER_MINUTE``,
  plus ``MINUTES_PER_CODE_CELL`` for each main-path code cell and its output, rounded to 5 minutes)
  is the one the landing page's table gives, and the landing page's count of the cells tagged
  ``nbval-ignore-output``, and of their chapters, is the notebooks' (``ignored_output_cells``).

By hand: ``python tests/prose_checks.py notebooks/05_*.ipynb`` prints each notebook's main-path word
count, code cells and reading time, and its broken references; with no argument, every notebook and
every page of ``book/``. ``python tests/prose_checks.py --write-reading-times`` rewrites the landing
page's reading times, and its count of the cells whose output nbval does not compare, from the
chapters as they are.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
MAX_MAIN_PATH_WORDS = 3500
MAX_MAIN_PATH_CODE_CELLS = 32
WORDS_PER_MINUTE = 180  # a reader of technical prose, slower than the 200-250 of plain text
MINUTES_PER_CODE_CELL = 0.75  # to read a cell, run it and read what it prints
OFF_MAIN_PATH_TAGS = {"hide-cell", "remove-cell"}

HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.M)
_LIST = r"(\d+(?:\.\d+)*(?:\s*(?:,\s*(?:and\s+|or\s+)?|\band\b|\bor\b|\bto\b|-|–)\s*{more}\d+(?:\.\d+)*)*)"
CHAPTER_REF = re.compile(r"\b[Cc]hapters?\s+" + _LIST.format(more=""))
SECTION_REF = re.compile(r"(?:§§?\s*|\b[Ss]ections?\s+)" + _LIST.format(more=r"(?:§\s*)?"))
NOTEBOOK_LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*?(\d\d)_[\w-]+\.ipynb)(#[^)]*)?\)")
# A paper's own section, cited right after the paper ("Vaswani et al. (2017, §3.2.2)", "Devlin et
# al., 2019, section 5.3", "the footnote to their §3.2.1") or followed by "of the paper".
PAPER_BEFORE = re.compile(r"(?:et al\.?,?|\b(?:19|20)\d\d[a-z]?\)?,?|\btheir|\bthe paper's)\s*$")
PAPER_AFTER = re.compile(r"\s*(?:of (?:the|their|that) (?:paper|report|article))")
FENCE = re.compile(r"^(`{3,}|:{3,})(.*)$")


def notebooks() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("*.ipynb"))


def markdown_of(path: Path) -> list[str]:
    """The markdown cells of a notebook, or the whole text of a ``.md`` page, as a list."""
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        return [c.source for c in nb.cells if c.cell_type == "markdown"]
    return [path.read_text()]


def headings(paths: list[Path] | None = None) -> set[str]:
    """Every numbered heading of the chapters: "5" for "# 5. ...", "5.6" for "## 5.6 ...", and so on."""
    found = set()
    for path in paths if paths is not None else notebooks():
        for text in markdown_of(path):
            found.update(HEADING.findall(text))
    return found


def _numbers(listing: str) -> list[str]:
    """'9 and 10' -> ['9', '10']; '5.3-5.5' -> ['5.3', '5.5'] (a range's two ends)."""
    return re.findall(r"\d+(?:\.\d+)*", listing)


def reference_problems(text: str, known: set[str], where: str) -> list[str]:
    """Every chapter or section reference in ``text`` whose heading is not in ``known``."""
    problems = []
    for pattern, kind in ((CHAPTER_REF, "chapter"), (SECTION_REF, "section")):
        for match in pattern.finditer(text):
            if kind == "section" and (PAPER_BEFORE.search(text[max(0, match.start() - 40):match.start()])
                                      or PAPER_AFTER.match(text, match.end())):
                continue
            for number in _numbers(match.group(1)):
                if kind == "chapter":
                    number = number.split(".")[0]
                if number not in known:
                    problems.append(f"{where}: '{match.group(0).strip()}' names {kind} {number}, "
                                    f"which has no heading")
    for match in NOTEBOOK_LINK.finditer(text):
        label, target, number = match.group(1), match.group(2), match.group(3)
        if not (ROOT / "notebooks" / Path(target).name).exists():
            problems.append(f"{where}: the link '{match.group(0)}' points to a notebook that does not exist")
        said = re.search(r"[Cc]hapter\s+(\d+)", label)
        if said and int(said.group(1)) != int(number):
            problems.append(f"{where}: the link '{match.group(0)}' says chapter {said.group(1)} "
                            f"but points to chapter {int(number)}")
    return problems


def without_dropdowns(text: str) -> str:
    """``text`` with every ``{dropdown}`` block (backtick or colon fence) and every plain code block
    removed: what a reader meets on the main path."""
    kept, closing, skipping = [], None, False
    for line in text.splitlines():
        fence = FENCE.match(line.strip())
        if closing is None and fence:
            info = fence.group(2).strip()
            if info.startswith("{dropdown}") or not info.startswith("{"):
                closing, skipping = fence.group(1), True  # a deep dive, or code: not main-path prose
            else:
                closing, skipping = fence.group(1), False  # another directive (a note): its text counts
            continue
        if closing is not None and line.strip() == closing:
            closing, skipping = None, False
            continue
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def main_path_words(path: Path) -> int:
    text = "\n\n".join(markdown_of(path))
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    return len(without_dropdowns(text).split())


def main_path_code_cells(path: Path) -> int:
    """The code cells a reader meets on the main path: not folded away (``hide-cell``), not removed
    from the book (``remove-cell``, the Colab install cell) and not an exercise's solution."""
    nb = nbformat.read(path, as_version=4)
    return sum(1 for c in nb.cells if c.cell_type == "code" and c.source.strip()
               and not OFF_MAIN_PATH_TAGS & set(c.metadata.get("tags", []))
               and not c.source.lstrip().startswith("# Solution"))


def reading_minutes(path: Path) -> int:
    """The main path's reading time, to the nearest 5 minutes (at least 5)."""
    minutes = main_path_words(path) / WORDS_PER_MINUTE + MINUTES_PER_CODE_CELL * main_path_code_cells(path)
    return max(5, 5 * round(minutes / 5))


def landing_page_reading_times(text: str) -> dict[str, int]:
    """The landing page's table: ``{notebook file name: minutes}`` from each row's first cell (the
    link to the chapter) and its "N min" cell."""
    times = {}
    for row in text.splitlines():
        link = re.match(r"\|\s*\[\d+\]\(\.\./notebooks/([\w.-]+\.ipynb)\)", row)
        minutes = re.search(r"\|\s*(\d+) min\s*\|", row)
        if link and minutes:
            times[link.group(1)] = int(minutes.group(1))
    return times


def prose_paths() -> list[Path]:
    return notebooks() + sorted((ROOT / "book").glob("*.md"))


def all_reference_problems(paths: list[Path] | None = None) -> list[str]:
    known = headings()
    problems = []
    for path in paths if paths is not None else prose_paths():
        for i, text in enumerate(markdown_of(path)):
            name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            where = f"{name}" + (f" (markdown cell {i})" if path.suffix == ".ipynb" else "")
            problems += reference_problems(text, known, where)
    return problems


IGNORED_OUTPUT = re.compile(r"(\d+)\s+cells,\s+in\s+(\d+)\s+chapters,\s+are\s+tagged\s+`nbval-ignore-output`")


def ignored_output_cells(paths: list[Path] | None = None) -> tuple[int, int]:
    """How many code cells are tagged ``nbval-ignore-output`` (their output is not compared), and in
    how many chapters."""
    counts = [sum("nbval-ignore-output" in c.metadata.get("tags", [])
                  for c in nbformat.read(path, as_version=4).cells)
              for path in (paths if paths is not None else notebooks())]
    return sum(counts), sum(1 for n in counts if n)


def write_reading_times(page: Path = ROOT / "book" / "intro.md") -> None:
    """Rewrite the "Reading" column of the landing page's table, and its count of the cells tagged
    ``nbval-ignore-output``, from the chapters as they are."""
    cells, chapters = ignored_output_cells()
    text = IGNORED_OUTPUT.sub(f"{cells} cells, in {chapters} chapters, are tagged `nbval-ignore-output`",
                              page.read_text())
    lines = text.splitlines()
    for i, row in enumerate(lines):
        link = re.match(r"\|\s*\[\d+\]\(\.\./notebooks/([\w.-]+\.ipynb)\)", row)
        if link:
            cells = row.split("|")
            cells[3] = f" {reading_minutes(ROOT / 'notebooks' / link.group(1))} min "
            lines[i] = "|".join(cells)
    page.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-reading-times"]:
        write_reading_times()
        sys.exit()
    paths = [Path(p).resolve() for p in sys.argv[1:]] or prose_paths()
    for path in paths:
        if path.suffix == ".ipynb":
            words, cells = main_path_words(path), main_path_code_cells(path)
            flag = "" if words <= MAX_MAIN_PATH_WORDS else f"  OVER {MAX_MAIN_PATH_WORDS}"
            flag += "" if cells <= MAX_MAIN_PATH_CODE_CELLS else f"  OVER {MAX_MAIN_PATH_CODE_CELLS} CELLS"
            print(f"{path.name}: {words} words and {cells} code cells on the main path, "
                  f"{reading_minutes(path)} min{flag}")
    for problem in all_reference_problems(paths):
        print(problem)
