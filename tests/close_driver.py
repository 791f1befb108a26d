"""The real SpecDeck window closed while something runs, in a process of its own (for
tests/test_desktop_defects.py): what the terminal shows after the window is gone is the point.

    python -m tests.close_driver chat|compare|hub

Starts the app as ``specdeck-gui`` does (``desktop.app.start``), waits for the bundled model, then
starts an answer (``chat``), a comparison (``compare``) or a Hub search against an address that
does not resolve (``hub``) and closes the window while it runs: after a few streamed steps, or at
once for the search. After the event loop has ended it prints one JSON line with what the
conversation store holds, so the test can check that the answer's text so far was kept.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QTimer  # noqa: E402

from backends.core.types import Step  # noqa: E402
from desktop.app import start  # noqa: E402
from desktop.hub import HubDialog  # noqa: E402
from desktop.store import ConversationStore  # noqa: E402

SLOW_FAILURE_S = 1.0


def slow_hub() -> str:
    """A local server that answers every request with an error after ``SLOW_FAILURE_S``."""

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            time.sleep(SLOW_FAILURE_S)
            self.send_error(503, "busy")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def main(mode: str) -> int:
    app, window, sampler = start(["--model", "smollm2-135m-q4_1"])
    steps = {"n": 0}

    def count(ev) -> None:
        if isinstance(ev.event, Step):
            steps["n"] += 1

    window.worker.answer_event.connect(count)  # on the worker thread, as each event is sent
    window.worker.compare_event.connect(count)
    poll = QTimer()
    poll.setInterval(20)

    def begin() -> None:
        if window.model is None or window.busy:
            return
        poll.timeout.disconnect(begin)
        window.sampling.max_tokens.setValue(400)
        text = "Write a long story about a lighthouse keeper and the sea."
        if mode == "chat":
            window.chat.input.setPlainText(text)
            window.chat.send()
        elif mode == "compare":
            window.compare.prompt.setPlainText(text)
            window.compare.run()
        else:
            dialog = HubDialog(endpoint=slow_hub(), parent=window)
            dialog.show()
            dialog.query.setText("SmolLM2")
            dialog.search()
            window.close()
            return
        poll.timeout.connect(close_when_streaming)

    def close_when_streaming() -> None:
        if steps["n"] >= 3:
            poll.stop()
            window.close()

    poll.timeout.connect(begin)
    poll.start()
    try:
        rc = app.exec()
    finally:
        sampler.stop()
    store = ConversationStore()
    conversations = store.list()
    messages = store.messages(conversations[0].id) if conversations else []
    print(json.dumps({"rc": rc, "steps": steps["n"], "messages": [[m.role, m.content] for m in messages]}), flush=True)
    store.close()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
