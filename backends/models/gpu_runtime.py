"""Which llama.cpp GPU backend this process runs, if any, chosen by running it first in a child.

Why. The portable build (packaging/llama_build.sh) carries CPU code only; the GPU code comes as
optional modules beside it (``libggml-cuda.so``, ``libggml-vulkan.so``, packaging/gpu_build.sh).
A module that loads can still be unusable here: no driver, a driver too old for the CUDA the
module was built with, cuBLAS missing, a Vulkan driver that offers only a CPU rasterizer, or a
driver bug that kills the process at the first kernel. So, as for the CPU variants
(``llama_runtime``), the question is asked cheaply first (can the driver library be opened, which
CUDA version does it support) and then answered by a child process that loads the module, lists
its devices and decodes the bundled model fully offloaded. Only a module that passed is loaded
here, after the CPU module and before ``llama_backend_init``. The verdict, including "CPU only,
because ...", is cached per module files, driver and visible devices.

``SPECDECK_GPU=off`` keeps everything on the CPU; ``SPECDECK_GPU=vulkan`` (or ``cuda``) tries only
that backend.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from backends.models.llama_runtime import death, ggml_library, module_dirs, read_verdict, run_child, write_verdict
from backends.models.paths import cache_dir

KINDS = ("cuda", "vulkan")  # tried in this order: on an NVIDIA card CUDA is the faster of the two
LABELS = {"cuda": "CUDA", "vulkan": "Vulkan"}
CUDA_NEEDED = 13000  # cuDriverGetVersion of a CUDA 13 driver (580 or newer)
_SUFFIX = ".dll" if sys.platform == "win32" else ".so"
_PREFIX = "ggml-" if sys.platform == "win32" else "libggml-"
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}  # enum ggml_backend_dev_type
_probed_here: dict[str, GpuRuntime] = {}


@dataclass(frozen=True)
class GpuDevice:
    """One device a GPU module offers, as ggml reports it."""

    name: str  # "CUDA0", "Vulkan0"
    description: str  # "NVIDIA GeForce RTX 4090", "llvmpipe (LLVM 15.0.6, 256 bits)"
    kind: str  # "gpu" | "igpu" | ...
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class GpuRuntime:
    """The verdict: the GPU backend that runs (None: CPU only) and why the others do not."""

    backend: str | None  # "cuda" | "vulkan" | None
    module: str | None
    devices: tuple[GpuDevice, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()  # (backend, why it is not used)
    cached: bool = False

    @property
    def why(self) -> str:
        """One sentence for `specdeck hw` and the hardware panel."""
        if self.backend is not None:
            cards = ", ".join(f"{d.description} ({d.total_bytes / 2**30:.1f} GiB)" for d in self.devices)
            used = f"{LABELS[self.backend]} on {cards}"
            return "; ".join([used, *(f"{LABELS[k]} not used: {why}" for k, why in self.skipped)])
        if not self.skipped:
            return ("CPU only: no GPU module is installed (bash packaging/gpu_build.sh vulkan|cuda .venv/bin/python "
                    "--install adds one)")
        return "CPU only: " + "; ".join(f"{LABELS[k]} module: {why}" for k, why in self.skipped)


# -- where the modules are -----------------------------------------------------------------------
def find_modules(dirs: list[Path] | None = None) -> dict[str, Path]:
    """``{"vulkan": Path(".../libggml-vulkan.so"), ...}`` in the CPU variants' folders."""
    found: dict[str, Path] = {}
    for d in dirs if dirs is not None else module_dirs():
        for kind in KINDS:
            p = d / f"{_PREFIX}{kind}{_SUFFIX}"
            if kind not in found and p.is_file():
                found[kind] = p
    return found


# -- the cheap checks, in this process -----------------------------------------------------------
def prepare(kind: str) -> str | None:
    """Make the libraries ``kind``'s module needs loadable; why it cannot run here, or None.

    Opening a driver library runs none of its GPU code, so this is safe in the window's process.
    For CUDA, cuBLAS and the runtime from PyPI's nvidia wheels are opened globally first (the
    module finds them by SONAME; their folder is on no loader path)."""
    if kind == "vulkan":
        return None if _open("vulkan-1.dll" if sys.platform == "win32" else "libvulkan.so.1") else (
            "no Vulkan loader (the graphics driver's Vulkan support; Debian/Ubuntu: apt install libvulkan1)")
    if kind != "cuda":
        return f"unknown GPU backend {kind!r}"
    driver = _open("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    if driver is None:
        return "no NVIDIA driver (libcuda.so.1 not found)"
    version = ctypes.c_int(0)
    if driver.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < CUDA_NEEDED:
        have = f"{version.value // 1000}.{version.value % 1000 // 10}" if version.value else "an unknown version"
        return f"the NVIDIA driver supports CUDA {have}; this module needs 13.0 (update the driver to 580 or newer)"
    for lib in ("cudart", "cublasLt", "cublas"):
        if _open_cuda_library(lib) is None:
            return f"lib{lib}.so.13 not found (pip install 'nvidia-cuda-runtime>=13,<14' 'nvidia-cublas>=13,<14')"
    return None


def _open(name: str | Path, mode: int = ctypes.DEFAULT_MODE) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(name), mode=mode)
    except OSError:
        return None


