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


SHARED_CODE = [*(BACKENDS / "core").glob("*.py"), BACKENDS / "factory.py", BACKENDS / "bench.py",
               BACKENDS / "bench_telemetry.py", BACKENDS / "chat.py", BACKENDS / "cli.py", BACKENDS / "train.py",
               *(ROOT / "desktop").glob("*.py")]


def _literals(node: ast.AST) -> list[str]:
    """The string literals a comparison operand is or holds (``"ar"``, ``("ar", "pld")``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for item in node.elts for s in _literals(item)]
    return []


def test_shared_code_compares_no_method_name():
    """The engine, factory, bench, CLI and desktop ask the registry (``MethodSpec.baseline``,
    capabilities) instead of comparing a method's name: a method added or renamed touches none of
    them. A name compared here would be a special case in the wrong place."""
    from backends.drafters import REGISTRY

    offenders = []
    for path in SHARED_CODE:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue):
                operands = [node.pattern.value]
            else:
                continue
            named = [s for operand in operands for s in _literals(operand) if s in REGISTRY]
            if named:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno if hasattr(node, 'lineno') else '?'} "
                                 f"compares {', '.join(named)}")
    assert not offenders, offenders
    assert SHARED_CODE and all(p.exists() for p in SHARED_CODE)
