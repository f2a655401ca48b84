# The single entry point: `make train` runs the main job, `make test` runs the whole suite.
# Both create the virtual environment on first use.

PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; a plain `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv train test lint format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

venv: $(STAMP)

# Until `reflow agent-train` lands (issue F4), the main job plays every built-in env with its
# scripted demonstration policy (10% slips) and prints success and episode-length figures.
train: $(STAMP)
	$(VENV)/bin/reflow envs play --all --episodes 50 --error-rate 0.1

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
