#!/bin/sh
# The .run's installer (makeself runs it from the unpacked payload): a per-user install with no
# root. The app goes to $PREFIX/share/specdeck/app, `specdeck-gui` to $PREFIX/bin, a menu entry
# and the icon to $PREFIX/share. PREFIX is ~/.local unless given:
#   sh specdeck-VERSION-x86_64.run [--target DIR] -- --prefix /some/where
set -eu
PREFIX="$HOME/.local"
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX="$2"; shift 2 ;;
        *) echo "install-user.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
app="$PREFIX/share/specdeck/app"
rm -rf "$app"
mkdir -p "$app" "$PREFIX/bin" "$PREFIX/share/applications" "$PREFIX/share/icons/hicolor/256x256/apps"
cp -a specdeck/. "$app/"
ln -sf "$app/specdeck" "$PREFIX/bin/specdeck-gui"
sed "s|^Exec=specdeck-gui|Exec=$app/specdeck|" specdeck.desktop > "$PREFIX/share/applications/specdeck.desktop"
cp specdeck.png "$PREFIX/share/icons/hicolor/256x256/apps/specdeck.png"
command -v update-desktop-database >/dev/null && update-desktop-database -q "$PREFIX/share/applications" || true
echo "SpecDeck installed in $app; start it from the menu or with $PREFIX/bin/specdeck-gui"
echo "(your chats and models are kept elsewhere, in ~/.local/share/specdeck; removing $app keeps them)"
