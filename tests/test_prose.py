"""The prose: every cross-reference names a heading that exists, and every chapter's main path is one
a reader can finish. Each check is also run on planted problems, to show that it can fail."""

from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_markdown_cell, new_notebook

from nbformat.v4 import new_code_cell

from prose_checks import (MAX_MAIN_PATH_CODE_CELLS, MAX_MAIN_PATH_WORDS, ROOT, all_reference_problems,
                          headings, landing_page_reading_times, main_path_code_cells, main_path_words,
                          notebooks, reading_minutes, reference_problems)

NOTEBOOKS = notebooks()


def test_every_cross_reference_names_a_heading_that_exists():
    assert all_reference_problems() == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_main_path_is_one_a_reader_can_finish(path):
    words = main_path_words(path)
    assert words <= MAX_MAIN_PATH_WORDS, (
        f"{path.name} has {words} words of prose on its main path (at most {MAX_MAIN_PATH_WORDS}): "
        f"move a deep dive into a {{dropdown}} box")
    cells = main_path_code_cells(path)
    assert cells <= MAX_MAIN_PATH_CODE_CELLS, (
        f"{path.name} has {cells} code cells on its main path (at most {MAX_MAIN_PATH_CODE_CELLS}): "
        f"tag a deep dive's cells hide-cell, after its {{dropdown}} box")


def test_landing_page_gives_each_chapter_its_reading_time():
    """The reading time in the landing page's table is the one computed from the main path (printed
    here, so that the suite's log shows each chapter's)."""
    stated = landing_page_reading_times((ROOT / "book" / "intro.md").read_text())
    computed = {path.name: reading_minutes(path) for path in NOTEBOOKS}
    for name, minutes in computed.items():
        print(f"{name}: {minutes} min")
    assert stated == computed, {n: (stated.get(n), m) for n, m in computed.items() if stated.get(n) != m}


# --- the same checks, shown to fail on planted problems -----------------------------------------

KNOWN = headings()


@pytest.mark.parametrize("text, expected", [
    ("As chapter 42 shows.", "chapter 42"),
    ("Chapters 3 and 99 agree.", "chapter 99"),
    ("See §5.99.", "section 5.99"),
    ("§§5.3-5.17 measure it.", "section 5.17"),
    ("Sections 2.1 and 2.9 draw it.", "section 2.9"),
    ("[Chapter 5](04_multi_head_attention.ipynb) splits heads.", "points to chapter 4"),
    ("[the heads](99_no_such_chapter.ipynb)", "does not exist"),
])
def test_a_planted_wrong_reference_is_found(text, expected):
    problems = reference_problems(text, KNOWN, "planted")
    assert any(expected in p for p in problems), problems


def test_right_references_and_papers_sections_pass():
    text = ("Chapters 2 and 3 build it, §5.6 measures it, sections 9.2 to 9.7 use it, and "
            "[chapter 4](04_multi_head_attention.ipynb) splits it, as Vaswani et al. (2017, §3.2.2) "
            "and Devlin et al., 2019, section 5.3 do in their papers.")
    assert reference_problems(text, KNOWN, "right") == []


def test_a_planted_wrong_reference_fails_the_whole_book_check(tmp_path):
    path = tmp_path / "99_planted.ipynb"
    nbformat.write(new_notebook(cells=[new_markdown_cell("# 99. Planted\n\nSee §7.42 and chapter 77.")]), path)
    problems = all_reference_problems([path])
    assert len(problems) == 2, problems


def test_word_count_leaves_out_dropdowns_and_code(tmp_path):
    dive = "````{dropdown} Deep dive\n" + "hidden " * 5000 + "\n```python\nx = 1\n```\n````"
    code = "```python\n" + "code " * 100 + "\n```"
    note = "```{note}\nfour words in note\n```"
    path = tmp_path / "01_x.ipynb"
    nbformat.write(new_notebook(cells=[new_markdown_cell("# Title here"), new_markdown_cell(dive),
                                       new_markdown_cell(code), new_markdown_cell(note)]), path)
    assert main_path_words(path) == 3 + 4
    nbformat.write(new_notebook(cells=[new_markdown_cell("word " * (MAX_MAIN_PATH_WORDS + 1))]), path)
    assert main_path_words(path) > MAX_MAIN_PATH_WORDS


def test_code_cells_off_the_main_path_are_not_counted(tmp_path):
    path = tmp_path / "01_x.ipynb"
    cells = [new_code_cell("x = 1"), new_code_cell("y = 2", metadata={"tags": ["hide-cell"]}),
             new_code_cell("pip = 3", metadata={"tags": ["remove-cell"]}),
             new_code_cell("# Solution\nz = 4"), new_code_cell("plot()", metadata={"tags": ["hide-input"]})]
    nbformat.write(new_notebook(cells=cells), path)
    assert main_path_code_cells(path) == 2  # the plain cell and the figure whose code is hidden
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1")] * (MAX_MAIN_PATH_CODE_CELLS + 1)), path)
    assert main_path_code_cells(path) > MAX_MAIN_PATH_CODE_CELLS


def test_a_wrong_reading_time_on_the_landing_page_is_found(tmp_path):
    row = "| [7](../notebooks/07_our_encoder_is_bert.ipynb) | Our encoder is BERT | 25 min | weights |"
    assert landing_page_reading_times(row) == {"07_our_encoder_is_bert.ipynb": 25}
    path = tmp_path / "07_our_encoder_is_bert.ipynb"
    nbformat.write(new_notebook(cells=[new_markdown_cell("word " * 1800)]), path)
    assert reading_minutes(path) == 10  # 1,800 words at 180 a minute
    assert landing_page_reading_times(row)[path.name] != reading_minutes(path)


def _clock_sentence_problem(how_to_run: str, paths) -> str | None:
    """How to run names the chapters whose code reads the clock; they must be exactly those."""
    import re

    from notebook_checks import CLOCK

    found = re.search(r"Only chapters? ([\d ,and]+?) reads? the clock", how_to_run)
    if found is None:
        return "how_to_run.md no longer says which chapters read the clock"
    stated = {int(n) for n in re.findall(r"\d+", found.group(1))}
    reading = {int(p.name[:2]) for p in paths
               if any(c.cell_type == "code" and CLOCK.search(c.source) for c in nbformat.read(p, as_version=4).cells)}
    return None if stated == reading else f"how_to_run.md names chapters {sorted(stated)}; {sorted(reading)} read the clock"


def test_how_to_run_names_the_chapters_that_read_the_clock():
    assert _clock_sentence_problem((ROOT / "book" / "how_to_run.md").read_text(), NOTEBOOKS) is None


def test_a_stale_clock_sentence_is_found():
    stale = "time nothing on your machine. Only chapter 22 reads the clock, and it prints"
    assert "[21, 22] read the clock" in _clock_sentence_problem(stale, NOTEBOOKS)
