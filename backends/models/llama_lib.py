"""Loading llama-cpp-python once, with llama.cpp's log routed into Python logging.

llama.cpp prints hundreds of lines per model load to stderr, which would bury a terminal chat.
Its log goes to the ``specdeck.llama`` logger instead: warnings and errors stay visible, the rest
appears with ``--verbose``. The last error lines are kept so a failed load can say why.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from types import ModuleType

log = logging.getLogger("specdeck.llama")

# ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line).
_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_state: dict[str, object] = {}
recent_errors: deque[str] = deque(maxlen=20)


def llama() -> ModuleType:
    """The ``llama_cpp`` module, initialized, with the log callback installed."""
    module = _state.get("module")
    if module is None:
        import llama_cpp

        callback = llama_cpp.llama_log_callback(_on_log)
        llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _state["callback"] = callback  # keep a reference: llama.cpp calls it from C
        _state["module"] = module = llama_cpp
    return module  # type: ignore[return-value]


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


def system_info() -> str:
    """llama.cpp's own summary of the CPU features and backends it was built with."""
    return llama().llama_print_system_info().decode("utf-8", errors="replace")
