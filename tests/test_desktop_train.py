"""The train dialog in the real window: a model without a head offers to train one, the dialog runs
the real ``specdeck train`` in a child process with live curves, and the method it unlocks can be
chosen afterwards, without reloading the model. Without torch, Start offers the torch add-on first.
Cancel stops the child and the window lives on."""

from __future__ import annotations

import json
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from tests.desktop_kit import LOAD_TIMEOUT, close_window, home, open_window  # noqa: E402,F401

pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")

TRAIN_TIMEOUT = 600_000


def _method_enabled(window, name: str) -> bool:
    return window.methods.disabled_reason(name) is None


def test_train_button_trains_heads_and_unlocks_medusa_and_eagle2(qtbot, home, gemma_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(home / "cache"))  # the recorded answers of this test only
    window = open_window(qtbot, home, autoload=str(gemma_path))
    try:
        qtbot.waitUntil(lambda: window.methods.advice is not None, timeout=LOAD_TIMEOUT)
        assert not _method_enabled(window, "medusa")
        assert "Train" in window.methods.disabled_reason("medusa")
        assert window.methods.train.isVisibleTo(window.methods)
        window.methods.train.click()
        dialog = window.train_dialog
        assert dialog is not None and dialog.isVisible()
        dialog.data.setCurrentIndex(dialog.data.findData("self"))  # questions the model writes itself
        assert dialog.arguments()[dialog.arguments().index("--data") + 1] == "self"
        dialog.show_event({"phase": "questions", "done": 3, "total": 10})
        assert dialog.progress.value() == 3 and "own questions: 3 of 10" in dialog.status.text()
        dialog.show_event({"phase": "reread", "done": 4, "total": 9, "tokens_per_s": 350.0, "eta_s": 90.0})
        assert dialog.progress.value() == 4 and "recorded answers again" in dialog.status.text()
        dialog.show_event({"phase": "data", "positions": 1200, "held_out": 60, "conversations": 9,
                           "device": "NVIDIA GeForce RTX 4090", "precision": "bfloat16"})
        assert "1,200 positions of 9 conversations, on NVIDIA GeForce RTX 4090 in bfloat16" in dialog.status.text()
        prompts = home / "prompts.jsonl"
        prompts.write_text(json.dumps({"turns": ["Say hello."]}) + "\n" + json.dumps({"prompt": "Name a fruit."}) + "\n")
        dialog.data.insertItem(0, prompts.name, str(prompts))
        dialog.data.setCurrentIndex(0)
        dialog.extra_args = ("--max-new-tokens", "12", "--steps", "12")
        dialog.start()
        assert dialog.running() and not dialog.start_button.isEnabled()
        qtbot.waitUntil(lambda: not dialog.running(), timeout=TRAIN_TIMEOUT)
        assert dialog.head is not None, dialog.status.text()
        assert dialog.status.text().startswith("Done"), dialog.status.text()
        assert len(dialog.loss_points[0]) >= 1 and dialog.agree_curves
        qtbot.waitUntil(lambda: _method_enabled(window, "medusa"), timeout=LOAD_TIMEOUT)
        # eagle2 still lacks its head: the button now offers that one, on the same recorded answers
        assert window.methods.missing_head() == "eagle" and "EAGLE" in window.methods.train.text()
        dialog.kind.setCurrentIndex(dialog.kind.findData("eagle"))
        dialog.start()
        qtbot.waitUntil(lambda: not dialog.running(), timeout=TRAIN_TIMEOUT)
        assert dialog.head is not None and dialog.head.endswith(".eagle.json"), dialog.status.text()
        qtbot.waitUntil(lambda: _method_enabled(window, "eagle2"), timeout=LOAD_TIMEOUT)
        # the kinds still missing (EAGLE-3, MTP) are offered next; none that the model now has
        assert window.methods.missing_head() in {"eagle3", "mtp"}, window.methods.missing_head()
        assert window.methods.train.isVisibleTo(window.methods) and "Medusa" not in window.methods.train.text()
    finally:
        close_window(window)


def test_cancelling_training_stops_the_child_and_says_what_is_kept(qtbot, home, monkeypatch):
    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(home / "cache"))
    window = open_window(qtbot, home)
    try:
        window.open_train_dialog("medusa")
        dialog = window.train_dialog
        dialog.minutes.setValue(30)
        monkeypatch.setattr("desktop.train.torch_installed", lambda: False)  # the installed app before its add-on
        dialog.start()
        assert not dialog.running() and dialog.addon is not None and dialog.addon.isVisible()
        assert "needs torch" in dialog.status.text()
        monkeypatch.setattr("desktop.train.torch_installed", lambda: True)
        dialog.addon.installed.emit("torch")  # what a finished install signals: the training asked for starts
        assert dialog.running() and not dialog.start_button.isEnabled()
        qtbot.waitUntil(lambda: dialog.addon is None, timeout=5000)  # closed: the progress is in front
        qtbot.waitUntil(lambda: "answers prompts" in dialog.status.text(), timeout=LOAD_TIMEOUT)
        dialog.cancel()
        qtbot.waitUntil(lambda: not dialog.running(), timeout=30_000)
        assert "kept" in dialog.status.text() and dialog.start_button.isEnabled()
        assert window.model is not None  # the window and its model live on
    finally:
        close_window(window)
