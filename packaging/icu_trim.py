"""Trim the ICU data library that Qt's wheel bundles to the parts Qt itself reads.

``libicudata.so.NN`` is 31 MB (7.6 MB of the .deb's xz stream): CLDR data for every locale and
every ICU service. Qt 6 calls ICU for collation (``ucol_*``: QCollator, the file dialog's
sorting), time zone names and IDs (``ucal_*``), case mapping (``u_strTo*``, whose tables live in
libicuuc, not here) and legacy text codecs (``ucnv_*``, only when a program asks for one by name;
SpecDeck decodes text in Python). ``nm -D --undefined-only libQt6*.so.6`` lists exactly these
families, with no break iterators, transliterators or number spell-out. So the localized names of
languages, regions, currencies and units, spell-out rules, transliteration, ICU's own break
iterators and the codec tables go, while collation, the locales' own data, time zone data (root and
English names) and normalization stay: the library becomes 8.6 MB (1.7 MB compressed). What a user
could notice: a time zone's long name in another language comes out in English, and a legacy codec
asked for by name (``QStringDecoder("Shift_JIS")``) is not there.

How: the data is one symbol, ``icudtNN_dat``, holding an ICU package; ``icupkg`` (Debian's
icu-devtools) removes items from it, and the result is linked into a library with the same
soname that exports the same symbol, which is all libicuuc asks of it.

    python3 packaging/icu_trim.py FROZEN_APP_FOLDER
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

DROPPED_TREES = ("lang/", "region/", "curr/", "unit/", "rbnf/", "translit/", "brkitr/", "zone/")
KEPT = {"zone/root.res", "zone/en.res", "zone/pool.res"}  # time zone names for the fallback and English


def dropped(item: str) -> bool:
    """Whether an item of the package (``lang/de.res``, ``ibm-943_P15A-2003.cnv``) goes."""
    if item in KEPT:
        return False
    return item.startswith(DROPPED_TREES) or ("/" not in item and item.endswith(".cnv"))


def data_symbol(lib: Path) -> tuple[str, int, int]:
    """The data symbol's name, file offset and size, read with readelf."""
    symbols = subprocess.run(["readelf", "-Ws", "--dyn-syms", str(lib)], capture_output=True, text=True,
                             check=True).stdout
    match = re.search(r"^\s*\d+:\s+([0-9a-f]+)\s+(\d+|0x[0-9a-f]+)\s+OBJECT\s+GLOBAL\s+\S+\s+\d+\s+(icudt\d+_dat)$",
                      symbols, re.M)
    if not match:
        raise SystemExit(f"{lib}: no icudtNN_dat symbol")
    address, size, name = int(match[1], 16), int(match[2], 0), match[3]
    for line in subprocess.run(["readelf", "-lW", str(lib)], capture_output=True, text=True, check=True).stdout.splitlines():
        fields = line.split()
        if fields[:1] == ["LOAD"]:
            offset, vaddr, filesz = int(fields[1], 16), int(fields[2], 16), int(fields[4], 16)
            if vaddr <= address < vaddr + filesz:
                return name, address - vaddr + offset, size
    raise SystemExit(f"{lib}: {name} lies in no loaded segment")


def trim(lib: Path) -> tuple[int, int]:
    """Rewrite ``lib`` in place; returns its size before and after."""
    name, offset, size = data_symbol(lib)
    soname = lib.name
    before = lib.stat().st_size
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        package = work / (name.removesuffix("_dat") + "l.dat")  # icudt73l: the name its items carry,
        trimmed = work / "out" / package.name  # which icupkg takes from the file's name
        trimmed.parent.mkdir()
        with lib.open("rb") as f:
            f.seek(offset)
            package.write_bytes(f.read(size))
        items = subprocess.run(["icupkg", "-l", str(package)], capture_output=True, text=True, check=True).stdout.split()
        remove = [item for item in items if dropped(item)]
        (work / "remove.txt").write_text("\n".join(remove) + "\n")
        subprocess.run(["icupkg", "-r", str(work / "remove.txt"), str(package), str(trimmed)], check=True)
        kept = subprocess.run(["icupkg", "-l", str(trimmed)], capture_output=True, text=True, check=True).stdout.split()
        if len(kept) != len(items) - len(remove):
            raise SystemExit(f"icupkg kept {len(kept)} of {len(items)} items, expected {len(items) - len(remove)}")
        source = work / "data.S"
        source.write_text(f""".section .rodata
.balign 16
.globl {name}
.type {name}, @object
{name}:
.incbin "{trimmed}"
.size {name}, . - {name}
.section .note.GNU-stack, "", @progbits
""")
        out = work / soname
        subprocess.run(["gcc", "-shared", "-nostdlib", f"-Wl,-soname,{soname}", "-o", str(out), str(source)], check=True)
        lib.write_bytes(out.read_bytes())
    return before, lib.stat().st_size


CHECK = """
import ctypes, sys
folder, version = sys.argv[1], sys.argv[2]
ctypes.CDLL(f"{folder}/libicudata.so.{version}", mode=ctypes.RTLD_GLOBAL)
uc = ctypes.CDLL(f"{folder}/libicuuc.so.{version}", mode=ctypes.RTLD_GLOBAL)
i18n = ctypes.CDLL(f"{folder}/libicui18n.so.{version}", mode=ctypes.RTLD_GLOBAL)
for call, args in ((getattr(i18n, f"ucol_open_{version}"), (b"de_DE",)),
                   (getattr(uc, f"ures_open_{version}"), (None, b"en"))):
    status = ctypes.c_int(0)
    call(*args, ctypes.byref(status))
    if status.value > 0:  # ICU's errors are positive, warnings (a fallback locale) negative
        sys.exit(f"{call.__name__}{args}: ICU error {status.value}")
"""


def check(lib: Path) -> None:
    """Open a German collator and the English locale through the libraries beside ``lib``, as Qt
    would: an ICU package written wrongly (its items under another name) fails both."""
    version = lib.name.rsplit(".", 1)[-1]
    if (lib.parent / f"libicui18n.so.{version}").exists():
        subprocess.run([sys.executable, "-c", CHECK, str(lib.parent), version], check=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    libs = sorted(p for p in Path(argv[0]).rglob("libicudata.so.*") if p.is_file() and not p.is_symlink())
    if not libs:
        print(f"{argv[0]}: no libicudata.so.* to trim", file=sys.stderr)
        return 1
    for lib in libs:
        before, after = trim(lib)
        check(lib)
        print(f"{lib}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
