"""Where a model's measured verify-cost curves are kept, so the session and the recommender agree.

A curve is valid for one model file, thread count, GPU offload, attention kernel and llama.cpp
build; the key holds all of them, so changing any of them measures again. The file holds a curve
measured at load (short context) and, once a long prompt has come by, one at that prompt's length.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from backends.models.llama_lib import build_id
from backends.models.paths import cache_dir, write_atomic

COST_CURVE_LENGTH = 64  # largest draft (tree nodes) the measured cost curve covers
LONG_CONTEXT = 512  # the first prompt at least this long (tokens) has the curve measured at its length too


def cost_curve_file(model: str | os.PathLike, n_threads: int, n_gpu_layers: int, flash_attn: str,
                    *runtime: object) -> Path:
    """``runtime``: what else changes the costs (another backend than llama.cpp, its precision)."""
    return measurement_file("costs", model, n_threads, n_gpu_layers, flash_attn,
                            COST_CURVE_LENGTH, LONG_CONTEXT, "short-then-first-long", *runtime)


def measurement_file(kind: str, model: str | os.PathLike, n_threads: int, n_gpu_layers: int, flash_attn: str,
                     *extra: object) -> Path:
    """Where a measurement of ``kind`` for this model file and runtime is kept. The key holds the
    file (path, size, time), threads, offload, attention kernel and the llama.cpp build with its
    CPU variant: each changes speeds and rounding."""
    path = Path(model)
    stat = path.stat()
    key = json.dumps([str(path), stat.st_size, stat.st_mtime_ns, n_threads, n_gpu_layers, flash_attn, build_id(), *extra])
    return cache_dir() / kind / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def load_cost_curves(file: Path) -> dict[int, list[float]] | None:
    """context -> seconds for k = 0..COST_CURVE_LENGTH drafted tokens, or None if not measured yet."""
    try:
        return {int(c): [float(x) for x in v] for c, v in json.loads(file.read_text()).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def save_cost_curves(file: Path, curves: dict[int, list[float]]) -> None:
    write_atomic(file, json.dumps(curves))
