#!/usr/bin/env bash
# Run the Windows installer script's stand-in build under Wine (64-bit) in a scratch prefix: a
# silent per-user install (files, Start-menu and desktop shortcuts, the Installed-apps entry), an
# uninstall that keeps the user's conversations and settings, and one with /REMOVEDATA that removes
# them. This checks the script's logic on Linux; the real program still needs a Windows machine
# (.github/workflows/windows.yml).
#   bash packaging/windows/wine_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { printf 'specdeck wine: %s\n' "$*" >&2; }
fail() { say "FAILED: $*"; exit 1; }
# shellcheck source=packaging/apt.sh
source packaging/apt.sh
WINE=/usr/lib/wine/wine64
missing=()
[ -x "$WINE" ] || missing+=(wine64)
command -v xvfb-run >/dev/null || missing+=(xvfb xauth)
if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi

scratch=$(mktemp -d /tmp/specdeck-wine.XXXXXX)
trap 'WINEPREFIX="$scratch/prefix" /usr/lib/wine/wineserver -k 2>/dev/null || true; rm -rf "$scratch"' EXIT
# The 64-bit build of the same script: Wine here is 64-bit only (no i386 packages); what the
# installer does is the same in the default 32-bit build.
bash packaging/windows/check_nsis.sh "$scratch/SpecDeck-stand-in-setup.exe" -DTARGET=amd64-unicode
# Wine links the prefix's Desktop to $HOME: a scratch home keeps the shortcut out of the real one.
export HOME="$scratch/home" WINEPREFIX="$scratch/prefix" WINEDEBUG=-all WINEDLLOVERRIDES="mscoree,mshtml="
mkdir -p "$HOME"
wine() { xvfb-run -a "$WINE" "$@" >/dev/null 2>&1; /usr/lib/wine/wineserver -w; }  # -w: until every child is done
user_dir() { echo "$WINEPREFIX/drive_c/users/$(id -un)"; }
uninstall_key='HKCU\Software\Microsoft\Windows\CurrentVersion\Uninstall\SpecDeck'
has_key() { "$WINE" reg query "$1" >/dev/null 2>&1; }

install() {
    wine "$scratch/SpecDeck-stand-in-setup.exe" /S
    local programs; programs="$(user_dir)/AppData/Local/Programs/SpecDeck"
    [ -f "$programs/specdeck.exe" ] && [ -f "$programs/uninstall.exe" ] && [ -f "$programs/_internal/README.txt" ] \
        || fail "the program is not in $programs"
    local menu; menu="$(user_dir)/AppData/Roaming/Microsoft/Windows/Start Menu/Programs/SpecDeck"
    [ -f "$menu/SpecDeck.lnk" ] && [ -f "$menu/Uninstall SpecDeck.lnk" ] || fail "no Start-menu shortcuts"
    [ -f "$HOME/SpecDeck.lnk" ] || [ -f "$(user_dir)/Desktop/SpecDeck.lnk" ] || fail "no desktop shortcut"
    has_key "$uninstall_key" || fail "no Installed-apps entry"
}

say "install, per user, silently"
install
say "what SpecDeck writes while it runs: conversations and window settings"
data="$(user_dir)/AppData/Local/specdeck"
mkdir -p "$data/specdeck"
echo "a conversation" > "$data/specdeck/conversations.sqlite3"
"$WINE" reg add 'HKCU\Software\SpecDeck\SpecDeck' /v geometry /d kept /f >/dev/null 2>&1
say "uninstall: the program goes, the user's files and settings stay"
wine "$(user_dir)/AppData/Local/Programs/SpecDeck/uninstall.exe" /S
[ ! -e "$(user_dir)/AppData/Local/Programs/SpecDeck" ] || fail "the program folder is still there"
[ ! -e "$(user_dir)/AppData/Roaming/Microsoft/Windows/Start Menu/Programs/SpecDeck" ] || fail "the Start-menu folder is still there"
[ ! -e "$HOME/SpecDeck.lnk" ] || fail "the desktop shortcut is still there"
! has_key "$uninstall_key" || fail "the Installed-apps entry is still there"
[ -f "$data/specdeck/conversations.sqlite3" ] || fail "the conversations were removed"
has_key 'HKCU\Software\SpecDeck\SpecDeck' || fail "the window settings were removed"
say "install again, uninstall with /REMOVEDATA: the user's files and settings go too"
install
[ -f "$data/specdeck/conversations.sqlite3" ] || fail "an install touched the conversations"
wine "$(user_dir)/AppData/Local/Programs/SpecDeck/uninstall.exe" /S /REMOVEDATA
[ ! -e "$data" ] || fail "/REMOVEDATA left $data"
! has_key 'HKCU\Software\SpecDeck' || fail "/REMOVEDATA left the settings"
say "passed"
