"""Leave out of the .deb the libraries its Depends already install.

The frozen app carries every library it loads, so that the .run works on any distribution. A .deb
declares Qt's X11, xcb, font, GLib and D-Bus libraries in Depends (apt installs them anyway), so its own
copies of them, and the libraries only those copies needed (libdbus's systemd, gcrypt, lz4...),
are dead weight: 2.9 MB of the .deb's xz stream. A library goes when the build machine's dpkg says
a package named in Depends owns a file of that name; then, repeatedly, any library that only the
removed ones listed as NEEDED. Libraries something opens with dlopen are never candidates: only
what a removed library needed is.

    python3 packaging/deb_prune.py LIBRARY_FOLDER CONTROL_FILE
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from abi_floor import elf_files  # packaging/, beside this script


def depends(control: Path) -> set[str]:
    """Package names in the control file's Depends (versions and alternatives' extras dropped)."""
    match = re.search(r"^Depends:(.*)$", control.read_text(), re.M)
    if not match:
        return set()
    return {re.split(r"[\s(|:]", part.strip(), maxsplit=1)[0] for part in match[1].split(",") if part.strip()}


def owner(name: str) -> str | None:
    """The installed package that owns a library of this file name on the build machine."""
    found = subprocess.run(["dpkg", "-S", f"*/{name}"], capture_output=True, text=True).stdout
    for line in found.splitlines():
        package, _, path = line.partition(": ")
        if Path(path).name == name:
            return package.split(":")[0]
    return None


def needed(lib: Path) -> set[str]:
    dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))


def prune(folder: Path, packages: set[str]) -> list[str]:
    """Remove the libraries directly in ``folder`` that ``packages`` provide, and what only they
    needed; returns the names removed."""
    folder = folder.resolve()
    libs = {p.name: p for p in folder.iterdir() if p.is_file() and ".so" in p.name}
    elves = elf_files(folder.parent)  # the program and everything it carries
    needs = {p: needed(p) for p in elves}
    removed = {name for name in libs if owner(name) in packages}
    while True:
        kept = [p for p in elves if p.name not in removed or p.parent != folder]
        still = set().union(*(needs[p] for p in kept)) if kept else set()
        wanted = set().union(*(needs.get(libs[r].resolve(), set()) for r in removed))  # by what goes
        orphans = {name for name in wanted if name in libs} - still - removed
        if not orphans:
            break
        removed |= orphans
    for name in removed:
        libs[name].unlink()
    return sorted(removed)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    removed = prune(Path(argv[0]), depends(Path(argv[1])))
    print(" ".join(removed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
