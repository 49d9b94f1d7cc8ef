# What a newcomer needs: `make setup`, `make demo` (build the offline demo release) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_OUT ?= demo-release

.PHONY: setup demo test test-fast test-e2e lint clean browser

setup: $(VENV)/.installed

# torch/torchvision are pinned with '===' so pip takes the registry's regular build even where a local CPU-only torch
# wheel is offered (its torchvision counterpart does not exist, and a mismatched pair fails at import).
# Each step says what it does; pip shows what it downloads (a progress bar on a terminal), so the minutes of torch's
# download are visible.
$(VENV)/.installed: pyproject.toml
	@echo "make setup [1/4]: creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "make setup [2/4]: upgrading pip"
	$(BIN)/pip install --quiet --upgrade pip
	@echo "make setup [3/4]: torch and torchvision with their CUDA libraries (most of the download)"
	$(BIN)/pip install --progress-bar on "torch===2.13.0" "torchvision===0.28.0"
	@echo "make setup [4/4]: lance-counterfactuals and its other dependencies"
	$(BIN)/pip install --progress-bar on -e ".[dev]"
	touch $@
	@echo "make setup: done; next: make demo (or: source $(VENV)/bin/activate)"

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/lance-cf build demo --output $(DEMO_OUT)
	$(BIN)/lance-cf verify $(DEMO_OUT)

# Three tiers, by pytest marker (pyproject.toml): fast, `slow`, `e2e`. `make test` runs the first two, `make test-e2e`
# the third; `.ci/run` runs both, in that order. The end-to-end tier (the README walks, CLI processes, the HTTP Hub
# double, the browser, Ray clusters) takes more CPU than the other two together, and two cores cannot run all three in
# 8 minutes (docs/testing.md, "The tiers").
# One pytest worker per CPU core (pytest-xdist; idle workers take tests from busy ones). Torch gets one intra-op
# thread per process: the tests use tiny models, and with a worker per core more threads only oversubscribe.
# One test alone: .venv/bin/python -m pytest tests/test_x.py::test_y (no workers).
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): pytest keeps the test modules
# it rewrote for assertions there, and without it every worker rewrites all of them at every run (collection took
# 19.6 s against 9.8 s on the 2-core machine).
PYTEST_WORKERS := -n auto --dist worksteal
PYTEST_ENV := HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=
test: setup
	$(PYTEST_ENV) $(BIN)/python -m pytest $(PYTEST_WORKERS) -m "not e2e" --durations=25

# The end-to-end tier only.
test-e2e: setup browser
	$(PYTEST_ENV) $(BIN)/python -m pytest $(PYTEST_WORKERS) -m e2e --durations=25

# The fast tier only: what to run while editing (a test costing about a second of CPU or more is marked slow; see the
# markers in pyproject.toml).
test-fast: setup
	$(PYTEST_ENV) $(BIN)/python -m pytest $(PYTEST_WORKERS) -m "not slow and not e2e"

# The browser tests (end-to-end tier): the evaluation report and the discovery report open in headless Chromium, and
# the review page is driven through chromedriver (selenium). Installed from Debian's packages when missing and this is
# root with apt (as on CI); otherwise say how.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make test-e2e: installing Debian's chromium and chromium-driver for the browser tests"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	else echo "make test-e2e needs Chromium and its driver: sudo apt-get install chromium chromium-driver"; exit 1; fi

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache
