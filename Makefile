# Omni-Flow developer commands. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROTO_SRC := $(shell find protos -name '*.proto')
API_STAMP := libs/omniflow/api/.stamp

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | \
		awk -F'\t' '{printf "  make %-10s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[worker,local,dev,gateway]'
	@touch $@

setup: $(VENV)/.installed protos kernels ## create .venv and install every service, extras and dev tools

kernels: $(VENV)/.installed ## build the engine's fused CPU kernels (cached in ~/.cache/omniflow/kernels)
	@$(PY) -c "from omniflow_services.worker.engine import kernels; raise SystemExit(kernels.main())" \
		|| echo "no engine kernels: the engine runs its torch path (same results, slower)" >&2

$(API_STAMP): $(PROTO_SRC) scripts/gen_protos.py | $(VENV)/.installed
	$(PY) scripts/gen_protos.py
	@touch $@

protos: $(API_STAMP) ## generate Python code and type stubs from protos/ into libs/omniflow/api/

lint: setup ## ruff check and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup lint ## lint, then every test (unit, in-process gRPC, multi-process integration)
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

up: setup ## start the local topology (Redis, kv-index, kv-agent, router, coordinator, workers)
	$(VENV)/bin/omniflow up

status: ## show the local topology
	$(VENV)/bin/omniflow status

down: ## stop everything `make up` started
	$(VENV)/bin/omniflow down

demo: setup ## start the topology (unless running) and stream a reply from an llm worker
	@$(VENV)/bin/omniflow status >/dev/null 2>&1 || $(VENV)/bin/omniflow up
	$(PY) examples/chat.py "Hello, Omni-Flow"

bench: setup ## run every benchmark (prints tables)
	@for b in $$(grep -l '__main__' bench/*.py); do echo "== $$b"; $(PY) $$b || exit 1; done

compose-local: setup ## build every image on a Debian base here and run the compose stack (docs/deploy.md)
	scripts/compose_local.sh all

compose-down: ## stop the compose stack of compose-local, its containers and volumes
	scripts/compose_local.sh down

clean: ## remove generated code and caches (keeps .venv)
	rm -rf libs/omniflow/api .pytest_cache .ruff_cache

.PHONY: help setup protos kernels lint test up status down demo bench compose-local compose-down clean
