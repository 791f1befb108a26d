"""The chat panel: conversation list, transcript with markdown and stats footers, message box.

The panel keeps the conversation and shows it; the main window turns "send" into a request for
the worker and feeds the worker's events back here. The transcript is redrawn on a short timer
while an answer streams, not once per token.
"""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut, QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from backends.chat import format_stats
from backends.core.types import Finished, Prefilled, RunStats, Step
from desktop.store import ConversationStore, StoredMessage

DRAFT_COLOUR = "rgba(80, 170, 90, 0.30)"


class MessageBox(QPlainTextEdit):
    """Ctrl+Enter sends; plain Enter is a new line, as in most chat apps' multi-line boxes."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setPlaceholderText("Message (Ctrl+Enter to send, Esc to stop)")
        self.setMaximumHeight(110)
        self.setObjectName("message_box")

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Qt's name
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and event.modifiers() & Qt.KeyboardModifier.ControlModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class ChatPanel(QWidget):
    send_requested = Signal(list)  # the conversation to answer: [{"role", "content"}, ...]
    stop_requested = Signal()

    def __init__(self, store: ConversationStore, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.conversation: int | None = None
        self.messages: list[StoredMessage] = []
        self.spans: dict[int, list[tuple[str, bool]]] = {}  # message index -> (text, came from a draft)
        self.streaming = False
        self._dirty = False
        self._build()
        self.redraw_timer = QTimer(self)
        self.redraw_timer.setInterval(80)
        self.redraw_timer.timeout.connect(self._redraw_if_dirty)
        self.redraw_timer.start()
        self.reload_list()
        conversations = self.store.list()
        self.open(conversations[0].id if conversations else self.store.create())

    def _build(self) -> None:
        self.list = QListWidget()
        self.list.setObjectName("conversations")
        self.list.itemActivated.connect(lambda item: self.open(item.data(Qt.ItemDataRole.UserRole)))
        self.list.itemClicked.connect(lambda item: self.open(item.data(Qt.ItemDataRole.UserRole)))
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(self.new_chat)
        self.delete_button = QPushButton("Delete")
        self.delete_button.clicked.connect(self.delete_chat)
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(self.list)
        row = QHBoxLayout()
        row.addWidget(self.new_button)
        row.addWidget(self.delete_button)
        lv.addLayout(row)

        self.transcript = QTextBrowser()
        self.transcript.setObjectName("transcript")
        self.transcript.setOpenExternalLinks(True)
        self.input = MessageBox()
        self.input.submitted.connect(self.send)
        self.send_button = QPushButton("Send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.stop_requested)
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.clicked.connect(self.regenerate)
        self.edit_button = QPushButton("Edit last message")
        self.edit_button.clicked.connect(self.edit_last)
        self.colour = QCheckBox("Colour drafted tokens")
        self.colour.setToolTip("Shade the text that came from accepted drafts (answers of this session)")
        self.colour.toggled.connect(lambda _: self.redraw())
        buttons = QHBoxLayout()
        for w in (self.send_button, self.stop_button, self.regenerate_button, self.edit_button):
            buttons.addWidget(w)
        buttons.addStretch(1)
        buttons.addWidget(self.colour)
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(0, 0, 0, 0)
        rv.addWidget(self.transcript, 1)
        rv.addWidget(self.input)
        rv.addLayout(buttons)

        split = QSplitter()
        split.addWidget(left)
        split.addWidget(right)
        split.setStretchFactor(1, 4)
        split.setSizes([180, 720])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(split)
        QShortcut(QKeySequence("Ctrl+Return"), self.input, activated=self.send)

    # -- conversations -----------------------------------------------------------------------
    def reload_list(self) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        for conv in self.store.list():
            item = QListWidgetItem(conv.title)
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            self.list.addItem(item)
            if conv.id == self.conversation:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)

    def open(self, conversation: int) -> None:
        if self.streaming:
            return
        self.conversation = conversation
        self.messages = list(self.store.messages(conversation))
        self.spans = {}
        self.reload_list()
        self.redraw()

    def new_chat(self) -> None:
        if self.streaming:
            return
        self.open(self.store.create())
        self.input.setFocus()

    def delete_chat(self) -> None:
        if self.streaming or self.conversation is None:
            return
        self.store.delete(self.conversation)
        remaining = self.store.list()
        self.open(remaining[0].id if remaining else self.store.create())

    def save(self) -> None:
        if self.conversation is not None:
            self.store.replace_messages(self.conversation, self.messages)
            self.reload_list()

    # -- sending -----------------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.streaming:
            return
        self.input.clear()
        self.messages.append(StoredMessage("user", text))
        self._ask()

    def regenerate(self) -> None:
        """Answer the last user message again (the previous answer is replaced)."""
        if self.streaming:
            return
        while self.messages and self.messages[-1].role == "assistant":
            self.spans.pop(len(self.messages) - 1, None)
            self.messages.pop()
        if self.messages and self.messages[-1].role == "user":
            self._ask()

    def edit_last(self) -> None:
        """Put the last user message back in the box, dropping it and its answer, to edit and resend."""
        if self.streaming:
            return
        last_user = max((i for i, m in enumerate(self.messages) if m.role == "user"), default=None)
        if last_user is None:
            return
        self.input.setPlainText(self.messages[last_user].content)
        for i in range(last_user, len(self.messages)):
            self.spans.pop(i, None)
        del self.messages[last_user:]
        self.save()
        self.redraw()
        self.input.setFocus()

    def _ask(self) -> None:
        conversation = [{"role": m.role, "content": m.content} for m in self.messages]
        self.messages.append(StoredMessage("assistant", ""))
        self.spans[len(self.messages) - 1] = []
        self.set_streaming(True)
        self.save()
        self.redraw()
        self.send_requested.emit(conversation)

    def set_streaming(self, on: bool) -> None:
        self.streaming = on
        self.stop_button.setEnabled(on)
        for w in (self.send_button, self.regenerate_button, self.edit_button, self.new_button, self.delete_button):
            w.setEnabled(not on)

    # -- events from the worker --------------------------------------------------------------
    def on_event(self, event, draft_text: str = "") -> None:
        if not self.messages or self.messages[-1].role != "assistant":
            return
        index = len(self.messages) - 1
        if isinstance(event, Step) and event.text:
            spans = self.spans.setdefault(index, [])
            if draft_text and event.text.startswith(draft_text):
                spans += [(draft_text, True), (event.text[len(draft_text):], False)]
            else:
                spans.append((event.text, False))
            old = self.messages[index]
            self.messages[index] = StoredMessage("assistant", old.content + event.text)
            self._dirty = True
        elif isinstance(event, Finished):
            self.messages[index] = StoredMessage("assistant", event.text, event.stats.to_dict())
            self.set_streaming(False)
            self.save()
            self.redraw()
        elif isinstance(event, Prefilled):
            self._dirty = True

    def on_failure(self, message: str) -> None:
        """The answer failed: drop the empty answer, keep the question, show the error inline."""
        if self.streaming and self.messages and self.messages[-1].role == "assistant":
            index = len(self.messages) - 1
            if not self.messages[index].content:
                self.messages.pop()
                self.spans.pop(index, None)
            self.set_streaming(False)
            self.save()
        self.redraw(error=message)

    # -- drawing -----------------------------------------------------------------------------
    def _redraw_if_dirty(self) -> None:
        if self._dirty:
            self._dirty = False
            self.redraw()

    def redraw(self, *, error: str | None = None) -> None:
        bar = self.transcript.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        self.transcript.clear()
        cursor = QTextCursor(self.transcript.document())
        for i, m in enumerate(self.messages):
            who = {"user": "You", "assistant": "SpecDeck", "system": "System"}.get(m.role, m.role)
            cursor.insertHtml(f"<p style='margin-top:12px'><b>{who}</b></p>")
            cursor.insertBlock()
            if m.role == "assistant" and self.colour.isChecked() and self.spans.get(i):
                cursor.insertHtml(_coloured(self.spans[i]))
            elif m.content:
                cursor.insertMarkdown(m.content)
            elif m.role == "assistant" and self.streaming and i == len(self.messages) - 1:
                cursor.insertHtml("<i>thinking ...</i>")
            if m.role == "assistant" and m.stats:
                cursor.insertBlock()
                footer = format_stats(RunStats.from_dict(m.stats))
                cursor.insertHtml(f"<p><small style='color:gray'>{html.escape(footer)}</small></p>")
            cursor.insertBlock()
        if error:
            cursor.insertHtml(f"<p style='color:#c0392b'><b>Error:</b> {html.escape(error)}</p>")
        if at_bottom or self.streaming:
            bar.setValue(bar.maximum())

    def transcript_text(self) -> str:
        return self.transcript.toPlainText()


def _coloured(spans: list[tuple[str, bool]]) -> str:
    out = []
    for text, drafted in spans:
        body = html.escape(text).replace("\n", "<br>")
        out.append(f"<span style='background-color:{DRAFT_COLOUR}'>{body}</span>" if drafted else body)
    return "".join(out)
