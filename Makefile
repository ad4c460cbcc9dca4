# Two commands on a fresh machine: `make up` runs the mesh, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install up test lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,postgres,hf]'
	@touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/ripplemesh up $(ARGS)

test: $(STAMP)
	$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m schemas.generate --check

bench: $(STAMP)
	$(VENV)/bin/ripplemesh bench overhead

clean:
	rm -rf .ripplemesh .pytest_cache .mypy_cache .ruff_cache
