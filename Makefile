# Two commands for a newcomer: `make demo` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint firmware clean

$(BIN)/qsched: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/qsched

demo: install
	$(BIN)/qsched demo

firmware:
	if [ -f firmware/Makefile ]; then $(MAKE) -C firmware; fi

test: install firmware
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python .ci/typecheck
	$(BIN)/pytest -q -p no:cacheprovider

# mypy cannot follow the folder -> qsched.<folder> mapping: .ci/typecheck links the tree.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python .ci/typecheck

clean:
	rm -rf $(VENV) firmware/build
