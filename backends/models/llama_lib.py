"""Loading llama-cpp-python once, on CPU code that was seen to run here, with its log routed
into Python logging.

Before llama.cpp's backends initialize, ``llama_runtime.choose`` picks the CPU variant module
that survived a probe in a child process (once per build and CPU; see that module for why), and
only that module is loaded, with the GPU module ``gpu_runtime.choose`` saw run (if any). A build whose CPU code kills the probe raises ``BackendError``
here, so a caller (the window, the CLI) reports it instead of dying with SIGILL.

llama.cpp prints hundreds of lines per model load to stderr, which would bury a terminal chat.
Its log goes to the ``specdeck.llama`` logger instead: warnings and errors stay visible, the rest
appears with ``--verbose``. The last error lines are kept so a failed load can say why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from collections import deque
from types import ModuleType

from backends.models import llama_runtime
from backends.models.gpu_runtime import GpuRuntime, prepare
from backends.models.gpu_runtime import choose as choose_gpu

log = logging.getLogger("specdeck.llama")

# ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line).
_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_state: dict[str, object] = {}
recent_errors: deque[str] = deque(maxlen=20)
_UNSET = object()
_init_lock = threading.Lock()  # the hardware panel and the worker may ask at the same time


def pin_cpu_module(module: str | None, *, gpu_module: str | None = None) -> None:
    """Run ``module`` (None: whatever the build has) and ``gpu_module`` beside it, without
    probing: for the probe child."""
    if "module" in _state:
        raise RuntimeError("llama.cpp is already initialized in this process")
    _state["pinned"] = module
    _state["pinned_gpu"] = gpu_module


def cpu_runtime() -> llama_runtime.CpuRuntime | None:
    """The probe's verdict this process runs on (None in the probe child itself)."""
    llama()
    return _state.get("runtime")  # type: ignore[return-value]


def gpu_runtime() -> GpuRuntime | None:
    """The GPU backend this process runs beside the CPU code, or why none (None in a probe child)."""
    llama()
    return _state.get("gpu")  # type: ignore[return-value]


def llama() -> ModuleType:
    """The ``llama_cpp`` module, initialized on a probed CPU module, with the log callback."""
    module = _state.get("module")
    if module is None:
        with _init_lock:
            return _initialize()
    return module  # type: ignore[return-value]


def _initialize() -> ModuleType:
    module = _state.get("module")
    if module is None:
        import llama_cpp

        callback = llama_cpp.llama_log_callback(_on_log)
        llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
        pinned = _state.get("pinned", _UNSET)
        gpu_module = _state.get("pinned_gpu")
        if pinned is _UNSET:
            runtime = llama_runtime.choose()  # raises BackendError when nothing runs here
            _state["runtime"] = runtime
            pinned = runtime.module
            gpu = _state["gpu"] = choose_gpu(runtime.module)  # never raises: CPU only says why
            gpu_module = gpu.module
            problem = prepare(gpu.backend) if gpu.backend is not None else None
            if problem is not None:  # the driver went away since the verdict was cached
                _state["gpu"] = GpuRuntime(None, None, skipped=((gpu.backend, problem),))
                gpu_module = None
        elif gpu_module is not None:
            prepare("cuda" if "cuda" in str(gpu_module) else "vulkan")
        llama_runtime.load_module(pinned, "CPU")  # type: ignore[arg-type]
        llama_runtime.load_module(gpu_module, "GPU")  # type: ignore[arg-type]
        llama_cpp.llama_backend_init()
        _single_blas_thread()
        _state["callback"] = callback  # keep a reference: llama.cpp calls it from C
        _state["module"] = module = llama_cpp
    return module  # type: ignore[return-value]


def _single_blas_thread() -> None:
    """numpy's BLAS (the trained heads' matrices) gets one thread for the whole process: it runs
    between llama.cpp's forwards, whose threads still spin on the cores. On 2 cores a run of the
    Medusa heads took 7.4 ms at numpy's 2 threads there, 2.6 ms at one (1.4 ms alone, 0.8 at two)."""
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1, user_api="blas")  # kept after the call (not used as a context manager)
    except Exception as exc:  # a speed setting: never a reason to refuse llama.cpp
        log.warning("numpy's BLAS threads were left as they are: %s", exc)


_FUNC_PREFIX = re.compile(r"^(?:[a-z_0-9]+: )+")
_GENERIC = ("failed to load model", "error loading model")


def failure_reason(default: str = "llama.cpp gave no reason") -> str:
    """llama.cpp's last error lines in words: without its function-name prefixes
    ("llama_model_load: error loading model: ...") and without the generic closing line."""
    reasons: list[str] = []
    for line in recent_errors:
        text = _FUNC_PREFIX.sub("", line).strip()
        for generic in _GENERIC:
            if text.startswith(generic + ": "):
                text = text[len(generic) + 2:]
        if text and text not in _GENERIC and text not in reasons:
            reasons.append(text)
    return "; ".join(reasons) or default


def _on_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", errors="replace").rstrip()
    if not message:
        return
    if level == 5:  # continuation of the previous line
        level = int(_state.get("last_level", 1))  # type: ignore[arg-type]
    _state["last_level"] = level
    py_level = _LEVELS.get(level, logging.DEBUG)
    if py_level >= logging.ERROR:
        recent_errors.append(message)
    log.log(py_level, "%s", message)


def library_version() -> str:
    return getattr(llama(), "__version__", "unknown")


def build_id() -> str:
    """The llama.cpp build and the code it runs here ("0.3.36/zen4+sb", "0.3.36/zen4+sb+cuda"):
    measurements of speed and rounding are valid for this combination only. "+sb": SpecDeck's
    small-batch kernel runs (a verify of a few rows costs about one row with it, 2x without)."""
    runtime, gpu = cpu_runtime(), gpu_runtime()
    cpu = runtime.variant if runtime and runtime.variant else "built-in"
    kernel = "+sb" if small_batch_kernel() == "on" else ""
    return f"{library_version()}/{cpu}{kernel}" + (f"+{gpu.backend}" if gpu and gpu.backend else "")


# Text compiled into a CPU module only with SpecDeck's small-batch kernel in it
# (packaging/llama_patches/specdeck-smallbatch.h; variants without AVX2 leave it out).
SMALL_BATCH_MARK = b"specdeck small batch: bad group"
_marked: dict[str, bool] = {}


def small_batch_kernel() -> str | None:
    """SpecDeck's small-batch F16/BF16 product in the CPU code this process runs: "on", "off"
    (``GGML_SPECDECK_SMALLBATCH=0``, which the kernel reads once per process), or None where the
    build or its CPU variant lacks it (a stock llama-cpp-python, a CPU without AVX2)."""
    runtime = cpu_runtime()
    try:
        module = runtime.module if runtime is not None and runtime.module else str(llama_runtime.lib_dir() / "libggml-cpu.so")
    except ImportError:  # no llama_cpp package to find the libraries by (a frozen app names its module)
        return None
    if module not in _marked:
        try:
            with open(module, "rb") as f:
                _marked[module] = SMALL_BATCH_MARK in f.read()
        except OSError:
            _marked[module] = False
    if not _marked[module]:
        return None
    return "off" if os.environ.get("GGML_SPECDECK_SMALLBATCH", "").startswith("0") else "on"


def system_info() -> str:
    """llama.cpp's own summary of the CPU features and backends it was built with."""
    return llama().llama_print_system_info().decode("utf-8", errors="replace")
