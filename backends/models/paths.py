"""Where SpecDeck keeps what it makes: derived models, metadata caches, measurements.

Per-user directories from platformdirs; ``SPECDECK_CACHE_DIR`` overrides the cache directory
(tests and CI point it at a scratch folder so they never touch a user's files).
"""

from __future__ import annotations

import os
import time
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


def keep_recent(folder: Path, keep: int, pattern: str = "*", *, spare: Path | None = None) -> None:
    """Delete all but the ``keep`` most recently used files of a cache folder (``spare`` is never
    deleted). Cache entries are keyed by a model file's path and time, so a moved, re-made or
    deleted model leaves its entry behind for good; without this the dequantized weights the
    PyTorch backend keeps (0.5-1 GB for a 135-270M model) filled a disk a test run at a time.
    "Used" is the file's time, which readers refresh with ``mark_used``; ``pattern`` keeps other
    processes' half-written temporary files out. A file another process holds open (Windows
    refuses to delete it) stays; the next pruning takes it."""
    if spare is not None:
        mark_used(spare)  # a new file's time is the kernel's coarse clock: put it on the same fine one
    used: list[tuple[int, Path]] = []
    for file in folder.glob(pattern):
        try:
            if file != spare and file.is_file():
                used.append((file.stat().st_mtime_ns, file))
        except OSError:  # deleted meanwhile by another process
            continue
    used.sort(reverse=True)
    for _, stale in used[max(keep - (spare is not None), 0):]:
        try:
            stale.unlink()
        except OSError:
            pass


def mark_used(path: Path) -> None:
    """Refresh a cache entry's time on a hit, so ``keep_recent`` deletes what is no longer read.
    The time is given, not left to the kernel: its "now" for file times ticks every few
    milliseconds, so a hit right after another entry's write tied with it, and the tie fell to
    the file names (seen in CI: the entry just read was deleted instead of the older one)."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass


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
