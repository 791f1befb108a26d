"""One call that describes the machine, and its human-readable form (``specdeck hw``)."""

from __future__ import annotations

import platform

from backends.hardware.build import detect_llama_build
from backends.hardware.cpu import detect_cpu, detect_ram
from backends.hardware.gpus import detect_gpus
from backends.hardware.types import GpuInfo, HardwareReport


def detect_hardware() -> HardwareReport:
    """CPU, RAM, GPUs and the llama.cpp build. Never raises: what cannot be read is unknown."""
    gpus, notes = detect_gpus()
    build = detect_llama_build()
    extra = () if build is not None else ("llama-cpp-python is not importable",)
    return HardwareReport(
        os=f"{platform.system()} {platform.release()}".strip(),
        cpu=detect_cpu(),
        ram=detect_ram(),
        gpus=gpus,
        llama_cpp=build,
        notes=tuple(notes) + extra,
    )


def format_report(report: HardwareReport) -> str:
    cpu, ram = report.cpu, report.ram
    caches = ", ".join(f"{k} {_size(v)}" for k, v in cpu.caches.items())
    lines = [
        f"OS      {report.os}",
        f"CPU     {cpu.name} ({cpu.arch}), {_opt(cpu.cores)} cores / {_opt(cpu.threads)} threads"
        + (f", up to {cpu.max_mhz:.0f} MHz" if cpu.max_mhz else ""),
        f"        flags: {' '.join(cpu.flags) or 'none that llama.cpp uses'}",
    ]
    if caches:
        lines.append(f"        caches: {caches}")
    lines.append(f"RAM     {_size(ram.available_bytes)} available of {_size(ram.total_bytes)}")
    if not report.gpus:
        lines.append("GPU     none detected")
    lines += [line for gpu in report.gpus for line in _gpu_lines(gpu)]
    build = report.llama_cpp
    if build is None:
        lines.append("llama.cpp  not installed")
    else:
        targets = ", ".join(build.offload_targets) or "none (CPU only)"
        lines.append(f"llama.cpp  llama-cpp-python {build.version}; backends {', '.join(build.backends) or 'none'}; GPU offload: {targets}")
        variant = build.cpu_variant or ("unusable" if not build.backends else "built-in")
        lines.append(f"           CPU variant: {variant} ({build.cpu_variant_why or 'not probed'})")
        lines.append("           Verify kernel: " + SMALL_BATCH_WORDS[build.small_batch])
        if build.gpu_backend_why:
            lines.append(f"           GPU backend: {build.gpu_backend_why}")
    lines += [f"note    {note}" for note in report.notes]
    return "\n".join(lines)


SMALL_BATCH_WORDS = {
    "on": "SpecDeck's small-batch F16/BF16 product (2-12 rows for about the weights' read of one)",
    "off": "llama.cpp's own (SpecDeck's small-batch kernel turned off by GGML_SPECDECK_SMALLBATCH=0)",
    None: "llama.cpp's own (this build or CPU variant has no SpecDeck small-batch kernel)",
}


def _gpu_lines(gpu: GpuInfo) -> list[str]:
    vram = "VRAM unknown" if gpu.vram_total_bytes is None else f"{_size(gpu.vram_total_bytes)} VRAM"
    if gpu.vram_free_bytes is not None:
        vram += f" ({_size(gpu.vram_free_bytes)} free)"
    first = f"GPU {gpu.index}   {gpu.name} [{gpu.vendor}, {gpu.source}], {vram}"
    live = [
        f"{gpu.power_w:.0f} W" + (f" of {gpu.power_limit_w:.0f} W" if gpu.power_limit_w else "") if gpu.power_w is not None else None,
        f"{gpu.temperature_c:.0f} C" if gpu.temperature_c is not None else None,
        f"{gpu.utilization_pct:.0f}% busy" if gpu.utilization_pct is not None else None,
        f"driver {gpu.driver_version}" if gpu.driver_version else None,
        f"CUDA {gpu.cuda_version}" if gpu.cuda_version else None,
        f"compute {gpu.compute_capability}" if gpu.compute_capability else None,
        f"{gpu.bandwidth_bytes_s / 1e9:.0f} GB/s" if gpu.bandwidth_bytes_s else None,
    ]
    rest = ", ".join(x for x in live if x)
    return [first] + ([f"        {rest}"] if rest else [])


def _size(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _opt(value: object) -> str:
    return "?" if value is None else str(value)
