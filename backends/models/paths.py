"""Where SpecDeck keeps what it makes: derived models, metadata caches, measurements.

Per-user directories from platformdirs; ``SPECDECK_CACHE_DIR`` overrides the cache directory
(tests and CI point it at a scratch folder so they never touch a user's files).
"""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir, user_data_dir

APP_NAME = "specdeck"


def cache_dir() -> Path:
    """Derived, re-creatable files: quantized model variants, parsed metadata."""
    override = os.environ.get("SPECDECK_CACHE_DIR")
    return Path(override) if override else Path(user_cache_dir(APP_NAME))


def data_dir() -> Path:
    """Files a user would miss if they vanished (conversations, datastores)."""
    override = os.environ.get("SPECDECK_DATA_DIR")
    return Path(override) if override else Path(user_data_dir(APP_NAME))


def library_dir() -> Path:
    """Where models downloaded from the Hugging Face Hub go; the model library always scans it."""
    return data_dir() / "models"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file of its own in the same folder, then
    rename: readers see the old content or the new, never half of it. The temporary name is
    unique per call (``mkstemp``), because two threads of one process (the model load and a
    background estimate) may write the same cache entry at the same moment; a name made of the
    process id alone let one thread's rename take the other's file away."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
