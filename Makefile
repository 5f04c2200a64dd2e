# brigade: `make demo` runs the default study on this machine; `make test` runs the test suite.
# Both create .venv on first use and install the pinned dependencies (torch first: see requirements.txt).
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.brigade-installed
# This machine's pip config lists local wheel folders that do not exist; pip warns about each one.
QUIET := grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: demo test test-all lint bench install clean-results chromium

install: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@# Keep a torch that is already there (a CUDA build you installed); else the CPU build.
	@$(PY) -c "import torch" 2>/dev/null || { echo "installing torch==2.13.0 (CPU build)"; $(PY) -m pip install -q torch==2.13.0 2>&1 | $(QUIET); }
	@echo "installing pinned dependencies (requirements.txt)"
	@$(PY) -m pip install -q -r requirements.txt 2>&1 | $(QUIET)
	@$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt 2>&1 | $(QUIET)
	@$(PY) -m pip install -q --no-deps -e . --config-settings editable_mode=compat 2>&1 | $(QUIET)
	@DS_ACCELERATOR=cpu $(PY) -c "import torch, deepspeed, hydra, wandb, hta" >/dev/null 2>&1 || { echo "dependency check failed"; exit 1; }
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/brigade experiment=demo $(ARGS)

# No -x: a run shows every failure (pytest's -ra summary lists them), not only the first.
test: lint chromium
	$(PY) -m pytest tests -q -m "not heavy"

# ruff's rules and line length are in pyproject.toml ([tool.ruff]); `ruff check --fix .` sorts imports.
lint: $(STAMP)
	$(PY) -m ruff check .

# Everything, with the whole studies the README names (`heavy`: tens of minutes more on 2 cores).
test-all: $(STAMP) chromium
	$(PY) -m pytest tests -q

# Headless Chromium for the report's browser test: Debian's package, driven by Playwright's Python
# package (never `playwright install`). Quick no-op when it is there; installs it as root (CI) or via sudo.
chromium:
	@test -x /usr/bin/chromium || { echo "installing Debian's chromium for the browser test (apt-get)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium >/dev/null; }

bench: $(STAMP)
	$(PY) -m pytest tests/benchmarks --benchmark-only --benchmark-columns=min,median,max,rounds -q -s -p no:cacheprovider

clean-results:
	rm -rf results/runs results/hydra results/*.jsonl results/*.html results/*.png
