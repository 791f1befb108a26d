"""Settings survive a relaunch as they were written (issue: one library folder read back as characters)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QSettings  # noqa: E402

from desktop.main_window import settings_list  # noqa: E402
from tests.desktop_kit import close_window, open_window  # noqa: E402


def test_lists_round_trip_through_the_ini_backend(tmp_path, qapp):
    path = str(tmp_path / "s.ini")
    for value in ([], ["/one/folder"], ["/a", "/b"]):
        s = QSettings(path, QSettings.Format.IniFormat)
        s.setValue("library/folders", value)
        s.sync()
        assert settings_list(QSettings(path, QSettings.Format.IniFormat), "library/folders") == value
    assert settings_list(QSettings(path, QSettings.Format.IniFormat), "never/written") == []


def test_one_added_folder_is_exactly_that_folder_after_a_relaunch(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path / "data"))
    folder = tmp_path / "models"
    folder.mkdir()
    window = open_window(qtbot, tmp_path, autoload=None)
    window.library.add_folder(str(folder))
    window.save_settings()
    close_window(window)
    again = open_window(qtbot, tmp_path, autoload=None)
    try:
        assert again.library.folders == [str(folder)]
    finally:
        close_window(again)


def test_a_method_form_offers_only_the_values_its_settings_accept(qapp):
    from backends.drafters.draft_model import DraftSettings
    from desktop.forms import DataclassForm

    form = DataclassForm(DraftSettings)
    spin, dspin = form.editors["max_draft"], form.editors["min_confidence"]
    assert (spin.minimum(), spin.maximum()) == (1, 32) and (dspin.minimum(), dspin.maximum()) == (0.0, 1.0)
    spin.setValue(100)  # typed past the bound: held at it, so what the form builds is valid
    assert DraftSettings(**form.values()).max_draft == 32
    form.deleteLater()
