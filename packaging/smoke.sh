#!/usr/bin/env bash
# The installers' smoke test: the .deb unpacked into a scratch root (dpkg -x) and the .run
# installed with its --target and --prefix options, then the frozen app's --self-test from each,
# in a clean environment (no Python, no compiler, no venv on PATH), on the offscreen platform, and
# once on Xvfb; then the torch add-on installed by the frozen app and a chat on the PyTorch backend.
#   bash packaging/smoke.sh dist/specdeck_V_amd64.deb dist/specdeck-V-x86_64.run
set -euo pipefail
deb="$1" run="$2"
scratch=$(mktemp -d /tmp/specdeck-smoke.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
say() { printf 'specdeck smoke: %s\n' "$*" >&2; }
clean_run() {  # the app in an environment with nothing of this build's
    env -i HOME="$scratch/home" PATH=/usr/bin:/bin LANG=C.UTF-8 QT_QPA_PLATFORM=offscreen "$@"
}
# dpkg -x unpacks without the .deb's dependencies: install the ones this machine lacks, as
# `apt install ./specdeck.deb` would (the X libraries Qt's xcb platform needs).
# shellcheck source=packaging/apt.sh
source "$(dirname "$0")/apt.sh"
wanted=()
for dep in $(dpkg-deb -f "$deb" Depends | tr ',' '\n' | sed -e 's/(.*)//' -e 's/|.*//' | tr -d ' '); do
    dpkg -s "$dep" >/dev/null 2>&1 || wanted+=("$dep")
done
if [ ${#wanted[@]} -gt 0 ]; then apt_install "${wanted[@]}"; fi
say ".deb into $scratch/root"
dpkg -x "$deb" "$scratch/root"
clean_run "$scratch/root/opt/specdeck/specdeck" --self-test --timeout 120
if command -v xvfb-run >/dev/null; then  # a real X server: the xcb platform plugin and the libraries it loads
    say "the same on an X server (Xvfb 1500x950, xcb)"
    env -i HOME="$scratch/home" PATH=/usr/bin:/bin LANG=C.UTF-8 \
        xvfb-run -a -s "-screen 0 1500x950x24" "$scratch/root/opt/specdeck/specdeck" --self-test --timeout 120
fi
say ".run into $scratch/prefix"
sh "$run" --quiet --target "$scratch/unpacked" -- --prefix "$scratch/prefix" >/dev/null
test -f "$scratch/prefix/share/applications/specdeck.desktop"
clean_run "$scratch/prefix/bin/specdeck-gui" --self-test --timeout 120
say "the torch add-on: installed by the frozen app's own pip into its data folder, then a chat on PyTorch"
app="$scratch/root/opt/specdeck/specdeck"
clean_run env SPECDECK_ADDON_PIP_ARGS="${SPECDECK_ADDON_PIP_ARGS:-}" "$app" -m backends.addons install torch >"$scratch/addon.log" 2>&1 \
    || { tail -20 "$scratch/addon.log" >&2; exit 1; }
printf 'Name one colour.\n' | clean_run "$app" -m backends.cli chat --backend torch --max-new-tokens 8 >"$scratch/torch-chat.log" 2>&1 \
    || { tail -20 "$scratch/torch-chat.log" >&2; exit 1; }
grep -q "tok/s" "$scratch/torch-chat.log" || { cat "$scratch/torch-chat.log" >&2; exit 1; }
say "a head trained by the installed app (torch add-on) on the shipped Spec-Bench questions, then a chat with it"
clean_run "$app" -m backends.cli train medusa --prompts 2 --max-new-tokens 16 --steps 3 --out "$scratch/home/h.medusa" \
    >"$scratch/train.log" 2>&1 || { tail -20 "$scratch/train.log" >&2; exit 1; }
printf 'Name one colour.\n' | clean_run "$app" -m backends.cli chat --method medusa --head "$scratch/home/h.medusa.json" \
    --max-new-tokens 8 >"$scratch/medusa-chat.log" 2>&1 || { tail -20 "$scratch/medusa-chat.log" >&2; exit 1; }
grep -q "medusa" "$scratch/medusa-chat.log" || { cat "$scratch/medusa-chat.log" >&2; exit 1; }
say "the bench on the shipped Spec-Bench questions (what the comparison panel and training read)"
clean_run "$app" -m backends.cli bench --methods ar,pld --categories qa --per-category 1 --max-new-tokens 8 \
    >"$scratch/bench.log" 2>&1 || { tail -20 "$scratch/bench.log" >&2; exit 1; }
grep -q "| pld |" "$scratch/bench.log" || { cat "$scratch/bench.log" >&2; exit 1; }
say "a CPU without AVX-512: the x64 (baseline) variant forced"
clean_run env SPECDECK_CPU_VARIANT=x64 "$scratch/root/opt/specdeck/specdeck" --self-test --timeout 180
say "passed"
