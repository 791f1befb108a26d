#!/usr/bin/env bash
# The Linux artifacts, with no compiler needed on the user's machine:
#   dist/specdeck/                     the frozen app (PyInstaller one-folder, packaging/frozen/)
#   dist/specdeck_VERSION_amd64.deb    Debian/Ubuntu: /opt/specdeck, specdeck-gui on PATH, menu entry
#   dist/specdeck-VERSION-x86_64.run   other distributions: a per-user install (no root), menu entry
#   dist/SpecDeck-VERSION-setup-stand-in.exe   the NSIS script compiled with warnings as errors
#                                      around a stand-in payload (the real one needs a Windows runner),
#                                      then installed and uninstalled under Wine (windows/wine_check.sh)
# then the smoke test (packaging/smoke.sh) installs both into scratch folders and runs the frozen
# app's --self-test from there with a clean environment.
#   bash packaging/build.sh [--no-smoke]
# SPECDECK_PACK_LEVEL: the installers' xz level, 9 (smallest) unless set; CI sets 1, which builds
# the same files about 3 minutes sooner on 2 cores and 10% larger (it ships none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf 'specdeck build: %s\n' "$*" >&2; }
# shellcheck source=packaging/apt.sh
source packaging/apt.sh

VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
DIST=dist
LEVEL="${SPECDECK_PACK_LEVEL:-9}"
WORK=build/frozen

missing=()
command -v dpkg-deb >/dev/null || missing+=(dpkg)
command -v makeself >/dev/null || missing+=(makeself)
command -v desktop-file-validate >/dev/null || missing+=(desktop-file-utils)
command -v appstreamcli >/dev/null || missing+=(appstream)
command -v lintian >/dev/null || missing+=(lintian)
command -v makensis >/dev/null || missing+=(nsis)
command -v xvfb-run >/dev/null || missing+=(xvfb xauth)  # the smoke test on a real X server too
command -v icupkg >/dev/null || missing+=(icu-devtools)  # trims Qt's ICU data (packaging/icu_trim.py)
if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi

say "validating the menu entry and the AppStream metadata"
desktop-file-validate packaging/linux/specdeck.desktop
appstreamcli validate --no-net packaging/linux/io.github.specdeck.SpecDeck.metainfo.xml

say "the virtual environment (SpecDeck, its portable llama.cpp, the bundled model)"
bash packaging/dev.sh specdeck --help >/dev/null
# the Vulkan module the installers carry (built once and cached; the test setup builds it too, but
# a build on a fresh clone must not depend on the tests having run first)
bash packaging/gpu_build.sh vulkan .venv/bin/python --install >/dev/null
.venv/bin/python -m pip install -q "pyinstaller>=6.22,<7"

say "freezing the app (PyInstaller one-folder)"
rm -rf "$WORK" "$DIST/specdeck"
.venv/bin/pyinstaller --noconfirm --log-level WARN --distpath "$DIST" --workpath "$WORK" packaging/frozen/specdeck.spec
# PyInstaller copies a library's link names (libllama.so -> libllama.so.0 -> libllama.so.0.5.0) as
# three files: make the shorter names links to the real file again (10 MB installed).
find "$DIST/specdeck" -type f -name 'lib*.so.*.*' | while read -r real; do  # the fully versioned file
    for short in "${real%%.so.*}".so "${real%%.so.*}".so.*; do
        if [ "$short" != "$real" ] && [ -f "$short" ] && [ ! -L "$short" ] && cmp -s "$short" "$real"; then
            ln -sf "$(basename "$real")" "$short"
        fi
    done
done

# Debug information, as Debian's own packages leave out (the Python interpreter was built with it:
# 17 MB of libpython's 23 MB); wheels' libraries carry none and are left as they are.
find "$DIST/specdeck" -type f -name '*.so*' | while read -r lib; do
    if readelf -S "$lib" 2>/dev/null | grep -q '\.debug_info'; then strip --strip-debug "$lib"; fi
done

say "Qt's ICU data, less what Qt never reads (packaging/icu_trim.py)"
python3 packaging/icu_trim.py "$DIST/specdeck" >&2

say "the newest glibc and libstdc++ any of its files asks for (at most Ubuntu 22.04's)"
read -r glibc glibcxx < <(python3 packaging/abi_floor.py "$DIST/specdeck" --max GLIBC=2.35 --max GLIBCXX=3.4.30)
say "glibc $glibc, GLIBCXX $glibcxx"

say "the .deb"
root=build/deb
rm -rf "$root"
mkdir -p "$root/DEBIAN" "$root/opt" "$root/usr/bin" "$root/usr/share/applications" \
         "$root/usr/share/icons/hicolor/256x256/apps" "$root/usr/share/metainfo" "$root/usr/share/doc/specdeck"
cp -a "$DIST/specdeck" "$root/opt/specdeck"
find "$root/opt" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$root/opt" -type f -name '*.so*' -exec chmod 644 {} +  # libraries are not programs
say ".deb: left out, as its Depends install them: $(python3 packaging/deb_prune.py "$root/opt/specdeck/_internal" packaging/linux/control.in)"
ln -s /opt/specdeck/specdeck "$root/usr/bin/specdeck-gui"
install -m 644 packaging/linux/specdeck.desktop "$root/usr/share/applications/specdeck.desktop"
install -m 644 assets/icons/specdeck.png "$root/usr/share/icons/hicolor/256x256/apps/specdeck.png"
install -m 644 packaging/linux/io.github.specdeck.SpecDeck.metainfo.xml "$root/usr/share/metainfo/"
install -m 644 packaging/linux/copyright "$root/usr/share/doc/specdeck/copyright"
installed_kb=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@SIZE@/$installed_kb/" -e "s/@GLIBC@/$glibc/" packaging/linux/control.in > "$root/DEBIAN/control"
deb="$DIST/specdeck_${VERSION}_amd64.deb"
dpkg-deb --root-owner-group -Zxz "-z$LEVEL" --build "$root" "$deb" >/dev/null
say "lintian (suppressions, each with its reason: packaging/linux/lintian-suppressions)"
lintian --suppress-tags-from-file packaging/linux/lintian-suppressions --tag-display-limit 0 "$deb" || true

say "the .run (makeself, per-user install)"
payload=build/run
rm -rf "$payload"
mkdir -p "$payload"
cp -a "$DIST/specdeck" "$payload/specdeck"
install -m 644 packaging/linux/specdeck.desktop assets/icons/specdeck.png "$payload/"
install -m 755 packaging/linux/install-user.sh "$payload/install-user.sh"
run="$DIST/specdeck-${VERSION}-x86_64.run"
XZ_OPT=-T0 makeself --quiet --xz --complevel "$LEVEL" "$payload" "$run" "SpecDeck $VERSION" ./install-user.sh >/dev/null  # xz on every core

say "the Windows installer script, compiled against a stand-in payload (packaging/windows/)"
bash packaging/windows/check_nsis.sh "$DIST/SpecDeck-$VERSION-setup-stand-in.exe"
say "the same script under Wine: install, shortcuts, uninstall that keeps or (/REMOVEDATA) removes user data"
bash packaging/windows/wine_check.sh

ls -l "$deb" "$run" >&2
say "installed size $((installed_kb / 1024)) MiB; .deb $(($(stat -c %s "$deb") / 1048576)) MiB; .run $(($(stat -c %s "$run") / 1048576)) MiB"
if [ "${1:-}" != "--no-smoke" ]; then
    bash packaging/smoke.sh "$deb" "$run"
fi
