# The two commands: `make demo` (the loop on embedded defaults and the tiny model) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.installed

.PHONY: install demo test lint lock services-up services-down clean

install: $(STAMP)

$(STAMP): requirements/lock.txt pyproject.toml
	bash infra/install.sh
	touch $(STAMP)

lock:  ## re-resolve requirements/lock.txt from requirements/base.in (+ overrides)
	$(UV) pip compile requirements/base.in --override requirements/overrides.txt \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 -o requirements/lock.txt

demo: install
	$(VENV)/bin/rtrl demo --cycles 3 --json .rtrl/demo/cycles.json

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy schemas

test: install lint
	bash infra/system-deps.sh
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	-$(VENV)/bin/rtrl services down
	rm -rf .rtrl
