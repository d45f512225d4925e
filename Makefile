# gpulane: `make run` starts the whole stack on this machine; `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test test-slow screenshot lint fmt bench gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.run-deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.dev-deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(VENV)/.run-deps

run: $(VENV)/.run-deps ## the whole stack: private Redis, API, one worker per GPU
	@scripts/ensure-redis.sh
	$(BIN)/gpulane up

test: $(VENV)/.dev-deps ## the default suite, a few minutes on 2 cores
	@scripts/ensure-redis.sh
	@scripts/ensure-test-tools.sh
	@scripts/llama-venv.sh
	@scripts/infinity-venv.sh
	GPULANE_REQUIRE_MODELS=1 $(BIN)/pytest

test-slow: $(VENV)/.dev-deps ## the slow fault tests (chaos, containers); CI runs them too
	@scripts/ensure-redis.sh
	@scripts/ensure-test-tools.sh
	@scripts/ensure-docker.sh
	@scripts/llama-venv.sh
	@scripts/infinity-venv.sh
	$(BIN)/pytest -m slow

screenshot: $(VENV)/.dev-deps ## regenerate docs/dashboard.png from the dashboard test
	@scripts/ensure-redis.sh
	@scripts/ensure-test-tools.sh
	GPULANE_UPDATE_DOCS=1 $(BIN)/pytest -q tests/test_dashboard.py -k live

lint: $(VENV)/.dev-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy dispatcher worker testkit bench tests/support gpulane.py

fmt: $(VENV)/.dev-deps
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

$(VENV)/.bench-deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[bench,models]'
	touch $@

bench: $(VENV)/.run-deps $(VENV)/.bench-deps ## benchmarks (never in `make test`): BENCH_ARGS="--quick overhead"
	@scripts/ensure-redis.sh
	$(BIN)/python -m bench $(BENCH_ARGS)

gpu-check: ## on a GPU machine (at most 8 min): NVML, the embed benches on cuda, a SIGKILL mid-CUDA
	@scripts/ensure-redis.sh
	$(BIN)/python -m bench.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .test-logs *.egg-info
