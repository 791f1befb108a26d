"""Live charts: decode speed, acceptance, GPU power and temperature, VRAM, CPU and RAM.

Engine steps arrive as events on the GUI thread and telemetry samples are read from the sampler's
history; both only append to buffers, and a timer redraws the plots four times a second, so a
fast stream of steps never turns into a stream of repaints.

The plots take their background, axes, titles and labels from the widget's palette and take them
again whenever the palette changes, so they follow the system's light/dark switch while the app
runs (pyqtgraph's config options only reach items created afterwards).

When the GPU stops answering while the window is open (card lost, driver unloaded, NVML gone),
the sampler keeps sampling and says why in each sample's ``status``; the GPU plots then show that
message over their last readings until readings come back, and the CPU and RAM plots go on.
"""

from __future__ import annotations

import time
from collections import deque

import pyqtgraph as pg
from PySide6.QtCore import QEvent, QTimer
from PySide6.QtWidgets import QVBoxLayout, QWidget

from backends.core.types import Step
from backends.hardware.telemetry import Sampler

WINDOW_S = 120.0  # seconds of history on screen
RATE_WINDOW_S = 1.0  # decode tokens/s is averaged over the last second of steps
NO_GPU = "no NVIDIA GPU detected"
PALETTE_EVENTS = (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange)


def follow_palette(widget: QWidget) -> None:
    """Plots in the system's light or dark colours instead of pyqtgraph's fixed black."""
    palette = widget.palette()
    pg.setConfigOptions(background=palette.base().color(), foreground=palette.text().color(), antialias=True)


