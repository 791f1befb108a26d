#!/usr/bin/env bash
# The installers' smoke test: the .deb unpacked into a scratch root (dpkg -x) and the .run
# installed with its --target and --prefix options, then the frozen app's --self-test from each,
# in a clean environment (no Python, no compiler, no venv on PATH), on the offscreen platform.
#   bash packaging/smoke.sh dist/specdeck_V_amd64.deb dist/specdeck-V-x86_64.run
set -euo pipefail
deb="$1" run="$2"
scratch=$(mktemp -d /tmp/specdeck-smoke.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
say() { printf 'specdeck smoke: %s\n' "$*" >&2; }
clean_run() {  # the app in an environment with nothing of this build's
    env -i HOME="$scratch/home" PATH=/usr/bin:/bin LANG=C.UTF-8 QT_QPA_PLATFORM=offscreen "$@"
}
say ".deb into $scratch/root"
dpkg -x "$deb" "$scratch/root"
clean_run "$scratch/root/opt/specdeck/specdeck" --self-test --timeout 120
say ".run into $scratch/prefix"
sh "$run" --quiet --target "$scratch/unpacked" -- --prefix "$scratch/prefix" >/dev/null
test -f "$scratch/prefix/share/applications/specdeck.desktop"
clean_run "$scratch/prefix/bin/specdeck-gui" --self-test --timeout 120
say "a CPU without AVX-512: the x64 (baseline) variant forced"
clean_run env SPECDECK_CPU_VARIANT=x64 "$scratch/root/opt/specdeck/specdeck" --self-test --timeout 180
say "passed"
