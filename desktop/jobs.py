"""Short background jobs that do not touch llama.cpp (GGUF headers, hardware probes, estimates).

They run on Qt's global thread pool so the GUI thread never waits on a disk read or a probe; the
result comes back as a queued signal on the GUI thread. The relay carrying it is kept alive until
the job ends, even if its owner (a window, a panel) is closed first: the result is then dropped.
So is the outcome of a job still running when the application shuts down (Qt then deletes every
relay): nothing is printed in the terminal after the window has closed.
"""

from __future__ import annotations

from typing import Any, Callable

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal
from shiboken6 import isValid


class _Relay(QObject):
    done = Signal(object)
    failed = Signal(str)


class _Job(QRunnable):
    def __init__(self, fn: Callable[[], Any], relay: _Relay) -> None:
        super().__init__()
        self.fn, self.relay = fn, relay

    def run(self) -> None:
        try:
            result = self.fn()
        except Exception as exc:  # noqa: BLE001 - reported to the GUI, never raised in a pool thread
            self._send("failed", str(exc) or type(exc).__name__)
        else:
            self._send("done", result)

    def _send(self, signal: str, value: Any) -> None:
        """Hand the outcome to the GUI thread. A job that outlives the application (the window was
        closed while it ran, and Qt's objects are being torn down) has nobody left to tell: its
        relay is gone, and the outcome is dropped instead of raising in a pool thread."""
        if not isValid(self.relay):
            return
        try:
            getattr(self.relay, signal).emit(value)
        except RuntimeError:  # the relay was deleted between the check and the emit
            pass


_live: set[_Relay] = set()


def run_job(owner: QObject, fn: Callable[[], Any], on_done: Callable[[Any], None],
            on_error: Callable[[str], None] | None = None) -> None:
    """Run ``fn`` off the GUI thread; ``on_done(result)`` or ``on_error(message)`` runs on it."""
    relay = _Relay()  # not parented to the owner: the pool thread may still emit after the owner is gone
    _live.add(relay)

    def finish(callback: Callable[[Any], None] | None, value: Any) -> None:
        _live.discard(relay)
        if callback is not None and isValid(owner):
            callback(value)
        relay.deleteLater()

    relay.done.connect(lambda result: finish(on_done, result))
    relay.failed.connect(lambda message: finish(on_error, message))
    QThreadPool.globalInstance().start(_Job(fn, relay))


def wait_for_jobs(msecs: int = 30000) -> bool:
    """Block until the pool is idle (tests and shutdown)."""
    return QThreadPool.globalInstance().waitForDone(msecs)