class LiveCharts(QWidget):
    def __init__(self, sampler: Sampler | None, *, has_gpu: bool, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.sampler = sampler
        self.has_gpu = has_gpu
        self._t0 = time.monotonic()
        self._steps: deque[tuple[float, int, int, int]] = deque(maxlen=20000)  # (t, tokens, drafted, accepted)
        self.series: dict[str, deque[tuple[float, float]]] = {
            name: deque(maxlen=5000) for name in ("tok_s", "acceptance", "tau", "gpu_w", "gpu_c", "vram_gib", "cpu_pct", "ram_gib")
        }
        self._last_sample_t = float("-inf")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.view = pg.GraphicsLayoutWidget()
        layout.addWidget(self.view)
        self._notes: list[pg.TextItem] = []  # text drawn inside plots ("no NVIDIA GPU detected")
        self._status_notes: list[pg.TextItem] = []  # why GPU readings stopped, over the GPU plots
        self._build()
        self.apply_palette()
        self.timer = QTimer(self)
        self.timer.setInterval(250)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()

    def _build(self) -> None:
        v = self.view
        text = self.palette().text().color()
        self.speed = v.addPlot(row=0, col=0, title="decode tokens/s")
        self.reference = pg.InfiniteLine(angle=0, pen=pg.mkPen((150, 150, 150), style=pg.QtCore.Qt.PenStyle.DashLine),
                                         label="plain decoding", labelOpts={"position": 0.1, "color": text})
        self.reference.setVisible(False)
        self.speed.addItem(self.reference)
        self.accept = v.addPlot(row=0, col=1, title="acceptance rate and tau per step")
        self.accept.addLegend(offset=(5, 5))
        self.gpu = v.addPlot(row=1, col=0, title="GPU power (W) and temperature (C)")
        self.vram = v.addPlot(row=1, col=1, title="VRAM used (GiB)")
        self.host = v.addPlot(row=2, col=0, colspan=2, title="CPU (%) and RAM used (GiB)")
        self.host.addLegend(offset=(5, 5))
        self.curves = {
            "tok_s": self.speed.plot(pen=pg.mkPen((60, 140, 230), width=2)),
            "acceptance": self.accept.plot(pen=None, symbol="o", symbolSize=4, name="acceptance"),
            "tau": self.accept.plot(pen=pg.mkPen((230, 140, 60)), name="tau"),
            "gpu_w": self.gpu.plot(pen=pg.mkPen((230, 80, 80))),
            "gpu_c": self.gpu.plot(pen=pg.mkPen((240, 180, 60))),
            "vram_gib": self.vram.plot(pen=pg.mkPen((120, 200, 120))),
            "cpu_pct": self.host.plot(pen=pg.mkPen((60, 140, 230)), name="CPU %"),
            "ram_gib": self.host.plot(pen=pg.mkPen((160, 100, 220)), name="RAM GiB"),
        }
        if not self.has_gpu:
            for plot in (self.gpu, self.vram):
                plot.hideAxis("left")
                plot.hideAxis("bottom")
                label = pg.TextItem(NO_GPU, anchor=(0.5, 0.5), color=text)
                self._notes.append(label)
                plot.addItem(label)
                label.setPos(0.5, 0.5)
                plot.setXRange(0, 1)
                plot.setYRange(0, 1)
                plot.setMouseEnabled(False, False)
        else:
            for plot in (self.gpu, self.vram):
                self._status_notes.append(_status_note(plot, text))
            self._notes += self._status_notes
        self.messages = {"gpu": NO_GPU if not self.has_gpu else None}

    # -- palette -----------------------------------------------------------------------------
    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt's name
        """The system switched light/dark (or the palette changed): recolour every plot."""
        if event.type() in PALETTE_EVENTS and hasattr(self, "curves"):
            self.apply_palette()
        super().changeEvent(event)

    def apply_palette(self) -> None:
        """Background, axes, titles, legends and labels in the palette's base and text colours.

        The data curves keep their own colours, which read on light and dark backgrounds alike.
        """
        follow_palette(self)  # plots added later start in the same colours
        palette = self.palette()
        background, text = palette.base().color(), palette.text().color()
        self.view.setBackground(background)
        for plot in (self.speed, self.accept, self.gpu, self.vram, self.host):
            for side in ("left", "bottom"):
                axis = plot.getAxis(side)
                axis.setPen(text)
                axis.setTextPen(text)
            plot.setTitle(plot.titleLabel.text, color=text)
            if plot.legend is not None:
                plot.legend.setLabelTextColor(text)  # for entries added later; it does not redraw these:
                for _, label in plot.legend.items:
                    label.setText(label.text, color=text)
        self.reference.label.setColor(text)
        for note in self._notes:
            note.setColor(text)
        for note in self._status_notes:
            note.fill = pg.mkBrush(background)
            note.update()

    # -- input -------------------------------------------------------------------------------
    def set_reference(self, tok_s: float | None) -> None:
        """The plain-decoding rate of the loaded model, drawn as a dashed line."""
        self.reference.setVisible(tok_s is not None)
        if tok_s is not None:
            self.reference.setValue(tok_s)

    def add_step(self, step: Step) -> None:
        now = time.monotonic() - self._t0
        self._steps.append((now, len(step.tokens), step.drafted, step.accepted))
        window = [s for s in self._steps if s[0] >= now - RATE_WINDOW_S]
        span = now - window[0][0] if len(window) > 1 else 0.0
        if span > 0:
            self.series["tok_s"].append((now, sum(s[1] for s in window[1:]) / span))
        if step.drafted:
            self.series["acceptance"].append((now, step.accepted / step.drafted))
        self.series["tau"].append((now, float(len(step.tokens))))

    def _pull_samples(self) -> None:
        if self.sampler is None:
            return
        for s in self.sampler.history(since=self._last_sample_t + 1e-9):
            t = s.t - self._t0
            self._last_sample_t = s.t
            self.series["cpu_pct"].append((t, s.cpu_pct))
            self.series["ram_gib"].append((t, s.ram_used_bytes / 2**30))
            if s.gpus:
                g = s.gpus[0]
                for name, value in (("gpu_w", g.power_w), ("gpu_c", g.temperature_c),
                                    ("vram_gib", g.vram_used_bytes / 2**30 if g.vram_used_bytes is not None else None)):
                    if value is not None:
                        self.series[name].append((t, value))
            if s.status:
                self.messages["gpu"] = s.status
            elif s.gpus and self.has_gpu:
                self.messages["gpu"] = None  # the GPU answers (again)

    # -- drawing -----------------------------------------------------------------------------
    def refresh(self) -> None:
        self._pull_samples()
        self._show_gpu_status()
        horizon = time.monotonic() - self._t0 - WINDOW_S
        for name, curve in self.curves.items():
            points = [(t, v) for t, v in self.series[name] if t >= horizon]
            if points:
                xs, ys = zip(*points)
                curve.setData(xs, ys)

    def _show_gpu_status(self) -> None:
        message = self.messages["gpu"] if self.has_gpu else None
        for note in self._status_notes:
            if message and note.toPlainText() != message:
                note.setText(message)
            note.setVisible(bool(message))

    def gpu_status_shown(self) -> str | None:
        """The message drawn over the GPU plots now, if any (what tests check)."""
        shown = [note.toPlainText() for note in self._status_notes if note.isVisible()]
        return shown[0] if shown else None

    def points(self, name: str) -> int:
        """How many points a series holds (what tests and the screenshot script check)."""
        return len(self.series[name])


def _status_note(plot: pg.PlotItem, colour) -> pg.TextItem:
    """A hidden label pinned to the plot's top-left corner (view pixels, not data coordinates, so
    it stays put while the axes rescale), wrapped to the plot's width, on a background that hides
    the curves behind it."""
    view = plot.getViewBox()
    note = pg.TextItem("", anchor=(0, 0), color=colour)
    note.setParentItem(view)
    note.setPos(6, 6)
    note.setZValue(10)
    note.hide()
    view.sigResized.connect(lambda: note.setTextWidth(max(view.width() - 12, 40)))  # wrap inside the plot
    return note
