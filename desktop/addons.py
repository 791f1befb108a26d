"""The add-on dialog: install torch into SpecDeck's data folder when the user asks for it.

The installers leave torch out (backends/addons.py says why). Picking the PyTorch backend without
it offers this dialog: what it is for, how big, where it goes; Install runs pip in a child process
(``QProcess``: the window never waits on the download), shows pip's own lines as they come, and
Cancel stops it. A finished install is importable at once (``backends.addons.activate``).
"""

from __future__ import annotations

import html
from typing import Callable

from PySide6.QtCore import QProcess, Signal
from PySide6.QtWidgets import QDialog, QHBoxLayout, QLabel, QPlainTextEdit, QProgressBar, QPushButton, QVBoxLayout, QWidget

from backends.addons import ADDONS, addon_dir, available, install_command

LOG_LINES = 400  # pip's output kept in the dialog


class AddonDialog(QDialog):
    installed = Signal(str)  # the add-on's name, once it imports

    def __init__(self, name: str, *, nvidia_gpu: bool, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self.nvidia_gpu = nvidia_gpu
        addon = ADDONS[name]
        self.setWindowTitle(f"Install {name}")
        self.setObjectName("addon_dialog")
        about = QLabel(f"<b>{html.escape(name)}</b> is needed for {html.escape(addon.needed_for)}. It is not part of "
                       f"the installer: {html.escape(addon.size)}. SpecDeck installs it with pip into "
                       f"<code>{html.escape(str(addon_dir()))}</code>; nothing else on this PC changes.")
        about.setWordWrap(True)
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(LOG_LINES)
        self.log.setObjectName("addon_log")
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)  # pip reports no fraction we could trust
        self.busy.hide()
        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.install_button = QPushButton("Install")
        self.install_button.setDefault(True)
        self.install_button.clicked.connect(self.start)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.install_button)
        buttons.addWidget(self.cancel_button)
        layout = QVBoxLayout(self)
        for widget in (about, self.log, self.busy, self.status):
            layout.addWidget(widget)
        layout.addLayout(buttons)
        self.process: QProcess | None = None
        self.resize(640, 360)

    def start(self) -> None:
        program, *args = install_command(self.name, nvidia_gpu=self.nvidia_gpu)
        self.process = QProcess(self)
        self.process.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        self.process.readyReadStandardOutput.connect(self._read)
        self.process.finished.connect(self._finished)
        self.process.errorOccurred.connect(self._failed_to_start)
        self.install_button.setEnabled(False)
        self.busy.show()
        self.status.setText("Installing ... (the download can take minutes)")
        self.process.start(program, args)

    def cancel(self) -> None:
        """Stop pip (what it unpacked so far is left for the next attempt to replace) and close."""
        if self.process is not None and self.process.state() != QProcess.ProcessState.NotRunning:
            self.process.kill()
            self.process.waitForFinished(5000)
        self.reject()

    def running(self) -> bool:
        return self.process is not None and self.process.state() != QProcess.ProcessState.NotRunning

    def _read(self) -> None:
        text = bytes(self.process.readAllStandardOutput()).decode("utf-8", "replace")
        for line in text.splitlines():
            if line.strip():
                self.log.appendPlainText(line)

    def _finished(self, code: int, _status: QProcess.ExitStatus) -> None:
        self.busy.hide()
        if code == 0 and available(self.name):
            self.status.setText(f"{self.name} is installed.")
            self.cancel_button.setText("Close")
            self.installed.emit(self.name)
            return
        last = self.log.toPlainText().strip().splitlines()[-1:] or ["no output"]
        self.status.setText(f"The install failed (pip exit code {code}): {last[0]}. Check the network and try again.")
        self.install_button.setEnabled(True)
        self.install_button.setText("Try again")

    def _failed_to_start(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart:
            self.busy.hide()
            self.status.setText("pip could not be started.")
            self.install_button.setEnabled(True)


class AddonOffer:
    """For a widget that needs an add-on the user may lack (the Models dock, the train dialog): one
    install dialog at a time in ``self.addon``, kept while it is open or installing, dropped once
    closed."""

    addon: AddonDialog | None = None  # the install, while its dialog is open

    def offer_addon(self, name: str, *, nvidia_gpu: bool, installed: Callable[[str], None]) -> None:
        """Open the dialog (again, if it is still there); ``installed`` runs once the add-on imports."""
        if self.addon is None:
            self.addon = AddonDialog(name, nvidia_gpu=nvidia_gpu, parent=self)
            self.addon.installed.connect(installed)
            self.addon.finished.connect(self._addon_closed)
        self.addon.open()

    def _addon_closed(self, _result: int) -> None:
        if self.addon is not None and not self.addon.running():
            self.addon.deleteLater()
            self.addon = None
