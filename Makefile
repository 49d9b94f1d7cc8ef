# Two targets a newcomer needs: `make demo` (set up + build the offline demo release) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_OUT ?= demo-release

.PHONY: setup demo test lint clean

setup: $(VENV)/.installed

# torch/torchvision are pinned with '===' so pip takes the registry's regular build even where a local CPU-only torch
# wheel is offered (its torchvision counterpart does not exist, and a mismatched pair fails at import).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch===2.13.0" "torchvision===0.28.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/lance-cf build demo --output $(DEMO_OUT)
	$(BIN)/lance-cf verify $(DEMO_OUT)

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache
