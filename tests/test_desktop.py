"""The desktop window with real widgets (offscreen), the real worker thread and the bundled model."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402

from backends.core.types import ROLLBACK  # noqa: E402
from backends.drafters import REGISTRY  # noqa: E402
from backends.hardware.gpus import NvmlSession  # noqa: E402
from backends.models.llama_lib import gpu_runtime  # noqa: E402
from backends.models.catalog import resolve_model  # noqa: E402
from desktop.charts import NO_GPU  # noqa: E402
from desktop.store import StoredMessage  # noqa: E402
from tests.desktop_kit import (ANSWER_TIMEOUT, BUNDLED, LOAD_TIMEOUT, Recorder, close_window,  # noqa: E402,F401
                               home, open_window, send, window)
from tests.hw_replay import load_replay  # noqa: E402


def test_window_opens_with_the_bundled_model_ready(qtbot, window):
    assert "smollm2-135m-q4_1" in window.windowTitle()  # the catalog id: it tells quantizations apart
    assert "ready" in window.status_label.text()
    # Where the model runs: the CPU, unless a GPU module passed its probe (then the device is named).
    running = gpu_runtime()
    assert f" · on {window.model.placement} · " in window.status_label.text()
    assert (window.model.placement == "CPU") == (running is None or running.backend is None)
    qtbot.waitUntil(lambda: "GPU backend: " in window.hardware_panel.text.text(), timeout=60_000)  # the same in Hardware
    assert window.chat.input.hasFocus() or window.focusWidget() is window.chat.input
    assert window.error_text() == ""
    hub = window.library.open_hub()  # the Hub dialog looks for heads for the loaded model
    assert hub.model_path == window.model.path and hub.heads_button.isEnabled()
    hub.hide()


def test_send_streams_tokens_fills_the_footer_and_the_charts(qtbot, window):
    window.sampling.max_tokens.setValue(48)
    rec = Recorder(window)
    send(qtbot, window, "Name three colors.")
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
    assert rec.steps > 1  # streamed step by step, not in one piece
    text = window.chat.transcript_text()
    assert "Name three colors." in text and window.chat.messages[-1].content == rec.finished.text
    assert "decode" in text and "tok/s" in text and "tau" in text and "TTFT" in text  # the stats footer
    qtbot.waitUntil(lambda: window.charts.points("tok_s") > 0 and window.charts.points("cpu_pct") > 0, timeout=5000)
    assert window.charts.points("tau") == rec.steps
    assert not window.sampler.has_gpu and window.charts.messages["gpu"] == NO_GPU  # the fixture's sampler reads no GPU
    assert window.charts.points("gpu_w") == 0


def test_charts_draw_a_recorded_gpu(qtbot, home):
    """The recorded RTX 4090 as the sampler's GPU: its power, temperature and VRAM are charted."""
    window = open_window(qtbot, home, autoload=None, gpus=NvmlSession(load_replay("nvml_rtx4090.json")))
    try:
        qtbot.waitUntil(lambda: min(window.charts.points(n) for n in ("gpu_w", "gpu_c", "vram_gib")) > 0, timeout=5000)
        assert window.charts.messages["gpu"] is None and window.charts.gpu_status_shown() is None
        assert window.charts.series["gpu_w"][-1][1] == pytest.approx(27.345)  # the recording: 27 345 mW, 36 C
        assert window.charts.series["gpu_c"][-1][1] == 36.0
    finally:
        close_window(window)


def test_stop_mid_answer_and_the_next_message_works(qtbot, window):
    window.sampling.max_tokens.setValue(3000)
    rec = Recorder(window)
    send(qtbot, window, "Count from 1 to 1000, one number per line.")
    qtbot.waitUntil(lambda: rec.steps >= 5, timeout=ANSWER_TIMEOUT)
    qtbot.keyClick(window, Qt.Key.Key_Escape)
    qtbot.waitUntil(rec.done, timeout=10_000)
    assert rec.finished.reason == "cancelled" and rec.finished.stats.new_tokens < 3000
    assert "stopped: cancelled" in window.chat.transcript_text()
    assert not window.chat.streaming and window.chat.send_button.isEnabled()
    window.sampling.max_tokens.setValue(16)
    again = Recorder(window)
    send(qtbot, window, "Say hello.")
    qtbot.waitUntil(again.done, timeout=ANSWER_TIMEOUT)
    assert again.finished.reason in ("eos", "length", "stop")


