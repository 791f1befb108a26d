"""The chat side of the desktop window: editing earlier messages, following a light/dark switch,
answering with a draft model picked in the method panel. Real widgets offscreen, the real worker
thread and real models (the bundled SmolLM2 and the catalog's derived variants)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import re  # noqa: E402
import sqlite3  # noqa: E402

import pytest  # noqa: E402

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QColor, QPalette, QTextCursor, QTextFormat  # noqa: E402
from PySide6.QtWidgets import QApplication, QMenu, QTextBrowser  # noqa: E402

from backends.core.types import RunStats  # noqa: E402
from backends.models.catalog import resolve_model  # noqa: E402
from desktop.chat import ChatPanel, Rendered, TranscriptTheme, align_shown, drafted_runs, markdown_source  # noqa: E402
from desktop.main_window import MainWindow  # noqa: E402
from desktop.store import ConversationStore, StoredMessage  # noqa: E402
from desktop.train import TrainDialog  # noqa: E402
from tests.desktop_kit import (ANSWER_TIMEOUT, LOAD_TIMEOUT, Recorder, ask, close_window, home,  # noqa: E402,F401
                               open_window, stored, window)

SMOLLM_F16 = "smollm2-135m-f16"


def fragments(browser: QTextBrowser):
    """Every text fragment of the transcript, with the block it sits in."""
    block = browser.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            yield block, it.fragment()
            it += 1
        block = block.next()


def links(browser: QTextBrowser) -> list[str]:
    return [f.charFormat().anchorHref() for _, f in fragments(browser) if f.charFormat().isAnchor()]


def click_link(qtbot, browser: QTextBrowser, href: str) -> None:
    """Click a transcript link with the mouse, in the middle of where the document laid it out."""
    fragment = next(f for _, f in fragments(browser) if f.charFormat().anchorHref() == href)
    cursor = QTextCursor(browser.document())
    cursor.setPosition(fragment.position() + fragment.length() // 2)
    browser.setTextCursor(cursor)
    browser.ensureCursorVisible()
    qtbot.mouseClick(browser.viewport(), Qt.MouseButton.LeftButton, pos=browser.cursorRect(cursor).center())


# -- editing an earlier message ------------------------------------------------------------------
def test_edit_an_earlier_message_cancel_then_resend(qtbot, window):
    chat = window.chat
    window.sampling.max_tokens.setValue(8)
    questions = ["Name a fruit.", "Name a colour.", "Name an animal."]
    for q in questions:
        ask(qtbot, window, q)
    before = [(m.role, m.content) for m in chat.messages]
    assert len(before) == 6 and stored(chat) == before
    assert links(chat.transcript) == ["edit:0", "copy:1", "edit:2", "copy:3", "edit:4", "copy:5"]  # edit asks, copy answers
    click_link(qtbot, chat.transcript, "copy:3")
    assert QApplication.clipboard().text() == before[3][1] and "copied" in chat.notice.text()

    # Click "edit" on the first message, then Esc: nothing changes and the box gets its text back.
    chat.input.setPlainText("half-typed")
    click_link(qtbot, chat.transcript, "edit:0")
    assert chat.editing == 0 and chat.input.toPlainText() == "Name a fruit."
    assert chat.cancel_edit_button.isVisible() and chat.send_button.text() == "Resend"
    assert "(being edited)" in chat.transcript_text()
    assert chat.input.hasFocus()
    qtbot.keyClick(chat.input, Qt.Key.Key_Escape)
    assert chat.editing is None and not chat.cancel_edit_button.isVisible()
    assert chat.input.toPlainText() == "half-typed"
    assert [(m.role, m.content) for m in chat.messages] == before and stored(chat) == before

    # The Cancel button does the same.
    click_link(qtbot, chat.transcript, "edit:2")
    chat.cancel_edit_button.click()
    assert chat.editing is None and chat.input.toPlainText() == "half-typed" and stored(chat) == before

    # Edit the middle message and resend: it is replaced, the turns after it are gone, and it is answered again.
    click_link(qtbot, chat.transcript, "edit:2")
    assert chat.input.toPlainText() == "Name a colour."
    chat.input.setPlainText("Name a vegetable.")
    rec = Recorder(window)
    qtbot.keyClick(chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    assert chat.streaming and chat.editing is None
    assert links(chat.transcript) == []  # no edit or copy links while an answer streams
    assert not chat.begin_edit(0) and chat.editing is None  # refused, with a notice saying why
    assert chat.notice.isVisible() and "Stop the answer" in chat.notice.text()
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)

    expected = [("user", "Name a fruit."), before[1], ("user", "Name a vegetable."), ("assistant", rec.finished.text)]
    assert [(m.role, m.content) for m in chat.messages] == expected
    assert stored(chat) == expected  # the SQLite store dropped the later turns too
    assert chat.messages[-1].stats is not None
    text = chat.transcript_text()
    assert "Name a colour." not in text and "Name an animal." not in text and "Name a vegetable." in text
    assert links(chat.transcript) == ["edit:0", "copy:1", "edit:2", "copy:3"]
    assert chat.send_button.text() == "Send" and chat.input.toPlainText() == ""


def test_editing_the_first_message_renames_the_conversation(qtbot, window):
    chat = window.chat
    window.sampling.max_tokens.setValue(4)
    ask(qtbot, window, "Old title question")
    assert chat.list.currentItem().text() == "Old title question"
    assert chat.begin_edit(0)
    assert not chat.begin_edit(1)  # an answer is not editable
    chat.input.setPlainText("New title question")
    rec = Recorder(window)
    chat.send_button.click()
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
    assert stored(chat) == [("user", "New title question"), ("assistant", rec.finished.text)]
    assert chat.list.currentItem().text() == "New title question" == chat.list.currentItem().toolTip()


STATS = RunStats(method="pld", prompt_tokens=12, reused_tokens=0, new_tokens=9, forwards=6, drafted=4, accepted=3,
                 prefill_s=0.05, ttft_s=0.06, decode_s=0.1, first_step_tokens=1, draft_s=0.0, verify_s=0.09, accept_s=0.0,
                 drafted_at=(4,), accepted_at=(3,), finish_reason="eos")


def test_conversations_are_renamed_in_place_exported_as_markdown_and_deleted_from_the_list(qtbot, tmp_path):
    store = ConversationStore(tmp_path / "conversations.sqlite3")
    first, second = store.create(), store.create()
    store.replace_messages(first, [StoredMessage("user", "Name a fruit."),
                                   StoredMessage("assistant", "**Apple**, and:\n\n```\npear\n```", STATS.to_dict())])
    store.replace_messages(second, [StoredMessage("user", "Name a colour.")])
    chat = ChatPanel(store)
    qtbot.addWidget(chat)
    titles = lambda: [chat.list.item(i).text() for i in range(chat.list.count())]  # noqa: E731
    assert titles() == ["Name a colour.", "Name a fruit."]

    item = chat.list.item(1)
    assert item.flags() & Qt.ItemFlag.ItemIsEditable  # F2 or the menu's Rename edits it in place
    item.setText("  Fruit   talk ")  # what the in-place editor commits
    qtbot.waitUntil(lambda: "Fruit talk" in titles(), timeout=2000)
    chat.open(first)
    chat.messages.append(StoredMessage("user", "Another one?"))
    chat.save()  # a later turn keeps the user's title
    assert [c.title for c in store.list() if c.id == first] == ["Fruit talk"]
    store.rename(first, "")  # an empty title gives the naming back to the first message
    assert [c.title for c in store.list() if c.id == first] == ["Name a fruit."]
    store.rename(first, "Fruit talk")

    out = tmp_path / "fruit.md"
    chat.export_markdown(first, out)
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# Fruit talk\n")
    assert "## You\n\nName a fruit." in text and "## SpecDeck\n\n**Apple**, and:\n\n```\npear\n```" in text
    assert "[pld" in text and text.index("[pld") > text.index("pear")  # the stats line after its answer
    with pytest.raises(OSError):
        chat.export_markdown(first, tmp_path / "missing" / "x.md")  # the dialog turns this into a notice

    chat._list_menu(chat.list.visualItemRect(chat.list.item(0)).center())  # the list's right-click menu
    menu = chat.findChildren(QMenu)[-1]
    assert [a.text() for a in menu.actions()] == ["Rename", "Export as Markdown ...", "Delete"]
    menu.close()
    chat.delete_chat(second)  # the menu's Delete: not the open conversation
    assert titles() == ["Fruit talk"] and chat.conversation == first
    chat.new_chat()
    fresh = chat.conversation
    chat.new_chat()  # pressed again on the empty new chat: no second empty one
    assert fresh != first and chat.conversation == fresh and len(titles()) == 2
    chat.open(first)
    store.close()

    old = tmp_path / "old.sqlite3"  # a store written before titles could be renamed opens and renames
    with sqlite3.connect(old) as db:
        db.executescript("CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, "
                         "system TEXT NOT NULL DEFAULT '', updated REAL NOT NULL);"
                         "INSERT INTO conversations VALUES (1, 'Kept', '', 0);")
    db.close()
    again = ConversationStore(old)
    again.rename(1, "Renamed")
    assert [c.title for c in again.list()] == ["Renamed"]
    again.close()


def test_a_saved_conversation_opens_with_code_first_and_stats_it_cannot_read(qtbot, tmp_path):
    store = ConversationStore(tmp_path / "conversations.sqlite3")
    conversation = store.create()
    store.replace_messages(conversation, [StoredMessage("user", "```\nprint(1)\n```\nWhat does this print?"),
                                          StoredMessage("assistant", "It prints 1.", {"method": "ar", "unknown": 1})])
    chat = ChatPanel(store)
    qtbot.addWidget(chat)
    assert chat.conversation == conversation and "It prints 1." in chat.transcript_text()
    assert "[ar" not in chat.transcript_text()  # stats from another version: no footer, and no crash
    assert code_lines(chat) == ["print(1)"]  # a message opening with code keeps its first line as code
    store.close()


# -- light / dark ---------------------------------------------------------------------------------
def dark_palette() -> QPalette:
    palette = QPalette()
    for role, colour in ((QPalette.ColorRole.Window, "#202124"), (QPalette.ColorRole.WindowText, "#e8eaed"),
                         (QPalette.ColorRole.Base, "#1b1b1d"), (QPalette.ColorRole.AlternateBase, "#2a2a2d"),
                         (QPalette.ColorRole.Text, "#e8eaed"), (QPalette.ColorRole.Button, "#2d2e31"),
                         (QPalette.ColorRole.ButtonText, "#e8eaed"), (QPalette.ColorRole.Link, "#8ab4f8"),
                         (QPalette.ColorRole.Highlight, "#3d6fb4"), (QPalette.ColorRole.HighlightedText, "#ffffff")):
        palette.setColor(role, QColor(colour))
    return palette


def transcript_colours(chat: ChatPanel) -> dict[str, set[str]]:
    """The colours the transcript actually shows, read back from its document."""
    out: dict[str, set[str]] = {"draft": set(), "footer": set(), "code": set(), "link": set()}
    for block, fragment in fragments(chat.transcript):
        fmt = fragment.charFormat()
        if block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence):
            out["code"].add(block.blockFormat().background().color().name())
        if fmt.isAnchor():
            out["link"].add(fmt.foreground().color().name())
        elif fragment.text().startswith("[pld"):
            out["footer"].add(fmt.foreground().color().name())
        elif fmt.background().style() != Qt.BrushStyle.NoBrush and not fmt.fontFixedPitch():
            out["draft"].add(fmt.background().color().name())
    return out


def code_lines(chat: ChatPanel) -> list[str]:
    """The transcript lines laid out as a code block."""
    lines, block = [], chat.transcript.document().begin()
    while block.isValid():
        if block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence):
            lines.append(block.text())
        block = block.next()
    return lines


def drawn_colour(label) -> str:
    """The colour a pyqtgraph text label is drawn in, read from its rendered text."""
    block = label.item.document().begin()
    return block.begin().fragment().charFormat().foreground().color().name()


def chart_colours(window: MainWindow) -> tuple[str, ...]:
    """Background, axis line, axis text, title, legend entries and the reference line's label."""
    charts = window.charts
    legend = {drawn_colour(label) for plot in (charts.accept, charts.host) for _, label in plot.legend.items}
    return (charts.view.backgroundBrush().color().name(), charts.speed.getAxis("left").pen().color().name(),
            charts.host.getAxis("bottom").textPen().color().name(), drawn_colour(charts.speed.titleLabel),
            *sorted(legend), charts.reference.label.textItem.defaultTextColor().name())


