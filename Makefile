# The README's commands. `make run` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
AREAL_STAMP := $(VENV)/.installed-areal

ENGINE_VENV ?= .venv-engine
ENGINE_STAMP := $(ENGINE_VENV)/.installed

.PHONY: run test test-engine lint protos bench clean chromium

AREAL_VERSION := 1.0.4

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# AReaL's own classes for the adapter tests only (docs/training.md, "AReaL"), so `make run`
# never pulls torch: areal pins an older torch than the CPU build here, so it goes in without
# its dependencies, beside what its modules import.
$(AREAL_STAMP): $(STAMP) requirements-areal.txt
	$(BIN)/python -m pip install --quiet -r requirements-areal.txt
	$(BIN)/python -m pip install --quiet --no-deps areal==$(AREAL_VERSION)
	touch $(AREAL_STAMP)

run: $(STAMP)  ## the whole stack as local processes (embedded Redis, mock LLM unless configured)
	$(BIN)/rollgate up $(ARGS)

test: $(AREAL_STAMP) chromium  ## every test, against real Redis and real service processes
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The console's browser tests drive a headless Chromium: Debian's `chromium` package, installed
# with apt-get when missing (as root, or through sudo); $CHROMIUM names another binary.
chromium:
	@"$${CHROMIUM:-chromium}" --version >/dev/null 2>&1 || { \
	  echo "make: installing Debian's chromium for the console's browser tests"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium; \
	  "$${CHROMIUM:-chromium}" --version >/dev/null 2>&1 || { \
	    echo "make: chromium is still missing: install it (apt-get install -y chromium) or set CHROMIUM" >&2; exit 1; }; }

# vLLM (CPU) in a venv of its own: it pins its own torch and transformers.
$(ENGINE_STAMP): tests/engine/requirements.txt tests/engine/overrides.txt tests/engine/install.sh
	PYTHON=$(PYTHON) bash tests/engine/install.sh $(ENGINE_VENV)
	touch $(ENGINE_STAMP)

test-engine: $(STAMP) $(ENGINE_STAMP)  ## rollgate in front of a real vLLM on a tiny model built here
	ROLLGATE_ENGINE_PYTHON=$(ENGINE_VENV)/bin/python $(BIN)/python -m pytest tests/engine $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy services rollgate schema stackconfig chatml grpcpoller

protos: $(STAMP)  ## regenerate the gRPC stubs after editing protos/*.proto
	PYTHON=$(BIN)/python bash protos/generate.sh

bench: $(STAMP)  ## rollgate vs the mock called directly vs the floor (bench/floor.py), per cell; Redis growth per turn
	$(BIN)/python bench/run.py $(ARGS)

clean:
	rm -rf $(VENV) $(ENGINE_VENV) .pytest_cache .mypy_cache .ruff_cache
