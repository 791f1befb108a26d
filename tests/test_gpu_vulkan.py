"""The Vulkan module, built by packaging/gpu_build.sh from the wheel's own llama.cpp, run for real.

No GPU is needed: Mesa's lavapipe is a Vulkan driver that runs on the CPU. ggml's Vulkan backend
ignores such a device unless ``GGML_VK_VISIBLE_DEVICES`` names it, so by default the probe finds
no GPU and SpecDeck stays on the CPU, saying why; with the variable set, the same module, loader,
probe, fit estimator and offload run end to end on it, each in a fresh process (the module
choice is made once per process, before llama.cpp initializes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backends.models import gpu_runtime, llama_runtime

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_NEEDED = {"libggml-base.so.0", "libvulkan.so.1", "libstdc++.so.6", "libm.so.6", "libgcc_s.so.1", "libc.so.6",
                  "ld-linux-x86-64.so.2", "libgomp.so.1"}


@pytest.fixture(scope="module")
def module() -> Path:
    found = gpu_runtime.find_modules().get("vulkan")
    assert found is not None, "packaging/dev.sh installs libggml-vulkan.so beside the CPU variants for the tests"
    return found


def _dynamic(path: Path) -> tuple[set[str], set[str], set[str]]:
    """(NEEDED libraries, defined symbols, undefined symbols) of a shared object."""
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]",
                            subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout))
    lines = subprocess.run(["nm", "-D", str(path)], capture_output=True, text=True, check=True).stdout.splitlines()
    defined = {ln.split()[-1] for ln in lines if len(ln.split()) == 3 and ln.split()[1] in "TtWDBR"}
    undefined = {ln.split()[-1] for ln in lines if ln.split()[0] == "U"}
    return needed, defined, undefined


def test_the_module_is_a_ggml_backend_for_this_wheel(module):
    """It exports ggml_backend_init, links only ggml-base, the Vulkan loader and the C/C++ runtimes,
    and every ggml symbol it needs is one the wheel's libggml-base defines: the same ABI."""
    needed, defined, undefined = _dynamic(module)
    assert "ggml_backend_init" in defined
    assert "libggml-base.so.0" in needed and "libvulkan.so.1" in needed and needed <= ALLOWED_NEEDED, needed
    base = next(llama_runtime.lib_dir().glob("libggml-base.so*"))
    _, base_defined, _ = _dynamic(base)
    missing = {s for s in undefined if s.startswith(("ggml_", "gguf_"))} - base_defined
    assert not missing, f"symbols the wheel's libggml-base lacks: {sorted(missing)[:10]}"


