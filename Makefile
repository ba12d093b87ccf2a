# Two commands for a newcomer, each doing all set-up from nothing:
#   make book   build the HTML book into _build/html
#   make test   everything CI checks
# Both create .venv from requirements.txt on first use and reuse it while nothing changed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# `make bench`: the issue's size (minutes); `make bench SIZE=quick`: a 1/16 replica (seconds).
SIZE   ?= full

export PYTHONHASHSEED := 0
export MPLBACKEND := Agg
# Two cores here and in CI: keep torch's thread pool from oversubscribing them.
export OMP_NUM_THREADS ?= 2

.PHONY: test book bench bench-loaded lint typecheck unit notebooks html browser clean env mathjax chromium

env: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m pip install --quiet --no-deps -e src/klpen_book
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

# The book reads offline: MathJax comes from the npm registry (pinned), unpacked once into
# _build/offline-static/mathjax, which _config.yml makes a Sphinx static path. Only the parts
# the book loads are kept: the tex-mml-chtml bundle, the TeX extensions it autoloads, the
# CHTML fonts, and the menu / accessibility components loaded on demand.
MATHJAX_VERSION := 3.2.2
MATHJAX_DIR     := _build/offline-static/mathjax
MATHJAX_STAMP   := $(MATHJAX_DIR)/.mathjax-$(MATHJAX_VERSION)

$(MATHJAX_STAMP):
	@command -v npm >/dev/null || { echo "make html needs npm (e.g. apt-get install -y npm)"; exit 1; }
	rm -rf $(MATHJAX_DIR) _build/.mathjax-pkg
	mkdir -p _build/.mathjax-pkg $(MATHJAX_DIR)/output
	cd _build/.mathjax-pkg && npm pack --silent mathjax@$(MATHJAX_VERSION) >/dev/null \
		&& tar -xzf mathjax-$(MATHJAX_VERSION).tgz
	cd _build/.mathjax-pkg/package && cp -r LICENSE es5/tex-mml-chtml.js es5/input es5/ui \
		es5/a11y es5/sre $(CURDIR)/$(MATHJAX_DIR)/ \
		&& cp -r es5/output/chtml es5/output/chtml.js $(CURDIR)/$(MATHJAX_DIR)/output/
	rm -rf _build/.mathjax-pkg
	touch $@

mathjax: $(MATHJAX_STAMP)

html: $(STAMP) $(MATHJAX_STAMP)
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "The book is at $(CURDIR)/_build/html/index.html"

book: html

# Headless Chromium from Debian's packages (no browser download), installed once if absent;
# CHROMIUM names another Chromium/Chrome binary instead.
CHROMIUM ?= $(firstword $(wildcard /usr/bin/chromium /usr/bin/chromium-browser /usr/bin/google-chrome))
export CHROMIUM

chromium:
	@if [ -z "$(CHROMIUM)" ]; then \
		echo "installing chromium from Debian packages"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

# Runs after `html` in `make test`: checks the built book in a real browser.
browser: $(STAMP) chromium
	@test -f _build/html/index.html || { echo "make browser needs the book: run make html"; exit 1; }
	$(BIN)/python -m pytest -o addopts= -p no:cacheprovider tests/browser

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py --size $(SIZE)
	$(BIN)/python benchmarks/linear.py --size $(SIZE)

# The same table while one busy process per core competes for the CPU (a trainer's data
# loaders, tokenizers, other ranks): the kernels must keep their lead there too.
bench-loaded: $(STAMP)
	$(BIN)/python benchmarks/run.py --size $(SIZE) --loaded

clean:
	rm -rf _build
