# The two commands: `make up` runs the whole stack, `make test` runs the whole suite.
# Both create .venv when missing and (re)install the project when pyproject.toml changed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: up test test-fast lint install clean

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"' \
	  || { echo "make: $(PYTHON) is older than 3.11; run: make PYTHON=python3.11 ..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --progress-bar off -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install --quiet --progress-bar off -e '.[test]'
	@touch $@

install: $(VENV)/.installed

up: $(VENV)/.installed
	$(VENV)/bin/llmgw up $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff, mypy (configured in pyproject.toml) and the import-layer check; all three run, and any failure fails lint.
lint: $(VENV)/.installed-test
	@status=0; \
	$(VENV)/bin/ruff check proto services tests scripts || status=1; \
	$(VENV)/bin/mypy || status=1; \
	$(PY) scripts/check_layers.py || status=1; \
	exit $$status

clean:
	rm -rf $(VENV) data
