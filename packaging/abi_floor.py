"""The newest glibc and libstdc++ symbol versions any ELF file of the frozen app asks for.

    python packaging/abi_floor.py dist/specdeck [--max GLIBC=2.35 --max GLIBCXX=3.4.30]  ->  "2.35 3.4.30"

A binary built on one distribution runs on an older one only if every library it carries asks
for glibc symbol versions that the older glibc has; the system's libstdc++ must likewise provide
the GLIBCXX versions asked for. The .deb's Depends are derived from these numbers, and the build
fails when a file asks for more than the oldest system SpecDeck supports has (Ubuntu 22.04: glibc
2.35, the GCC 12 runtime).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

VERSION = re.compile(r"\((GLIBC|GLIBCXX)_([0-9.]+)\)")


def elf_files(root: Path) -> list[Path]:
    """Regular files that start with the ELF magic (libraries, modules, the program)."""
    out = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            with path.open("rb") as f:
                if f.read(4) == b"\x7fELF":
                    out.append(path)
    return out


def wanted(path: Path) -> dict[str, tuple[int, ...]]:
    """The newest GLIBC and GLIBCXX version among the symbols ``path`` imports."""
    listing = subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True).stdout
    newest: dict[str, tuple[int, ...]] = {}
    for line in listing.splitlines():
        if "*UND*" not in line:
            continue
        for lib, version in VERSION.findall(line):
            key = tuple(int(p) for p in version.split("."))
            newest[lib] = max(newest.get(lib, key), key)
    return newest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--max", action="append", default=[], metavar="LIB=VERSION",
                        help="fail if a file needs a newer GLIBC or GLIBCXX than this")
    args = parser.parse_args()
    floor: dict[str, tuple[int, ...]] = {"GLIBC": (2, 17), "GLIBCXX": (3, 4)}
    culprit: dict[str, Path] = {}
    for path in elf_files(args.root):
        for lib, version in wanted(path).items():
            if version > floor[lib]:
                floor[lib], culprit[lib] = version, path
    text = {lib: ".".join(map(str, v)) for lib, v in floor.items()}
    for lib in floor:
        if lib in culprit:
            print(f"{lib} {text[lib]}: {culprit[lib].relative_to(args.root)}", file=sys.stderr)
    for lib, limit in (item.split("=", 1) for item in args.max):
        if floor[lib] > tuple(int(p) for p in limit.split(".")):
            print(f"{culprit[lib]} needs {lib} {text[lib]}, newer than {limit}", file=sys.stderr)
            return 1
    print(text["GLIBC"], text["GLIBCXX"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
