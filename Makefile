# Two commands do all the set-up on a fresh machine:
#   make generate   generate text with the default model (pulled and built on first use)
#   make test       lint + the test suite (CPU; GPU tests skip without CUDA)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Write a haiku about graphs.

.PHONY: install browser generate test test-gpu clean

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

# Debian's chromium and chromedriver for tests/test_server_browser.py (the chat page in a real browser):
# installed with apt-get where either is missing and we are root, the package lists fetched only when
# the install fails without them; elsewhere that test skips, naming what is missing.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "browser: chromium or chromedriver missing (needs root and apt-get to install); the browser test will skip" >&2; \
	else \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || \
		{ apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }; \
	fi

test: install browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow"

test-gpu:
	$(PYTHON) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache
