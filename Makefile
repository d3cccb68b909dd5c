# Two entry points (see README Quickstart): `make demo` and `make test`.
# Both create .venv on first use; torch 2.13.0 (CPU) is installed only when the venv has no torch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/plait: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/plait

demo: setup
	$(BIN)/plait demo

test: setup
	$(BIN)/python -m pytest -q

.PHONY: setup demo test
