"""Input widgets shared by the panels: a settings form generated from a method's settings dataclass
(so a new method needs no GUI code), and the multi-line text box every panel uses.

Each field becomes an editor by its type (int: spin box, float: decimal spin box, bool: check box,
anything else: a line edit, with a "..." file chooser when the field's metadata names a file
filter, e.g. ``field(default="", metadata={"file": "Datastores (*.sdstore)"})``); a spin box offers
the field's ``bounded`` range (``backends.core.settings``); the dataclass's own ``__post_init__``
validation decides what is accepted, and its message is shown under the form instead of a crash.

``PromptBox`` is a multi-line box that keyboard users can leave: Tab and Shift+Tab move the focus
as in every other field (a box that took Tab as a character could only be left with the mouse),
Ctrl+Tab does the same instead of switching the window's tabs behind the typist's back, and
Ctrl+Enter emits ``submitted`` (send, run).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

from backends.core.settings import RANGE


class DataclassForm(QWidget):
    changed = Signal()

    def __init__(self, settings_type: type, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings_type = settings_type
        self.editors: dict[str, QWidget] = {}
        layout = QFormLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        hints = typing.get_type_hints(settings_type)
        defaults = settings_type()
        for f in dataclasses.fields(settings_type):
            editor = self._editor(hints.get(f.name, str), getattr(defaults, f.name), f.metadata.get(RANGE))
            editor.setObjectName(f"setting_{f.name}")
            self.editors[f.name] = editor
            row = self._with_chooser(editor, f.metadata["file"]) if "file" in f.metadata else editor
            layout.addRow(f.name.replace("_", " "), row)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #c0392b")
        layout.addRow(self.error)

    def _editor(self, kind: Any, value: Any, bounds: tuple | None = None) -> QWidget:
        """``bounds`` (a ``bounded`` field's): the spin box offers that range only."""
        low, high = (-1_000_000, 1_000_000) if bounds is None else bounds[:2]
        if kind is bool:
            box = QCheckBox()
            box.setChecked(bool(value))
            box.toggled.connect(self.changed)
            return box
        if kind is int:
            spin = QSpinBox()
            spin.setRange(int(max(low, -(1 << 31))), int(min(high, (1 << 31) - 1)))
            spin.setValue(int(value))
            spin.valueChanged.connect(self.changed)
            return spin
        if kind is float:
            dspin = QDoubleSpinBox()
            dspin.setRange(float(low), float(high))
            dspin.setDecimals(3)
            dspin.setSingleStep(0.05)
            dspin.setValue(float(value))
            dspin.valueChanged.connect(self.changed)
            return dspin
        line = QLineEdit("" if value is None else str(value))
        line.textChanged.connect(self.changed)
        return line

    def _with_chooser(self, line: QWidget, file_filter: str) -> QWidget:
        """The line edit plus a button that fills it from a file dialog."""
        row = QWidget()
        box = QHBoxLayout(row)
        box.setContentsMargins(0, 0, 0, 0)
        button = QPushButton("...")
        button.setToolTip("Choose a file")
        button.clicked.connect(lambda: self._choose(line, file_filter))
        box.addWidget(line, 1)
        box.addWidget(button)
        return row

    def _choose(self, line: QLineEdit, file_filter: str) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a file", line.text(), file_filter)
        if path:
            line.setText(path)

    def values(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, editor in self.editors.items():
            if isinstance(editor, QCheckBox):
                out[name] = editor.isChecked()
            elif isinstance(editor, (QSpinBox, QDoubleSpinBox)):
                out[name] = editor.value()
            else:
                out[name] = editor.text()
        return out

    def set_values(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            editor = self.editors.get(name)
            if isinstance(editor, QCheckBox):
                editor.setChecked(bool(value))
            elif isinstance(editor, (QSpinBox, QDoubleSpinBox)):
                editor.setValue(value)
            elif isinstance(editor, QLineEdit):
                editor.setText(str(value))

    def settings(self) -> Any | None:
        """The validated settings object, or None with the reason shown under the form."""
        try:
            value = self.settings_type(**self.values())
        except (ValueError, TypeError) as exc:
            self.error.setText(str(exc))
            return None
        self.error.setText("")
        return value

    def changed_values(self) -> dict[str, Any]:
        """Only the fields that differ from the defaults (what a request needs to carry)."""
        defaults = dataclasses.asdict(self.settings_type())
        return {k: v for k, v in self.values().items() if defaults.get(k) != v}


class PromptBox(QPlainTextEdit):
    """Multi-line text that Tab leaves and Ctrl+Enter submits (see the module docstring)."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTabChangesFocus(True)

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt's name
        ctrl = bool(event.modifiers() & Qt.KeyboardModifier.ControlModifier)
        if ctrl and event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            self.submitted.emit()
            return
        if ctrl and event.key() in (Qt.Key.Key_Tab, Qt.Key.Key_Backtab):
            self.focusNextPrevChild(event.key() == Qt.Key.Key_Tab and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier)
            return
        super().keyPressEvent(event)
