"""The launch command for a server, written from the method chosen here.

A serving engine drafts as it was started, and vLLM and llama-server spell speculative decoding
differently from version to version. This dialog is ``specdeck launch`` with a form: the user
picks the engine, its version (or flag spelling), the model and one of SpecDeck's method names,
and gets the command to paste on the server machine, or the reason that engine cannot run it.
Nothing is started from here: the server usually runs on another machine.
"""

from __future__ import annotations

import shutil
import subprocess

from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QFormLayout, QLineEdit, QPlainTextEdit, QPushButton,
                               QSpinBox, QVBoxLayout, QWidget)

from backends.core.errors import SpecDeckError
from backends.drafters import baseline_method
from backends.remote import launch
from desktop.jobs import run_job

ENGINES = {"vllm": "vLLM", "llama-server": "llama-server (llama.cpp)"}
METHODS = {"vllm": (baseline_method(), *launch.VLLM_METHODS),  # plain decoding first, then what each drafts with
           "llama-server": (baseline_method(), *launch.LLAMA_TYPES)}


def local_llama_server_flags() -> launch.LlamaServerFlags:
    """The flags of the llama-server on this PC, from its ``--help`` (run off the GUI thread)."""
    binary = shutil.which("llama-server")
    if binary is None:
        raise SpecDeckError("no llama-server on this PC's PATH; choose its flag generation instead")
    try:
        help_text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SpecDeckError(f"{binary} --help failed ({exc}); choose its flag generation instead") from None
    return launch.llama_server_flags(help_text)


class LaunchDialog(QDialog):
    """Engine, version, model and method in; the command to start that server out."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Launch command for a server")
        self.engine = QComboBox()
        for key, text in ENGINES.items():
            self.engine.addItem(text, key)
        self.version = QLineEdit()
        self.version.setPlaceholderText("vLLM version, e.g. 0.7.3 (empty: 0.8.3 or later, --speculative-config)")
        self.spelling = QComboBox()
        self.spelling.addItem("newer flags (--spec-type, --spec-draft-model)", "newer")
        self.spelling.addItem("older flags (--model-draft, --draft-max)", "older")
        self.spelling.addItem("read from the llama-server on this PC", "here")
        self.model = QLineEdit()
        self.model.setPlaceholderText("the target: a Hub id for vLLM, a GGUF path for llama-server")
        self.method = QComboBox()
        self.draft = QLineEdit()
        self.draft.setPlaceholderText("draft model or head (path or Hub id), for draft, eagle2, eagle3, medusa")
        self.tokens = QSpinBox()
        self.tokens.setRange(1, 64)
        self.tokens.setValue(5)
        self.tokens.setToolTip("Tokens drafted per step")
        self.gpus = QSpinBox()
        self.gpus.setRange(1, 64)
        self.gpus.setToolTip("GPUs the model is split over (vLLM's tensor parallelism)")
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setValue(8000)
        self.command = QPlainTextEdit()
        self.command.setReadOnly(True)
        self.command.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.command.setMinimumHeight(110)
        self.copy_button = QPushButton("Copy")
        self.copy_button.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.command.toPlainText()))
        form = QFormLayout()
        for label, widget in (("Engine", self.engine), ("vLLM version", self.version), ("Flags", self.spelling),
                              ("Model", self.model), ("Method", self.method), ("Draft / head", self.draft),
                              ("Draft tokens", self.tokens), ("GPUs", self.gpus), ("Port", self.port)):
            form.addRow(label, widget)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.addButton(self.copy_button, QDialogButtonBox.ButtonRole.ActionRole)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.command)
        layout.addWidget(buttons)
        self.form = form
        self.engine.currentIndexChanged.connect(self._engine_changed)
        for edit in (self.version, self.model, self.draft):
            edit.textChanged.connect(self.refresh)
        for box in (self.method, self.spelling):
            box.currentIndexChanged.connect(self.refresh)
        for spin in (self.tokens, self.gpus, self.port):
            spin.valueChanged.connect(self.refresh)
        self.local_flags: launch.LlamaServerFlags | str | None = None  # this PC's llama-server's, or why not
        self.spelling.currentIndexChanged.connect(self._read_local_flags)
        self.resize(640, 0)
        self._engine_changed()

    def _read_local_flags(self) -> None:
        """Read this PC's llama-server's flags once, off the GUI thread, when that choice is made."""
        if self.spelling.currentData() != "here" or self.local_flags is not None:
            return
        self.local_flags = "reading llama-server --help ..."
        self.refresh()

        def done(value: object) -> None:
            self.local_flags = value  # type: ignore[assignment]
            self.refresh()

        run_job(self, local_llama_server_flags, done, done)

    def _llama_flags(self) -> launch.LlamaServerFlags:
        choice = self.spelling.currentData()
        if choice != "here":
            return launch.LLAMA_NEWER if choice == "newer" else launch.LlamaServerFlags()
        if not isinstance(self.local_flags, launch.LlamaServerFlags):
            raise SpecDeckError(self.local_flags or "reading llama-server --help ...")
        return self.local_flags

    def _engine_changed(self) -> None:
        engine = self.engine.currentData()
        current = self.method.currentText()
        self.method.blockSignals(True)
        self.method.clear()
        self.method.addItems(list(METHODS[engine]))
        self.method.setCurrentIndex(max(0, self.method.findText(current)))
        self.method.blockSignals(False)
        vllm = engine == "vllm"
        self.form.setRowVisible(self.version, vllm)
        self.form.setRowVisible(self.gpus, vllm)
        self.form.setRowVisible(self.spelling, not vllm)
        self.port.setValue(8000 if vllm else 8080)
        self.refresh()

    def plan(self) -> launch.LaunchPlan:
        """The launch plan for the form as filled in (LaunchError or SpecDeckError: why not)."""
        model = self.model.text().strip()
        if not model:
            raise SpecDeckError("name the model the server is to load")
        method, draft = self.method.currentText(), self.draft.text().strip() or None
        if self.engine.currentData() == "vllm":
            spec = launch.VllmLaunch(model, method, draft=draft, num_tokens=self.tokens.value(), host="0.0.0.0",
                                     port=self.port.value(), parallel=launch.Parallel(tensor=self.gpus.value()))
            version = self.version.text().strip() or None
            return launch.vllm_plan(spec, generation=launch.vllm_generation(version=version))
        return launch.llama_server_plan(model, flags=self._llama_flags(), method=method,
                                        draft=draft, num_tokens=self.tokens.value(), host="0.0.0.0", port=self.port.value())

    def refresh(self) -> None:
        try:
            text, ok = self.plan().shell(), True
        except SpecDeckError as exc:
            text, ok = f"# {exc}", False
        self.command.setPlainText(text)
        self.copy_button.setEnabled(ok)
