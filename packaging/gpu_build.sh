#!/usr/bin/env bash
# Build (once) one of llama.cpp's GPU backend modules for SpecDeck's portable llama-cpp-python,
# and print its path; with --install, also copy it beside the CPU variants in PYTHON's llama_cpp/lib.
#
#   bash packaging/gpu_build.sh vulkan PYTHON [--install]   -> .../libggml-vulkan.so
#   bash packaging/gpu_build.sh cuda   PYTHON [--install]   -> .../libggml-cuda.so
#
# Why a module and not another wheel: the portable build loads its backends at run time
# (GGML_BACKEND_DL), so one wheel serves every PC and the GPU code is an optional file beside
# it. The module is compiled from the same vendored llama.cpp as the wheel (the sdist of the same
# version) with the wheel's flags, so its ggml ABI is the wheel's: ggml_backend_load checks only
# the backend API version, and the module's libggml-base.so.0 is the one the wheel already loaded.
# SpecDeck loads it only after a child process saw it run (backends/models/gpu_runtime.py).
#
# vulkan: AMD, Intel and NVIDIA cards through the Vulkan loader (libvulkan.so.1, from the GPU
#   driver). Needs glslc, the Vulkan headers and SPIRV-Headers (apt-get: glslc libvulkan-dev
#   spirv-headers), installed here when missing. Debian 12's glslc lacks the cooperative-matrix and
#   integer-dot extensions, so those fast paths are compiled out (a newer glslc enables them).
# cuda: NVIDIA cards, CUDA 13 (driver 580 or newer). Needs nvcc; cuBLAS comes from PyPI's
#   nvidia-cublas wheel (about 420 MB, cached). Compile-only here: nothing CUDA runs without a GPU.
#   Architectures: Turing (PTX, JIT-compiled by the driver for anything newer than listed),
#   Ampere 86, Ada 89, Hopper 90, Blackwell 120. Compiling takes hours on 2 cores.
#
# Modules are cached under the user cache directory, keyed by version, backend and flags.
# SPECDECK_BUILD_JOBS caps the compile jobs (default: every core).
set -euo pipefail
KIND="${1:?usage: gpu_build.sh vulkan|cuda PYTHON [--install]}"
PY="${2:?usage: gpu_build.sh vulkan|cuda PYTHON [--install]}"
INSTALL="${3:-}"
VERSION="0.3.36"
CUBLAS="nvidia-cublas==13.0.2.14"
VULKAN_HEADERS="1.4.309.0"
VULKAN_HEADERS_URL="http://deb.debian.org/debian/pool/main/v/vulkan-loader/libvulkan-dev_1.4.309.0-1_amd64.deb"
VULKAN_HEADERS_SHA256="8d329d465e16168afff58b1bd0dd6db46aac2cc3f56054a481b25a04e90b345a"
CUDA_ARCHS="${SPECDECK_CUDA_ARCHS:-75-virtual;86-real;89-real;90-real;120a-real}"
# The wheel's own flags (packaging/llama_build.sh): the same ggml configuration, hence the same ABI.
BASE="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAVA_BUILD=OFF -DCMAKE_BUILD_TYPE=Release"
case "$KIND" in
    vulkan) FLAGS="-DGGML_VULKAN=ON" ;;
    # NO_VMM: the virtual-memory pool links libcuda at build time, and this toolkit has no stub of it;
    # the module then uses the legacy pool (libcuda is still loaded at run time, by cudart).
    cuda) FLAGS="-DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_GRAPHS=ON -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS" ;;
    *) echo "gpu_build.sh: unknown backend '$KIND' (vulkan or cuda)" >&2; exit 2 ;;
esac
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/specdeck"
KEY=$(printf '%s %s %s %s' "$VERSION" "$BASE" "$FLAGS" "$(uname -m)" | sha256sum | cut -c1-16)
OUT="$CACHE/gpu-modules/$KIND-$VERSION-$KEY"
MODULE="$OUT/libggml-$KIND.so"
say() { printf 'specdeck gpu build: %s\n' "$*" >&2; }

# shellcheck source=packaging/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

sources() {  # the sdist's tree, unpacked once
    local dir="$CACHE/src/llama-cpp-python-$VERSION"
    if [ ! -f "$dir/CMakeLists.txt" ]; then
        local tmp="$CACHE/src/dl.$$"
        mkdir -p "$tmp"
        "$PY" -m pip download -q --no-binary :all: --no-deps -d "$tmp" "llama-cpp-python==$VERSION" >&2
        rm -rf "$dir" && mkdir -p "$dir"
        tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$dir" --strip-components=1
        rm -rf "$tmp"
    fi
    echo "$dir"
}