def test_a_chat_longer_than_the_context_drops_its_oldest_turns(qtbot, window):
    window.load_model(BUNDLED, 512)
    qtbot.waitUntil(lambda: window.model is not None and window.model.n_ctx == 512, timeout=LOAD_TIMEOUT)
    window.sampling.max_tokens.setValue(8)
    notices: list[str] = []
    window.worker.notice.connect(notices.append)
    long_text = "Here is a long note about gardening, watering, soil and light. " * 12
    for i in range(4):
        rec = Recorder(window)
        send(qtbot, window, f"{i}: {long_text}")
        qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
        assert rec.finished.reason != "cancelled" and window.error_text() == ""
    assert notices and "oldest message" in notices[-1]
    assert len(window.chat.messages) == 8  # the window keeps the whole conversation; only the prompt is cut


def test_regenerate_and_edit_last_message(qtbot, window):
    window.sampling.max_tokens.setValue(12)
    rec = Recorder(window)
    send(qtbot, window, "Name a fruit.")
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
    rec.finished = None
    window.chat.regenerate_button.click()
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
    assert [m.role for m in window.chat.messages] == ["user", "assistant"]
    window.chat.edit_button.click()  # like the message's own edit link: nothing is dropped until resend
    assert window.chat.input.toPlainText() == "Name a fruit." and window.chat.editing == 0
    assert [m.role for m in window.chat.messages] == ["user", "assistant"]
    window.chat.input.setPlainText("Name a vegetable.")
    rec.finished = None
    window.chat.send_button.click()
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
    assert [(m.role, m.content) for m in window.chat.messages][0] == ("user", "Name a vegetable.")
    assert len(window.chat.messages) == 2 and window.chat.editing is None


def test_method_chooser_labels_fit_and_greys_out_what_cannot_run(qtbot, window):
    qtbot.waitUntil(lambda: window.methods.advice is not None, timeout=60_000)
    labels = [window.methods.items.item(i).text() for i in range(window.methods.items.rowCount())]
    assert any(label.startswith("pld") and "runs on CPU" in label for label in labels)
    why = window.methods.disabled_reason("draft")
    assert why is not None and "draft model" in why  # no smaller model with SmolLM2's vocabulary is loaded
    # no file can draft for the bundled Q4_1: the picker shows so, not a greyed-out file as if picked
    drafts = window.methods.draft_box
    assert drafts.currentIndex() == -1 and "none usable" in drafts.placeholderText()
    assert not any(window.methods.draft_items.item(i).isEnabled() for i in range(window.methods.draft_items.rowCount()))
    assert not window.methods.load_draft.isEnabled()
    assert window.methods.recommended.text().startswith("Recommended:")
    assert window.methods.disabled_reason("pld") is None and window.methods.select("pld")
    assert "MiB" in window.methods.memory.text()  # the memory terms of the chosen method
    assert not window.compare.checks["draft"].isEnabled()

    # A recurrent model (Mamba, RWKV) offers no rollback: everything that drafts is greyed out, and
    # the chosen pld falls back to plain decoding, in the chooser and in the comparison panel.
    window.methods.set_advice(window.methods.advice, window.model.offers - {ROLLBACK})
    assert window.methods.method() == "ar" and window.methods.disabled_reason("ar") is None
    for name in set(REGISTRY) - {"ar"}:
        assert "cache can forget rejected guesses" in (window.methods.disabled_reason(name) or ""), name
    assert not window.compare.checks["pld"].isEnabled() and window.compare.checks["ar"].isChecked()  # ar: always run


