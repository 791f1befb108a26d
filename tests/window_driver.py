"""The real SpecDeck window in a process of its own, driven for tests/test_kill.py.

Starts the app as ``specdeck-gui`` does (``desktop.app.start``: crash log armed, probe, window),
reports what it opened with, then sends one message after another, each as soon as the last
answer finished. Every fact goes to stdout as a JSON line, flushed at once, because the test
kills this process with SIGKILL at a random moment and trusts only what was printed before.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QTimer  # noqa: E402

from desktop.app import start  # noqa: E402


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(tag: str) -> int:
    app, window, sampler = start(["--model", "smollm2-135m-q4_1"])
    chat = window.chat
    emit(started=True, banner=window.error_text(), status=window.statusBar().currentMessage(), conversation=chat.conversation,
         messages=[[m.role, m.content] for m in chat.messages])
    sent = {"n": 0, "idle": time.monotonic()}

    def tick() -> None:
        if window.model is None or chat.streaming or window.busy:
            if time.monotonic() - sent["idle"] > 10:  # waiting long: say on what, for the test's failure message
                sent["idle"] = time.monotonic()
                emit(waiting=True, model=window.model is not None, streaming=chat.streaming, busy=window.busy,
                     banner=window.error_text()[:300], status=window.status_label.text()[:200])
            return
        sent["idle"] = time.monotonic()
        if sent["n"]:
            last = chat.messages[-1]
            emit(done=sent["n"], role=last.role, content=last.content)
        sent["n"] += 1
        n = sent["n"]
        ask = f"Tell me a short story about the number {n}." if n % 3 == 0 else f"What is {n} plus {n}? Answer with the number."
        chat.input.setPlainText(f"[{tag}.{n}] {ask}")
        chat.send()
        emit(sent=sent["n"], text=chat.messages[-2].content)

    timer = QTimer()
    timer.setInterval(20)
    timer.timeout.connect(tick)
    timer.start()
    try:
        return app.exec()
    finally:
        sampler.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "run"))
