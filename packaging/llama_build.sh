#!/usr/bin/env bash
# Build (once) and print the path of SpecDeck's portable llama-cpp-python wheel.
#
#   bash packaging/llama_build.sh PYTHON     -> prints /path/to/llama_cpp_python-...whl
#
# Why a build of our own: llama-cpp-python's default build compiles with -march=native, so a
# wheel made on one CPU can die with SIGILL on another, and even on the machine that built it
# when the CPU lists an instruction set the OS or VM does not enable (AMX on an Intel Xeon VM:
# `tilezero` at the first Q4 matmul). This build compiles every x86-64 CPU variant ggml knows
# (GGML_CPU_ALL_VARIANTS, as dynamically loaded modules, GGML_BACKEND_DL) and SpecDeck picks one
# at run time after probing it in a subprocess (backends/llamacpp/runtime.py).
#
# The vendored llama.cpp gets SpecDeck's own CPU kernels first (packaging/llama_patch.py: a
# small-batch F16/BF16 product, so a verify of a few drafted rows costs about what one row costs).
#
# The wheel is cached under the user cache directory, keyed by the version, the flags and the patch:
# pip's own wheel cache is keyed by the sdist alone, so it would hand a native build back for a
# portable request (or the reverse). Building takes about 15 minutes on 2 cores, once.
set -euo pipefail
PY="${1:?usage: llama_build.sh PYTHON}"
VERSION="0.3.36"
# CMAKE_INSTALL_BINDIR: the CPU variant modules install to <prefix>/bin by default, which is
# site-packages/bin for a wheel; keep them beside libggml.so in llama_cpp/lib instead.
# LLAVA_BUILD=OFF: SpecDeck runs no multimodal projector; mtmd is imported lazily by
# llama-cpp-python, so leaving it out only saves build time.
FLAGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DCMAKE_INSTALL_BINDIR=llama_cpp/lib -DLLAVA_BUILD=OFF -DCMAKE_BUILD_TYPE=Release"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PATCH=$(cat "$HERE/llama_patch.py" "$HERE"/llama_patches/* | sha256sum | cut -c1-16)
KEY=$(printf '%s %s %s %s' "$VERSION" "$FLAGS" "$(uname -m)" "$PATCH" | sha256sum | cut -c1-16)
DIR="${XDG_CACHE_HOME:-$HOME/.cache}/specdeck/wheels/llama-cpp-python-$VERSION-$KEY"

find_wheel() { ls "$DIR"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1; }

if [ -z "$(find_wheel)" ]; then
    printf 'specdeck setup: compiling the portable llama.cpp (all CPU variants, ~15 minutes on 2 cores, once)\n' >&2
    tmp="$DIR.tmp.$$"
    rm -rf "$tmp"
    mkdir -p "$tmp"
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$tmp/sdist" "llama-cpp-python==$VERSION" >&2
    mkdir -p "$tmp/src"
    tar -xzf "$tmp"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$tmp/src" --strip-components=1
    "$PY" "$HERE/llama_patch.py" "$tmp/src"
    CMAKE_ARGS="$FLAGS" FORCE_CMAKE=1 "$PY" -m pip wheel -q --no-deps --no-cache-dir -w "$tmp/wheel" "$tmp/src" >&2
    mv "$tmp"/wheel/*.whl "$tmp"/
    rm -rf "$tmp/sdist" "$tmp/src" "$tmp/wheel"
    rm -rf "$DIR"
    mv "$tmp" "$DIR"
fi
find_wheel
