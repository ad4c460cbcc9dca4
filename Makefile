# Two commands on a fresh machine: `make up` runs the mesh, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install up test lint bench clean receivers

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,postgres,hf]'
	@touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/ripplemesh up $(ARGS)

test: $(STAMP) receivers
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The real parts the observability tests run against: Prometheus and Chromium (Debian's packages,
# installed where this runs as root; elsewhere those tests skip and say what to install), and a
# Phoenix OTLP trace receiver in a venv of its own.
RECEIVERS := .venv-receivers
RECEIVERS_STAMP := $(RECEIVERS)/.installed-stamp
$(RECEIVERS_STAMP): infra/receivers-requirements.txt
	@test -x $(RECEIVERS)/bin/python || python3 -m venv $(RECEIVERS)
	$(RECEIVERS)/bin/python -m pip install --quiet --disable-pip-version-check -r infra/receivers-requirements.txt
	@touch $(RECEIVERS_STAMP)

receivers: $(RECEIVERS_STAMP)
	@if [ "$$(id -u)" = 0 ] && ! { command -v prometheus && command -v chromium; } >/dev/null; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus chromium >/dev/null; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m schemas.generate --check

bench: $(STAMP)
	$(VENV)/bin/ripplemesh bench overhead

clean:
	rm -rf .ripplemesh .pytest_cache .mypy_cache .ruff_cache