def test_charts_and_transcript_follow_a_palette_switch(qtbot, window):
    chat, app = window.chat, QApplication.instance()
    assert window.methods.select("pld")
    window.methods.form_of["pld"].editors["adaptive"].setChecked(False)  # propose on every match
    window.sampling.max_tokens.setValue(40)
    chat.colour.setChecked(True)
    ask(qtbot, window, "```\napples, pears, plums, cherries, grapes, melons\n```\n\nRepeat this list exactly.")
    light = transcript_colours(chat)
    assert light["draft"] and light["footer"] and light["code"] and light["link"]  # the answer drafted something
    lines = code_lines(chat)  # the question's block, and the answer's own where it writes one: nothing after them
    assert lines[0] == "apples, pears, plums, cherries, grapes, melons" and set(lines) == {lines[0]}
    original = app.palette()
    light_charts = chart_colours(window)
    assert light_charts[0] == original.base().color().name()
    dialog = TrainDialog("smollm2-135m-f16", "eagle", window)  # open through the switch, as a training run may be
    qtbot.addWidget(dialog)
    plots = (window.compare.chart, dialog.loss_plot, dialog.agree_plot)  # every other plot follows too
    plot_colours = lambda: {(p.backgroundBrush().color().name(), p.getAxis("left").textPen().color().name())  # noqa: E731
                            for p in plots}
    assert plot_colours() == {(original.base().color().name(), original.text().color().name())}
    dark = dark_palette()
    try:
        app.setPalette(dark)
        qtbot.waitUntil(lambda: chart_colours(window)[0] == "#1b1b1d", timeout=2000)
        assert chart_colours(window) == ("#1b1b1d",) + ("#e8eaed",) * 5
        qtbot.waitUntil(lambda: plot_colours() == {("#1b1b1d", "#e8eaed")}, timeout=2000)
        colours = transcript_colours(chat)
        theme = chat.theme
        assert chat.transcript.palette().base().color().name() == "#1b1b1d"
        assert colours == {"draft": {theme.draft}, "footer": {theme.muted}, "code": {theme.code}, "link": {"#8ab4f8"}}
        for name in ("draft", "footer", "code", "link"):
            assert colours[name] != light[name], name
        assert QColor(theme.draft).lightness() < 100 and QColor(theme.code).lightness() < 100  # dark shades
    finally:
        app.setPalette(original)
    qtbot.waitUntil(lambda: chart_colours(window) == light_charts, timeout=2000)
    assert transcript_colours(chat) == light


