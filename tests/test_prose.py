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


# --- the model inventory (book/models.md) names every model class a chapter builds ---------------

import re

MODEL_CLASS = re.compile(
    r"(?<![\w.])(?:transformers\.|tfcore\.(?:moe\.|gemma\.)?)?"
    r"(\w+(?:ForCausalLM|LMHeadModel|ForSequenceClassification|ForPreTraining|ForMaskedLM)|BertModel|GPT2Model"
    r"|GPT|Llama|Gemma|Mixtral|DeepseekV3WithExperts|make_model|EncoderDecoder|TransformerEncoder)"
    r"(?:\(|\.from_pretrained\(|\.from_transformers\()")


def built_model_classes(path) -> set[str]:
    """The model classes a chapter's code builds or loads: `transformers`' model classes and
    `tfcore`'s models, called or loaded by ``from_pretrained``/``from_transformers``."""
    code = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    return set(MODEL_CLASS.findall(code))


def inventory_entries(text: str) -> dict[int, str]:
    """``{chapter: its entry}`` from the bullets "- **Chapter N.** ..." of book/models.md."""
    parts = re.split(r"^- \*\*Chapter (\d+)\.\*\*", text, flags=re.M)
    return {int(n): entry for n, entry in zip(parts[1::2], parts[2::2])}


def inventory_problems(text: str, paths) -> list[str]:
    entries = inventory_entries(text)
    problems = []
    for path in paths:
        chapter = int(path.name[:2])
        if chapter not in entries:
            problems.append(f"book/models.md has no entry for chapter {chapter}")
            continue
        for name in sorted(built_model_classes(path)):
            if not re.search(rf"`(?:transformers\.|tfcore\.(?:moe\.)?)?{name}`", entries[chapter]):
                problems.append(f"chapter {chapter} builds {name}; its entry in book/models.md does not name it")
    return problems


def test_the_model_inventory_names_every_model_a_chapter_builds():
    assert inventory_problems((ROOT / "book" / "models.md").read_text(), NOTEBOOKS) == []


def test_a_model_missing_from_the_inventory_is_found():
    text = (ROOT / "book" / "models.md").read_text()
    chapter_14 = [p for p in NOTEBOOKS if p.name.startswith("14_")]
    assert "GPT2LMHeadModel" in built_model_classes(chapter_14[0])
    planted = text.replace("a small `GPT2LMHeadModel` from `transformers`,\n  ported", "a small GPT-2, ported")
    assert planted != text
    assert inventory_problems(planted, chapter_14) == [
        "chapter 14 builds GPT2LMHeadModel; its entry in book/models.md does not name it"]
    assert "no entry for chapter 14" in inventory_problems(text.replace("**Chapter 14.**", "**Ch 14.**"), chapter_14)[0]


# --- the landing page's "Start here" box and its drawing of what each chapter needs ---------------

def total_hours_problem(text: str) -> str | None:
    """The box's total reading time is the sum of the table's column, to the nearest hour."""
    found = re.search(r"The (\d+) chapters take about (\d+) hours to read", text)
    if found is None:
        return "the landing page no longer states the total reading time"
    times = landing_page_reading_times(text)
    hours = round(sum(times.values()) / 60)
    if (int(found.group(1)), int(found.group(2))) != (len(times), hours):
        return f"the box says {found.group(1)} chapters, {found.group(2)} hours; the table sums to {len(times)}, {hours}"
    return None


def test_the_start_box_gives_the_table_total():
    assert total_hours_problem((ROOT / "book" / "intro.md").read_text()) is None


def test_a_stale_total_is_found():
    text = (ROOT / "book" / "intro.md").read_text()
    hours = re.search(r"take about (\d+) hours", text).group(1)
    stale = text.replace(f"take about {hours} hours", f"take about {int(hours) + 2} hours")
    assert "the table sums to" in total_hours_problem(stale)


