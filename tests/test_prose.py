"""The prose: every cross-reference names a heading that exists, and every chapter's main path is one
a reader can finish. Each check is also run on planted problems, to show that it can fail."""

from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_markdown_cell, new_notebook

from nbformat.v4 import new_code_cell

from prose_checks import (IGNORED_OUTPUT, MAX_MAIN_PATH_CODE_CELLS, MAX_MAIN_PATH_WORDS, ROOT,
                          all_reference_problems, headings, ignored_output_cells, landing_page_reading_times,
                          main_path_code_cells, main_path_words, notebooks, reading_minutes, reference_problems)

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


def ignored_output_problem(text: str, paths) -> str | None:
    """The landing page's "N cells, in M chapters, are tagged `nbval-ignore-output`" is the count in
    the notebooks."""
    found = IGNORED_OUTPUT.search(text)
    if found is None:
        return "the landing page no longer counts the cells tagged nbval-ignore-output"
    stated, counted = (int(found.group(1)), int(found.group(2))), ignored_output_cells(paths)
    if stated != counted:
        return (f"the landing page says {stated[0]} cells in {stated[1]} chapters are tagged nbval-ignore-output; "
                f"the notebooks have {counted[0]} in {counted[1]} (python tests/prose_checks.py --write-reading-times)")
    return None


def test_landing_page_counts_the_cells_whose_output_is_not_compared():
    assert ignored_output_problem((ROOT / "book" / "intro.md").read_text(), NOTEBOOKS) is None


# --- the same checks, shown to fail on planted problems -----------------------------------------


def test_a_stale_count_of_uncompared_cells_is_found(tmp_path):
    path = tmp_path / "01_x.ipynb"
    ignored = {"tags": ["nbval-ignore-output"]}
    nbformat.write(new_notebook(cells=[new_code_cell("a = 1", metadata=ignored), new_code_cell("b = 2"),
                                       new_code_cell("c = 3", metadata={"tags": ["hide-cell", "nbval-ignore-output"]})]),
                   path)
    assert ignored_output_cells([path]) == (2, 1)
    right = "Only 2 cells, in 1 chapters,\nare tagged `nbval-ignore-output`, so that"
    assert ignored_output_problem(right, [path]) is None
    assert "the notebooks have 2 in 1" in ignored_output_problem(right.replace("Only 2", "Only 3"), [path])
    assert "no longer counts" in ignored_output_problem("Only a few cells are left uncompared.", [path])


def test_writing_the_reading_times_also_writes_the_count(tmp_path):
    from prose_checks import write_reading_times

    page = tmp_path / "intro.md"
    page.write_text("Only 1 cells, in 1 chapters, are tagged `nbval-ignore-output`, so that\n")
    write_reading_times(page)
    assert ignored_output_problem(page.read_text(), NOTEBOOKS) is None

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
    stale = "time nothing on your machine. Only chapter 24 reads the clock, and it prints"
    assert "[22, 24] read the clock" in _clock_sentence_problem(stale, NOTEBOOKS)


# --- the model inventory (book/models.md) names every model class a chapter imports or names ------

import re

# tfcore's models: every tfcore class that ports a `transformers` model (`from_transformers`; a test
# below keeps the list whole), its encoders and encoder-decoders, and the Keras appendix's model.
TFCORE_MODELS = {"GPT", "Llama", "Gemma", "DeepseekV3", "Qwen35", "Mixtral", "DeepseekV3WithExperts", "TransformerEncoder",
                 "TransformerForSequenceClassification", "EncoderDecoder", "make_model", "Transformer"}
IMPORT = re.compile(r"^[ \t]*from (transformers|tfcore)((?:\.\w+)*) import (\([^)]*\)|[^\n]*)", re.M)
MODULE_ALIAS = re.compile(r"^[ \t]*import ((?:transformers|tfcore)(?:\.\w+)*) as (\w+)", re.M)


def is_transformers_model(name: str) -> bool:
    """A model class of the pinned `transformers`: a `PreTrainedModel` or an `Auto*` model class."""
    import transformers
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    try:
        found = getattr(transformers, name)
    except (AttributeError, ImportError):
        return False
    return isinstance(found, type) and issubclass(found, (transformers.PreTrainedModel, _BaseAutoModelClass))