def test_shaded_drafted_tokens_sit_in_the_rendered_markdown_and_code_keeps_its_indentation(qtbot):
    """With "Colour drafted tokens" on (the default) the answer is still markdown: bold shows bold,
    a code fence shows as code with its indentation, and exactly the shown characters that came
    from drafts are shaded. (The shaded view drew the raw text before: "**", "```python" and all.)"""
    spans = [("Tips:\n\n1. **Water** ", False), ("them weekly.", True), ("\n\n```python\n", False),
             ("print", True), ("(1)\ndef water(plant):\n", False), ("    if plant.dry:", True),
             ("\n        plant.water(  2)\n```\n", False)]
    raw = "".join(text for text, _ in spans)
    theme = TranscriptTheme("#0000ff", "#777777", "#c2e1c5", "#eeeeee", "#c0392b")
    browser = QTextBrowser()
    qtbot.addWidget(browser)
    Rendered.of(raw, drafted_runs(spans, len(raw)), theme).insert(QTextCursor(browser.document()))
    shown = browser.toPlainText()
    assert "**" not in shown and "```" not in shown and "python" not in shown
    assert "    if plant.dry:\n        plant.water(  2)" in shown  # spaces kept
    bold = [f.text() for _, f in fragments(browser) if f.charFormat().fontWeight() >= 700]
    assert bold == ["Water"]
    shaded = "".join(f.text() for _, f in fragments(browser) if f.charFormat().background().color().name() == theme.draft)
    assert shaded == "them weekly.print    if plant.dry:"  # the drafted text, in order, and nothing else
    assert drafted_runs(spans, len(raw) - 5)[-1][1] <= len(raw) - 5  # a finished answer cut short keeps runs inside


def test_html_and_line_breaks_in_a_message_show_as_written_and_code_stays_code(qtbot):
    """Qt's markdown took tags for HTML and dropped them ("<select ...>" pasted by a user vanished,
    "the <br> tag" lost its tag) and ran single lines together; code spans and blocks are unchanged."""
    cases = {
        "Fix my page:\n<select id=\"a\"><option>1</option></select>\nplease":
            "Fix my page:\n<select id=\"a\"><option>1</option></select>\nplease",
        "Use the <br> tag.\nIngredients:\n2 eggs\n1 cup flour\n\nThen bake.":
            "Use the <br> tag.\nIngredients:\n2 eggs\n1 cup flour\nThen bake.",
        "Inline `<b>` and ``a`b``.\n```html\n<div>\n  x\n</div>\n```\nafter <p>":
            "Inline <b> and a`b.\n<div>\n  x\n</div>\nafter <p>",
    }
    theme = TranscriptTheme("#0000ff", "#777777", "#c2e1c5", "#eeeeee", "#c0392b")
    for raw, expected in cases.items():
        browser = QTextBrowser()
        qtbot.addWidget(browser)
        Rendered.of(raw, ((0, len(raw)),), theme).insert(QTextCursor(browser.document()))
        assert browser.toPlainText() == expected
        shaded = "".join(f.text() for _, f in fragments(browser) if f.charFormat().background().color().name() == theme.draft)
        assert shaded == expected.replace("\n", "")  # every character shown, all drafted: all shaded
        source, origin = markdown_source(raw)
        assert all(o < 0 or source[k] == raw[o] for k, o in enumerate(origin))  # offsets point at the same text


def test_the_shown_text_is_placed_in_the_markdown_it_came_from():
    raw = "See [the docs](https://example.com/a b) & *this*:\n```sh\nsh run.sh\n```"
    shown = "See the docs & this:\nsh run.sh"
    where = align_shown(raw, shown)
    assert [raw[j] if j >= 0 else None for j in where] == list(shown)
    assert where[shown.index("sh run")] == raw.index("sh run")  # not the fence's "sh"
    assert align_shown("a &amp; b", "a & b") == [0, 1, 2, 7, 8]  # the entity's "&", then on


# -- a draft model picked in the method panel -----------------------------------------------------
def test_draft_model_from_the_picker_answers_with_the_draft_method(qtbot, home, smollm_f16_path, gemma_path):
    resolve_model("smollm2-135m-q8_0")  # made on first use, like the F16 target and Gemma (conftest)
    window = open_window(qtbot, home, autoload=SMOLLM_F16)  # the F16 target: smaller SmolLM2 files can draft
    try:
        methods = window.methods
        qtbot.waitUntil(lambda: methods.advice is not None, timeout=60_000)
        assert methods.disabled_reason("draft") is not None  # nothing loaded yet
        items = [methods.draft_items.item(i) for i in range(methods.draft_items.rowCount())]
        usable = {item.text(): item.data(Qt.ItemDataRole.UserRole) for item in items if item.isEnabled()}
        refused = {item.text(): item.toolTip() for item in items if not item.isEnabled()}
        assert {"SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-q8_0.gguf"} <= set(usable)
        assert not any("gemma" in name.lower() for name in usable)
        gemma_why = refused["gemma3-270m-q4_k_m.gguf (not usable)"]
        assert "tokenizer type differs" in gemma_why and "vocabulary sizes differ" in gemma_why

        q8 = usable["smollm2-135m-q8_0.gguf"]
        methods.draft_box.setCurrentIndex(methods.draft_box.findData(q8))
        advice = methods.advice
        methods.load_draft.click()
        qtbot.waitUntil(lambda: window.model is not None and window.model.draft_model == q8, timeout=LOAD_TIMEOUT)
        qtbot.waitUntil(lambda: methods.advice is not advice, timeout=60_000)
        assert methods.draft_box.currentData() == q8  # the picker still shows the loaded draft
        assert methods.disabled_reason("draft") is None and methods.select("draft")
        methods.form_of["draft"].editors["adaptive"].setChecked(False)  # draft every step, however it pays here

        window.sampling.max_tokens.setValue(24)
        rec = ask(qtbot, window, "Name three colors.")
        assert rec.finished.stats.method == "draft" and rec.finished.stats.drafted > 0
        footer = window.chat.transcript_text().strip().splitlines()[-1]
        assert footer.startswith("[draft ·")
        shown = re.search(r"acceptance (\d+)%", footer)
        assert shown and int(shown.group(1)) == round(100 * rec.finished.stats.acceptance_rate)
        assert window.error_text() == ""
    finally:
        close_window(window)
