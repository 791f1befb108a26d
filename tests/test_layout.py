"""The project's shape: the fixed top level, a Qt-free backends/ and the import layers."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ROOT / "backends"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules_of(package: str) -> dict[Path, set[str]]:
    return {p: imported_modules(p) for p in (BACKENDS / package).rglob("*.py")}


def test_top_level_layout():
    entries = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} - {"specdeck.egg-info", "build", "dist"}
    assert {"desktop", "backends", "assets", "tests", "packaging", "pyproject.toml", "README.md"} <= entries
    assert entries <= {"desktop", "backends", "assets", "tests", "packaging", "pyproject.toml", "README.md"}
    assert (ROOT / ".ci" / "run").exists()


def test_backends_never_import_qt():
    offenders = []
    for path in BACKENDS.rglob("*.py"):
        for name in imported_modules(path):
            if name.split(".")[0] in {"PySide6", "PyQt5", "PyQt6", "pyqtgraph", "shiboken6"}:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders


def test_layers_only_import_upwards():
    """core < models < drafters, llamacpp (neither imports the other) < hardware < factory, bench, cli."""
    front = ("backends.factory", "backends.bench", "backends.cli", "backends.chat")
    forbidden = {
        "core": ("backends.models", "backends.drafters", "backends.llamacpp", "backends.hardware", "llama_cpp", *front),
        "models": ("backends.drafters", "backends.llamacpp", "backends.hardware", *front),
        "drafters": ("backends.llamacpp", "backends.hardware", "llama_cpp", *front),
        "llamacpp": ("backends.drafters", "backends.hardware", *front),
        "hardware": front,
    }
    offenders = []
    for package, banned in forbidden.items():
        for path, names in modules_of(package).items():
            offenders += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.startswith(banned)]
    assert not offenders