vulkan_flags() {  # Vulkan headers with VK_EXT_layer_settings (1.3.261+); Debian 12 has 1.3.239
    grep -qs VK_EXT_layer_settings /usr/include/vulkan/vulkan_core.h && return 0
    local dir="$CACHE/src/vulkan-headers-$VULKAN_HEADERS"
    if [ ! -f "$dir/usr/include/vulkan/vulkan_core.h" ]; then
        local tmp="$CACHE/src/vk.$$.deb"
        mkdir -p "$CACHE/src"
        say "this system's Vulkan headers are too old for ggml; using Debian's $VULKAN_HEADERS headers (header-only)"
        "$PY" -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$VULKAN_HEADERS_URL" "$tmp"
        echo "$VULKAN_HEADERS_SHA256  $tmp" | sha256sum -c --quiet - >&2 || { say "the downloaded Vulkan headers do not match their checksum"; exit 1; }
        rm -rf "$dir" && mkdir -p "$dir" && dpkg-deb -x "$tmp" "$dir" && rm -f "$tmp"
    fi
    printf '%s' "-DVulkan_INCLUDE_DIR=$dir/usr/include"
}

cuda_flags() {  # cuBLAS from its PyPI wheel: headers and libraries, unpacked once
    command -v nvcc >/dev/null || { say "nvcc not found: install the CUDA 13 compiler (nvidia-cuda-nvcc) first"; exit 1; }
    local dir="$CACHE/src/cublas-${CUBLAS#*==}"
    if [ ! -f "$dir/nvidia/cu13/lib/libcublas.so.13" ]; then
        local tmp="$CACHE/src/cublas.$$"
        mkdir -p "$tmp"
        "$PY" -m pip download -q --no-deps -d "$tmp" "$CUBLAS" >&2
        rm -rf "$dir" && mkdir -p "$dir"
        "$PY" -m zipfile -e "$tmp"/nvidia_cublas-*.whl "$dir"
        rm -rf "$tmp"
    fi
    local lib="$dir/nvidia/cu13/lib"
    printf '%s' "-DCMAKE_CUDA_COMPILER=$(readlink -f "$(command -v nvcc)") -DCUDA_cublas_LIBRARY=$lib/libcublas.so.13 -DCUDA_cublasLt_LIBRARY=$lib/libcublasLt.so.13 -DCMAKE_CUDA_FLAGS=-I$dir/nvidia/cu13/include -DCMAKE_CXX_FLAGS=-I$dir/nvidia/cu13/include"
}

tools() {  # cmake and ninja: the system's, else PyPI's into PYTHON's environment
    if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
        "$PY" -m pip install -q "cmake>=3.25,<5" "ninja>=1.11,<2" >&2
        PATH="$(dirname "$PY"):$PATH"
    fi
}

if [ ! -f "$MODULE" ]; then
    tools
    extra=""
    if [ "$KIND" = vulkan ]; then
        missing=()
        command -v glslc >/dev/null || missing+=(glslc)
        [ -f /usr/include/vulkan/vulkan.h ] || missing+=(libvulkan-dev)
        [ -d /usr/share/cmake/SPIRV-Headers ] || [ -d /usr/lib/cmake/SPIRV-Headers ] || missing+=(spirv-headers)
        if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
        extra=$(vulkan_flags)
    else
        extra=$(cuda_flags)
    fi
    src=$(sources)
    build="$CACHE/build/$KIND-$KEY"
    say "compiling libggml-$KIND.so from llama-cpp-python $VERSION's llama.cpp (once; see the script for how long)"
    start=$(date +%s)
    # shellcheck disable=SC2086 # the flag strings are lists of words
    cmake -S "$src" -B "$build" -G Ninja $BASE $FLAGS $extra -DGGML_CCACHE=OFF >&2
    cmake --build "$build" --target "ggml-$KIND" -j "${SPECDECK_BUILD_JOBS:-$(nproc)}" >&2
    built=$(find "$build" -name "libggml-$KIND.so" -type f | head -n1)
    [ -n "$built" ] || { say "the build finished without libggml-$KIND.so"; exit 1; }
    mkdir -p "$OUT"
    cp "$built" "$MODULE.tmp" && mv "$MODULE.tmp" "$MODULE"
    printf '{"kind": "%s", "version": "%s", "seconds": %d, "bytes": %d, "flags": "%s"}\n' "$KIND" "$VERSION" \
        "$(( $(date +%s) - start ))" "$(stat -c %s "$MODULE")" "$BASE $FLAGS" > "$OUT/build.json"
    say "built in $(( $(date +%s) - start )) s, $(( $(stat -c %s "$MODULE") / 1048576 )) MiB"
fi
if [ "$INSTALL" = "--install" ]; then
    lib=$("$PY" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llama_cpp"); print(pathlib.Path(list(s.submodule_search_locations)[0]) / "lib")')
    cp "$MODULE" "$lib/libggml-$KIND.so"
fi
echo "$MODULE"
