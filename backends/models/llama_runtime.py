"""Which llama.cpp CPU code this process runs, chosen by running it first in a child process.

Why. A llama.cpp compiled for one CPU dies with SIGILL on another, and even on the machine that
built it when the CPU lists an instruction set that the OS or hypervisor does not enable: an
Intel Xeon VM lists AMX (``amx_tile``) but refuses tile state, and ggml's AMX kernels die at the
first Q4 matmul. A crash by signal takes the whole process, the desktop window included, so
the only safe way to know a build works here is to run it somewhere that may die.

SpecDeck's build (packaging/llama_build.sh) compiles every x86-64 CPU variant ggml knows as a
loadable module (``libggml-cpu-haswell.so``, ``-zen4``, ``-sapphirerapids`` ...). Once per build
and CPU, a child process (``backends.models.llama_probe``) scores the variants (ggml's own
``ggml_backend_score``: 0 when the CPU lacks a feature, higher for wider ones), then the best
one loads the bundled model in Q4_1, Q4_K, Q8_0 and F16 and decodes one token and a batch with
each. A child that dies by a signal condemns that variant; the next best is tried. The verdict
is cached (``cache_dir()/llama-cpu-probe.json``), and this process loads only the chosen module
(``ggml_backend_load``) before ``llama_backend_init``, which then loads nothing else.

A build without variant modules (a stock llama-cpp-python, compiled with -march=native) is
probed the same way; when it dies there is nothing to fall back to, and loading raises
``BackendError`` saying so instead of killing the process.

``SPECDECK_CPU_VARIANT=haswell`` forces a variant (it is still probed first);
``SPECDECK_BACKEND_DIRS`` names more folders of modules (os.pathsep-separated).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backends.core.errors import BackendError
from backends.models.paths import cache_dir, write_atomic

PROBE_TIMEOUT_S = 180.0
_probed_here: dict[str, CpuRuntime] = {}  # verdicts this process probed itself (not read back)
_PREFIX = "ggml-cpu-" if sys.platform == "win32" else "libggml-cpu-"
_SUFFIX = ".dll" if sys.platform == "win32" else ".so"


@dataclass(frozen=True)
class Attempt:
    """One variant's probe: passed, or how it died and where."""

    variant: str
    ok: bool
    reason: str = ""  # "killed by SIGILL (illegal instruction) while decoding a batch of F16"
    seconds: float = 0.0
    died: bool = False  # killed by a signal (or hung): this CPU code cannot run here


@dataclass(frozen=True)
class CpuRuntime:
    """The verdict: which module runs (None: the build has no variants) and why."""

    variant: str | None
    module: str | None  # the module file loaded, None for a build without variants
    portable: bool  # the build carries CPU variants to choose from
    scores: dict[str, int] = field(default_factory=dict)  # what ggml scored each variant here
    attempts: tuple[Attempt, ...] = ()
    forced: bool = False
    cached: bool = False  # read from the cache file rather than probed in this process

    @property
    def verified(self) -> bool:
        """The module in use passed the probe (else it could not be probed, e.g. no model)."""
        return any(a.ok and a.variant == (self.variant or "built-in") for a in self.attempts)

    @property
    def fallback_note(self) -> str | None:
        """What a user should be told once: better CPU code died here, and what runs instead."""
        dead = [a for a in self.attempts if a.died]
        if not dead or self.variant is None:
            return None
        names = ", ".join(a.variant for a in dead)
        return (f"llama.cpp's {names} CPU code died on this PC ({dead[0].reason}); "
                f"SpecDeck runs the {self.variant} variant instead")

    @property
    def why(self) -> str:
        """One sentence for `specdeck hw` and the hardware panel."""
        failed = [a for a in self.attempts if not a.ok]
        dead = "; ".join(f"{a.variant} {a.reason}" for a in failed)
        if not self.portable:
            state = "it passed the probe" if self.verified else f"it could not be probed ({dead})"
            return f"this llama.cpp build has one CPU code path (no variants to choose from); {state}"
        supported = sum(1 for s in self.scores.values() if s > 0)
        how = "forced by SPECDECK_CPU_VARIANT" if self.forced else (
            f"the best of {supported} variants this CPU supports" if not failed else "the best variant that survived the probe")
        passed = "passed the probe: Q4_1, Q4_K, Q8_0 and F16 weights, one token and a batch" if self.verified else "not probed"
        return "; ".join(filter(None, [how, passed, dead]))