def named_model_classes(code: str) -> set[str]:
    """The `transformers` and `tfcore` model classes that code imports or names: every name imported
    from either package, and every attribute written after ``transformers.``, ``tfcore.`` or an alias
    of them or of one of their modules (``transformers.LlamaForCausalLM``, ``tfcore.moe.Mixtral``,
    ``kt.Transformer``), kept when it is a model class. So a class is found however it is then called
    (``model_class(config_class(**tiny))``, ``AutoModel.from_config``)."""
    found = {"transformers": set(), "tfcore": set()}
    roots = {"transformers": "transformers", "tfcore": "tfcore"}  # a name in the code -> its package
    for package, _, names in IMPORT.findall(code):
        for name, alias in re.findall(r"(\w+)(?:\s+as\s+(\w+))?", names.strip("()")):
            found[package].add(name)
            roots[alias or name] = package  # a module, or a class whose attributes are not models
    for module, alias in MODULE_ALIAS.findall(code):
        roots[alias] = module.split(".")[0]
    for name, package in roots.items():
        for chain in re.findall(rf"(?<![\w.]){name}((?:\.\w+)+)", code):
            found[package].update(chain.split(".")[1:])
    return ({n for n in found["transformers"] if is_transformers_model(n)}
            | (found["tfcore"] & TFCORE_MODELS))


def built_model_classes(path) -> set[str]:
    """The model classes of `transformers` and `tfcore` that a chapter's code imports or names."""
    return named_model_classes(
        "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"))


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
            # `Name`, `transformers.Name`, `tfcore.moe.Name`, `Name.from_config`
            if not re.search(rf"`(?:transformers\.|tfcore\.(?:\w+\.)?)?{name}(?:\.\w+)?`", entries[chapter]):
                problems.append(f"chapter {chapter} names {name}; its entry in book/models.md does not")
    return problems


def test_the_model_inventory_names_every_model_class_a_chapter_names():
    assert inventory_problems((ROOT / "book" / "models.md").read_text(), NOTEBOOKS) == []


def test_a_model_missing_from_the_inventory_is_found():
    text = (ROOT / "book" / "models.md").read_text()
    chapter_14 = [p for p in NOTEBOOKS if p.name.startswith("14_")]
    assert "GPT2LMHeadModel" in built_model_classes(chapter_14[0])
    entry = inventory_entries(text)[14]
    assert "`GPT2LMHeadModel`" in entry
    # every mention of the class in chapter 14's entry, and in no other entry, replaced
    planted = text.replace(entry, entry.replace("`GPT2LMHeadModel`", "GPT-2"))
    assert inventory_problems(planted, chapter_14) == [
        "chapter 14 names GPT2LMHeadModel; its entry in book/models.md does not"]
    assert "no entry for chapter 14" in inventory_problems(text.replace("**Chapter 14.**", "**Ch 14.**"), chapter_14)[0]


def test_a_model_class_called_through_a_variable_is_found():
    """Chapter 16's deep dive builds Mistral through ``model_class(config_class(**tiny))``: no call
    of the class by its name, yet the inventory must name it."""
    text = (ROOT / "book" / "models.md").read_text()
    chapter_16 = [p for p in NOTEBOOKS if p.name.startswith("16_")]
    planted = text.replace("`MistralForCausalLM`", "Mistral")
    assert planted != text
    assert inventory_problems(planted, chapter_16) == [
        "chapter 16 names MistralForCausalLM; its entry in book/models.md does not"]


def test_every_way_of_naming_a_model_class_is_found():
    code = """
from transformers import (
    AutoTokenizer,
    BertConfig,
    MistralForCausalLM,
)
import transformers
from tfcore import moe as m
import tfcore.keras_transformer as kt
families = {"Mistral": MistralForCausalLM, "Qwen2": transformers.Qwen2ForCausalLM}
model = families[name](BertConfig())
auto = transformers.AutoModel.from_config(BertConfig())
mix = m.Mixtral.from_transformers(model)
keras_model = kt.Transformer(13, 13)
encoder = tfcore.TransformerEncoder(tfcore.load_config())
config = transformers.LlamaConfig()
tokenizer = AutoTokenizer.from_pretrained(".")
"""
    assert named_model_classes(code) == {"MistralForCausalLM", "Qwen2ForCausalLM", "AutoModel", "Mixtral",
                                         "Transformer", "TransformerEncoder"}


def test_the_list_of_tfcore_models_is_whole():
    """Every tfcore class that ports a `transformers` model (``from_transformers``) is in
    TFCORE_MODELS, and every name there is defined in tfcore."""
    import ast

    defined, ports = set(), set()
    for path in (ROOT / "tfcore").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                defined.add(node.name)
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(f, ast.FunctionDef) and f.name == "from_transformers" for f in node.body):
                ports.add(node.name)
    assert ports and ports <= TFCORE_MODELS, ports - TFCORE_MODELS
    assert TFCORE_MODELS <= defined, TFCORE_MODELS - defined


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
    others = re.findall(r"https://github\.com/([\w.-]+/[\w.-]+)", (ROOT / "book" / "intro.md").read_text())
    assert all(repo == repository for repo in others if not repo.startswith("computationalmodelling/")), others


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
    assert "chapter 22's opening links chapters [15], not on its path" in prerequisite_problems(
        parent | {22: 14}, NOTEBOOKS)
