# Two commands for a newcomer, each doing all set-up from nothing:
#   make book   build the HTML book into _build/html
#   make test   everything CI checks
# Both create .venv from requirements.txt on first use and reuse it while nothing changed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Quick benchmark by default in `make bench`; `make bench SIZE=full` for the issue's size.
SIZE   ?= full

export PYTHONHASHSEED := 0
export MPLBACKEND := Agg
# Two cores here and in CI: keep torch's thread pool from oversubscribing them.
export OMP_NUM_THREADS ?= 2

.PHONY: test book bench lint typecheck unit notebooks html browser clean env

env: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

test: lint typecheck unit notebooks html browser
	@echo "make test: all checks passed"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest --ignore=tests/browser

notebooks: $(STAMP)
	$(BIN)/python -m pytest --nbval --nbval-current-env \
		-p no:cacheprovider -o addopts= -o filterwarnings= book/*.ipynb

html: $(STAMP)
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "The book is at $(CURDIR)/_build/html/index.html"

book: html

browser: $(STAMP)
	@if [ -d tests/browser ]; then $(BIN)/python -m pytest -o addopts= tests/browser; fi

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py --size $(SIZE)

clean:
	rm -rf _build
