"""A crash inside llama.cpp (or Qt) must not make the window vanish without a word.

A signal (SIGSEGV, SIGILL, SIGABRT) kills the process before any Python code can show a dialog,
so the next best thing is Python's ``faulthandler``: it writes the fatal error and every
thread's stack to a file from inside the signal handler. On the next start the window reads
that file and says in its banner what happened and where ("a crash inside llama.cpp
(Illegal instruction) while verifying a draft"). Conversations are written to SQLite before each
answer starts, so they survive. The log opens with a "running" line and a normal exit empties
it, so a run that ended without either (killed, out of memory, power loss) is reported too.

Example of what faulthandler writes::

    Fatal Python error: Segmentation fault

    Thread 0x00007f... (most recent call first):
      File ".../backends/llamacpp/target.py", line 231 in _decode
      File ".../backends/llamacpp/target.py", line 152 in verify
      ...
"""

from __future__ import annotations

import faulthandler
import os
import re
from pathlib import Path
from typing import TextIO

from backends.models.paths import data_dir

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line \d+ in (?P<func>\w+)')
# What the app was doing, by the innermost SpecDeck function on the crashing thread's stack.
_DOING = {
    "verify": "verifying a draft", "prefill": "reading the prompt", "quantize": "converting a model",
    "_load": "loading a model", "load": "loading a model",
    "commit": "updating the KV cache", "truncate": "updating the KV cache", "propose": "drafting",
}
_RUNNING = "SpecDeck running, pid"
_held: dict[str, TextIO] = {}  # the open log file: faulthandler writes to its descriptor


def crash_log_path() -> Path:
    return data_dir() / "crash.log"


def arm(path: Path | None = None) -> str | None:
    """Start recording fatal errors into ``path``; return what the previous run left there, in
    words (None when it ended normally). Call once, early, in the GUI process."""
    path = path or crash_log_path()
    previous = None
    try:
        if path.is_file() and path.stat().st_size:
            previous = describe(path.read_text(encoding="utf-8", errors="replace"))
            path.replace(path.with_name("crash-previous.log"))
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - kept open for faulthandler
        f.write(f"{_RUNNING} {os.getpid()}\n")
        f.flush()
    except OSError:
        return previous
    old = _held.pop("log", None)
    _held["log"] = f
    faulthandler.enable(file=f, all_threads=True)
    if old is not None:
        old.close()
    return previous


def disarm() -> None:
    """A normal exit: stop recording and leave an empty log (nothing to report next time)."""
    f = _held.pop("log", None)
    if f is None:
        return
    faulthandler.disable()
    name = f.name
    f.close()
    try:
        Path(name).write_text("")
    except OSError:
        pass


def describe(text: str) -> str | None:
    """One sentence for the banner from a faulthandler dump (None if it holds no crash)."""
    first = next((line for line in text.splitlines() if line.startswith("Fatal Python error")), None)
    if first is None:
        if text.startswith(_RUNNING):
            return ("SpecDeck did not close normally last time (it was killed, ran out of memory, or the PC lost power). "
                    "Your conversations were kept.")
        return None
    what = first.split(":", 1)[1].strip() if ":" in first else "a fatal error"
    frames = [m for m in _FRAME.finditer(text)]
    ours = [m for m in frames if "/backends/" in m["file"].replace("\\", "/")]
    in_llama = any("/llamacpp/" in m["file"].replace("\\", "/") or "llama_cpp" in m["file"] for m in frames[:3])
    doing = next((_DOING[m["func"]] for m in ours if m["func"] in _DOING), None)
    where = "inside llama.cpp" if in_llama or (ours and "/llamacpp/" in ours[0]["file"]) else "in the app"
    sentence = f"SpecDeck stopped unexpectedly last time: a crash {where} ({what})"
    if doing:
        sentence += f" while {doing}"
    return sentence + ". Your conversations were kept; the details are in crash-previous.log in the data folder."
