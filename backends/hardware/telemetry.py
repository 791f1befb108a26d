"""Live telemetry: a sampler thread publishing immutable samples, and energy per token.

The sampler polls at a fixed rate (2 Hz by default) on its own daemon thread, so a slow driver
call never stalls generation or the GUI; readers get the latest sample or a copy of the history.
Each source fails on its own: an unreadable RAPL file means "no CPU power", and an NVIDIA GPU
that stops answering (driver reset, card lost) is reported in the sample's ``status`` while CPU and
RAM keep being sampled.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from backends.hardware.types import GpuSample


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic()
    cpu_pct: float
    ram_used_bytes: int
    cpu_power_w: float | None  # CPU package power from RAPL, when readable
    gpus: tuple[GpuSample, ...] = ()
    status: str | None = None  # e.g. "GPU 0 stopped answering (driver reset?)"

    @property
    def power_w(self) -> float | None:
        """CPU package + GPU board power: the draw SpecDeck can see, or None if it sees none."""
        parts = [g.power_w for g in self.gpus if g.power_w is not None]
        if self.cpu_power_w is not None:
            parts.append(self.cpu_power_w)
        return sum(parts) if parts else None


class GpuSource(Protocol):
    """Live GPU readings (``gpus.NvmlSession`` for NVIDIA cards)."""

    def read_all(self) -> tuple[tuple[GpuSample, ...], str | None]: ...

    def close(self) -> None: ...


class SysfsSource:
    """Live readings of AMD and Intel cards on Linux: the same sysfs files detection reads."""

    def __init__(self, root: str = "/sys") -> None:
        self.root = root

    def read_all(self) -> tuple[tuple[GpuSample, ...], str | None]:
        from backends.hardware.gpus import sysfs_gpus

        cards = sysfs_gpus(self.root)
        return tuple(GpuSample(index=g.index, vram_used_bytes=g.vram_used_bytes, power_w=g.power_w,
                               temperature_c=g.temperature_c, utilization_pct=g.utilization_pct) for g in cards), None

    def close(self) -> None:
        pass


class Rapl:
    """CPU package power from Linux powercap (``intel-rapl:N``; AMD Zen exposes it too).

    The counters are energy in microjoules that wrap at ``max_energy_range_uj``; power is the
    difference between two reads. Since 2020 the files are root-only on most distributions, so
    ``available`` is often False and the sample's CPU power stays None.
    """

    def __init__(self, root: str | Path = "/sys/class/powercap") -> None:
        self._zones = [z for z in _package_zones(Path(root)) if _read_int(z / "energy_uj") is not None]
        self._last: tuple[float, list[int]] | None = None

    @property
    def available(self) -> bool:
        return bool(self._zones)

    def power_w(self, now: float) -> float | None:
        values = [_read_int(z / "energy_uj") for z in self._zones]
        if not self._zones or any(v is None for v in values):
            return None
        last, self._last = self._last, (now, values)  # type: ignore[assignment]
        if last is None or now <= last[0]:
            return None
        joules = sum(_wrapped(v - p, z) for v, p, z in zip(values, last[1], self._zones)) / 1e6  # type: ignore[operator]
        return joules / (now - last[0])


def _package_zones(root: Path) -> list[Path]:
    """Top-level package domains only (``intel-rapl:0``), not their core/uncore subzones."""
    zones = [z for z in sorted(root.glob("intel-rapl:*")) if z.name.count(":") == 1] if root.is_dir() else []
    return [z for z in zones if (_read_text(z / "name") or "package").startswith("package")]


def _wrapped(delta: int, zone: Path) -> int:
    return delta if delta >= 0 else delta + (_read_int(zone / "max_energy_range_uj") or 0)


class Sampler:
    """Polls CPU, RAM, RAPL and GPUs every ``interval`` seconds on a daemon thread.

    ``subscribe`` callbacks run on the sampler thread; a GUI forwards them to its own thread.
    """

    def __init__(self, *, interval: float = 0.5, gpus: GpuSource | None = None, rapl: Rapl | None = None,
                 history: int = 3600) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        self.interval = interval
        self._gpus = gpus
        self._rapl = rapl if rapl is not None else Rapl()
        self._samples: deque[Sample] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._subscribers: list[Callable[[Sample], None]] = []

    @classmethod
    def for_this_machine(cls, *, interval: float = 0.5) -> Sampler:
        """NVIDIA GPUs through NVML, else AMD/Intel cards through sysfs; RAPL when readable."""
        from backends.hardware.gpus import NvmlSession, NvmlUnavailable, sysfs_gpus

        gpus: GpuSource | None
        try:
            gpus = NvmlSession()
        except NvmlUnavailable:
            gpus = SysfsSource() if sysfs_gpus() else None
        return cls(interval=interval, gpus=gpus)

    @property
    def has_gpu(self) -> bool:
        return self._gpus is not None

    @property
    def has_power(self) -> bool:
        """Whether any power reading can come: RAPL, or a GPU source."""
        return self._rapl.available or self._gpus is not None

    def use_gpus(self, gpus: GpuSource | None) -> GpuSource | None:
        """Read ``gpus`` from the next sample on (a server's GPUs while the window uses a server);
        returns the source read until now, which the caller keeps to put back (not closed)."""
        previous, self._gpus = self._gpus, gpus
        return previous

    def subscribe(self, callback: Callable[[Sample], None]) -> None:
        self._subscribers.append(callback)

    def start(self) -> Sampler:
        if self._thread is None:
            self._stop.clear()
            psutil.cpu_percent(interval=None)  # the first call only sets the reference point
            self._thread = threading.Thread(target=self._run, name="specdeck-telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._gpus is not None:
            self._gpus.close()
            self._gpus = None

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def latest(self) -> Sample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def history(self, since: float = float("-inf")) -> list[Sample]:
        with self._lock:
            return [s for s in self._samples if s.t >= since]

    def sample_now(self) -> Sample:
        """Take one sample immediately (also used by the thread)."""
        now = time.monotonic()
        gpus, status = self._read_gpus()
        sample = Sample(
            t=now,
            cpu_pct=psutil.cpu_percent(interval=None),
            ram_used_bytes=int(psutil.virtual_memory().used),
            cpu_power_w=self._rapl.power_w(now),
            gpus=gpus,
            status=status,
        )
        with self._lock:
            self._samples.append(sample)
        return sample

    def _read_gpus(self) -> tuple[tuple[GpuSample, ...], str | None]:
        if self._gpus is None:
            return (), None
        try:
            return self._gpus.read_all()
        except Exception as exc:  # noqa: BLE001 - a broken driver must not end telemetry
            return (), f"GPU telemetry failed: {exc}"

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            sample = self.sample_now()
            for callback in list(self._subscribers):
                callback(sample)
            next_t += self.interval
            self._stop.wait(max(0.0, next_t - time.monotonic()))


def energy_joules(samples: Sequence[Sample], t0: float, t1: float) -> float | None:
    """Energy drawn between ``t0`` and ``t1``.

    GPU energy comes from NVML's energy counter when every GPU has one (exact, interpolated at the
    ends); otherwise power readings are integrated (trapezoids, held flat beyond the first and last
    sample). None when no sample carries any power reading.
    """
    window = [s for s in samples if s.power_w is not None]
    if t1 <= t0 or not window:
        return None
    counters = _counter_energy(samples, t0, t1)
    if counters is not None:
        cpu = _integrate([(s.t, s.cpu_power_w) for s in samples if s.cpu_power_w is not None], t0, t1) or 0.0
        return counters + cpu
    return _integrate([(s.t, s.power_w) for s in window], t0, t1)  # type: ignore[misc]


def joules_per_token(samples: Sequence[Sample], t0: float, t1: float, tokens: int) -> float | None:
    energy = energy_joules(samples, t0, t1)
    return energy / tokens if energy is not None and tokens > 0 else None


def _counter_energy(samples: Sequence[Sample], t0: float, t1: float) -> float | None:
    with_counter = [s for s in samples if s.gpus and all(g.energy_mj is not None for g in s.gpus)]
    if len(with_counter) < 2:
        return None
    points = [(s.t, sum(g.energy_mj or 0 for g in s.gpus) / 1000.0) for s in with_counter]
    return _interp(points, t1) - _interp(points, t0)


def _interp(points: list[tuple[float, float]], t: float) -> float:
    """Linear interpolation, extrapolated from the nearest pair at either end."""
    pairs = list(zip(points, points[1:]))
    (ta, ea), (tb, eb) = next(((a, b) for a, b in pairs if a[0] <= t <= b[0]), pairs[0] if t < points[0][0] else pairs[-1])
    return ea if tb == ta else ea + (eb - ea) * (t - ta) / (tb - ta)


def _integrate(points: Iterable[tuple[float, float | None]], t0: float, t1: float) -> float | None:
    pts = sorted((t, p) for t, p in points if p is not None)
    if not pts:
        return None
    # Hold the first/last reading flat outside the sampled span, then clip to [t0, t1].
    pts = [(min(t0, pts[0][0]), pts[0][1]), *pts, (max(t1, pts[-1][0]), pts[-1][1])]
    total = 0.0
    for (ta, pa), (tb, pb) in zip(pts, pts[1:]):
        lo, hi = max(ta, t0), min(tb, t1)
        if hi <= lo or tb == ta:
            continue
        p_lo = pa + (pb - pa) * (lo - ta) / (tb - ta)
        p_hi = pa + (pb - pa) * (hi - ta) / (tb - ta)
        total += (p_lo + p_hi) / 2 * (hi - lo)
    return total


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    try:
        return int(text) if text else None
    except ValueError:
        return None
