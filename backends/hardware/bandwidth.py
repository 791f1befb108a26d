"""Memory bandwidth of this machine's RAM, measured once and cached.

Plain decoding reads every weight once per token, so on a home PC its speed is close to
bandwidth / bytes per token (the roofline). The CPU figure is measured with a short multi-threaded
copy (numpy releases the GIL while copying; one thread per physical core, as llama.cpp uses);
GPU figures come from the card's bus width and memory clock (``GpuInfo.bandwidth_bytes_s``).
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil

from backends.hardware.types import CpuInfo
from backends.models.paths import cache_dir, write_atomic

_BUFFER = 64 * 1024**2  # per thread: far beyond any L3, small enough to take ~0.2 s in all


def measure_cpu_bandwidth(threads: int | None = None, *, repeats: int = 5) -> float:
    """Bytes per second moved by copying (read + write) large buffers; best of ``repeats``."""
    n = max(1, threads or psutil.cpu_count(logical=False) or 1)
    src = [np.ones(_BUFFER // 8) for _ in range(n)]
    dst = [np.empty_like(a) for a in src]
    best = float("inf")
    with ThreadPoolExecutor(n) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.copyto, dst, src))
            best = min(best, time.perf_counter() - start)
    return 2 * n * _BUFFER / best


def cpu_bandwidth(cpu: CpuInfo, total_ram: int, *, use_cache: bool = True) -> float:
    """The cached measurement for this CPU and RAM size, measured on first use."""
    key = hashlib.sha256(f"{cpu.name}|{cpu.cores}|{cpu.threads}|{total_ram}".encode()).hexdigest()[:16]
    path = cache_dir() / "bandwidth" / f"{key}.json"
    if use_cache and path.is_file():
        try:
            return float(json.loads(path.read_text())["bytes_per_s"])
        except (OSError, ValueError, KeyError):
            pass
    value = measure_cpu_bandwidth(cpu.cores)
    write_atomic(path, json.dumps({"cpu": cpu.name, "bytes_per_s": value, "measured_at": time.time()}))
    return value
