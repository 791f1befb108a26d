"""GPU modules: used only after a child saw them run; otherwise the CPU, with the reason in words.

The drivers and modules that fail here are real machine code compiled by the test: a
``libcuda.so.1`` that reports an old driver, one that reports CUDA 13 beside stand-ins for the
CUDA runtime and cuBLAS, and a ``libggml-cuda.so`` whose ``ggml_backend_init`` dereferences NULL.
They are put first on the loader's path of a fresh Python process (the loader reads
LD_LIBRARY_PATH at start), so the test behaves the same on PCs with and without an NVIDIA driver.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from backends.hardware.fit import CPU, VRAM_MARGIN, plan
from backends.hardware.offload import with_devices
from backends.hardware.shape import load_shape
from backends.models import gpu_runtime
from backends.models.llama_lib import cpu_runtime
from tests.hw_replay import recorded_cpu_machine

ROOT = Path(__file__).resolve().parents[1]
DRIVER = "int cuDriverGetVersion(int *v) {{ *v = {version}; return 0; }}\n"
CRASH_IN_INIT = "void *ggml_backend_init(void) { volatile int *p = 0; *p = 1; return 0; }\n"
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the stand-in libraries are ELF shared objects")


def _compile(source: str, out: Path, soname: str | None = None) -> Path:
    c = out.with_name(out.name + ".c")
    c.write_text(source)
    cmd = ["cc", "-shared", "-fPIC", "-O0", "-o", str(out), str(c)]
    subprocess.run(cmd + ([f"-Wl,-soname,{soname}"] if soname else []), check=True)
    return out


def _nvidia_stand_ins(folder: Path, driver_version: int) -> Path:
    """A driver reporting ``driver_version`` and empty CUDA runtime and cuBLAS libraries."""
    folder.mkdir()
    _compile(DRIVER.format(version=driver_version), folder / "libcuda.so.1", "libcuda.so.1")
    for name in ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13"):
        _compile("int specdeck_stand_in;\n", folder / name, name)
    return folder


def _choose_in_child(modules: Path, libs: Path, tmp_path: Path) -> dict:
    """``gpu_runtime.choose`` in a fresh process whose loader finds ``libs`` first."""
    code = ("import json, sys; from pathlib import Path; from backends.models import gpu_runtime as g; "
            "r = g.choose(sys.argv[1], dirs=[Path(sys.argv[2])], cache_file=Path(sys.argv[3]), use_cache=False); "
            "print(json.dumps({'backend': r.backend, 'skipped': r.skipped, 'why': r.why}))")
    env = dict(os.environ, LD_LIBRARY_PATH=str(libs), PYTHONPATH=str(ROOT))
    env.pop("SPECDECK_GPU", None)
    cpu = cpu_runtime().module or "-"
    done = subprocess.run([sys.executable, "-c", code, cpu, str(modules), str(tmp_path / "gpu.json")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def crashing_cuda_module(tmp_path) -> Path:
    modules = tmp_path / "modules"
    modules.mkdir()
    _compile(CRASH_IN_INIT, modules / "libggml-cuda.so")
    return modules


def test_a_driver_too_old_for_the_module_keeps_the_cpu_and_says_why(crashing_cuda_module, tmp_path):
    libs = _nvidia_stand_ins(tmp_path / "libs", 12080)
    verdict = _choose_in_child(crashing_cuda_module, libs, tmp_path)
    assert verdict["backend"] is None
    assert verdict["skipped"] == [["cuda", "the NVIDIA driver supports CUDA 12.8; this module needs 13.0 "
                                           "(update the driver to 580 or newer)"]]
    assert verdict["why"].startswith("CPU only: CUDA module: the NVIDIA driver supports CUDA 12.8")


def test_a_module_that_crashes_its_probe_is_not_loaded_and_we_live(crashing_cuda_module, tmp_path):
    libs = _nvidia_stand_ins(tmp_path / "libs", 13000)
    verdict = _choose_in_child(crashing_cuda_module, libs, tmp_path)
    assert verdict["backend"] is None
    (kind, why), = verdict["skipped"]
    assert kind == "cuda" and why == "killed by SIGSEGV (Segmentation fault) while loading libggml-cuda.so", why


def test_no_module_means_cpu_only_with_the_way_to_add_one(tmp_path):
    verdict = gpu_runtime.choose(None, dirs=[tmp_path], cache_file=tmp_path / "gpu.json", use_cache=False)
    assert verdict.backend is None and verdict.module is None
    assert "no GPU module is installed" in verdict.why and "packaging/gpu_build.sh" in verdict.why
    if ctypes.util.find_library("cuda") is None:  # this PC has no NVIDIA driver: the check says so
        assert gpu_runtime.prepare("cuda") == "no NVIDIA driver (libcuda.so.1 not found)"


def test_this_process_reports_its_gpu_backend():
    from backends.hardware.build import detect_llama_build

    build = detect_llama_build()
    assert build is not None and build.gpu_backend_why
    running = gpu_runtime.find_modules()
    if build.gpu_backend is None:  # CPU only: either no module, or each module's reason is given
        assert build.gpu_backend_why.startswith("CPU only: ")
        for kind in running:
            assert f"{gpu_runtime.LABELS[kind]} module: " in build.gpu_backend_why
    else:
        assert build.gpu_backend in running and gpu_runtime.LABELS[build.gpu_backend] in build.offload_targets


# -- how many layers go to the GPU --------------------------------------------------------------
GIB = 2**30


@pytest.mark.parametrize("free_gib,expect", [(20.0, "all"), (0.0, "none"), (None, "some")])
def test_offload_follows_the_fit_estimator_on_recorded_gpu_memory(smollm_f16_path, free_gib, expect):
    """A recorded CPU-only machine given one GPU device as a GPU module reports it (name, total,
    free): with room for everything the whole model goes there, with none nothing does, and in
    between exactly the most layers the estimator fits."""
    shape = load_shape(smollm_f16_path)
    machine = recorded_cpu_machine()
    build = machine.llama_cpp
    hw = replace(machine, llama_cpp=replace(build, gpu_offload=True, backends=("CPU", "Vulkan")))
    whole = plan(shape, with_devices(hw, [("card", 24 * GIB, 24 * GIB)]))
    on_gpu = sum(t.bytes for t in whole.terms if t.device != CPU)
    per_layer = sum(t.bytes for t in whole.terms if t.device != CPU and t.name.startswith(("weights: ", "KV cache")))
    # "some": room for everything but half of the layers' weights and KV cache
    free = int(free_gib * GIB) if free_gib is not None else VRAM_MARGIN + on_gpu - per_layer // 2
    report = plan(shape, with_devices(hw, [("card", 24 * GIB, free)]))
    if expect == "all":
        assert report.gpu_layers == report.total_layers and report.fits
    elif expect == "none":
        assert report.gpu_layers == 0
    else:
        assert 0 < report.gpu_layers < report.total_layers
        on_gpu = sum(t.bytes for t in report.terms if t.device != CPU)
        assert on_gpu <= free - VRAM_MARGIN  # what it placed fits the free memory less the margin
