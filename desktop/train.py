"""The train dialog: make a draft head for the loaded model, with live loss and agreement curves.

Training runs ``specdeck train ... --progress json`` in a child process (``QProcess``), not in a
thread of the window: it loads its own copy of the model, keeps both cores busy for many minutes,
and uses torch, so a crash or an out-of-memory kill there costs the window nothing, and Cancel is
a plain terminate. The child's JSON progress lines arrive through Qt's event loop; the GUI thread
never waits on them. What a cancelled run recorded and trained is kept (answers as files,
training as checkpoints), so Start picks up where it stopped. Training needs torch, which the
installers leave out: Start without it offers the torch add-on first (``desktop.addons``), and
training starts once it is installed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import QEvent, QProcess, QProcessEnvironment, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from desktop.addons import AddonOffer
from desktop.charts import PALETTE_EVENTS, paint_plot_widget
from desktop.library import torch_installed

REPO = Path(__file__).resolve().parents[1]
HEAD_COLOURS = [(60, 140, 230), (230, 140, 60), (80, 180, 90), (200, 80, 160), (140, 140, 140)]


KIND_LABELS = {"eagle": "EAGLE head (for eagle2)", "eagle3": "EAGLE-3 head (for eagle3, eagle3-native)",
               "mtp": "MTP module (for mtp-trained)", "medusa": "Medusa heads (for medusa)"}


class TrainDialog(QDialog, AddonOffer):
    """Model, kind, data source, time budget; Start and Cancel; progress, loss and agreement."""

    trained = Signal(str)  # the head's .json path

    def __init__(self, model: str, kind: str = "medusa", parent: QWidget | None = None,
                 extra_args: tuple[str, ...] = (), *, nvidia_gpu: bool = False) -> None:
        super().__init__(parent)
        self.setWindowTitle("SpecDeck - train a draft head")
        self.model = model
        self.extra_args = extra_args  # more `specdeck train` options (tests shorten runs with them)
        self.nvidia_gpu = nvidia_gpu  # which torch the add-on installs: the CUDA build or the CPU one
        self.process: QProcess | None = None
        self.head: str | None = None
        self._buffer = b""
        self._errors: list[str] = []
        form = QFormLayout()
        form.addRow("Model:", QLabel(Path(model).name))
        self.kind = QComboBox()
        self.kind.setObjectName("train_kind")
        for key, label in KIND_LABELS.items():
            self.kind.addItem(label, key)
        self.kind.setCurrentIndex(max(0, self.kind.findData(kind)))
        form.addRow("Head:", self.kind)
        self.data = QComboBox()
        self.data.setObjectName("train_data")
        self.data.addItem("Spec-Bench questions that benchmarks do not use", "spec-bench")
        self.data.addItem("What you asked in your saved chats", "chats")
        self.data.addItem("Questions the model writes itself", "self")
        self.data.addItem("Both: Spec-Bench questions, then the model's own", "spec-bench,self")
        self.data.addItem("Prompts from a JSONL file ...", "")
        self.data.activated.connect(self._pick_file)
        form.addRow("Prompts:", self.data)
        self.minutes = QSpinBox()
        self.minutes.setObjectName("train_minutes")
        self.minutes.setRange(1, 24 * 60)
        self.minutes.setValue(30)
        self.minutes.setSuffix(" min")
        form.addRow("Time budget:", self.minutes)
        self.start_button = QPushButton("Start")
        self.start_button.setObjectName("train_start")
        self.start_button.clicked.connect(self.start)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setObjectName("train_cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel)
        buttons = QHBoxLayout()
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.cancel_button)
        buttons.addStretch(1)
        self.progress = QProgressBar()
        self.status = QLabel("The model answers the prompts itself, then the head learns to guess its next words.")
        self.status.setObjectName("train_status")
        self.status.setWordWrap(True)
        self.loss_plot = pg.PlotWidget(title="training loss")
        self.loss_curve = self.loss_plot.plot(pen=pg.mkPen(HEAD_COLOURS[0], width=2))
        self.agree_plot = pg.PlotWidget(title="held-out agreement per guess ahead")
        self.agree_plot.setYRange(0, 1)
        self.agree_plot.addLegend(offset=(5, 5))
        self._paint_plots()
        self.agree_curves: list = []
        self.loss_points: tuple[list[float], list[float]] = ([], [])
        self.agree_points: list[tuple[list[float], list[float]]] = []
        plots = QHBoxLayout()
        plots.addWidget(self.loss_plot)
        plots.addWidget(self.agree_plot)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addLayout(plots, 1)
        self.resize(760, 520)

    # -- choosing ------------------------------------------------------------------------------
    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt's name
        """The system switched light/dark while training: the curves' plots follow."""
        if event.type() in PALETTE_EVENTS and hasattr(self, "agree_plot"):
            self._paint_plots()
        super().changeEvent(event)

    def _paint_plots(self) -> None:
        for plot in (self.loss_plot, self.agree_plot):
            paint_plot_widget(plot, self.palette())

    def _pick_file(self, row: int) -> None:
        if self.data.itemData(row):
            return
        path, _ = QFileDialog.getOpenFileName(self, "Prompts to train on", str(Path.home()), "JSON lines (*.jsonl)")
        if path:
            self.data.insertItem(row, Path(path).name, path)
        self.data.setCurrentIndex(row if path else 0)

    def arguments(self) -> list[str]:
        """The ``specdeck`` command line this dialog runs."""
        return ["-m", "backends.cli", "train", self.kind.currentData(), "--model", self.model,
                "--data", self.data.currentData() or "spec-bench", "--minutes", str(self.minutes.value()),
                "--progress", "json", *self.extra_args]

    # -- running -------------------------------------------------------------------------------
    def start(self) -> None:
        if self.process is not None:
            return
        if not torch_installed():
            self._offer_torch()
            return
        self.head, self._buffer, self._errors = None, b"", []
        self.loss_points = ([], [])
        self.loss_curve.setData([], [])
        self.agree_points = []
        for curve in self.agree_curves:  # a second run (another kind of head) draws its own curves
            self.agree_plot.removeItem(curve)
        self.agree_curves = []
        self.process = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        env.insert("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), env.value("PYTHONPATH")])))
        self.process.setProcessEnvironment(env)
        self.process.setWorkingDirectory(str(REPO))
        self.process.readyReadStandardOutput.connect(self._read)
        self.process.readyReadStandardError.connect(self._read_errors)
        self.process.finished.connect(self._finished)
        self.process.errorOccurred.connect(self._failed_to_start)
        self.start_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.status.setText("Starting ...")
        self.process.start(sys.executable, self.arguments())

    def _offer_torch(self) -> None:
        """Training without torch: the add-on dialog (what, how big, where; Install or Cancel);
        a finished install starts the training asked for."""
        self.status.setText("Training needs torch, which is not installed yet: install it (an add-on, downloaded "
                            "once) and training starts.")
        self.offer_addon("torch", nvidia_gpu=self.nvidia_gpu, installed=self._torch_arrived)

    def _torch_arrived(self, _name: str) -> None:
        if self.addon is not None:
            self.addon.accept()  # its work is done: the training's progress is what to watch now
        self.start()

    def cancel(self) -> None:
        if self.process is not None:
            self.status.setText("Stopping ... (what was recorded and trained is kept: Start goes on from there)")
            self.process.terminate()

    def running(self) -> bool:
        return self.process is not None

    def _read(self) -> None:
        self._buffer += bytes(self.process.readAllStandardOutput())
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self.show_event(event)

    def _read_errors(self) -> None:
        text = bytes(self.process.readAllStandardError()).decode("utf-8", "replace")
        self._errors.extend(line for line in text.splitlines() if line.strip())
        del self._errors[:-20]

    def show_event(self, event: dict) -> None:
        """One progress event of ``backends.train.train`` on the dialog."""
        phase = event.get("phase")
        if phase == "questions":
            self.progress.setRange(0, int(event["total"]))
            self.progress.setValue(int(event["done"]))
            self.status.setText(f"The model writes its own questions: {event['done']} of {event['total']}")
        elif phase == "record":
            self.progress.setRange(0, int(event["total"]))
            self.progress.setValue(int(event["done"]))
            self.status.setText(f"The model answers prompts: {event['done']} of {event['total']} conversations, "
                                f"{event['tokens_per_s']:.0f} tokens/s ({event['eta_s'] / 60:.1f} min left for this)")
        elif phase == "reread":
            self.progress.setRange(0, int(event["total"]))
            self.progress.setValue(int(event["done"]))
            self.status.setText(f"The model reads its recorded answers again for this head: {event['done']} of "
                                f"{event['total']} conversations, {event['tokens_per_s']:.0f} tokens/s "
                                f"({event['eta_s'] / 60:.1f} min left for this)")
        elif phase == "data":
            self.status.setText(f"Training on {event['positions']:,} positions of {event['conversations']} "
                                f"conversations, on {event['device']} in {event['precision']} ...")
        elif phase == "train":
            self.progress.setRange(0, int(event["steps"]))
            self.progress.setValue(int(event["step"]))
            self.loss_points[0].append(event["step"])
            self.loss_points[1].append(event["loss"])
            self.loss_curve.setData(*self.loss_points)
            if event.get("agreement"):
                self._add_agreement(event["step"], event["agreement"])
            self.status.setText(f"Training: step {event['step']} of {event['steps']}, loss {event['loss']:.3f}, "
                                f"about {event['eta_s'] / 60:.1f} min left")
        elif phase == "done":
            self.head = event["head"]
            self._add_agreement(self.loss_points[0][-1] if self.loss_points[0] else 0, event["agreement"])
            agree = ", ".join(f"{a:.0%}" for a in event["agreement"])
            self.status.setText(f"Done: {Path(self.head).name} (held-out agreement per guess ahead {agree}). "
                                "Its method can be chosen now.")

    def _add_agreement(self, step: float, agreement: list[float]) -> None:
        while len(self.agree_curves) < len(agreement):
            k = len(self.agree_curves)
            self.agree_curves.append(self.agree_plot.plot(pen=pg.mkPen(HEAD_COLOURS[k % len(HEAD_COLOURS)], width=2),
                                                          symbol="o", symbolSize=5, name=f"guess {k + 1}"))
            self.agree_points.append(([], []))
        for k, value in enumerate(agreement):
            self.agree_points[k][0].append(step)
            self.agree_points[k][1].append(value)
            self.agree_curves[k].setData(*self.agree_points[k])

    def _finished(self, code: int, status: QProcess.ExitStatus) -> None:
        self._read()
        self._read_errors()
        self.process = None
        self.start_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        if code == 0 and self.head:
            self.trained.emit(self.head)
        elif status == QProcess.ExitStatus.CrashExit or code in (-15, 143):
            self.status.setText("Stopped. What was recorded and trained is kept: Start goes on from there.")
        else:
            why = next((line.removeprefix("specdeck: ") for line in reversed(self._errors)
                        if line.startswith("specdeck: ")), self._errors[-1] if self._errors else f"exit code {code}")
            self.status.setText(f"Training failed: {why}")

    def _failed_to_start(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart:
            self.status.setText(f"Training could not start ({sys.executable} did not run)")
            self.process = None
            self.start_button.setEnabled(True)
            self.cancel_button.setEnabled(False)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        """Closing the dialog stops its training (it would otherwise run on unseen)."""
        if self.process is not None:
            self.process.finished.disconnect(self._finished)
            self.process.terminate()
            if not self.process.waitForFinished(3000):
                self.process.kill()
            self.process = None
        super().closeEvent(event)
