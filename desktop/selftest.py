"""``specdeck-gui --self-test``: does the app work on this PC? Opens the real window, loads the
model (the bundled one by default), asks one question through the chat as a user would, and
exits 0 once the answer has streamed, printing how long each stage took; 1 with the reason when
anything fails or takes longer than ``--timeout``.

Why: an installer's smoke test and a user's "is it the app or my PC?" both need the whole path
(Qt, the llama.cpp CPU probe, the model, the worker thread, the chat) checked in one command
that touches none of the user's conversations or settings (it uses a scratch data folder).

    specdeck-gui --self-test -platform offscreen
    self-test: OK · window 0.4 s · model ready 2.1 s · first token 2.6 s · 18 tokens by 3.0 s
"""

from __future__ import annotations

import html
import os
import re
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "Say hello in one short sentence."


def run(model: str | None, timeout: float, qt_args: list[str]) -> int:
    """The self-test; returns the process exit code."""
    t0 = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="specdeck-selftest-"))
    os.environ["SPECDECK_DATA_DIR"] = str(scratch / "data")  # no trace in the user's conversations

    from PySide6.QtCore import QSettings

    from backends.core.types import Finished, Step
    from backends.hardware.telemetry import Sampler
    from backends.models.catalog import DEFAULT_MODEL
    from desktop.app import create_app, dispose, probe_cpu_code
    from desktop.headless import wait_until
    from desktop.main_window import MainWindow
    from desktop.store import ConversationStore

    app = create_app([sys.argv[0], *qt_args])
    probe_cpu_code(app)
    sampler = Sampler.for_this_machine(interval=0.5).start()
    settings = QSettings(str(scratch / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("model/last", model or DEFAULT_MODEL)
    window = MainWindow(sampler=sampler, store=ConversationStore(scratch / "conversations.sqlite3"),
                        settings=settings, autoload=model or DEFAULT_MODEL)
    window.show()
    marks: dict[str, float] = {"window": time.monotonic() - t0}
    seen: dict[str, object] = {}

    def on_event(ev) -> None:  # on the worker thread, as the chat receives it
        if isinstance(ev.event, Step) and "first token" not in marks:
            marks["first token"] = time.monotonic() - t0
        elif isinstance(ev.event, Finished):
            seen["finished"] = ev.event
            marks["answered"] = time.monotonic() - t0

    def failed() -> bool:
        return window.banner.isVisible() and bool(window.banner.text())

    try:
        wait_until(app, lambda: (window.model is not None and not window.busy) or failed(), timeout)
        if failed():
            return _fail(f"the model did not load: {window.banner.text()}")
        marks["model ready"] = time.monotonic() - t0
        window.worker.answer_event.connect(on_event)
        window.chat.input.setPlainText(QUESTION)
        window.chat.send()
        wait_until(app, lambda: ("finished" in seen and not window.chat.streaming) or failed(),
                   max(1.0, timeout - (time.monotonic() - t0)))
        if failed() or "finished" not in seen:
            return _fail(f"the answer failed: {window.banner.text()}")
        finished = seen["finished"]
        if not finished.text.strip():  # type: ignore[attr-defined]
            return _fail("the answer was empty")
    except TimeoutError:
        return _fail(f"no answer within {timeout:.0f} s")
    finally:
        dispose(window)
        sampler.stop()
    tokens = finished.stats.new_tokens  # type: ignore[attr-defined]
    print(f"self-test: OK · window {marks['window']:.1f} s · model ready {marks['model ready']:.1f} s · "
          f"first token {marks['first token']:.1f} s · {tokens} tokens by {marks['answered']:.1f} s")
    return 0


def _fail(reason: str) -> int:
    plain = html.unescape(re.sub(r"<br>", "; ", re.sub(r"<(?!br>)[^>]+>", "", reason)))  # the banner's rich text
    print(f"self-test: FAILED · {plain}", file=sys.stderr)
    return 1
