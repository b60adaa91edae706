# The two commands: `make demo` (the loop on embedded defaults and the tiny model) and `make test`.
# Both do all their own set-up: the virtualenv (`install`) and the Debian packages (`system-deps`).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.installed

.PHONY: install system-deps test-deps demo demo-methods test lint bench lock clean

install: $(STAMP)

$(STAMP): requirements/lock.txt pyproject.toml
	bash infra/install.sh
	touch $(STAMP)

system-deps:  ## PostgreSQL, Redis, Java 17 + Maven: apt-installs what is missing as root, else says how
	bash infra/system-deps.sh

test-deps:  ## system-deps plus Prometheus (promtool, for the alert rules) and Chromium (headless, for rtrl report)
	bash infra/system-deps.sh --test

lock:  ## re-resolve requirements/lock.txt from requirements/base.in (+ overrides)
	$(UV) pip compile requirements/base.in --override requirements/overrides.txt --generate-hashes \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 -o requirements/lock.txt

demo: install system-deps
	$(VENV)/bin/rtrl demo --cycles 3 --json .rtrl/demo/cycles.json

METHODS := parl summarize self-edit

demo-methods: install system-deps  ## the loop on each RL method's simulated agents in turn (docs/methods.md)
	@set -e; for m in $(METHODS); do echo "== $$m"; \
	  $(VENV)/bin/rtrl demo --scenario $$m --cycles 2 --requests 48 --json .rtrl/demo/$$m.json; done

lint: install  ## style, the layer contract (docs/architecture.md, Layers), strict types on every package
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

test: install test-deps lint
	$(VENV)/bin/python -m pytest --durations=40 --durations-min=5 $(PYTEST_ARGS)

bench: install system-deps  ## every benchmark under bench/; each prints one JSON object last
	@set -e; for b in bench/bench_*.py; do echo "== $$b"; $(VENV)/bin/python $$b; done

clean:
	-$(VENV)/bin/rtrl services down
	rm -rf .rtrl