def test_the_colab_link_names_the_books_repository():
    import yaml
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    repository = url.removeprefix("https://github.com/").rstrip("/")
    links = re.findall(r"colab\.research\.google\.com/github/([^/]+/[^/]+)/blob/main/(notebooks/[\w.-]+)",
                       (ROOT / "book" / "intro.md").read_text())
    assert links and all(repo == repository and (ROOT / path).is_file() for repo, path in links), links


def prerequisites(text: str) -> dict[int, int]:
    """``{chapter: the chapter it builds on}`` from the landing page's ```text drawing: "a → b" on a
    line, and "a ┬→ b" with the "├→ c" and "└→ c" below the ┬, in its column."""
    drawing = re.search(r"### What each chapter needs.*?```text\n(.*?)```", text, re.S).group(1)
    parent, branch = {}, {}
    for line in drawing.splitlines():
        last = None
        for token in re.finditer(r"\d+(?:, \d+)*|[┬├└]→|→", line):
            kind = token.group()
            if kind[0].isdigit():
                for n in map(int, kind.split(", ")):
                    assert n not in parent, f"chapter {n} is drawn twice"
                    if last is not None:
                        parent[n] = last
                    elif n != 1:
                        raise AssertionError(f"chapter {n} has no arrow into it")
                last = int(kind.split(", ")[-1])
            elif kind == "┬→":
                branch[token.start()] = last
            elif kind in ("├→", "└→"):
                last = branch[token.start()]
    return parent


def chapters_named(path) -> set[int]:
    """The chapters a notebook names in its markdown: "chapter N", "§N.M" or a link to its file."""
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
    return {int(a or b or c) for a, b, c in re.findall(r"[Cc]hapters? (\d+)|§(\d+)\.|\]\((\d\d)_", text)}


# Earlier chapters that a chapter's opening names in passing, without needing them: chapter 9's
# opening and chapter 12's recall that chapter 7 checked the encoder against BERT.
NAMED_IN_PASSING = {9: {7}, 12: {7}}


def prerequisite_problems(parent: dict[int, int], paths) -> list[str]:
    problems = []
    by_chapter = {int(p.name[:2]): p for p in paths}
    if set(parent) | {1} != set(by_chapter):
        problems.append(f"the drawing has chapters {sorted(set(parent) | {1})}")
    for chapter, passing in NAMED_IN_PASSING.items():
        opening = nbformat.read(by_chapter[chapter], as_version=4).cells[0].source
        if not all(re.search(rf"\]\({n:02d}_", opening) for n in passing):
            problems.append(f"chapter {chapter}'s opening no longer links {sorted(passing)}: drop it from NAMED_IN_PASSING")
    for chapter, path in sorted(by_chapter.items()):
        if chapter in parent and parent[chapter] not in chapters_named(path):
            problems.append(f"chapter {chapter} is drawn on chapter {parent[chapter]}, which it never names")
        ancestors, n = set(), chapter
        while n in parent:
            n = parent[n]
            ancestors.add(n)
        opening = nbformat.read(path, as_version=4).cells[0].source
        linked = {int(n) for n in re.findall(r"\]\((\d\d)_", opening) if int(n) < chapter}
        missing = linked - ancestors - NAMED_IN_PASSING.get(chapter, set())
        if missing:
            problems.append(f"chapter {chapter}'s opening links chapters {sorted(missing)}, not on its path")
    return problems


def test_the_drawing_of_what_each_chapter_needs_matches_the_chapters():
    parent = prerequisites((ROOT / "book" / "intro.md").read_text())
    assert prerequisite_problems(parent, NOTEBOOKS) == []


def test_a_wrong_prerequisite_is_found():
    parent = prerequisites((ROOT / "book" / "intro.md").read_text())
    assert parent[17] == 13 and parent[10] == 9
    assert "chapter 17 is drawn on chapter 6, which it never names" in prerequisite_problems(
        parent | {17: 6}, NOTEBOOKS)
    assert "chapter 21's opening links chapters [15], not on its path" in prerequisite_problems(
        parent | {21: 14}, NOTEBOOKS)
