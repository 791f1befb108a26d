"""CPU, RAM and llama.cpp build detection, and ``specdeck hw``: on this machine and on recordings."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

from backends.hardware.build import detect_llama_build, parse_backends
from backends.hardware.cpu import _parse_size, detect_cpu, detect_ram
from backends.hardware.detect import detect_hardware, format_report
from backends.hardware.gpus import sysfs_gpus, windows_gpus
from backends.hardware.types import GpuInfo

HW = Path(__file__).parent / "data" / "hw"


def nvml_device_names() -> list[str] | None:
    """The NVIDIA GPUs as NVML itself lists them, asked without SpecDeck's probe; None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
        return [(n.decode() if isinstance(n, bytes) else n).strip("\x00 ") for n in names]
    finally:
        pynvml.nvmlShutdown()


def gpus_this_machine_has() -> list[str]:
    """Names of the GPUs present, NVIDIA first: NVML's list, then the other vendors' cards."""
    nvidia = nvml_device_names() or []
    if sys.platform.startswith("linux"):
        others = sysfs_gpus()
    elif sys.platform == "win32":
        others = windows_gpus(skip_vendors=("nvidia",) if nvidia else ())
    else:
        others = ()
    return nvidia + [g.name for g in others]


GGML_GPU_TYPES = {1: "GPU", 2: "IGPU"}  # enum ggml_backend_dev_type: CPU 0, GPU 1, IGPU 2, ACCEL 3, META 4


def ggml_devices() -> list[tuple[str, int]]:
    """(backend, device type) of every device ggml registered in this process: the backends llama.cpp
    really loaded (with GGML_BACKEND_DL, the modules beside libggml), asked from ggml itself."""
    from backends.models.llama_lib import llama
    from backends.models.llama_runtime import ggml_library

    llama()  # backends register when llama.cpp initializes
    ggml = ggml_library()
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_dev_type.restype = ctypes.c_int
    ggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_name.restype = ctypes.c_char_p
    ggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    devices = (ggml.ggml_backend_dev_get(i) for i in range(ggml.ggml_backend_dev_count()))
    return [(ggml.ggml_backend_reg_name(ggml.ggml_backend_dev_backend_reg(d)).decode(), ggml.ggml_backend_dev_type(d))
            for d in devices]


def test_cpu_from_recorded_epyc_fixture():
    cpu = detect_cpu(proc_root=HW / "proc_epyc_zen4", sys_root=HW / "sys_epyc_zen4")
    assert cpu.name == "AMD EPYC"
    assert cpu.vendor == "AuthenticAMD"
    assert {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "fma", "f16c", "sse3"} <= set(cpu.flags)
    assert "amx_tile" not in cpu.flags and "neon" not in cpu.flags
    assert cpu.caches == {"L1d": 32 * 1024, "L1i": 32 * 1024, "L2": 1024 * 1024, "L3": 32 * 1024**2}


def test_cpu_from_recorded_arm_fixture():
    cpu = detect_cpu(proc_root=HW / "proc_arm_cortex_a76", sys_root=HW / "nowhere")
    assert cpu.name == "Raspberry Pi 5 Model B Rev 1.0 (Cortex-A76)"
    assert set(cpu.flags) == {"neon", "dotprod", "fp16"}
    assert cpu.caches == {}


def test_cpu_on_this_machine():
    cpu = detect_cpu()
    assert cpu.name and cpu.threads and cpu.threads >= (cpu.cores or 1)
    ram = detect_ram()
    assert 0 < ram.available_bytes <= ram.total_bytes


def test_cache_sizes_parse():
    assert _parse_size("32K") == 32768
    assert _parse_size("8M") == 8 * 1024**2
    assert _parse_size("garbage") is None and _parse_size("") is None


@pytest.mark.parametrize("info, expected", [
    ("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ", ("CPU",)),
    ("CUDA : ARCHS = 500,610,700,750,800,860,890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : SSE3 = 1 | AVX2 = 1 | ",
     ("CUDA", "CPU")),
    ("Vulkan : COOPMAT = 1 | CPU : NEON = 1 | ARM_FMA = 1 | ", ("Vulkan", "CPU")),
    ("Metal : EMBED_LIBRARY = 1 | BF16 = 1 | CPU : NEON = 1 | DOTPROD = 1 | ACCELERATE = 1 | ", ("Metal", "CPU")),
])
def test_llama_backends_from_recorded_system_info_fixture(info, expected):
    assert parse_backends(info) == expected


def test_llama_build_on_this_machine():
    """GPU offload is reported exactly when a GPU backend (CUDA, Vulkan, Metal ... module) is loaded
    and found a device; the CPU variant modules never count as one."""
    build = detect_llama_build()
    assert build is not None
    assert "CPU" in build.backends
    devices = ggml_devices()
    assert ("CPU", 0) in devices  # the CPU backend (the probed variant, with GGML_BACKEND_DL) is registered
    gpu_backends = {backend for backend, kind in devices if kind in GGML_GPU_TYPES}
    assert build.gpu_offload == (bool(gpu_backends) or "RPC" in build.backends)
    assert gpu_backends <= set(build.offload_targets)  # the report names the backend each GPU came from
    assert not any(t.startswith("CPU") for t in build.offload_targets)


def test_hardware_report_lists_the_gpus_this_machine_has():
    report = detect_hardware()
    expected = gpus_this_machine_has()
    assert [g.name for g in report.gpus] == expected
    assert [g.index for g in report.gpus] == list(range(len(expected)))
    if not nvml_device_names():
        assert any("no NVIDIA GPU" in note for note in report.notes)
    text = format_report(report)
    assert report.cpu.name in text
    assert ("GPU     none detected" in text) == (not expected)
    assert all(name in text for name in expected)


def test_report_text_shows_a_gpu():
    from dataclasses import replace

    gpu = GpuInfo(index=0, name="NVIDIA GeForce RTX 4090", vendor="nvidia", source="nvml", vram_total_bytes=24564 * 2**20,
                  vram_free_bytes=23000 * 2**20, power_w=31.5, power_limit_w=450, temperature_c=38, cuda_version="12.8",
                  mem_bus_width_bits=384, mem_clock_mhz=10501)
    report = replace(detect_hardware(), gpus=(gpu,))
    text = format_report(report)
    assert "RTX 4090" in text and "24.0 GiB VRAM" in text and "1008 GB/s" in text and "CUDA 12.8" in text
    data = report.to_json()
    assert data["gpus"][0]["bandwidth_bytes_s"] == pytest.approx(1.008e12, rel=1e-3)


def test_specdeck_hw_json():
    out = subprocess.run([sys.executable, "-m", "backends.cli", "hw", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"cpu", "ram", "gpus", "llama_cpp"} <= set(data)
    assert {"name", "cores", "threads", "flags"} <= set(data["cpu"])
    assert data["ram"]["total_bytes"] >= data["ram"]["available_bytes"] > 0
    assert [g["name"] for g in data["gpus"]] == gpus_this_machine_has()
    build = detect_llama_build()
    assert data["llama_cpp"]["backends"] == list(build.backends)
    assert (data["llama_cpp"]["gpu_offload"], data["llama_cpp"]["offload_targets"]) == (build.gpu_offload,
                                                                                       list(build.offload_targets))
    text = subprocess.run([sys.executable, "-m", "backends.cli", "hw"], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "CPU" in text.stdout and "llama.cpp" in text.stdout
