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
from backends.models.llama_lib import cpu_runtime
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
