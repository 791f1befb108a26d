"""The Models panel and the title say which model is which (issue: derived rows stayed "made on
first use" after they were made; every SmolLM2 quantization was called by the GGUF's internal
name; the title read "SpecDeck — ... — SpecDeck")."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtGui import QGuiApplication  # noqa: E402

from backends.models.catalog import CATALOG  # noqa: E402
from tests.desktop_kit import LOAD_TIMEOUT, close_window, open_window  # noqa: E402


def _row(window, spec):
    return window.library._row_of(spec)


def _cell(window, spec, col):
    item = window.library.table.item(_row(window, spec), col)
    return item.text() if item is not None else ""


def test_a_derived_row_fills_in_once_made_and_names_tell_quantizations_apart(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(tmp_path / "cache"))  # nothing derived yet
    old_name = QGuiApplication.applicationDisplayName()
    QGuiApplication.setApplicationDisplayName("SpecDeck")
    window = open_window(qtbot, tmp_path, autoload=None)
    try:
        spec = "smollm2-135m-q8_0"
        qtbot.waitUntil(lambda: _cell(window, spec, 6) == "made on first use", timeout=LOAD_TIMEOUT)
        table = window.library.table
        for row in range(table.rowCount()):  # every name whole: the quantization is what tells rows apart
            name = table.item(row, 0).text()
            assert table.fontMetrics().horizontalAdvance(name) < table.columnWidth(0), name
        assert "made on first use" in window.library.table.item(_row(window, spec), 0).toolTip()
        for gemma in ("gemma3-270m-q4_k_m", "gemma3-270m-f16"):
            tip = window.library.table.item(_row(window, gemma), 0).toolTip()
            assert "bundled" not in tip and (tip.endswith(".gguf") or CATALOG[gemma].description in tip)
        window.load_model(spec, 1024)
        qtbot.waitUntil(lambda: window.model is not None, timeout=LOAD_TIMEOUT)
        qtbot.waitUntil(lambda: _cell(window, spec, 5).endswith("MiB"), timeout=LOAD_TIMEOUT)
        assert _cell(window, spec, 3) == "Q8_0" and window.library.table.item(_row(window, spec), 0).toolTip().endswith(".gguf")
        assert window.model.name == spec and spec in window.status_label.text()
        assert window.windowTitle() == spec  # Qt adds " — SpecDeck" itself
        window.load_model("smollm2-135m-q4_1", 1024)
        qtbot.waitUntil(lambda: window.model is not None and window.model.model == "smollm2-135m-q4_1", timeout=LOAD_TIMEOUT)
        assert "smollm2-135m-q4_1" in window.status_label.text() and spec not in window.status_label.text()
    finally:
        close_window(window)
        QGuiApplication.setApplicationDisplayName(old_name)


def test_a_hugging_face_folder_is_listed_runs_on_pytorch_and_answers(qtbot, tmp_path, monkeypatch, smollm_hf_folder):
    """A safetensors folder in an added library folder: picking it switches "Run with" to PyTorch,
    it loads there (the status bar says so) and answers; a GGUF picked afterwards can still run on
    llama.cpp, and the choice is kept for the next start."""
    from tests.desktop_kit import ask

    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path / "data"))
    models = tmp_path / "models"
    models.mkdir()
    folder = smollm_hf_folder(models / "smollm2-hf")
    window = open_window(qtbot, tmp_path, autoload=None)
    try:
        library = window.library
        library.add_folder(str(models))
        row = _row(window, str(folder))
        assert row is not None and "safetensors" in library.table.item(row, 0).text()
        assert library.backend.currentData() == "llamacpp"
        library.table.setCurrentCell(row, 0)
        assert library.backend.currentData() == "torch"
        library._load_row(row)
        qtbot.waitUntil(lambda: window.model is not None and not window.busy, timeout=LOAD_TIMEOUT)
        assert window.model.backend == "torch" and "PyTorch" in window.status_label.text()
        recorder = ask(qtbot, window, "Name three primary colors.")
        assert recorder.finished is not None and recorder.finished.tokens and recorder.steps > 0
        window.save_settings()
        assert window.settings.value("model/backend") == "torch"
        library.set_backend("llamacpp")
        window.load_model("smollm2-135m-q4_1", 1024, backend=library.backend.currentData())
        qtbot.waitUntil(lambda: window.model is not None and window.model.model == "smollm2-135m-q4_1", timeout=LOAD_TIMEOUT)
        assert window.model.backend == "llamacpp" and "PyTorch" not in window.status_label.text()
    finally:
        close_window(window)
