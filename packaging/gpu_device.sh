#!/usr/bin/env bash
# The GPU check on a lent NVIDIA machine: what to carry there, and what to run there.
#
#   bash packaging/gpu_device.sh pack     # here: fills .gpu/ (about 20 MB, git-ignored; name it in `carry`)
#   bash packaging/gpu_device.sh run      # there, with .gpu carried: builds, checks, writes $OUT/gpu-check.md
#
# That machine reaches no network and takes 64 MiB of files, so neither the bundled model (94 MB)
# nor SpecDeck's wheels travel. It has Python with numpy, psutil, nvidia-ml-py, CMake, ninja, nvcc
# and the cu13 cuBLAS wheels. So `pack` carries llama-cpp-python's source (without llama.cpp's
# docs and test models, keeping one tokenizer file), the Spec-Bench questions and the one missing
# pure-Python dependency; `run` compiles llama-cpp-python there with SpecDeck's portable flags
# plus CUDA for that GPU only (about 5 minutes on 16 cores), writes random-weight Llama-3 8B and
# 1B GGUFs with that tokenizer (packaging/random_gguf.py), and runs packaging/gpu_check.py on them.
# Random weights give real costs (tokens/s, verify-cost curve, VRAM, J/token) but meaningless
# acceptance rates; the GPU/CPU greedy comparison reports the margin at any first difference.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="0.3.36"
PACK=.gpu
CMD="${1:?usage: gpu_device.sh pack|run}"

pack() {
    local py=".venv/bin/python" src cache="${XDG_CACHE_HOME:-$HOME/.cache}/specdeck"
    src="$cache/src/llama-cpp-python-$VERSION"
    if [ ! -f "$src/CMakeLists.txt" ]; then  # the same unpacked sdist gpu_build.sh uses
        mkdir -p "$cache/src/dl.$$"
        "$py" -m pip download -q --no-binary :all: --no-deps -d "$cache/src/dl.$$" "llama-cpp-python==$VERSION"
        mkdir -p "$src" && tar -xzf "$cache/src/dl.$$"/*.tar.gz -C "$src" --strip-components=1 && rm -rf "$cache/src/dl.$$"
    fi
    rm -rf "$PACK" && mkdir -p "$PACK"
    tar -czf "$PACK/llama-cpp-python.tar.gz" -C "$(dirname "$src")" \
        --exclude='vendor/llama.cpp/docs' --exclude='vendor/llama.cpp/media' --exclude='vendor/llama.cpp/benches' \
        --exclude='vendor/llama.cpp/models/*' --exclude='*.git*' "$(basename "$src")"
    cp "$src/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf" "$PACK/vocab.gguf"
    cp assets/spec_bench/question.jsonl "$PACK/question.jsonl"
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$PACK" "platformdirs>=4,<5" "threadpoolctl>=3.1,<4"
    du -sh "$PACK"
}

run() {
    local py="${PYTHON:-python3}" site=/tmp/site out="${OUT:-/tmp/out}" start
    mkdir -p "$site" "$out" /tmp/src
    start=$(date +%s)
    tar -xzf "$PACK/llama-cpp-python.tar.gz" -C /tmp/src
    "$py" packaging/llama_patch.py /tmp/src/llama-cpp-python-"$VERSION"  # SpecDeck's CPU kernels, as llama_build.sh
    # The portable wheel's flags, plus CUDA for this GPU's architecture only (a build for every
    # home card would take far longer than one call may run).
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d '.')
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DCMAKE_INSTALL_BINDIR=llama_cpp/lib \
-DLLAVA_BUILD=OFF -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF -DCMAKE_CUDA_ARCHITECTURES=${arch}-real" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$py" -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" /tmp/src/llama-cpp-python-"$VERSION"
    "$py" -m pip install -q --no-index --no-deps --target "$site" "$PACK"/platformdirs-*.whl "$PACK"/threadpoolctl-*.whl
    echo "gpu check: built in $(( $(date +%s) - start )) s" | tee "$out/build.txt"
    ls -la "$site/llama_cpp/lib" >> "$out/build.txt"
    export PYTHONPATH="$site:$PWD:/tmp/src/llama-cpp-python-$VERSION/vendor/llama.cpp/gguf-py"
    export SPECDECK_DATA_DIR=/tmp/specdeck-data SPECDECK_CACHE_DIR=/tmp/specdeck-cache PYTHONUNBUFFERED=1
    "$py" packaging/random_gguf.py --vocab "$PACK/vocab.gguf" --shape 8b --out /tmp/random-8b.gguf
    "$py" packaging/random_gguf.py --vocab "$PACK/vocab.gguf" --shape 1b --out /tmp/random-1b.gguf --seed 1
    export SPECDECK_PROBE_MODEL=/tmp/random-1b.gguf  # the probes' model: the bundled one is not there
    "$py" -m backends.cli hw | tee "$out/hw.txt"
    # the tests' tiny model with a next-n block whose every guess is right: MTP's GPU path, end to end
    "$py" -c "import sys; from pathlib import Path; from tests.mtp_model import write_mtp_gguf; \
write_mtp_gguf(Path('/tmp/mtp-tiny.gguf'), Path(sys.argv[1]), copy=True, context=4096)" "$PACK/vocab.gguf"
    "$py" packaging/gpu_check.py --model /tmp/random-8b.gguf --draft-model /tmp/random-1b.gguf \
        --prompts "$PACK/question.jsonl" --per-category 1 --max-new-tokens 64 --mtp-model /tmp/mtp-tiny.gguf \
        --out "$out/gpu-check.md"
}

case "$CMD" in
    pack) pack ;;
    run) run ;;
    *) echo "usage: gpu_device.sh pack|run" >&2; exit 2 ;;
esac
