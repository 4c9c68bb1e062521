# Set-up and everyday commands. TORCH_SPEC is installed first so that a CPU wheel
# is used where one is available; override it for CUDA: make train TORCH_SPEC=torch
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# pytest processes for `make test` (pytest-xdist; each test module runs whole in one of them)
TEST_WORKERS ?= 2
BIN := $(VENV)/bin

.PHONY: venv dev train test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"

venv: $(BIN)/python
	$(BIN)/pip install -q -e .

dev: $(BIN)/python
	$(BIN)/pip install -q -e ".[dev,nuplan,sweep]"

train: venv
	$(BIN)/carl-train +experiment=quick_vector

test: dev
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: venv
	$(BIN)/python scripts/bench_sim.py

clean:
	rm -rf $(VENV) runs outputs
