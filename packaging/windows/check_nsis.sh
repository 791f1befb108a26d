#!/usr/bin/env bash
# Compile the Windows installer script here, with warnings as errors, against a stand-in payload
# (an empty program and one file in _internal): it proves the script, its pages, icons and
# uninstaller. The real payload is the PyInstaller folder a Windows runner builds
# (.github/workflows/windows.yml); no Windows machine is reachable from here.
#   bash packaging/windows/check_nsis.sh [OUT.exe [MAKENSIS OPTIONS ...]]   (e.g. -DTARGET=amd64-unicode)
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { printf 'specdeck nsis: %s\n' "$*" >&2; }
# shellcheck source=packaging/apt.sh
source packaging/apt.sh
command -v makensis >/dev/null || apt_install nsis
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
stand_in=$(mktemp -d /tmp/specdeck-nsis.XXXXXX)
trap 'rm -rf "$stand_in"' EXIT
mkdir -p "$stand_in/specdeck/_internal"
printf 'MZ stand-in for the frozen program\n' > "$stand_in/specdeck/specdeck.exe"
printf 'stand-in payload\n' > "$stand_in/specdeck/_internal/README.txt"
out=$(realpath -m "${1:-dist/SpecDeck-$VERSION-setup-stand-in.exe}")
mkdir -p "$(dirname "$out")"
makensis -WX -V2 -DVERSION="$VERSION" -DPAYLOAD="$stand_in/specdeck" -DOUTFILE="$out" "${@:2}" packaging/windows/specdeck.nsi
say "compiled without warnings: $out ($(stat -c %s "$out") bytes)"
