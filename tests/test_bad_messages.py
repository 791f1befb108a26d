"""Bad messages get a clear answer and lose nothing: an empty message (window and terminal chat),
one message longer than the context (window). Real widgets offscreen, the real worker thread, the
bundled model; the terminal chat as a real process."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import subprocess  # noqa: E402
import sys  # noqa: E402

from PySide6.QtCore import Qt  # noqa: E402

from tests.desktop_kit import (ANSWER_TIMEOUT, BUNDLED, LOAD_TIMEOUT, Recorder, ask, home,  # noqa: E402,F401
                               send, shown, stored, window)


# -- an empty message -----------------------------------------------------------------------------
def test_an_empty_message_is_not_sent_and_the_window_says_so(qtbot, window):
    chat = window.chat
    window.sampling.max_tokens.setValue(4)
    ask(qtbot, window, "Name a fruit.")
    before = shown(chat)
    requests: list = []
    window.answer_request.connect(requests.append)
    chat.send_requested.connect(requests.append)
    for text in ("", "   ", "\n\t  \n"):
        chat.notice.hide()
        chat.input.setPlainText(text)
        qtbot.keyClick(chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
        assert chat.notice.isVisible() and "empty" in chat.notice.text(), repr(text)
        assert requests == [] and not chat.streaming
        assert shown(chat) == before and stored(chat) == before
        assert chat.input.toPlainText() == text  # what was typed stays where it was
    chat.notice.hide()
    chat.input.clear()
    chat.send_button.click()
    assert chat.notice.isVisible() and requests == []

    # Emptying a message being edited and resending it drops nothing: the edit goes on.
    assert chat.begin_edit(0)
    chat.input.setPlainText("  ")
    chat.send_button.click()
    assert chat.editing == 0 and chat.notice.isVisible() and requests == []
    assert shown(chat) == before and stored(chat) == before
    chat.cancel_edit()

    rec = Recorder(window)
    send(qtbot, window, "Name a colour.")
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
    assert len(requests) == 2  # the panel's request and the window's, for the one real message
    assert shown(chat) == before + [("user", "Name a colour."), ("assistant", rec.finished.text)]
    assert window.error_text() == ""


def test_an_empty_message_in_the_terminal_chat_is_not_sent(tmp_path):
    """A real ``specdeck chat`` through a pipe: blank lines get a notice, no answer and no turn."""
    env = {**os.environ, "SPECDECK_DATA_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "backends.cli", "chat", "--max-new-tokens", "8"],
                            input="\n   \n\t\nSay hi.\n\n", capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("(empty message: nothing sent)") == 4
    assert out.count("assistant> ") == 1 and "you> Say hi." in out
    assert len([line for line in out.splitlines() if line.startswith("[pld")]) == 1
    assert "Traceback" not in result.stderr


# -- one message longer than the context ---------------------------------------------------------
def test_a_message_longer_than_the_context_is_refused_and_nothing_is_lost(qtbot, window):
    qtbot.waitUntil(lambda: not window.busy, timeout=LOAD_TIMEOUT)  # "ready" arrives just before "not busy"
    window.load_model(BUNDLED, 512)
    qtbot.waitUntil(lambda: window.model is not None and window.model.n_ctx == 512, timeout=LOAD_TIMEOUT)
    model, chat = window.model, window.chat
    window.sampling.max_tokens.setValue(8)
    notices: list[str] = []
    window.worker.notice.connect(notices.append)
    ask(qtbot, window, "Name a fruit.")
    ask(qtbot, window, "Name a colour.")
    before = shown(chat)

    long_text = "A very long note about soil, water and light in the garden. " * 60  # ~800 tokens
    send(qtbot, window, long_text)
    qtbot.waitUntil(lambda: not chat.streaming and bool(window.error_text()), timeout=ANSWER_TIMEOUT)
    error = window.error_text()
    assert "too long" in error and "context holds 512" in error and "Traceback" not in error
    assert "too long" in chat.transcript_text()  # the error in words under the conversation
    assert shown(chat) == before and stored(chat) == before  # the conversation as it was
    assert chat.input.toPlainText() == long_text.strip()  # the text back in the box, to shorten
    assert notices == []  # no earlier turn was left out for a message that cannot fit anyway
    assert window.model is model and "ready" in window.status_label.text()

    # Resending an earlier message edited to something too long keeps the turns after it.
    assert chat.begin_edit(2)
    chat.input.setPlainText(long_text)
    chat.send_button.click()
    qtbot.waitUntil(lambda: not chat.streaming, timeout=ANSWER_TIMEOUT)
    assert shown(chat) == before and stored(chat) == before
    assert chat.editing == 2 and chat.input.toPlainText() == long_text.strip()
    chat.cancel_edit()
    assert chat.editing is None and shown(chat) == before

    requests: list = []
    window.answer_request.connect(requests.append)
    rec = ask(qtbot, window, "Say hello.")  # the next short message answers with the whole conversation
    assert rec.finished.reason in ("eos", "length") and rec.finished.stats.new_tokens > 0
    asked = [(m["role"], m["content"]) for m in requests[0].messages if m["role"] != "system"]
    assert asked == before + [("user", "Say hello.")]
    assert notices == []  # and the worker left none of them out
    assert shown(chat) == before + [("user", "Say hello."), ("assistant", rec.finished.text)]
    assert "too long" not in chat.transcript_text()
    assert window.model is model
