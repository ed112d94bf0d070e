# Two commands do all the set-up on a fresh machine:
#   make generate   generate text with the default model (pulled and built on first use)
#   make test       lint + the test suite (CPU; GPU tests skip without CUDA)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Write a haiku about graphs.

.PHONY: install generate test test-gpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch first: a bare torch requirement would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

generate: install
	$(BIN)/onnxgen generate --chat --max-new-tokens 200 --prompt "$(PROMPT)"

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow"

test-gpu:
	$(PYTHON) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache
