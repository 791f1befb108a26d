"""The chat panel: conversation list, transcript with markdown and stats footers, message box.

The panel keeps the conversation and shows it; the main window turns "send" into a request for
the worker and feeds the worker's events back here. The transcript is redrawn on a short timer
while an answer streams, not once per token.

A send that ends without any answer is taken back: one the worker refuses before running anything
(too long for the context), one that fails or is stopped before its first token. The conversation
returns to what it was before the send, the text goes back into the message box, and the error (or
a notice) says why; so the next send never carries two user turns in a row. An empty message is
not sent; a notice says so. While a long message is read, the answer shows how many of its prompt
tokens the model has read so far instead of "thinking".

Any earlier user message can be edited: its "edit" link in the transcript puts its text in the
message box, and sending replaces it, drops every turn after it (those answered the old text)
and asks again. Until then nothing changes, so Cancel or Esc leaves the conversation as it was.

Every colour in the transcript comes from the palette (``TranscriptTheme``), and the panel redraws
when the palette changes, so switching the system between light and dark mode while the app runs
keeps drafted-token shading, footers, links and code blocks readable.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from PySide6.QtCore import QEvent, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QColor,
    QDesktopServices,
    QGuiApplication,
    QKeySequence,
    QPalette,
    QShortcut,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextDocumentFragment,
    QTextFormat,
)
from PySide6.QtWidgets import (
    QCheckBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from backends.chat import format_stats
from backends.core.types import Finished, Prefilled, RunStats, Step
from desktop.forms import PromptBox
from desktop.store import ConversationStore, StoredMessage
from desktop.worker import PrefillProgress

EDIT_SCHEME = "edit"  # transcript links "edit:<message index>" start editing that message
COPY_SCHEME = "copy"  # "copy:<message index>" puts that answer's text (its markdown) on the clipboard
SPEAKERS = {"user": "You", "assistant": "SpecDeck", "system": "System"}  # each role's name in the transcript
PALETTE_EVENTS = (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange)
NOTICE_MS = 6000
HEADER_GAP = 12.0  # pixels above each "You" / "SpecDeck" line
READING_SHOWN_FROM = 256  # prompts this long show how far they have been read, not just "thinking"
_DRAFT_GREEN = QColor(80, 170, 90)


@dataclass(frozen=True)
class TranscriptTheme:
    """The transcript's colours (``#rrggbb``), derived from a palette.

    Derived rather than fixed so one rule serves light and dark themes: drafted tokens get a green
    mixed into the background, footers a tone between text and background, code a faint shade of
    the text colour. On white, for example, drafted text sits on ``#c2e1c5``; on ``#1e1e1e`` on
    ``#304f33``.
    """

    link: str
    muted: str
    draft: str
    code: str
    error: str

    @classmethod
    def from_palette(cls, palette: QPalette) -> TranscriptTheme:
        base, text = palette.base().color(), palette.text().color()
        dark = base.lightness() < 128
        return cls(
            link=palette.link().color().name(),
            muted=_mix(text, base, 0.55).name(),
            draft=_mix(_DRAFT_GREEN, base, 0.35).name(),
            code=_mix(text, base, 0.10).name(),
            error="#ff7b6b" if dark else "#c0392b",
        )


def _mix(colour: QColor, background: QColor, amount: float) -> QColor:
    """``amount`` of ``colour`` over ``background``, as an opaque colour (0: background, 1: colour)."""
    mixed = [round(a * amount + b * (1 - amount)) for a, b in zip(colour.getRgb()[:3], background.getRgb()[:3])]
    return QColor(*mixed)


class MessageBox(PromptBox):
    """Ctrl+Enter sends; plain Enter is a new line, as in most chat apps' multi-line boxes; Tab
    leaves the box (``PromptBox``).

    While a message is being edited, Esc cancels the edit instead of reaching the window's
    "stop" shortcut: the box claims the key in ``ShortcutOverride``, Qt's way for a focused
    widget to take a key that a shortcut would otherwise get.
    """

    cancelled = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setPlaceholderText("Message (Ctrl+Enter to send, Esc to stop)")
        self.setMaximumHeight(110)
        self.setObjectName("message_box")
        self.escape_cancels = False

    def event(self, event: QEvent) -> bool:
        if (event.type() == QEvent.Type.ShortcutOverride and self.escape_cancels
                and event.key() == Qt.Key.Key_Escape):
            event.accept()
            return True
        return super().event(event)

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Qt's name
        if event.key() == Qt.Key.Key_Escape and self.escape_cancels:
            self.cancelled.emit()
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
        self.editing: int | None = None  # index of the user message being edited, if any
        self._box_before_edit = ""  # what the message box held when the edit began (Cancel gives it back)
        self._dirty = False
        self._error: str | None = None  # the error line under the conversation, until the next send or chat
        self._undo: Undo | None = None  # the conversation before the answer now asked for
        self._reading: PrefillProgress | None = None  # how far the prompt of the answer asked for is read
        self._rendered: dict[RenderKey, Rendered] = {}  # (text, drafted runs) -> its styled markdown (see redraw)
        self._build()
        self.theme = TranscriptTheme.from_palette(self.palette())
        self.redraw_timer = QTimer(self)
        self.redraw_timer.setInterval(80)
        self.redraw_timer.timeout.connect(self._redraw_if_dirty)
        self.redraw_timer.start()
        self.notice_timer = QTimer(self, singleShot=True, interval=NOTICE_MS)
        self.notice_timer.timeout.connect(self.notice.hide)
        self.reload_list()
        conversations = self.store.list()
        self.open(conversations[0].id if conversations else self.store.create())

    def _build(self) -> None:
        self.list = QListWidget()
        self.list.setObjectName("conversations")
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)  # long titles end in "...", the whole one in the tooltip
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setEditTriggers(QListWidget.EditTrigger.EditKeyPressed)  # F2 renames; a click opens
        self.list.itemChanged.connect(self._renamed)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._list_menu)
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
        self.transcript.setOpenLinks(False)  # "edit:" links are ours; _on_link opens the others
        self.transcript.anchorClicked.connect(self._on_link)
        self.input = MessageBox()
        self.input.submitted.connect(self.send)
        self.input.cancelled.connect(self.cancel_edit)
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
        rv.addWidget(self._build_edit_bar())
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
        self.setFocusProxy(self.input)  # the tab's own box gets the keys when the tab is shown

    def _build_edit_bar(self) -> QWidget:
        """The line above the message box: what an edit will do and its Cancel button, or a notice."""
        bar = QWidget()
        row = QHBoxLayout(bar)
        row.setContentsMargins(0, 0, 0, 0)
        self.notice = QLabel()
        self.notice.setObjectName("chat_notice")
        self.notice.setWordWrap(True)
        self.notice.hide()
        self.edit_label = QLabel()
        self.edit_label.setObjectName("edit_label")
        self.edit_label.setWordWrap(True)
        self.cancel_edit_button = QPushButton("Cancel edit")
        self.cancel_edit_button.setToolTip("Keep the conversation as it is (Esc)")
        self.cancel_edit_button.clicked.connect(self.cancel_edit)
        for w in (self.notice, self.edit_label):
            row.addWidget(w, 1)
        row.addWidget(self.cancel_edit_button)
        self.edit_label.hide()
        self.cancel_edit_button.hide()
        return bar

    # -- conversations -----------------------------------------------------------------------
    def reload_list(self) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        for conv in self.store.list():
            item = QListWidgetItem(conv.title)
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            item.setToolTip(conv.title)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            self.list.addItem(item)
            if conv.id == self.conversation:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)

    def open(self, conversation: int) -> None:
        if self.streaming:
            return
        if conversation != self.conversation:
            self.cancel_edit()  # an edit belongs to the conversation it started in
        self.conversation = conversation
        self._error = None
        self.messages = list(self.store.messages(conversation))
        self.spans = {}
        self.reload_list()
        self.redraw()

    def new_chat(self) -> None:
        """A new conversation; the open one if it is still empty (New chat pressed twice makes one)."""
        if self.streaming:
            return
        if self.messages or self.conversation is None:
            self.open(self.store.create())
        self.input.setFocus()

    def delete_chat(self, conversation: int | None = None) -> None:
        """Delete ``conversation`` (the open one by default; not while an answer streams)."""
        conversation = self.conversation if conversation is None else conversation
        if self.streaming or conversation is None:
            return
        self.store.delete(conversation)
        if conversation != self.conversation:
            self.reload_list()
            return
        remaining = self.store.list()
        self.open(remaining[0].id if remaining else self.store.create())

    def rename_chat(self, conversation: int) -> None:
        """Edit that conversation's title in place (Enter keeps it, Esc leaves it; an empty title
        gives the naming back to its first message)."""
        item = self._item_of(conversation)
        if item is not None:
            self.list.editItem(item)

    def _renamed(self, item: QListWidgetItem) -> None:
        conversation = item.data(Qt.ItemDataRole.UserRole)
        if item.text() == self.store.title(conversation):  # some other change of the item
            return
        self.store.rename(conversation, item.text())
        QTimer.singleShot(0, self.reload_list)  # not from inside the item's own signal: the list is rebuilt

    def _item_of(self, conversation: int) -> QListWidgetItem | None:
        return next((self.list.item(i) for i in range(self.list.count())
                     if self.list.item(i).data(Qt.ItemDataRole.UserRole) == conversation), None)

    def _list_menu(self, point) -> None:
        item = self.list.itemAt(point)
        if item is None:
            return
        conversation = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        menu.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)  # one menu a right-click, gone once closed
        menu.addAction("Rename", lambda: self.rename_chat(conversation))
        menu.addAction("Export as Markdown ...", lambda: self._export_dialog(conversation))
        delete = menu.addAction("Delete", lambda: self.delete_chat(conversation))
        delete.setEnabled(not self.streaming)
        menu.popup(self.list.viewport().mapToGlobal(point))

    def _export_dialog(self, conversation: int) -> None:
        title = self.store.title(conversation)
        safe = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in title).strip() or "conversation"
        path, _ = QFileDialog.getSaveFileName(self, "Export conversation", str(Path.home() / f"{safe}.md"),
                                              "Markdown (*.md);;All files (*)")
        if path:
            try:
                self.export_markdown(conversation, Path(path))
            except OSError as exc:
                self.show_notice(f"Could not write {path}: {exc.strerror or exc}")
            else:
                self.show_notice(f"Saved {Path(path).name}.")

    def export_markdown(self, conversation: int, path: Path) -> None:
        """Write the conversation as it is stored (title, system prompt, each turn with its
        answer's stats line) to ``path`` as Markdown."""
        text = conversation_markdown(self.store.title(conversation) or "Conversation", self.store.system(conversation),
                                     self.store.messages(conversation))
        path.write_text(text, encoding="utf-8")

    def save(self) -> None:
        if self.conversation is not None:
            self.store.replace_messages(self.conversation, self.messages)
            self.reload_list()

    # -- sending -----------------------------------------------------------------------------
    def send(self) -> None:
        """Send the box's text: a new message, or the edited one, replacing it and what followed."""
        text = self.input.toPlainText().strip()
        if self.streaming:
            return
        if not text:
            self.show_notice("Nothing to send: the message is empty.")
            return
        undo = Undo(tuple(self.messages), dict(self.spans), text, self.editing)
        self.input.clear()
        if self.editing is not None:
            self._drop_from(self.editing)
            self._end_edit()
        self.messages.append(StoredMessage("user", text))
        self._ask(undo)

    def regenerate(self) -> None:
        """Answer the last user message again (the previous answer is replaced)."""
        if self.streaming:
            return
        self.cancel_edit()
        undo = Undo(tuple(self.messages), dict(self.spans), None, None)
        while self.messages and self.messages[-1].role == "assistant":
            self.spans.pop(len(self.messages) - 1, None)
            self.messages.pop()
        if self.messages and self.messages[-1].role == "user":
            self._ask(undo)

    def edit_last(self) -> None:
        """Edit the last user message (the same as its edit link: nothing is dropped until resend)."""
        last_user = max((i for i, m in enumerate(self.messages) if m.role == "user"), default=None)
        if last_user is not None:
            self.begin_edit(last_user)
            self.input.setFocus()

    def _drop_from(self, index: int) -> None:
        """Forget message ``index`` and everything after it, with their drafted-token shading."""
        for i in range(index, len(self.messages)):
            self.spans.pop(i, None)
        del self.messages[index:]

    def _ask(self, undo: Undo) -> None:
        self._undo = undo
        self._reading = None
        self._error = None
        conversation = [{"role": m.role, "content": m.content} for m in self.messages]
        self.messages.append(StoredMessage("assistant", ""))
        self.spans[len(self.messages) - 1] = []
        self.set_streaming(True)
        self.save()
        self.redraw()
        self.send_requested.emit(conversation)

    def set_streaming(self, on: bool) -> None:
        self.streaming = on
        if not on:
            self._undo = None  # the answer is over: nothing left to take back
        self.stop_button.setEnabled(on)
        for w in (self.send_button, self.regenerate_button, self.edit_button, self.new_button, self.delete_button):
            w.setEnabled(not on)

    # -- editing an earlier message ----------------------------------------------------------
    def begin_edit(self, index: int) -> bool:
        """Put user message ``index`` in the message box to rewrite it; True when editing began.

        Nothing changes yet: ``send`` replaces the message and drops the turns after it, which
        answered the old text; ``cancel_edit`` (Esc, Cancel) gives the box back what it held.
        Refused while an answer streams, since that answer belongs to the turn being rewritten.
        """
        if self.streaming:
            self.show_notice("Stop the answer first (Esc): a message cannot be edited while it is being answered.")
            return False
        if not 0 <= index < len(self.messages) or self.messages[index].role != "user":
            return False
        if self.editing is None:
            self._box_before_edit = self.input.toPlainText()
        self.editing = index
        self.input.setPlainText(self.messages[index].content)
        self.input.moveCursor(QTextCursor.MoveOperation.End)
        self.input.escape_cancels = True
        later = len(self.messages) - index - 1
        self.edit_label.setText(f"Editing message {index + 1}: sending replaces it and drops the {later} "
                                f"message(s) after it, then answers again. Esc cancels.")
        self.notice.hide()
        for w in (self.edit_label, self.cancel_edit_button):
            w.show()
        self.send_button.setText("Resend")
        self.redraw()
        self.input.setFocus()
        return True

    def cancel_edit(self) -> None:
        """Leave the conversation as it was and give the message box back its earlier text."""
        if self.editing is None:
            return
        self.input.setPlainText(self._box_before_edit)
        self._end_edit()
        self.redraw()

    def _end_edit(self) -> None:
        self.editing = None
        self._box_before_edit = ""
        self.input.escape_cancels = False
        self.edit_label.hide()
        self.cancel_edit_button.hide()
        self.send_button.setText("Send")

    def show_notice(self, text: str) -> None:
        """A short message above the box that goes away by itself (the panel has no status bar)."""
        self.notice.setText(text)
        self.notice.show()
        self.notice_timer.start()

    def _on_link(self, url: QUrl) -> None:
        """Edit links start an edit, copy links copy an answer; links inside messages open in the
        browser as before."""
        index = url.path()
        if url.scheme() == EDIT_SCHEME:
            if index.isdigit():
                self.begin_edit(int(index))
        elif url.scheme() == COPY_SCHEME:
            if index.isdigit() and int(index) < len(self.messages):
                QGuiApplication.clipboard().setText(self.messages[int(index)].content)
                self.show_notice("Answer copied (as markdown).")
        else:
            QDesktopServices.openUrl(url)

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
        elif isinstance(event, Finished) and event.reason == "cancelled" and not event.tokens and self._undo is not None:
            self._take_back(self._undo)  # stopped before the first token: there is no answer to keep
            self.redraw()
            self.show_notice("Stopped before the answer began; the conversation is as it was"
                             + (" and your message is back in the box." if self.input.toPlainText() else "."))
        elif isinstance(event, Finished):
            self.messages[index] = StoredMessage("assistant", event.text, event.stats.to_dict())
            self.set_streaming(False)
            self.save()
            self.redraw()
        elif isinstance(event, PrefillProgress):
            self._reading = event
            self._dirty = True
        elif isinstance(event, Prefilled):
            self._reading = None
            self._dirty = True

    def on_failure(self, message: str, *, refused: bool = False) -> None:
        """The answer failed: the error goes under the conversation, inline.

        Before its first token (or ``refused``: turned down before anything ran, such as a message
        too long for the context) the send is taken back (``_take_back``): a question left without
        its answer would make the next send carry two user turns in a row. After some text, that
        text stays as the answer.
        """
        if self.streaming and self._undo is not None and (refused or not self._answer_so_far()):
            self._take_back(self._undo)
        elif self.streaming:
            self.set_streaming(False)
            self.save()
        self._error = message
        self.redraw()

    def _answer_so_far(self) -> str:
        last = self.messages[-1] if self.messages else None
        return last.content if last is not None and last.role == "assistant" else ""

    def _take_back(self, undo: Undo) -> None:
        """The conversation as it was before the send (an edit's later turns included), and the
        sent text back in the message box (in edit mode again if it was an edit)."""
        self.messages, self.spans = list(undo.messages), dict(undo.spans)
        self.set_streaming(False)
        self.save()
        if undo.text is None:
            return
        typed = self.input.toPlainText()  # anything typed since the send stays, after the text
        if undo.editing is not None:
            self.begin_edit(undo.editing)
        self.input.setPlainText(undo.text + (f"\n\n{typed}" if typed.strip() else ""))
        self.input.moveCursor(QTextCursor.MoveOperation.End)

    # -- palette -----------------------------------------------------------------------------
    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt's name
        """The system switched light/dark (or the palette changed): recolour the transcript."""
        if event.type() in PALETTE_EVENTS and hasattr(self, "theme"):
            self.apply_palette()
        super().changeEvent(event)

    def apply_palette(self) -> None:
        """Colours from the panel's own palette: Qt tells a parent of the change before it updates
        its children's palettes, so the transcript's would still be the old one here."""
        self.theme = TranscriptTheme.from_palette(self.palette())
        self._rendered = {}
        self.redraw()

    # -- drawing -----------------------------------------------------------------------------
    def _redraw_if_dirty(self) -> None:
        if self._dirty:
            self._dirty = False
            self.redraw()

    def redraw(self) -> None:
        """Rebuild the transcript, with the error line if one is shown. While an answer streams this
        runs a few times a second, so the markdown of unchanged messages is parsed and styled once
        and reused from ``_rendered`` (kept for the texts drawn this time only, so the growing
        answer's versions do not pile up)."""
        self._dirty = False
        error = self._error
        bar = self.transcript.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        self.transcript.clear()
        cursor = QTextCursor(self.transcript.document())
        previous, self._rendered = self._rendered, {}
        for i, m in enumerate(self.messages):
            _paragraph(cursor, top_margin=HEADER_GAP)
            cursor.insertHtml(self._header(i, m))
            _paragraph(cursor)
            self._insert_body(cursor, i, m, previous)
            footer = _footer(m)
            if footer:
                _paragraph(cursor)
                cursor.insertHtml(f"<small style='color:{self.theme.muted}'>{html.escape(footer)}</small>")
        if error:
            _paragraph(cursor, top_margin=HEADER_GAP)
            cursor.insertHtml(f"<span style='color:{self.theme.error}'><b>Error:</b> {html.escape(error)}</span>")
        if at_bottom or self.streaming:
            bar.setValue(bar.maximum())

    def _header(self, index: int, m: StoredMessage) -> str:
        """Who speaks; a user message also gets its edit link, an answer its copy link (neither
        while an answer streams)."""
        who = SPEAKERS.get(m.role, m.role)
        extra = ""
        if m.role == "user" and index == self.editing:
            extra = " <i>(being edited)</i>"
        elif m.role in ("user", "assistant") and m.content and not self.streaming:
            scheme, label = (EDIT_SCHEME, "edit") if m.role == "user" else (COPY_SCHEME, "copy")
            extra = f" &nbsp;<small><a href='{scheme}:{index}' style='color:{self.theme.link}'>{label}</a></small>"
        return f"<b>{who}</b>{extra}"

    def _insert_body(self, cursor: QTextCursor, index: int, m: StoredMessage, previous: dict[RenderKey, Rendered]) -> None:
        if m.content:
            shade = self.colour.isChecked() and m.role == "assistant"
            key = (m.content, drafted_runs(self.spans.get(index, []), len(m.content)) if shade else ())
            rendered = previous.get(key) or self._rendered.get(key) or Rendered.of(*key, self.theme)
            self._rendered[key] = rendered
            rendered.insert(cursor)
        elif m.role == "assistant" and self.streaming and index == len(self.messages) - 1:
            cursor.insertHtml(f"<i>{html.escape(self._waiting_text())}</i>")

    def _waiting_text(self) -> str:
        """What the answer shows before its first token: how far a long prompt has been read."""
        reading = self._reading
        if reading is None or reading.total < READING_SHOWN_FROM:
            return "thinking ..."
        return (f"reading your message: {reading.done:,} of {reading.total:,} prompt tokens "
                f"({reading.done / reading.total:.0%}) ...")

    def transcript_text(self) -> str:
        return self.transcript.toPlainText()


@dataclass(frozen=True)
class Undo:
    """The conversation before a send, and what was sent: what a refused message gives back."""

    messages: tuple[StoredMessage, ...]
    spans: dict[int, list[tuple[str, bool]]]
    text: str | None  # the message box's text (None for Regenerate, whose question stays)
    editing: int | None  # the index of the message being edited, if the send was a resend


def _paragraph(cursor: QTextCursor, *, top_margin: float = 0.0) -> None:
    """Start a paragraph with plain formats (the empty document's first block is reused).

    A plain ``insertBlock`` inherits the formats at the cursor: after a message that ends in a
    code block, every later header and message would be laid out as code too.
    """
    block = QTextBlockFormat()
    block.setTopMargin(top_margin)
    if cursor.atStart():
        cursor.setBlockFormat(block)
        cursor.setCharFormat(QTextCharFormat())
    else:
        cursor.insertBlock(block, QTextCharFormat())


def conversation_markdown(title: str, system: str, messages: Sequence[StoredMessage]) -> str:
    """A conversation as one Markdown file: the answers are markdown already, so each turn goes
    in as written under a heading naming who spoke, an answer's stats line after it."""
    parts = [f"# {title}\n"]
    if system.strip():
        parts.append(f"*System prompt:* {system.strip()}\n")
    for m in messages:
        who = SPEAKERS.get(m.role, m.role)
        parts.append(f"## {who}\n\n{m.content.strip()}\n")
        footer = _footer(m)
        if footer:
            parts.append(f"*{footer}*\n")
    return "\n".join(parts)


def _footer(m: StoredMessage) -> str | None:
    """An answer's stats line; None for other messages and for stats this version cannot read
    (a conversation saved by another SpecDeck version must still open)."""
    if m.role != "assistant" or not m.stats:
        return None
    try:
        return format_stats(RunStats.from_dict(m.stats))
    except (TypeError, ValueError):
        return None


RenderKey = tuple[str, tuple[tuple[int, int], ...]]  # a message's text and its drafted runs (offsets in it)
ALIGN_WINDOW = 400  # markdown syntax skipped between two shown characters: a link's address, a fence line
ALIGN_PIECE = 8  # characters matched at once where they can be
ALIGN_STRETCH = 64  # characters first tried where the last match ended


@dataclass(frozen=True)
class Rendered:
    """A message's markdown, parsed and styled for one theme, ready to insert again and again."""

    fragment: QTextDocumentFragment
    first_block: QTextBlockFormat

    @classmethod
    def of(cls, text: str, drafted: Sequence[tuple[int, int]], theme: TranscriptTheme) -> Rendered:
        """``drafted``: runs ``[start, end)`` of ``text`` that came from accepted drafts, shaded
        where they show (the markdown syntax among them does not; ``markdown_source`` says which
        character of ``text`` each one of what is parsed came from)."""
        markdown, origin = markdown_source(text)
        source = QTextDocument()
        source.setMarkdown(markdown)
        _style_document(source, theme)
        if drafted:
            is_drafted = bytearray(len(text))
            for start, end in drafted:
                is_drafted[start:end] = b"\x01" * (end - start)
            _shade(source, markdown, bytes(o >= 0 and is_drafted[o] for o in origin), QColor(theme.draft))
        return cls(QTextDocumentFragment(source), source.begin().blockFormat())

    def insert(self, cursor: QTextCursor) -> None:
        """Insert at the cursor, keeping the first paragraph's layout: ``insertFragment`` merges
        that paragraph into the cursor's and drops its block format, so a message opening with
        a code block showed its first line as plain text."""
        block = cursor.block()
        cursor.insertFragment(self.fragment)
        QTextCursor(block).setBlockFormat(self.first_block)


FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")


def markdown_source(raw: str) -> tuple[str, list[int]]:
    """``raw`` as the markdown the transcript parses, with each character's offset in ``raw`` (-1
    for the characters added). Outside code (fenced blocks and backtick spans) two things change:
    a ``<`` is escaped, since Qt's markdown takes ``<b>``, ``<div>`` or ``<select ...>`` for HTML and
    drops them from the text (a user's pasted page, or an answer naming a tag, lost words); and a
    line followed by another non-blank line ends in a hard break, as chat text means it (markdown
    would run "2 eggs" and "1 cup flour" together into one line)."""
    out: list[str] = []
    origin: list[int] = []

    def put(text: str, at: int) -> None:  # text taken from raw at offset at (-1: added)
        out.append(text)
        origin.extend(range(at, at + len(text)) if at >= 0 else [-1] * len(text))

    lines = raw.splitlines(keepends=True)
    fence: str | None = None  # the open fence's marker, inside a fenced block
    at = 0
    for i, line in enumerate(lines):
        body = line.rstrip("\r\n")
        opening = FENCE.match(body)
        if fence is not None or opening:
            put(line, at)
            if fence is None:
                fence = opening.group(1)
            elif opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence) \
                    and not body.strip().strip(fence[0]):
                fence = None
        else:
            _escape_outside_code(body, at, put)
            following = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if body.strip() and following and not FENCE.match(lines[i + 1]) and not body.endswith("  "):
                put("  ", -1)
            put(line[len(body):], at + len(body))
        at += len(line)
    return "".join(out), origin


def _escape_outside_code(text: str, at: int, put: Callable[[str, int], None]) -> None:
    """``text`` (from raw offset ``at``) with ``<`` escaped, except inside backtick code spans."""
    i = 0
    while i < len(text):
        if text[i] == "`":
            run = len(text[i:]) - len(text[i:].lstrip("`"))
            close = text.find("`" * run, i + run)
            while close >= 0 and text[close + run:close + run + 1] == "`":  # a longer run does not close it
                close = text.find("`" * run, close + run + 1)
            end = close + run if close >= 0 else i + run
            put(text[i:end], at + i)
            i = end
        elif text[i] == "<":
            put("\\", -1)
            put("<", at + i)
            i += 1
        else:
            j = min([k for k in (text.find("`", i), text.find("<", i)) if k >= 0], default=len(text))
            put(text[i:j], at + i)
            i = j


def drafted_runs(spans: Sequence[tuple[str, bool]], length: int) -> tuple[tuple[int, int], ...]:
    """The ``[start, end)`` offsets of the drafted spans, within the first ``length`` characters
    (the finished answer's text can be shorter than what streamed: a stop string is cut off)."""
    runs, at = [], 0
    for text, drafted in spans:
        end = min(at + len(text), length)
        if drafted and end > at:
            runs.append((at, end))
        at += len(text)
    return tuple(runs)


def align_shown(raw: str, shown: str, window: int = ALIGN_WINDOW) -> list[int]:
    """For each character of ``shown`` (the text markdown made of ``raw``), the offset in ``raw``
    it came from, or -1. Markdown only removes characters (emphasis marks, fences, list markers,
    a link's address) and turns a line break inside a paragraph into a space, so ``shown`` is
    matched to ``raw`` in order, skipping at most ``window`` characters of syntax. Pieces of up
    to ``ALIGN_PIECE`` characters are matched at once, so the first letters of a code block's
    line are not taken from its fence's language name; a character that cannot be placed
    (an entity such as ``&amp;``) is left unmatched, not the rest after it."""
    out: list[int] = []
    i, n = 0, 0
    while n < len(shown):
        size = min(ALIGN_STRETCH, len(shown) - n)
        j = i if raw.startswith(shown[n:n + size], i) else -1  # text as it is: most of a message
        size = size if j >= 0 else min(ALIGN_PIECE, len(shown) - n)
        while size > 1 and j < 0:  # the longest piece found as it is
            j = raw.find(shown[n:n + size], i, i + window + size)
            size = size if j >= 0 else size // 2
        if j < 0 and shown[n].isspace():  # a space, or a line break the markdown made one of
            j = next((k for k in range(i, min(len(raw), i + window)) if raw[k].isspace()), -1)
        elif j < 0:
            j = raw.find(shown[n], i, i + window)
        size = max(size, 1)
        out += range(j, j + size) if j >= 0 else [-1] * size
        i = j + size if j >= 0 else i
        n += size
    return out


def _shade(document: QTextDocument, markdown: str, is_drafted: bytes, colour: QColor) -> None:
    """Shade the characters of ``document`` (made of ``markdown``) whose character in ``markdown``
    is marked in ``is_drafted``."""
    positions, shown = [], []
    block = document.begin()
    while block.isValid():  # every block, code and list items and table cells too, separated by "\n"
        positions += [*range(block.position(), block.position() + len(block.text())), -1]  # -1: the separator
        shown.append(block.text() + "\n")
        block = block.next()
    where = align_shown(markdown, "".join(shown))
    marked = [p for p, source in zip(positions, where) if p >= 0 and source >= 0 and is_drafted[source]]
    fmt = QTextCharFormat()
    fmt.setBackground(colour)
    cursor = QTextCursor(document)
    for first, last in _runs(marked):
        cursor.setPosition(first)
        cursor.setPosition(last + 1, QTextCursor.MoveMode.KeepAnchor)
        cursor.mergeCharFormat(fmt)


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Increasing positions as runs of consecutive ones, ``(first, last)``."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    return runs


def _style_document(document: QTextDocument, theme: TranscriptTheme) -> None:
    """Colour what markdown made: code blocks and inline code get a shade, links the palette's link.

    Qt's markdown importer marks fenced code blocks with ``BlockCodeFence`` and inline code with a
    fixed-pitch font but sets no colours, and its links keep the link colour of the moment they
    were inserted; without this a dark theme would show code on nothing and links in dark blue.
    """
    code_block = QTextBlockFormat()
    code_block.setBackground(QColor(theme.code))
    code_text, link = QTextCharFormat(), QTextCharFormat()
    code_text.setBackground(QColor(theme.code))
    link.setForeground(QColor(theme.link))
    blocks, spans = [], []
    block = document.begin()
    while block.isValid():
        if block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence):
            blocks.append(block.position())
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            fmt = fragment.charFormat()
            if fmt.isAnchor() or fmt.fontFixedPitch():
                spans.append((fragment.position(), fragment.length(), link if fmt.isAnchor() else code_text))
            it += 1
        block = block.next()
    cursor = QTextCursor(document)
    for position in blocks:
        cursor.setPosition(position)
        cursor.mergeBlockFormat(code_block)
    for position, length, fmt in spans:
        cursor.setPosition(position)
        cursor.setPosition(position + length, QTextCursor.MoveMode.KeepAnchor)
        cursor.mergeCharFormat(fmt)
