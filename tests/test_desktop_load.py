"""A load that fails keeps the model that worked (issue: a truncated GGUF left "No model loaded").

Real window, real worker thread, the bundled model loaded; then files that cannot load: a
truncated copy of the bundled GGUF (refused from its header, in words, before anything is
unloaded, and refused from the library row already marked unreadable) and a valid GGUF of an
architecture llama.cpp does not know (refused by llama.cpp itself).
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from backends.models.catalog import resolve_model  # noqa: E402
from tests.desktop_kit import ANSWER_TIMEOUT, LOAD_TIMEOUT, Recorder, home, send, window  # noqa: E402,F401
from tests.test_gguf_fuzz import tiny_gguf  # noqa: E402


def truncated_copy(folder):
    folder.mkdir(exist_ok=True)
    out = folder / "truncated.gguf"
    with open(resolve_model("smollm2-135m-q4_1"), "rb") as src:
        out.write_bytes(src.read(40_000_000))
    return out


def still_answers(qtbot, window) -> None:
    rec = Recorder(window)
    send(qtbot, window, "Say hello.")
    qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
    assert rec.finished is not None and rec.finished.text.strip()


@pytest.mark.parametrize("kind,tight", [("truncated", False), ("unknown architecture", False),
                                        ("unknown architecture", True)])
def test_a_failed_load_keeps_the_working_model(qtbot, window, tmp_path, monkeypatch, kind, tight):
    """``tight``: RAM too small for both models, so the worker unloads first and reopens the old one."""
    if tight:
        monkeypatch.setattr("desktop.worker._room_for_both", lambda session, config: False)
    before = window.model
    bad = truncated_copy(tmp_path / "m") if kind == "truncated" else tiny_gguf(tmp_path / "strange.gguf", "notanarch")
    window.load_model(str(bad))
    qtbot.waitUntil(lambda: "could not be loaded" in window.error_text(), timeout=LOAD_TIMEOUT)
    qtbot.waitUntil(lambda: not window.busy, timeout=LOAD_TIMEOUT)
    assert (window.model.model, window.model.path, window.model.n_ctx) == (before.model, before.path, before.n_ctx)
    assert (window.model is before) != tight  # kept as it was, or reopened when both did not fit
    banner = window.error_text()
    assert ("truncated" in banner) if kind == "truncated" else ("unknown model architecture" in banner), banner
    assert "llama_model_load" not in banner and "\n" not in banner  # words, not llama.cpp's log
    assert "kept" in window.status_label.text() and before.name in window.status_label.text()
    assert not window.progress.isVisible()
    still_answers(qtbot, window)


def test_a_row_marked_unreadable_is_refused_with_its_reason(qtbot, window, tmp_path):
    folder = tmp_path / "models"
    truncated_copy(folder)
    window.library.add_folder(str(folder))
    spec = str(folder / "truncated.gguf")
    qtbot.waitUntil(lambda: spec in window.library.unreadable, timeout=LOAD_TIMEOUT)
    row = window.library._row_of(spec)
    with qtbot.assertNotEmitted(window.load_request):
        window.library.table.selectRow(row)
        window.library.load_button.click()
    assert "truncated.gguf cannot be loaded" in window.error_text() and "truncated" in window.error_text()
    assert window.model is not None
    still_answers(qtbot, window)
