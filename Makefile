# lmc: `make help` lists the targets.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.DEFAULT_GOAL := help
.PHONY: help install slurm demo repro repro-quick test test-fast lint format clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

# Quiet: pip prints its warnings and errors only. PYTHONWARNINGS drops the ten-line notice setuptools gives on
# every editable install of a mapped folder (lmc.configs is configs/): information, not a warning.
$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	$(BIN)/python -c 'import lmc.cli; lmc.cli.keep_help()'  # lmc run/fit --help, fast from the first (lmc.cli.help_cache)
	touch $@

install: $(BIN)/.installed  ## Create .venv and install lmc with its pinned dependencies

# The tests start a single-node SLURM on this machine (tests/slurm.py): Debian's packages, as root.
slurm:  ## Install SLURM and munge for the tests (apt-get, Debian/Ubuntu, as root) unless present
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then \
	  echo "slurm: slurmctld, slurmd and munged are installed"; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "make slurm: installing slurm-wlm and munge needs root and apt-get; install them, then rerun" >&2; exit 1; \
	else \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; \
	fi

demo: install  ## The main job on the embedded default (offline, CPU)
	$(BIN)/lmc demo

repro: install  ## The paper's study at small scale (lmc repro): regenerates docs/results.md
	$(BIN)/lmc repro

repro-quick: install  ## The study's pipeline in its tiny form (runs/repro_quick/results.md)
	$(BIN)/lmc repro --quick true

# Two workers, one per core; each test file stays on one worker (its module fixtures, the SLURM cluster).
test: install slurm  ## Run every test (slow ones in their tiny form; the SLURM test on a local cluster)
	LMC_REQUIRE_SLURM=1 $(BIN)/python -m pytest -n 2 --dist loadfile

test-fast: install  ## Run the tests not marked slow
	$(BIN)/python -m pytest -m "not slow"

lint: install  ## ruff check and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install  ## Format the code with ruff
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:  ## Remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache
