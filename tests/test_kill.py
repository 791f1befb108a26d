"""``kill -9`` of the window process in the middle of answers loses no message.

Twenty times, the real window (its own process, offscreen) is started on the same data folder,
sends messages one after another (the first run finishes one answer, so the measured verify
costs are cached for the others), and is killed with SIGKILL at a random moment (seeded). After
each kill the SQLite database must pass ``PRAGMA integrity_check`` and hold every message the
window had sent and every answer it had finished; on the next start the window opens that
conversation with all of them and says in its banner that the last run did not close normally.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

KILLS = 20
START_TIMEOUT = 120.0


class Run:
    """One window process; its JSON lines, collected by a reader thread as they come."""

    def __init__(self, env: dict, tag: str) -> None:
        self.lines: list[dict] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.window_driver", tag], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env, cwd=Path(__file__).parents[1])
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:  # type: ignore[union-attr]
            try:
                self.lines.append(json.loads(raw))
            except ValueError:
                pass

    def wait_for(self, key: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((line for line in self.lines if key in line), None)
            if hit is not None:
                return hit
            assert self.proc.poll() is None, f"the window process exited with {self.proc.returncode}: {self.lines}"
            time.sleep(0.02)
        raise AssertionError(f"no {key!r} line within {timeout} s: {self.lines}")

    def kill(self) -> list[dict]:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.reader.join(timeout=10)
        return self.lines


def stored(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        conv = con.execute("SELECT id FROM conversations ORDER BY updated DESC, id DESC").fetchone()[0]
        return [(r, c) for r, c in con.execute("SELECT role, content FROM messages WHERE conversation = ? ORDER BY position",
                                                (conv,))]


def test_kill_9_during_answers_loses_no_message(tmp_path):
    env = dict(os.environ, SPECDECK_DATA_DIR=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               QT_QPA_PLATFORM="offscreen")
    db = tmp_path / "data" / "conversations.sqlite3"
    rng = random.Random(20261201)
    sent_total: list[str] = []  # every user message any run sent
    finished: list[str] = []  # every answer any run finished
    for k in range(KILLS):
        run = Run(env, f"k{k}")
        started = run.wait_for("started", START_TIMEOUT)
        if k:
            assert "did not close normally" in started["banner"]
            opened = [c for r, c in started["messages"] if r == "user"]
            assert [t for t in sent_total if t not in opened] == [], "a sent message is missing after the restart"
        run.wait_for("sent", START_TIMEOUT)
        if k == 0:  # the first run measures this machine's verify costs (kept for the others)
            run.wait_for("done", START_TIMEOUT)
        time.sleep(rng.uniform(0.0, 4.0))  # somewhere in the first answer, or a later one
        lines = run.kill()
        sent_total += [line["text"] for line in lines if "sent" in line]
        finished += [line["content"] for line in lines if "done" in line]
        messages = stored(db)
        users = [c for r, c in messages if r == "user"]
        answers = [c for r, c in messages if r == "assistant"]
        assert [t for t in sent_total if t not in users] == []
        assert [a for a in finished if a not in answers] == []
    assert len(sent_total) >= KILLS and finished, (len(sent_total), len(finished))
