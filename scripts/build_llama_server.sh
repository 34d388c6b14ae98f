#!/usr/bin/env bash
# Build llama.cpp's own llama-server once, for `pagedllm bench throughput --compare llama.cpp`, and its
# llama-quantize (K-quant files for the real-size benchmarks, scripts/make_real_size_gguf.py).
#
# The source is the llama.cpp vendored in llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION (a pinned, released
# snapshot from PyPI, the same one `pip install llama-cpp-python` would compile), built with cmake for this
# CPU (GGML_NATIVE). It lands in $CACHE/bin/ (llama-server and the shared libraries it links), which is
# where pagedllm looks by default; nothing is done when the binary is already there. About 25 minutes on
# 2 cores. Needs cmake, a C++ compiler and pip (to download the sdist).
# Knobs: LLAMA_CPP_PYTHON_VERSION, PAGEDLLM_LLAMA_CACHE (default ~/.cache/pagedllm/llama.cpp/<version>),
# JOBS (default: nproc), PIP (default: python3 -m pip), LLAMA_ISA: "native" (default) or "avx2", a build for
# AVX2 + FMA only (no AVX-512, no AMX) in $CACHE/bin-avx2/: the peer of pagedllm capped with
# PAGEDLLM_CPU_ISA=avx2 on a bigger CPU (`PAGEDLLM_LLAMA_SERVER=$CACHE/bin-avx2/llama-server`).
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}  # keep in step with pagedllm/bench/llamacpp_server.py
CACHE=${PAGEDLLM_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedllm/llama.cpp/$VERSION}
JOBS=${JOBS:-$(nproc)}
PIP=${PIP:-python3 -m pip}
ISA=${LLAMA_ISA:-native}
case "$ISA" in
    native) OUT="$CACHE/bin" ;;
    avx2) OUT="$CACHE/bin-avx2" ;;
    *) echo "error: LLAMA_ISA must be native or avx2, got $ISA" >&2; exit 2 ;;
esac
BIN="$OUT/llama-server"

if [ -x "$BIN" ]; then
    echo "llama-server is already built: $BIN"
    exit 0
fi
command -v cmake >/dev/null || { echo "error: cmake is needed (apt-get install cmake)" >&2; exit 1; }

SRC="$CACHE/src"
mkdir -p "$SRC"
if [ ! -d "$SRC/llama_cpp_python-$VERSION" ]; then
    # the sdist, not a wheel: it is the one that carries vendor/llama.cpp
    $PIP download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
    tar -xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
fi
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"

# On a CPU with AMX, GGML_NATIVE compiles ggml's AMX matmul, and this release's build of it dies at its first
# tile instruction (SIGILL in ggml_backend_amx_mul_mat's tilezero: the tile state is never granted) while
# loading any model; without AMX it runs its AVX-512 VNNI / BF16 kernels. GCC keeps an explicit -mno-amx-*
# over what -march=native would turn on, whatever their order on the command line.
NO_AMX=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
CPU_FLAGS=(-DGGML_NATIVE=ON)
BUILD="$LLAMA/build"
if [ "$ISA" = avx2 ]; then  # what ggml's own x86 variants call haswell: AVX2, FMA, F16C, BMI2
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
        -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF)
    BUILD="$LLAMA/build-avx2"
    NO_AMX=""
fi
cmake -S "$LLAMA" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "${CPU_FLAGS[@]}" \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
cmake --build "$BUILD" --target llama-server llama-quantize -j "$JOBS"

# the binary and its shared libraries (libllama, libggml*, libmtmd) side by side: pagedllm runs it with
# LD_LIBRARY_PATH set to that folder, so the build tree may be deleted afterwards
mkdir -p "$OUT"
cp -a "$BUILD/bin/"*.so* "$OUT/" 2>/dev/null || true  # -a: the .so -> .so.0 links stay links
cp "$BUILD/bin/llama-quantize" "$OUT/llama-quantize"
cp "$BUILD/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"  # last, so that a half-finished copy never counts as built
LD_LIBRARY_PATH="$OUT" "$BIN" --version
echo "built $BIN"
