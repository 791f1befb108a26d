"""The portable llama.cpp build: CPU variants chosen by running them, and crashes that do not kill us.

The variant that kills its probe here is real machine code: a module compiled by the test whose
``ggml_backend_init`` executes an undefined instruction (``__builtin_trap``, ``ud2`` on x86), so the
probe child dies by SIGILL exactly as a CPU refusing AMX or AVX-512 makes it die.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from backends.core.errors import BackendError
from backends.models import llama_runtime
from backends.models.llama_lib import SMALL_BATCH_MARK, cpu_runtime, small_batch_kernel
from desktop import crashlog

TRAP_IN_INIT = """
int ggml_backend_score(void) { return 1 << 30; }          /* beats every real variant */
void *ggml_backend_init(void) { __builtin_trap(); return 0; }
"""
TRAP_IN_SCORE = """
int ggml_backend_score(void) { __builtin_trap(); return 0; }
void *ggml_backend_init(void) { return 0; }
"""


def _compile(source: str, out: Path) -> Path:
    c = out.with_suffix(".c")
    c.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-O0", "-o", str(out), str(c)], check=True)
    return out


@pytest.fixture
def module_dir(tmp_path):
    """The real variants (symlinked) plus two that die: one when initialized, one when scored."""
    d = tmp_path / "modules"
    d.mkdir()
    for name, path in llama_runtime.find_variants().items():
        (d / path.name).symlink_to(path)
    _compile(TRAP_IN_INIT, d / "libggml-cpu-zzdies.so")
    _compile(TRAP_IN_SCORE, d / "libggml-cpu-zzscoredies.so")
    return d


def test_this_install_is_the_portable_build():
    variants = llama_runtime.find_variants()
    assert {"x64", "haswell"} <= set(variants), f"expected ggml's CPU variants, found {sorted(variants)}"
    for path in variants.values():
        assert path.parent == llama_runtime.lib_dir(), "variant modules must sit beside libggml"


def test_this_process_runs_a_probed_variant():
    runtime = cpu_runtime()
    assert runtime is not None and runtime.portable
    assert runtime.variant in llama_runtime.find_variants()
    assert runtime.scores[runtime.variant] > 0
    assert any(a.ok and a.variant == runtime.variant for a in runtime.attempts)
    assert runtime.variant in runtime.why or "best" in runtime.why


def test_numpys_blas_runs_on_one_thread_beside_llama_cpp():
    """The heads' numpy matrices run between llama.cpp's forwards: BLAS threads of their own would
    fight llama.cpp's for the cores (a Medusa run 7.4 ms at two threads on 2 cores, 2.6 at one)."""
    from threadpoolctl import threadpool_info

    cpu_runtime()  # llama.cpp initialized in this process
    blas = [lib for lib in threadpool_info() if lib["user_api"] == "blas"]
    assert blas and all(lib["num_threads"] == 1 for lib in blas), blas


def test_a_variant_that_dies_by_sigill_is_reported_and_skipped(module_dir, tmp_path):
    cache = tmp_path / "probe.json"
    runtime = llama_runtime.choose(dirs=[module_dir], cache_file=cache, use_cache=False, forced="")
    # The process running this test is alive; the two trapping modules each killed a child. A
    # real variant may die too, by the CPU's own refusal (the sapphirerapids one on a VM that
    # lists AMX without enabling it): then it is one of this build's, killed by a signal as well.
    died = {a.variant: a for a in runtime.attempts if not a.ok}
    assert {"zzdies", "zzscoredies"} <= set(died)
    for variant in set(died) - {"zzdies", "zzscoredies"}:
        assert variant in llama_runtime.find_variants() and "killed by" in died[variant].reason, died[variant].reason
    assert "SIGILL" in died["zzdies"].reason and "loading the CPU module" in died["zzdies"].reason
    assert "SIGILL" in died["zzscoredies"].reason and "being loaded" in died["zzscoredies"].reason
    assert runtime.variant not in died and runtime.variant in llama_runtime.find_variants()
    assert runtime.scores["zzdies"] > max(s for v, s in runtime.scores.items() if v != "zzdies")
    assert "zzdies killed by SIGILL" in runtime.why
    assert "zzdies" in runtime.fallback_note and f"runs the {runtime.variant} variant instead" in runtime.fallback_note
    # The verdict is cached per build and CPU: asked again (as a new process would), nothing is probed.
    llama_runtime._probed_here.clear()
    again = llama_runtime.choose(dirs=[module_dir], cache_file=cache, forced="")
    assert again.cached and again.variant == runtime.variant
    assert json.loads(cache.read_text())