def test_comparison_runs_ar_and_pld_and_marks_identical_output(qtbot, window):
    window.sampling.max_tokens.setValue(32)
    # Propose on every match: with the planner on, pld may rightly draft nothing here (its cost
    # curve, measured by an earlier test on this machine, says it cannot pay) and leave no acceptance.
    window.methods.form_of["pld"].editors["adaptive"].setChecked(False)
    window.tabs.setCurrentWidget(window.compare)
    window.compare.prompt.setPlainText("Repeat this list exactly: apples, pears, plums, cherries, grapes, melons.")
    for name, box in window.compare.checks.items():
        box.setChecked(name in ("ar", "pld"))
    window.compare.run_button.click()
    qtbot.waitUntil(lambda: not window.compare.running, timeout=ANSWER_TIMEOUT)
    table = window.compare.table
    rows = {table.item(r, 0).text(): [table.item(r, c).text() for c in range(table.columnCount())] for r in range(table.rowCount())}
    assert set(rows) == {"ar", "pld"}
    assert rows["ar"][2] == "1.00x"
    assert rows["pld"][-1] == "yes" or "near-tie" in rows["pld"][-1]
    assert rows["ar"][5] == "-" and all(p.isdigit() for p in rows["pld"][5].split())  # acceptance by depth, in percent
    assert window.compare.panes["pld"].toPlainText().strip()
    # a method its gate kept from drafting (a head that does not pay here) says why under the table
    from dataclasses import replace

    done = window.compare.last
    why = "drafting lost to plain decoding here: 0.67x its speed in the steps that drafted"
    window.compare.show_result(replace(done, rows=tuple(replace(r, declined=why) if r.method == "pld" else r
                                                        for r in done.rows)))
    assert f"pld drafted nothing: {why}." in window.compare.note.text()
    window.compare.show_result(done)
    assert "drafted nothing" not in window.compare.note.text()
    assert window.compare.history.count() == 1  # kept, reloadable
    window.compare.history.itemClicked.emit(window.compare.history.item(0))
    assert window.compare.table.rowCount() == 2


def test_corrupt_model_shows_an_error_and_the_app_keeps_working(qtbot, window, home):
    broken = home / "broken.gguf"
    with open(resolve_model(BUNDLED), "rb") as src:
        broken.write_bytes(src.read(4 << 20))  # a real header, the weights cut off
    window.load_model(str(broken))
    qtbot.waitUntil(lambda: bool(window.error_text()), timeout=LOAD_TIMEOUT)
    error = window.error_text()
    assert "could not be loaded" in error and ("corrupt" in error or "truncated" in error)
    assert window.model is not None and "smollm2-135m-q4_1" in window.windowTitle()  # the working model stays
    qtbot.waitUntil(lambda: not window.busy, timeout=LOAD_TIMEOUT)
    rec = Recorder(window)
    window.sampling.max_tokens.setValue(8)
    send(qtbot, window, "Hello again.")
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)


def test_an_unreadable_conversations_file_is_kept_aside_and_the_window_opens(qtbot, home):
    """A damaged conversations file (a partial copy, a disk error) stopped the app at start with a
    traceback; now it is renamed, never deleted, the banner says where it is, and chat goes on."""
    damaged = home / "conversations.sqlite3"
    damaged.write_bytes(b"not a database " * 100)
    window = open_window(qtbot, home, autoload=None)
    try:
        kept = [p for p in home.iterdir() if p.name.startswith("conversations.sqlite3.unreadable-")]
        assert len(kept) == 1 and kept[0].read_bytes() == b"not a database " * 100
        assert "could not be read" in window.error_text() and kept[0].name in window.error_text()
        window.chat.new_chat()
        window.chat.messages.append(StoredMessage("user", "Still here?"))
        window.chat.save()
        assert [c.title for c in window.chat.store.list()][0] == "Still here?"  # the new file works
    finally:
        close_window(window)


def test_conversation_and_settings_survive_a_restart(qtbot, home):
    first = open_window(qtbot, home)
    first.sampling.max_tokens.setValue(8)
    first.sampling.temperature.setValue(0.7)
    rec = Recorder(first)
    send(qtbot, first, "Remember the word pineapple.")
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
    close_window(first)
    second = open_window(qtbot, home)
    try:
        assert "Remember the word pineapple." in second.chat.transcript_text()
        assert [m.content for m in second.chat.messages] == ["Remember the word pineapple.", rec.finished.text]
        assert second.sampling.temperature.value() == pytest.approx(0.7)
        assert second.chat.list.count() >= 1
    finally:
        close_window(second)


def test_loading_can_be_cancelled(qtbot, home):
    window = open_window(qtbot, home, autoload=None)
    try:
        window.load_model("smollm2-135m-f16")
        window.stop()  # cancelled before or during the load: either way nothing half-loaded stays
        qtbot.waitUntil(lambda: not window.busy and window._load is None, timeout=LOAD_TIMEOUT)
        assert window.model is None or window.model.model == "smollm2-135m-f16"
    finally:
        close_window(window)
