"""How many of a model's layers go to the GPU: the fit estimator's answer, on the devices the
loaded GPU module really drives.

A session asks for ``AUTO`` layers by default. With no GPU module running (CPU-only install, no
driver, a module that failed its probe) that is 0, and nothing else is consulted. With one, the
fit estimator (``backends.hardware.fit.plan``) places the target, its KV cache and compute
buffers, and a draft model: everything on the GPU when it fits with the safety margin, else the
most layers that do. Its VRAM figures come from NVML or sysfs where they know the card, else
from the GPU module's own report (a Vulkan device that neither knows, e.g. a software one).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from backends.core.errors import SpecDeckError
from backends.hardware.fit import Extra, FitReport, RuntimeSettings, plan
from backends.hardware.shape import load_shape
from backends.hardware.types import GpuInfo, HardwareReport

AUTO = -1  # n_gpu_layers: as many as the fit estimator places on the GPU


def offload_plan(model: str | Path, *, n_ctx: int, draft: str | Path | None = None,
                 hw: HardwareReport | None = None) -> FitReport | None:
    """The fit estimator's plan for ``model`` on the running GPU backend; None when no GPU backend
    runs (then every layer stays on the CPU)."""
    from backends.models.llama_lib import gpu_runtime

    running = gpu_runtime()
    if running is None or running.backend is None:
        return None
    if hw is None:
        from backends.hardware.detect import detect_hardware

        hw = detect_hardware()
    hw = with_gpu_module(hw)
    extra = Extra(draft=load_shape(draft) if draft else None)
    return plan(load_shape(model), hw, RuntimeSettings(n_ctx=n_ctx), extra)


def with_gpu_module(hw: HardwareReport) -> HardwareReport:
    """``hw`` with the running GPU module's devices where the detectors found no GPU."""
    from backends.models.gpu_runtime import list_devices
    from backends.models.llama_lib import gpu_runtime

    running = gpu_runtime()
    if hw.gpus or running is None or running.backend is None:
        return hw
    return with_devices(hw, [(d.description, d.total_bytes, d.free_bytes) for d in list_devices()])


def with_devices(hw: HardwareReport, devices: list[tuple[str, int, int]]) -> HardwareReport:
    """``hw`` with the GPU module's devices (description, total, free bytes) as its GPUs when the
    detectors found none: their memory is all the estimator needs."""
    if hw.gpus or not devices:
        return hw
    gpus = tuple(GpuInfo(index=i, name=name, vendor="other", source="ggml", vram_total_bytes=total,
                         vram_free_bytes=free) for i, (name, total, free) in enumerate(devices))
    return replace(hw, gpus=gpus)


def resolve_gpu_layers(requested: int, model: str | Path, *, n_ctx: int,
                       draft: str | Path | None = None) -> tuple[int, FitReport | None]:
    """``requested`` layers, or the plan's for ``AUTO``; with the plan when one was made."""
    if requested != AUTO:
        return requested, None
    try:
        report = offload_plan(model, n_ctx=n_ctx, draft=draft)
    except SpecDeckError:  # a file the estimator cannot read: loading it says why, in llama.cpp's words
        return 0, None
    return (0, None) if report is None else (report.gpu_layers, report)