def _open_cuda_library(lib: str) -> ctypes.CDLL | None:
    """``lib{lib}.so.13`` from the system's loader path, else from an nvidia wheel's folder."""
    name = f"lib{lib}.so.13"
    found = _open(name, ctypes.RTLD_GLOBAL)
    if found is not None:
        return found
    for root in _site_dirs():
        candidate = root / "nvidia" / "cu13" / "lib" / name
        if candidate.is_file():
            return _open(candidate, ctypes.RTLD_GLOBAL)
    return None


def _site_dirs() -> list[Path]:
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    return [Path(d) for d in dict.fromkeys(dirs)]


# -- the verdict ---------------------------------------------------------------------------------
def choose(cpu_module: str | None, *, dirs: list[Path] | None = None, cache_file: Path | None = None,
           use_cache: bool = True) -> GpuRuntime:
    """The GPU backend this process should load (or why none), probing each candidate in a child."""
    wanted = (os.environ.get("SPECDECK_GPU") or "").strip().lower()
    modules = find_modules(dirs)
    if wanted in ("off", "0", "none", "cpu"):
        return GpuRuntime(None, None, skipped=tuple((k, "turned off by SPECDECK_GPU=off") for k in modules))
    if wanted:
        modules = {k: p for k, p in modules.items() if k == wanted}
    if not modules:
        return GpuRuntime(None, None)  # nothing to probe (the common case of a CPU-only install)
    key = _fingerprint(modules, cpu_module)
    cache_file = cache_file or cache_dir() / "llama-gpu-probe.json"
    if use_cache and key in _probed_here:
        return _probed_here[key]
    if use_cache:
        hit = _read_cache(cache_file, key)
        if hit is not None:
            return hit
    runtime = _probe_all(modules, cpu_module)
    write_verdict(cache_file, key, runtime)
    _probed_here[key] = runtime
    return runtime


def _probe_all(modules: dict[str, Path], cpu_module: str | None) -> GpuRuntime:
    skipped: list[tuple[str, str]] = []
    for kind in KINDS:
        if kind not in modules:
            continue
        problem = prepare(kind)
        if problem is None:
            devices, problem = probe(kind, modules[kind], cpu_module)
            if problem is None:
                return GpuRuntime(kind, str(modules[kind]), devices, tuple(skipped))
        skipped.append((kind, problem))
    return GpuRuntime(None, None, skipped=tuple(skipped))


def probe(kind: str, module: Path, cpu_module: str | None) -> tuple[tuple[GpuDevice, ...], str | None]:
    """Load ``module`` in a child, list its devices and decode the bundled model on them."""
    out, rc, err = run_child(["gpu", cpu_module or "-", str(module)])
    devices = tuple(GpuDevice(**d) for line in out for d in line.get("devices", ()))
    if rc == 0 and any(line.get("ok") for line in out):
        return devices, None
    error = next((line["error"] for line in reversed(out) if "error" in line), None)
    stage = next((line["stage"] for line in reversed(out) if "stage" in line), "starting")
    if error:
        return devices, error
    if rc > 0:
        return devices, f"failed while {stage}: {(err.strip().splitlines() or [death(rc)])[-1]}"
    return devices, f"{death(rc)} while {stage}"


def list_devices() -> list[GpuDevice]:
    """The non-CPU devices registered in this process's ggml, with their memory now."""
    ggml = ggml_library()
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(ggml, fn).restype = ctypes.c_char_p
        getattr(ggml, fn).argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_type.restype = ctypes.c_int
    ggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                             ctypes.POINTER(ctypes.c_size_t)]
    devices = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        kind = DEVICE_TYPES.get(ggml.ggml_backend_dev_type(dev), "other")
        if kind == "cpu":
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        devices.append(GpuDevice(ggml.ggml_backend_dev_name(dev).decode(errors="replace"),
                                 ggml.ggml_backend_dev_description(dev).decode(errors="replace"), kind,
                                 int(total.value), int(free.value)))
    return devices


# -- the cache -----------------------------------------------------------------------------------
def _fingerprint(modules: dict[str, Path], cpu_module: str | None) -> str:
    """The modules, the driver libraries and what selects devices: any change asks again."""
    h = hashlib.sha256()
    for kind, path in sorted(modules.items()):
        st = path.stat()
        h.update(f"{kind}:{path}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(f"cpu:{cpu_module};".encode())
    for name in ("cuda", "vulkan", "cudart", "cublas"):
        found = ctypes.util.find_library(name)
        h.update(f"{name}:{found};".encode())
    for path in ["/proc/driver/nvidia/version", *sorted(str(p) for p in Path("/usr/share/vulkan/icd.d").glob("*.json"))]:
        try:
            h.update(path.encode() + Path(path).read_bytes())
        except OSError:
            pass
    for var in ("CUDA_VISIBLE_DEVICES", "GGML_VK_VISIBLE_DEVICES", "SPECDECK_GPU"):
        h.update(f"{var}={os.environ.get(var, '')};".encode())
    return h.hexdigest()[:24]


def _read_cache(path: Path, key: str) -> GpuRuntime | None:
    data = read_verdict(path, key)
    if data is None:
        return None
    try:
        data["devices"] = tuple(GpuDevice(**d) for d in data["devices"])
        data["skipped"] = tuple(tuple(s) for s in data["skipped"])
        runtime = GpuRuntime(**data, cached=True)
    except (TypeError, KeyError):
        return None
    if runtime.module is not None and not Path(runtime.module).is_file():
        return None
    return runtime
