"""Conversations, kept in SQLite in the user data directory so they survive restarts.

A conversation is an ordered list of messages; an assistant message also keeps the stats footer
of its answer (JSON) so a reloaded conversation shows how each answer was produced. Its title is
its first message's first line until the user renames it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from backends.models.paths import data_dir

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, system TEXT NOT NULL DEFAULT '', updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, conversation INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL, stats TEXT
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation, position);
"""


@dataclass(frozen=True)
class StoredMessage:
    role: str
    content: str
    stats: dict | None = None


@dataclass(frozen=True)
class ConversationSummary:
    id: int
    title: str
    updated: float


class ConversationStore:
    """Used from the GUI thread only; every write is one short transaction."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or data_dir() / "conversations.sqlite3"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.recovered: str | None = None  # what was done with a file that could not be read, for the window to say
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as exc:  # not a database, or damaged: kept aside, never deleted
            kept = self.path.with_name(f"{self.path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
            self.path.replace(kept)
            self.recovered = (f"the saved conversations could not be read ({exc}); the file is kept as {kept} "
                              "and a new one was started")
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path)
        try:
            db.execute("PRAGMA foreign_keys = ON")
            db.executescript(_SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(conversations)")}
            if "named" not in columns:  # a store written before titles could be renamed
                with db:
                    db.execute("ALTER TABLE conversations ADD COLUMN named INTEGER NOT NULL DEFAULT 0")
        except sqlite3.DatabaseError:
            db.close()  # before the file is moved aside (Windows keeps an open file in place)
            raise
        return db

    def close(self) -> None:
        self._db.close()

    def create(self, title: str = "New chat", system: str = "") -> int:
        with self._db:
            cur = self._db.execute("INSERT INTO conversations (title, system, updated) VALUES (?, ?, ?)",
                                   (title, system, time.time()))
        return int(cur.lastrowid)

    def list(self) -> list[ConversationSummary]:
        rows = self._db.execute("SELECT id, title, updated FROM conversations ORDER BY updated DESC, id DESC")
        return [ConversationSummary(int(i), t, float(u)) for i, t, u in rows]

    def messages(self, conversation: int) -> list[StoredMessage]:
        rows = self._db.execute("SELECT role, content, stats FROM messages WHERE conversation = ? ORDER BY position",
                                (conversation,))
        return [StoredMessage(r, c, json.loads(s) if s else None) for r, c, s in rows]

    def title(self, conversation: int) -> str:
        row = self._db.execute("SELECT title FROM conversations WHERE id = ?", (conversation,)).fetchone()
        return row[0] if row else ""

    def system(self, conversation: int) -> str:
        row = self._db.execute("SELECT system FROM conversations WHERE id = ?", (conversation,)).fetchone()
        return row[0] if row else ""

    def replace_messages(self, conversation: int, messages: list[StoredMessage], *, system: str | None = None) -> None:
        """Write the whole conversation (edits and regenerations rewrite its tail)."""
        title = _first_line(messages)
        with self._db:
            self._db.execute("DELETE FROM messages WHERE conversation = ?", (conversation,))
            self._db.executemany(
                "INSERT INTO messages (conversation, position, role, content, stats) VALUES (?, ?, ?, ?, ?)",
                [(conversation, i, m.role, m.content, json.dumps(m.stats) if m.stats else None) for i, m in enumerate(messages)],
            )
            self._db.execute("UPDATE conversations SET updated = ?, title = CASE WHEN named THEN title ELSE COALESCE(?, title) END, "
                             "system = COALESCE(?, system) WHERE id = ?", (time.time(), title, system, conversation))

    def rename(self, conversation: int, title: str) -> None:
        """The user's own title: kept from now on (the first message no longer names it); an empty
        one gives the naming back to the first message."""
        title = " ".join(title.split())
        with self._db:
            self._db.execute("UPDATE conversations SET title = ?, named = ? WHERE id = ?",
                             (title or _first_line(self.messages(conversation)) or "New chat", int(bool(title)), conversation))

    def delete(self, conversation: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation,))


def _first_line(messages: list[StoredMessage]) -> str | None:
    """The title a conversation's first user message gives it (its first line, 60 characters)."""
    return next((m.content.strip().splitlines()[0][:60] for m in messages if m.role == "user" and m.content.strip()), None)