# -- where the libraries are -------------------------------------------------------------------
def lib_dir() -> Path:
    """llama-cpp-python's shared libraries (``llama_cpp/lib``), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llama-cpp-python is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def module_dirs() -> list[Path]:
    """Where the CPU variant modules may lie: folders named in ``SPECDECK_BACKEND_DIRS``
    (modules installed apart from the wheel), beside libggml, or where an unpatched install
    puts them (``<site-packages>/bin``, CMake's default binary directory)."""
    libs = lib_dir()
    extra = [Path(p) for p in os.environ.get("SPECDECK_BACKEND_DIRS", "").split(os.pathsep) if p]
    return [*extra, libs, libs.parent.parent / "bin"]


def find_variants(dirs: list[Path] | None = None) -> dict[str, Path]:
    """``{"haswell": Path(".../libggml-cpu-haswell.so"), ...}``; the first directory wins."""
    found: dict[str, Path] = {}
    for d in dirs if dirs is not None else module_dirs():
        if d.is_dir():
            for p in sorted(d.glob(f"{_PREFIX}*{_SUFFIX}")):
                found.setdefault(p.name[len(_PREFIX): -len(_SUFFIX)], p)
    return found


def _fingerprint(dirs: list[Path], variants: dict[str, Path]) -> str:
    """The build (every library file's name, size and time) and the CPU and kernel it runs on:
    a new build, CPU, microcode-less VM migration or kernel asks the question again."""
    h = hashlib.sha256()
    try:
        libs = sorted(lib_dir().glob("*" + _SUFFIX))
    except ImportError:
        libs = []
    for p in [*libs, *variants.values()]:
        st = p.stat()
        h.update(f"{p}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(repr(sorted(str(d) for d in dirs)).encode())
    h.update(_cpu_identity().encode())
    return h.hexdigest()[:24]


def _cpu_identity() -> str:
    text = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    text += line
                if line.strip() == "":
                    break  # the first processor block is enough
    except OSError:
        pass
    return f"{platform.machine()}|{platform.system()}|{platform.release()}|{text}"


# -- the verdict -------------------------------------------------------------------------------
def choose(*, dirs: list[Path] | None = None, cache_file: Path | None = None,
           forced: str | None = None, use_cache: bool = True) -> CpuRuntime:
    """Probe (or read the cached verdict) and return the CPU code this process should run.

    Raises ``BackendError`` when nothing survives the probe."""
    dirs = module_dirs() if dirs is None else dirs
    forced = forced if forced is not None else (os.environ.get("SPECDECK_CPU_VARIANT") or None)
    variants = find_variants(dirs)
    cache_file = cache_file or cache_dir() / "llama-cpu-probe.json"
    key = _fingerprint(dirs, variants) + (f":{forced}" if forced else "")
    if forced and forced not in variants:
        raise BackendError(f"SPECDECK_CPU_VARIANT={forced} is not one of this build's CPU variants: "
                           f"{', '.join(sorted(variants)) or 'it has none'}")
    if use_cache and key in _probed_here:
        return _probed_here[key]  # probed by this process (the window's start-up dialog)
    if use_cache:
        hit = _read_cache(cache_file, key)
        if hit is not None:
            return hit
    try:
        runtime = _probe_all(variants, dirs, forced)
    except BackendError as exc:  # as deterministic as a success: remembered the same way
        write_verdict(cache_file, key, {"error": str(exc)})
        raise
    if runtime.verified:
        write_verdict(cache_file, key, runtime)
    _probed_here[key] = runtime
    return runtime


def _probe_all(variants: dict[str, Path], dirs: list[Path], forced: str | None) -> CpuRuntime:
    if not variants:
        attempt = probe(None)
        if attempt.died:
            raise BackendError(
                f"the installed llama.cpp crashes on this CPU ({attempt.reason}). It was compiled for another "
                "processor; reinstall SpecDeck's portable build (bash packaging/dev.sh builds it)")
        return CpuRuntime(variant=None, module=None, portable=False, attempts=(attempt,))
    scores, attempts = score_variants(dirs)
    if forced:
        order = [forced]
    else:
        order = [v for v, s in sorted(scores.items(), key=lambda kv: -kv[1]) if s > 0]
    for name in order:
        attempt = probe(variants[name])
        attempts.append(attempt)
        if attempt.ok or not attempt.died:
            # Passed, or failed for a reason that is not this CPU code (a missing model file, a
            # full disk): another variant would fail the same way, so run this one unverified.
            return CpuRuntime(variant=name, module=str(variants[name]), portable=True, scores=scores,
                              attempts=tuple(attempts), forced=bool(forced))
    tried = "; ".join(f"{a.variant} {a.reason}" for a in attempts if not a.ok) or "no variant supports this CPU"
    raise BackendError(f"no llama.cpp CPU variant runs on this machine: {tried}")


def score_variants(dirs: list[Path]) -> tuple[dict[str, int], list[Attempt]]:
    """What ggml scores each variant on this CPU, asked in a child (loading a module runs its
    initializers, compiled for its instruction set). A variant whose load kills the child is
    recorded as an attempt that died and scored 0; the child is restarted without it."""
    variants = find_variants(dirs)
    scores: dict[str, int] = {}
    dead: list[Attempt] = []
    while len(scores) < len(variants):
        todo = [v for v in variants if v not in scores]
        out, rc, _ = run_child(["score", *(str(variants[v]) for v in todo)])
        for line in out:
            if "score" in line:
                scores[line["variant"]] = int(line["score"])
        if rc != 0:
            culprit = next(v for v in todo if v not in scores)
            scores[culprit] = 0
            dead.append(Attempt(culprit, False, f"{death(rc)} while being loaded", died=True))
    return scores, dead


def probe(module: Path | None) -> Attempt:
    """Run the bundled model through ``module`` in a child; how it went."""
    name = _variant_name(module)
    start = time.perf_counter()
    out, rc, err = run_child(["probe", str(module) if module else "-"])
    seconds = time.perf_counter() - start
    if rc == 0 and any(line.get("ok") for line in out):
        return Attempt(name, True, seconds=seconds)
    stage = next((line["stage"] for line in reversed(out) if "stage" in line), "starting")
    if rc > 0:
        error = next((line["error"] for line in reversed(out) if "error" in line), None)
        error = error or (err.strip().splitlines() or [death(rc)])[-1]
        return Attempt(name, False, f"failed while {stage}: {error}", seconds)
    return Attempt(name, False, f"{death(rc)} while {stage}", seconds, died=True)


def _variant_name(module: Path | None) -> str:
    if module is None:
        return "built-in"
    return module.name[len(_PREFIX): -len(_SUFFIX)] if module.name.startswith(_PREFIX) else module.name


def death(rc: int) -> str:
    """'killed by SIGILL (illegal instruction)' for a child's return code."""
    if rc == -999:
        return f"hung for more than {PROBE_TIMEOUT_S:.0f} s"
    if rc < 0:
        try:
            sig = signal.Signals(-rc)
            return f"killed by {sig.name} ({signal.strsignal(sig) or sig.name})".replace("Illegal instruction", "illegal instruction")
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with code {rc}"


def run_child(args: list[str]) -> tuple[list[dict], int, str]:
    """Run ``python -m backends.models.llama_probe ARGS``; its JSON lines, return code, stderr."""
    cmd = [sys.executable, "-m", "backends.models.llama_probe", *args]
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
        stdout, rc, stderr = done.stdout, done.returncode, done.stderr
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, stderr = -999, ""
    lines = []
    for raw in stdout.splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    return lines, rc, stderr


def read_verdict(path: Path, key: str) -> dict | None:
    """The record stored under ``key`` by ``write_verdict``; None when there is none or the file
    cannot be read."""
    try:
        data = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return data if isinstance(data, dict) and data else None


def _read_cache(path: Path, key: str) -> CpuRuntime | None:
    """The cached verdict for ``key``; raises the cached ``BackendError`` when nothing ran."""
    data = read_verdict(path, key)
    if data is None:
        return None
    try:
        if "error" in data:
            raise BackendError(str(data["error"]))
        data["attempts"] = tuple(Attempt(**a) for a in data["attempts"])
        data["cached"] = True
        runtime = CpuRuntime(**data)
    except (TypeError, KeyError, AttributeError):
        return None
    if runtime.module is not None and not Path(runtime.module).is_file():
        return None
    return runtime


def write_verdict(path: Path, key: str, verdict: object) -> None:
    """Store one verdict (a dataclass, or a dict such as ``{"error": ...}``) under ``key``, keeping
    the others: the file is shared by every build and machine state seen."""
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    record = verdict if isinstance(verdict, dict) else asdict(verdict)
    record.pop("cached", None)
    data[key] = record
    try:
        write_atomic(path, json.dumps(data, indent=1))
    except OSError:
        pass  # an unwritable cache only means probing again next time


# -- loading in this process -------------------------------------------------------------------
def load_module(module: str | Path | None, role: str = "CPU") -> None:
    """Register backend ``module`` (its ``role``: "CPU", "GPU") before ``llama_backend_init``.

    ``llama_backend_init`` loads every module it finds only while no backend is registered, so
    after the CPU module's call it loads nothing else (in particular not a variant the probe
    condemned, nor a GPU module that failed its own probe)."""
    if module is None:
        return
    ggml = ggml_library()
    ggml.ggml_backend_load.restype = ctypes.c_void_p
    ggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
    if not ggml.ggml_backend_load(str(module).encode()):
        raise BackendError(f"llama.cpp could not load its {role} module {module}")


def ggml_library() -> ctypes.CDLL:
    """libggml, the very instance libllama uses.

    The wheel holds ``libggml.so`` and ``libggml.so.0`` as two copies of one file (zip keeps no
    symlinks), so opening the first by path would load a second ggml whose backend registry
    llama.cpp never sees. Symbols looked up through libllama's own handle come from its
    dependencies, i.e. from the right ggml."""
    import llama_cpp.llama_cpp as bindings

    lib = getattr(bindings, "_lib", None)
    if lib is not None and hasattr(lib, "ggml_backend_load"):
        return lib
    name = "ggml.dll" if sys.platform == "win32" else ("libggml.dylib" if sys.platform == "darwin" else "libggml.so.0")
    return ctypes.CDLL(name)  # by name: the loader hands back the copy already loaded
