"""CPU and RAM: the numbers that decide llama.cpp's speed on a machine without a big GPU.

Linux is read from ``/proc/cpuinfo`` and ``/sys/devices/system/cpu`` (instant, and testable on
recorded trees through ``proc_root``/``sys_root``). Other systems go through py-cpuinfo, which
takes about a second, so callers in a GUI run detection off the GUI thread.
"""

from __future__ import annotations

import platform
from pathlib import Path

import psutil

from backends.hardware.types import CpuInfo, RamInfo

# Instruction sets llama.cpp has kernels for, as /proc/cpuinfo (x86) or "Features" (Arm) spell
# them, mapped to the names SpecDeck reports.
_X86_FLAGS = {
    "sse3": "sse3", "pni": "sse3", "ssse3": "ssse3", "avx": "avx", "avx2": "avx2", "fma": "fma",
    "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512vl": "avx512vl",
    "avx512_vnni": "avx512_vnni", "avx512vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16",
    "avx512vbmi": "avx512_vbmi", "avx_vnni": "avx_vnni", "avxvnni": "avx_vnni",
    "amx_tile": "amx_tile", "amx_int8": "amx_int8", "amx_bf16": "amx_bf16",
}
_ARM_FLAGS = {
    "asimd": "neon", "neon": "neon", "asimddp": "dotprod", "dotprod": "dotprod", "i8mm": "i8mm",
    "sve": "sve", "sve2": "sve2", "fphp": "fp16", "asimdhp": "fp16", "sme": "sme",
}
_ARM_MACHINES = {"arm64", "aarch64", "armv8l"}


def detect_cpu(*, proc_root: str | Path = "/proc", sys_root: str | Path = "/sys") -> CpuInfo:
    """The CPU's name, core counts, llama.cpp-relevant flags and cache sizes. Never raises."""
    cpuinfo = Path(proc_root) / "cpuinfo"
    if cpuinfo.is_file():
        return _from_proc(_read(cpuinfo) or "", Path(sys_root))
    return _from_py_cpuinfo()


def detect_ram() -> RamInfo:
    vm = psutil.virtual_memory()
    return RamInfo(total_bytes=int(vm.total), available_bytes=int(vm.available))


def _from_proc(text: str, sys_root: Path) -> CpuInfo:
    first = _first_block(text)
    machine = platform.machine() or "unknown"
    raw_flags = (first.get("flags") or first.get("Features") or "").split()
    is_arm = "Features" in first or machine.lower() in _ARM_MACHINES
    name = first.get("model name") or _arm_name(first) or first.get("Hardware") or "unknown CPU"
    mhz = _float(first.get("cpu MHz"))
    return CpuInfo(
        name=name.strip(),
        vendor=first.get("vendor_id") or first.get("CPU implementer"),
        arch=machine,
        cores=psutil.cpu_count(logical=False),
        threads=psutil.cpu_count(logical=True),
        flags=_normalize_flags(raw_flags, _ARM_FLAGS if is_arm else _X86_FLAGS),
        caches=_sys_caches(sys_root / "devices/system/cpu/cpu0/cache"),
        max_mhz=_max_mhz(sys_root) or mhz,
    )


def _first_block(text: str) -> dict[str, str]:
    """The key/value pairs of the first processor block (plus global Arm lines like 'Hardware')."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key and key not in out:
            out[key] = value.strip()
    return out


_ARM_PARTS = {"0xd03": "Cortex-A53", "0xd08": "Cortex-A72", "0xd0b": "Cortex-A76", "0xd0c": "Neoverse-N1",
              "0xd40": "Neoverse-V1", "0xd41": "Cortex-A78", "0xd49": "Neoverse-N2", "0xd4f": "Neoverse-V2"}


def _arm_name(block: dict[str, str]) -> str | None:
    """Arm kernels name no CPU: the core comes from its part number, the board from "Model"."""
    part = block.get("CPU part")
    core = _ARM_PARTS.get(part or "", f"Arm core {part}" if part else None)
    board = block.get("Model")
    return f"{board} ({core})" if board and core else board or core


def _normalize_flags(raw: list[str], table: dict[str, str]) -> tuple[str, ...]:
    return tuple(sorted({table[f.lower()] for f in raw if f.lower() in table}))


def _sys_caches(cache_dir: Path) -> dict[str, int]:
    """{"L1d": bytes, "L1i": ..., "L2": ..., "L3": ...} for the first core."""
    caches: dict[str, int] = {}
    for index in sorted(cache_dir.glob("index*")) if cache_dir.is_dir() else ():
        level, kind, size = (_read(index / n) for n in ("level", "type", "size"))
        nbytes = _parse_size(size)
        if not level or nbytes is None:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind or "", "")
        caches[f"L{level}{suffix}"] = nbytes
    return caches


def _parse_size(text: str | None) -> int | None:
    """'32K' -> 32768; '1024K' -> 1048576; '8M' -> 8388608."""
    if not text:
        return None
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
    digits = text.rstrip("KMGB")
    return int(digits) * scale if digits.isdigit() else None


def _max_mhz(sys_root: Path) -> float | None:
    khz = _float(_read(sys_root / "devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"))
    return khz / 1000 if khz else None


def _from_py_cpuinfo() -> CpuInfo:
    """Windows and macOS: py-cpuinfo (cpuid on x86, sysctl on macOS)."""
    try:
        import cpuinfo

        info = cpuinfo.get_cpu_info()
    except Exception:  # noqa: BLE001 - a CPU we cannot name is still a CPU
        info = {}
    machine = platform.machine() or str(info.get("arch", "unknown"))
    is_arm = machine.lower() in _ARM_MACHINES
    flags = _normalize_flags(list(info.get("flags", [])), _ARM_FLAGS if is_arm else _X86_FLAGS)
    if is_arm and platform.system() == "Darwin":
        flags = tuple(sorted({*flags, "neon", "dotprod", "fp16"}))  # every Apple Silicon core has them
    caches = {
        label: int(info[key])
        for label, key in (("L2", "l2_cache_size"), ("L3", "l3_cache_size"))
        if isinstance(info.get(key), int)
    }
    hz = info.get("hz_advertised")
    return CpuInfo(
        name=str(info.get("brand_raw") or platform.processor() or "unknown CPU"),
        vendor=info.get("vendor_id_raw"),
        arch=machine,
        cores=psutil.cpu_count(logical=False),
        threads=psutil.cpu_count(logical=True),
        flags=flags,
        caches=caches,
        max_mhz=hz[0] / 1e6 if isinstance(hz, (list, tuple)) and hz and hz[0] else None,
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None
