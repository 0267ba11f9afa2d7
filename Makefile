# Both targets set everything up on a fresh machine: a .venv with the package and its extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: bench test lint install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[engine,tiers,server,test]"
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

test: $(STAMP)
	$(BIN)/ruff check kvheat tests bench
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check kvheat tests bench

clean:
	rm -rf $(VENV) build *.egg-info
