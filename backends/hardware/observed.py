"""What SpecDeck has measured on this machine, per model file and method, for the recommender.

Every finished answer records its decode rate and acceptance (tau, drafted tokens per step), and
``specdeck bench`` records speedups measured against interleaved plain decoding. Values are
exponential moving averages, so old measurements fade as new ones arrive. The store is one small
JSON file in the user data directory, written atomically.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from backends.core.types import RunStats
from backends.models.paths import data_dir

_SMOOTHING = 0.3
_lock = threading.Lock()


@dataclass(frozen=True)
class Observation:
    decode_tok_s: float | None
    tau: float | None
    drafted_per_step: float | None
    speedup: float | None  # measured against interleaved plain decoding (bench); None from chat
    n: int


def model_key(path: str | os.PathLike) -> str:
    """File name and size: stable when the file moves, different when it is re-quantized."""
    p = Path(path)
    try:
        return f"{p.name}:{p.stat().st_size}"
    except OSError:
        return p.name


class ObservedStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or data_dir() / "observed.json"

    def _load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def record(self, model: str | os.PathLike, method: str, task: str, *, decode_tok_s: float, tau: float | None = None,
               drafted_per_step: float | None = None, speedup: float | None = None) -> None:
        """Fold one measurement into the averages (a run without a decode rate is ignored)."""
        if not _finite(decode_tok_s):
            return
        values = {"decode_tok_s": decode_tok_s, "tau": tau, "drafted_per_step": drafted_per_step, "speedup": speedup}
        with _lock:
            data = self._load()
            entry = data.setdefault(model_key(model), {}).setdefault(method, {}).setdefault(task, {"n": 0})
            for name, value in values.items():
                if _finite(value):
                    old = entry.get(name)
                    entry[name] = value if old is None else old + _SMOOTHING * (value - old)
            entry["n"] += 1
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.path)

    def record_run(self, model: str | os.PathLike, task: str, stats: RunStats) -> None:
        """A finished answer: its decode rate and acceptance."""
        self.record(model, stats.method, task, decode_tok_s=stats.decode_tok_s, tau=stats.tau,
                    drafted_per_step=stats.drafted / stats.forwards if stats.forwards else None)

    def lookup(self, model: str | os.PathLike, method: str, task: str) -> Observation | None:
        """This task's numbers, else the average over the method's other tasks, else None."""
        by_task = self._load().get(model_key(model), {}).get(method, {})
        if not by_task:
            return None
        entries = [by_task[task]] if task in by_task else list(by_task.values())
        return Observation(
            decode_tok_s=_mean(e.get("decode_tok_s") for e in entries),
            tau=_mean(e.get("tau") for e in entries),
            drafted_per_step=_mean(e.get("drafted_per_step") for e in entries),
            speedup=_mean(e.get("speedup") for e in entries),
            n=sum(int(e.get("n", 0)) for e in entries),
        )


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _mean(values) -> float | None:
    xs = [v for v in values if _finite(v)]
    return sum(xs) / len(xs) if xs else None