def test_only_dying_variants_give_a_clear_error(tmp_path):
    d = tmp_path / "modules"
    d.mkdir()
    _compile(TRAP_IN_INIT, d / "libggml-cpu-zzdies.so")
    with pytest.raises(BackendError, match="no llama.cpp CPU variant runs on this machine: zzdies killed by SIGILL"):
        llama_runtime.choose(dirs=[d], cache_file=tmp_path / "probe.json", use_cache=False, forced="")


def test_a_forced_variant_is_probed_and_used(tmp_path):
    runtime = llama_runtime.choose(cache_file=tmp_path / "probe.json", use_cache=False, forced="x64")
    assert runtime.variant == "x64" and runtime.forced and "SPECDECK_CPU_VARIANT" in runtime.why
    with pytest.raises(BackendError, match="not one of this build's CPU variants"):
        llama_runtime.choose(cache_file=tmp_path / "probe.json", use_cache=False, forced="nosuchcpu")


def test_specdeck_hw_names_the_cpu_variant():
    out = subprocess.run([sys.executable, "-m", "backends.cli", "hw"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    variant = cpu_runtime().variant
    assert f"CPU variant: {variant} (" in out.stdout
    data = json.loads(subprocess.run([sys.executable, "-m", "backends.cli", "hw", "--json"], capture_output=True,
                                     text=True, timeout=300).stdout)
    assert data["llama_cpp"]["cpu_variant"] == variant and data["llama_cpp"]["cpu_variant_why"]
    assert "GPU backend: " in out.stdout and data["llama_cpp"]["gpu_backend_why"]  # which one runs, or why none
    assert "Verify kernel: " in out.stdout and data["llama_cpp"]["small_batch"] == small_batch_kernel()


CRASH_IN_LLAMA = textwrap.dedent("""
    import ctypes, sys
    from pathlib import Path
    from desktop import crashlog
    crashlog.arm(Path(sys.argv[1]))
    from backends.models.catalog import resolve_model
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget
    from backends.core.types import Proposal
    target = LlamaTarget(LlamaModel(resolve_model("smollm2-135m-q4_1")), n_ctx=64)
    target.prefill([1, 2, 3])
    target.ctx = ctypes.c_void_p(16)  # a context pointer llama.cpp will dereference and die on
    target.verify(4, Proposal.chain([5, 6]))
""")


def test_a_crash_inside_llama_cpp_is_described_on_the_next_start(tmp_path):
    log = tmp_path / "crash.log"
    child = subprocess.run([sys.executable, "-c", CRASH_IN_LLAMA, str(log)], capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGSEGV, child.stderr[-2000:]
    sentence = crashlog.arm(log)  # what the next start shows in its banner
    crashlog.disarm()
    assert sentence is not None
    assert "a crash inside llama.cpp (Segmentation fault) while verifying a draft" in sentence
    assert (tmp_path / "crash-previous.log").read_text().startswith(crashlog._RUNNING)
    assert log.read_text() == ""  # a normal exit leaves nothing to report
    assert crashlog.arm(log) is None
    crashlog.disarm()


def test_a_run_that_was_killed_is_reported(tmp_path):
    log = tmp_path / "crash.log"
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; from desktop import crashlog; "
                              "crashlog.arm(Path(sys.argv[1])); print('armed', flush=True); time.sleep(60)", str(log)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "armed"
    child.kill()
    child.wait()
    sentence = crashlog.arm(log)
    crashlog.disarm()
    assert sentence and "did not close normally" in sentence


def test_the_window_reports_a_dying_variant_and_answers_on_the_next_one(module_dir, tmp_path):
    """The real app, in its own process, on a fresh machine whose best variant dies by SIGILL."""
    from tests.test_kill import Run

    env = dict(os.environ, SPECDECK_BACKEND_DIRS=str(module_dir), SPECDECK_CACHE_DIR=str(tmp_path / "cache"),
               SPECDECK_DATA_DIR=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               QT_QPA_PLATFORM="offscreen")
    env.pop("SPECDECK_CPU_VARIANT", None)
    run = Run(env, "probe")
    try:
        started = run.wait_for("started", 300)
        assert "zzdies" in started["status"] and "instead" in started["status"], started
        done = run.wait_for("done", 300)
        assert done["role"] == "assistant" and done["content"].strip()
    finally:
        run.kill()
    cached = json.loads((tmp_path / "cache" / "llama-cpu-probe.json").read_text())
    assert [v["variant"] for v in cached.values()] == [cpu_runtime().variant]


# -- SpecDeck's small-batch kernel (packaging/llama_patches/specdeck-smallbatch.h) -------------------
SMALL_BATCH_LOGITS = textwrap.dedent("""
    import sys
    import numpy as np
    from backends.models.catalog import resolve_model
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget
    from backends.core.types import Proposal
    model = LlamaModel(resolve_model(sys.argv[2]))
    target = LlamaTarget(model, n_ctx=256)
    text = "Speculative decoding checks several guessed tokens in one forward pass of the model. " * 3
    tokens = model.tokenize(text)[:48]
    out = {}
    for k in (1, 4, 11, 15):  # 2, 5, 12 and 16 rows: the kernel's, and tinyBLAS's above its range
        target.reset()
        target.prefill(tokens[:24])
        verdict = target.verify(tokens[24], Proposal.chain(tokens[25:25 + k]))
        out[f"batch{k + 1}"] = np.stack([verdict.row(i) for i in range(k + 1)])
    target.reset()
    target.prefill(tokens[:24])
    out["one"] = np.concatenate([target.extend([t]).logits for t in tokens[24:40]])
    np.savez(sys.argv[1], **out)
    from backends.models.llama_lib import build_id, small_batch_kernel
    print(small_batch_kernel(), build_id())
""")


def _small_batch_logits(tmp_path: Path, model: str, on: bool) -> dict:
    import numpy as np

    out = tmp_path / f"logits-{int(on)}.npz"
    env = {**os.environ, "GGML_SPECDECK_SMALLBATCH": "1" if on else "0"}
    done = subprocess.run([sys.executable, "-c", SMALL_BATCH_LOGITS, str(out), model], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    state, build = done.stdout.split()[-2:]
    return {**np.load(out), "state": state, "build": build}


def test_the_build_compiles_specdeck_small_batch_kernel_into_the_variants_that_can_run_it():
    """AVX2, F16C and FMA: every variant from haswell up has the kernel, the older ones are left
    with ggml's own path; the variant this process runs has it wherever the CPU has AVX2."""
    from backends.hardware.cpu import detect_cpu

    variants = llama_runtime.find_variants()
    assert SMALL_BATCH_MARK in variants["haswell"].read_bytes()
    assert SMALL_BATCH_MARK not in variants["sse42"].read_bytes()
    if "avx2" in detect_cpu().flags:
        assert SMALL_BATCH_MARK in variants[cpu_runtime().variant].read_bytes()
        assert small_batch_kernel() == ("off" if os.environ.get("GGML_SPECDECK_SMALLBATCH", "").startswith("0") else "on")


@pytest.mark.parametrize("weights", ["F16", "BF16"])
def test_the_small_batch_kernel_gives_ggmls_own_products(tmp_path, weights):
    """A verify of 2, 5, 12 and 16 rows of SmolLM2 in F16 and BF16 with the kernel and with ggml's path
    (GGML_SPECDECK_SMALLBATCH=0), each against the same tokens fed one at a time (ggml_vec_dot_f16,
    code the patch does not touch). Sums in another order move the logits a little through 30
    layers (measured on Zen 4, F16: at most 0.03 from ggml's batched path and from one at a time,
    where ggml's own batched path is 0.016-0.023 from one at a time; BF16, whose rounding of the
    activations is coarser: 0.10-0.20, against 0.14-0.17): the kernel must stay within twice
    ggml's own distance, and pick the same best token wherever it leads by more than such noise."""
    import numpy as np

    from backends.models.catalog import entry_path, quantize

    model = "smollm2-135m-f16"
    if weights == "BF16":  # bfloat16 weights, widened by a shift instead of F16C
        model = str(tmp_path / "smollm2-bf16.gguf")
        quantize(entry_path("smollm2-135m-q4_1"), Path(model), "BF16")
    on, off = _small_batch_logits(tmp_path, model, True), _small_batch_logits(tmp_path, model, False)
    assert (on["state"], off["state"]) == ("on", "off")
    assert on["build"] != off["build"] == on["build"].replace("+sb", "", 1)  # their cost curves are kept apart
    for rows in (2, 5, 12, 16):
        key = f"batch{rows}"
        one = on["one"][:rows]
        noise = np.abs(off[key] - one).max() + 0.01  # ggml's own batched path against one at a time
        assert np.abs(on[key] - off[key]).max() < 2 * noise, (rows, np.abs(on[key] - off[key]).max(), noise)
        assert np.abs(on[key] - one).max() < 2 * noise, (rows, np.abs(on[key] - one).max(), noise)
        top2 = np.sort(one, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.25  # rows whose best token is no near-tie
        assert clear.sum() >= rows // 2
        assert (on[key].argmax(1) == one.argmax(1))[clear].all(), rows


def _llama_patch():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "packaging" / "llama_patch.py"
    spec = importlib.util.spec_from_file_location("specdeck_llama_patch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_llama_patch_inserts_the_kernel_once_and_refuses_a_llama_cpp_that_moved(tmp_path):
    patch = _llama_patch()
    source = "// ggml-cpu.c\n" + "\n// ...\n".join(anchor for anchor, _ in patch.INSERTIONS)
    cpu = tmp_path / patch.CPU_DIR
    cpu.mkdir(parents=True)
    (cpu / "ggml-cpu.c").write_text(source)
    assert patch.main([str(tmp_path)]) == 0
    patched = (cpu / "ggml-cpu.c").read_text()
    assert (cpu / "specdeck-smallbatch.h").read_bytes() == patch.HEADER.read_bytes()
    for anchor, after in patch.INSERTIONS:
        assert patched.count(anchor + after) == 1
    assert patched.index("specdeck_sb_mul_mat(params, dst)") > patched.index("ggml_compute_forward_mul_mat_tiled")
    assert patch.main([str(tmp_path)]) == 0 and (cpu / "ggml-cpu.c").read_text() == patched  # again: unchanged
    moved = source.replace('#include "tiled/tiled.h"', '#include "tiled.h"')
    with pytest.raises(SystemExit, match='found 0 places for \'#include "tiled/tiled.h"\''):
        patch.patch_source(moved)
    first, after = patch.INSERTIONS[0]
    with pytest.raises(SystemExit, match="partly patched"):
        patch.patch_source(source.replace(first, first + after))
    with pytest.raises(SystemExit, match="not an unpacked llama-cpp-python sdist|not found"):
        patch.main([str(tmp_path / "nothing")])
