"""What the desktop tests share: a fresh user's home, a real window on the real worker thread,
and the ways a test sends a message and reads what came back.

Test modules import the ``home`` and ``window`` fixtures from here by name (pytest registers a
fixture a module imports), so every desktop test opens and closes its window the same way.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtCore import QSettings, Qt  # noqa: E402

from backends.core.types import Finished, Step  # noqa: E402
from backends.hardware.telemetry import GpuSource, Rapl, Sampler  # noqa: E402
from desktop.jobs import wait_for_jobs  # noqa: E402
from desktop.main_window import MainWindow  # noqa: E402
from desktop.store import ConversationStore  # noqa: E402
from desktop.welcome import WELCOME_DONE  # noqa: E402

BUNDLED = "smollm2-135m-q4_1"
LOAD_TIMEOUT = 120_000
ANSWER_TIMEOUT = 120_000


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh user: data directory (conversations, comparisons) and settings file of its own."""
    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path / "data"))
    return tmp_path


def open_window(qtbot, home: Path, *, autoload: str | None = BUNDLED, gpus: GpuSource | None = None,
                sampler: Sampler | None = None, first_start: bool = False) -> MainWindow:
    """The window on a sampler of this machine's CPU and RAM and of ``gpus`` only (a recording, or
    none): what the charts show of GPUs is then the same on every PC. A test that needs another
    sampler (a stand-in NVML card) passes its own, started.

    With ``autoload`` it returns once the model is loaded *and* the worker is idle: "ready"
    arrives just before "not busy", and a message sent in between would be refused.
    ``first_start``: the welcome page is in front, as on a new user's first start.
    """
    sampler = sampler or Sampler(interval=0.1, gpus=gpus, rapl=Rapl("/nonexistent")).start()
    settings = QSettings(str(home / "settings.ini"), QSettings.Format.IniFormat)
    if not first_start:  # a user who has seen the welcome page: the chat is in front
        settings.setValue(WELCOME_DONE, True)
    window = MainWindow(sampler=sampler, store=ConversationStore(home / "conversations.sqlite3"), settings=settings,
                        autoload=autoload)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    if autoload:
        qtbot.waitUntil(lambda: window.model is not None and not window.busy, timeout=LOAD_TIMEOUT)
    return window


def close_window(window: MainWindow) -> None:
    sampler = window.sampler
    window.close()
    if sampler is not None:
        sampler.stop()
    wait_for_jobs()  # background estimates of this window end before the next test starts


@pytest.fixture
def window(qtbot, home):
    w = open_window(qtbot, home)
    yield w
    close_window(w)


class Recorder:
    """Counts what the worker streams to the window (called on the worker thread as it is sent)."""

    def __init__(self, window: MainWindow) -> None:
        self.window = window
        self.steps = 0
        self.finished: Finished | None = None
        window.worker.answer_event.connect(self.on_event)

    def done(self) -> bool:
        """The worker finished, the window has shown it (the chat is no longer streaming) and the
        worker is idle again ("finished" is sent before the run is recorded, so a model load
        asked for in between would be refused as busy)."""
        return self.finished is not None and not self.window.chat.streaming and not self.window.busy

    def on_event(self, ev) -> None:
        if isinstance(ev.event, Step):
            self.steps += 1
        elif isinstance(ev.event, Finished):
            self.finished = ev.event


def send(qtbot, window: MainWindow, text: str) -> None:
    """Type ``text`` into the message box and press Ctrl+Enter, as a user sends it."""
    window.chat.input.setPlainText(text)
    qtbot.keyClick(window.chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)


def ask(qtbot, window: MainWindow, text: str) -> Recorder:
    """Send ``text`` from the message box and wait until its answer is shown."""
    rec = Recorder(window)
    send(qtbot, window, text)
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
    window.worker.answer_event.disconnect(rec.on_event)
    return rec


def shown(chat) -> list[tuple[str, str]]:
    """(role, text) of every message the chat panel shows."""
    return [(m.role, m.content) for m in chat.messages]


def stored(chat) -> list[tuple[str, str]]:
    """(role, text) of every message the conversation store holds for the open conversation."""
    return [(m.role, m.content) for m in chat.store.messages(chat.conversation)]
