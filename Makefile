# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup demo test clean

setup: $(VENV)/.installed

# The venv sees system site-packages so an already-installed torch (e.g. a CUDA build) is reused;
# otherwise we install the CPU build torch==2.13.0 explicitly, never letting pip resolve a multi-GB CUDA wheel.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

demo: setup
	$(PY) -m leapdecode.cli generate --max-tokens 48 "def fibonacci(n):"

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
