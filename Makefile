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

.PHONY: test book bench bench-loaded lint typecheck unit notebooks html browser clean env mathjax chromium \
	wheel wheel-test torch-floor

env: $(STAMP)

$(STAMP): requirements.txt pyproject.toml src/klpen_book/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m pip install --quiet --no-deps -e src/klpen_book
	touch $@

test: lint typecheck unit wheel-test notebooks html browser
	@echo "make test: all checks passed"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# TRITON_INTERPRET=1: the Triton backend's kernels run on CPU tensors (Triton's interpreter),
# so every backend-parametrised test checks them against the torch reference here too.
unit: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest --ignore=tests/browser

# The release as a user gets it: `python -m build` makes the sdist and the wheel into
# _build/dist; wheel-test installs the wheel into a fresh venv whose only other packages are
# .venv's pinned ones (a path entry, not a copy: .venv's editable klpen is not on it), and runs
# tests/wheel_smoke.py there with `python -I` from a folder outside the tree: the installed klpen
# must hold every file of src/klpen, pass a smoke test and its own doctests.
DIST       := _build/dist
WHEEL_VENV := _build/wheel-venv

wheel: $(STAMP)
	rm -rf $(DIST)
	$(BIN)/python -m build --no-isolation --outdir $(DIST) .

wheel-test: wheel
	rm -rf $(WHEEL_VENV)
	$(BIN)/python -m venv --without-pip $(WHEEL_VENV)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> "$$($(WHEEL_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/klpen-deps.pth"
	$(BIN)/python -m pip --python $(WHEEL_VENV)/bin/python install --quiet --no-index $(DIST)/klpen-*.whl
	cd "$$(mktemp -d)" && $(CURDIR)/$(WHEEL_VENV)/bin/python -I $(CURDIR)/tests/wheel_smoke.py $(CURDIR)
	rm -rf $(WHEEL_VENV)

# The oldest torch klpen supports (pyproject's floor: torch.library.custom_op is 2.4's): run by
# .ci/run after `make test` (not part of `make test`: it downloads about 2.5 GB), in a
# venv of its own with the unit tests' own pins, running every unit test and doctest of klpen
# except those of the pinned interoperability (transformers >= 5 needs torch 2.6; TRL; the
# build tools). A hang fails after 15 minutes: on 2.4.1 a gloo rank can deadlock in
# ProcessGroupGloo's destructor at exit (seen once, in test_distributed_aggregate, under load).
# PyPI's Linux torch wheel is a CUDA build: it brings its nvidia-* libraries
# (about 2.5 GB to download, 5 GB installed, a minute here), so the venv is removed after.
TORCH_FLOOR := 2.4.1
FLOOR_VENV  := _build/torch-floor-venv
FLOOR_SKIP  := tests/browser tests/test_language.py tests/test_examples.py \
	tests/test_trl_example.py tests/test_wheel.py src/klpen_book/language.py \
	tests/test_lab_chapter_10.py src/klpen_book/distillation_study.py

torch-floor: $(STAMP)
	rm -rf $(FLOOR_VENV)
	$(BIN)/python -m venv $(FLOOR_VENV)
	status=0; \
	$(FLOOR_VENV)/bin/python -m pip install --quiet --no-cache-dir torch==$(TORCH_FLOOR) \
		$$(grep -E '^(numpy|matplotlib|pytest|hypothesis)==' requirements.txt) \
	&& PYTHONPATH=src $(FLOOR_VENV)/bin/python -c \
		"import torch; assert torch.__version__.startswith('$(TORCH_FLOOR)'), torch.__version__" \
	&& PYTHONPATH=src timeout 900 $(FLOOR_VENV)/bin/python -m pytest -q \
		$(addprefix --ignore=,$(FLOOR_SKIP)) \
	|| status=$$?; \
	rm -rf $(FLOOR_VENV); exit $$status

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
	$(BIN)/python benchmarks/linear.py --size $(SIZE) --loaded

clean:
	rm -rf _build