def _child(code: str, tmp_path: Path, **env: str) -> dict:
    full = dict(os.environ, PYTHONPATH=str(ROOT), SPECDECK_CACHE_DIR=str(tmp_path / "cache"), **env)
    for name in ("GGML_VK_VISIBLE_DEVICES", "SPECDECK_GPU"):
        if name not in env:
            full.pop(name, None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


REPORT = ("import json; from backends.models.llama_lib import gpu_runtime; r = gpu_runtime(); "
          "print(json.dumps({'backend': r.backend, 'why': r.why, 'devices': [vars(d) for d in r.devices]}))")


def test_a_software_vulkan_device_is_not_taken_for_a_gpu(module, tmp_path):
    verdict = _child(REPORT, tmp_path)
    assert verdict["backend"] is None
    assert verdict["why"].startswith("CPU only: Vulkan module: it sees no GPU"), verdict["why"]


OFFLOADED = """
import json
from backends.core.types import Finished, GenerationSettings, SamplingSettings
from backends.factory import Session, SessionConfig
from backends.models.llama_lib import gpu_runtime

gen = GenerationSettings(max_new_tokens=24, sampling=SamplingSettings(temperature=0.0))
def answer(session):
    prompt = session.model.chat_prompt([{"role": "user", "content": "Name three colors."}])
    return [e for e in session.generate("ar", prompt, gen) if isinstance(e, Finished)][-1].tokens
with Session(SessionConfig(model="smollm2-135m-q4_1", n_ctx=512)) as gpu:
    on_gpu, placement = list(answer(gpu)), gpu.placement
    layers, total = gpu.config.n_gpu_layers, gpu.model.n_layer + 1
    planned = gpu.offload.gpu_layers if gpu.offload else None
with Session(SessionConfig(model="smollm2-135m-q4_1", n_ctx=512, n_gpu_layers=0)) as cpu:
    on_cpu = list(answer(cpu))
from backends.hardware.build import detect_llama_build
build = detect_llama_build()
print(json.dumps({"backend": gpu_runtime().backend, "placement": placement, "layers": layers, "total": total,
                  "planned": planned, "gpu": on_gpu, "cpu": on_cpu, "targets": build.offload_targets,
                  "why": build.gpu_backend_why}))
"""


def test_the_fit_estimator_offloads_every_layer_and_the_answer_is_the_cpus(module, tmp_path):
    """With the software device made visible: the probe passes, AUTO offload is the estimator's
    (every layer: a 135M model fits its memory), and greedy output matches the CPU's (a
    difference may only come at a near-tie; this short answer has none on the machines tried)."""
    got = _child(OFFLOADED, tmp_path, GGML_VK_VISIBLE_DEVICES="0")
    assert got["backend"] == "vulkan" and got["placement"].startswith("GPU (Vulkan, llvmpipe"), got["placement"]
    assert got["layers"] == got["planned"] == got["total"]
    assert got["targets"] == ["Vulkan"] and got["why"].startswith("Vulkan on llvmpipe")  # what `specdeck hw` says
    assert got["gpu"] == got["cpu"]


def test_gpu_off_keeps_the_cpu_even_with_the_device_visible(module, tmp_path):
    verdict = _child(REPORT, tmp_path, GGML_VK_VISIBLE_DEVICES="0", SPECDECK_GPU="off")
    assert verdict["backend"] is None and "turned off by SPECDECK_GPU=off" in verdict["why"]


def test_the_gpu_check_runs_to_its_table(module, tmp_path, smollm_q4_path):
    """packaging/gpu_check.py, as a lent GPU machine runs it, here on the software device and a
    tiny random-weight model written by packaging/random_gguf.py: every section of the table."""
    model = tmp_path / "random-tiny.gguf"
    subprocess.run([sys.executable, str(ROOT / "packaging" / "random_gguf.py"), "--vocab", str(smollm_q4_path),
                    "--shape", "tiny", "--out", str(model)], check=True, timeout=300)
    env = dict(os.environ, GGML_VK_VISIBLE_DEVICES="0", SPECDECK_CACHE_DIR=str(tmp_path / "cache"),
               SPECDECK_DATA_DIR=str(tmp_path / "data"), SPECDECK_PROBE_MODEL=str(model), PYTHONPATH=str(ROOT))
    out = tmp_path / "gpu-check.md"
    done = subprocess.run([sys.executable, str(ROOT / "packaging" / "gpu_check.py"), "--model", str(model),
                           "--draft-model", str(model), "--per-category", "1", "--categories", "mt_bench,translation",
                           "--max-new-tokens", "8", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    table = out.read_text()
    for needed in ("Backend: Vulkan on llvmpipe", "Offload: GPU (Vulkan", "| fit estimate (GPU terms) |",
                   "Greedy output, GPU against CPU, 2 Spec-Bench prompts", "Verify cost at", "| ar |", "| pld |",
                   "| draft |", "ar on the GPU / ar on the CPU: "):
        assert needed in table, (needed, table)
    # Without a GPU backend the check says why and does nothing else.
    none = subprocess.run([sys.executable, str(ROOT / "packaging" / "gpu_check.py"), "--out", str(tmp_path / "x.md")],
                          capture_output=True, text=True, env=dict(env, SPECDECK_GPU="off"), timeout=300)
    assert none.returncode == 2 and "no GPU backend runs here" in none.stderr and not (tmp_path / "x.md").exists()
