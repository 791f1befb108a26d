"""Live charts: decode speed, acceptance and tau, GPU power and temperature, VRAM, CPU and RAM.

Engine steps arrive as events on the GUI thread and telemetry samples are read from the sampler's
history; both only append to buffers, and a timer redraws the plots four times a second through
persistent curves (``setData``), so a fast stream of steps never turns into a stream of repaints.

How the plots read:

- One time axis. Every plot shows the same stretch (the last ``WINDOW_S`` seconds), in seconds
  since the window opened: their x axes are linked, and samples the sampler took before the
  window opened are not drawn.
- Each quantity on an axis of its own unit. A plot with two quantities gives the second one a
  scale of its own on the right: tau (tokens per step) beside acceptance (%), temperature (°C)
  beside power (W), RAM (GiB) beside CPU (%).
- Gaps stay gaps. Between two answers nothing is measured, so a step series is broken where more
  than ``GAP_S`` seconds pass without a step, instead of a straight line across the idle time.
- Without an NVIDIA GPU the GPU plots are not drawn at all; one line under the plots says so.
- The plots are laid out in as many columns as the width gives each ``MIN_PLOT_WIDTH``, and the
  widget asks for ``MIN_PLOT_HEIGHT`` per row, so labels never pile up in a short plot.

The plots take their background, axes, titles and labels from the widget's palette and take them
again whenever the palette changes, so they follow the system's light/dark switch while the app
runs (pyqtgraph's config options only reach items created afterwards).

When the GPU stops answering while the window is open (card lost, driver unloaded, NVML gone),
the sampler keeps sampling and says why in each sample's ``status``; the GPU plots then show that
message over their last readings until readings come back, and the CPU and RAM plots go on.
"""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QTimer
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from backends.core.types import Step
from backends.hardware.telemetry import Sampler

WINDOW_S = 120.0  # seconds of history on screen
RATE_WINDOW_S = 1.0  # decode tokens/s is averaged over the last second of steps
GAP_S = 2.0  # a step series breaks where this long passes without a step (between answers)
MIN_PLOT_WIDTH = 260  # pixels per plot before the plots wrap onto another row
MIN_PLOT_HEIGHT = 125  # pixels per row of plots: title, axes, labels and room for the data
NO_GPU = "no NVIDIA GPU detected"
PALETTE_EVENTS = (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange)
STEP_SERIES = ("tok_s", "acceptance", "tau")


def follow_palette(widget: QWidget) -> None:
    """Plots in the system's light or dark colours instead of pyqtgraph's fixed black."""
    palette = widget.palette()
    pg.setConfigOptions(background=palette.base().color(), foreground=palette.text().color(), antialias=True)


def paint_plot(plot: pg.PlotItem, text: QColor) -> None:
    """A plot's axes, title, legend and labels in ``text`` (its curves keep their own colours)."""
    for side in ("left", "bottom", "right"):
        axis = plot.getAxis(side)
        axis.setPen(text)
        axis.setTextPen(text)
        if axis.labelText:
            axis.setLabel(axis.labelText, color=text.name())
    if plot.titleLabel.text:
        plot.setTitle(plot.titleLabel.text, color=text)
    if plot.legend is not None:
        plot.legend.setLabelTextColor(text)  # for entries added later; it does not redraw these:
        for _, label in plot.legend.items:
            label.setText(label.text, color=text)


def paint_plot_widget(widget: pg.PlotWidget, palette: QPalette) -> None:
    """A whole ``PlotWidget`` (the comparison's bars, the train dialog's curves) in ``palette``'s
    base and text colours, as the live charts are: they follow a light/dark switch too."""
    widget.setBackground(palette.base().color())
    paint_plot(widget.getPlotItem(), palette.text().color())


class LiveCharts(QWidget):
    def __init__(self, sampler: Sampler | None, *, has_gpu: bool, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.sampler = sampler
        self.has_gpu = has_gpu
        self.gpu_title = "GPU"  # "server GPU" while a server's GPUs are charted
        self._t0 = time.monotonic()
        self._run: deque[tuple[float, int]] = deque()  # the current run's recent steps: (elapsed, tokens)
        self.series: dict[str, deque[tuple[float, float]]] = {
            name: deque(maxlen=5000) for name in ("tok_s", "acceptance", "tau", "gpu_w", "gpu_c", "vram_gib", "cpu_pct", "ram_gib")
        }
        self._last_sample_t = self._t0  # samples from before the window opened are not drawn
        self._columns = 0
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        self.view = pg.GraphicsLayoutWidget()
        layout.addWidget(self.view, 1)
        self.gpu_note = QLabel(NO_GPU)  # said once, under the plots, when there is no GPU to chart
        self.gpu_note.setObjectName("no_gpu_note")
        self.gpu_note.setContentsMargins(6, 0, 6, 2)
        layout.addWidget(self.gpu_note)
        self._status_notes: list[pg.TextItem] = []  # why GPU readings stopped, over the GPU plots
        self.plots: list[pg.PlotItem] = []
        self._build()
        self.apply_palette()
        self._relayout()
        self.timer = QTimer(self)
        self.timer.setInterval(250)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()

    def _build(self) -> None:
        text = self.palette().text().color()
        self.speed = self._add(_plot("decode tokens/s", "tok/s"))
        self.reference = pg.InfiniteLine(angle=0, pen=pg.mkPen((150, 150, 150), style=pg.QtCore.Qt.PenStyle.DashLine),
                                         label="plain decoding", labelOpts={"position": 0.02, "color": text,
                                                                            "anchors": [(0, 1), (0, 1)]})
        self.reference.setVisible(False)
        self.speed.addItem(self.reference)
        self.accept = self._add(_plot("acceptance and tau per step", "acceptance %", legend=True))
        self.accept.setYRange(0, 100, padding=0.02)
        self.curves = {
            "tok_s": self.speed.plot(pen=pg.mkPen((60, 140, 230), width=2), connect="finite"),
            "acceptance": self.accept.plot(pen=None, symbol="o", symbolSize=4, name="acceptance %"),
            "tau": _twin_curve(self.accept, "tau (tokens/step)", pg.mkPen((230, 140, 60)), "tau"),
        }
        self.gpu = self.vram = None  # drawn only where there is a GPU to chart
        if self.has_gpu:
            self.gpu = self._add(_plot(f"{self.gpu_title} power and temperature", "W", legend=True))
            self.vram = self._add(_plot("VRAM used", "GiB"))
            self.curves["gpu_w"] = self.gpu.plot(pen=pg.mkPen((230, 80, 80)), name="power W")
            self.curves["gpu_c"] = _twin_curve(self.gpu, "°C", pg.mkPen((240, 180, 60)), "temperature °C")
            self.curves["vram_gib"] = self.vram.plot(pen=pg.mkPen((120, 200, 120)))
            self._status_notes += [_status_note(self.gpu, text), _status_note(self.vram, text)]
        self.host = self._add(_plot("CPU and RAM", "CPU %", legend=True))
        self.host.setYRange(0, 100, padding=0.02)
        self.curves["cpu_pct"] = self.host.plot(pen=pg.mkPen((60, 140, 230)), name="CPU %")
        self.curves["ram_gib"] = _twin_curve(self.host, "RAM GiB", pg.mkPen((160, 100, 220)), "RAM GiB")
        for plot in self.plots:
            plot.getViewBox().setMouseEnabled(x=False, y=plot is self.speed)
            if plot is not self.speed:
                plot.setXLink(self.speed)  # one time axis for all
        self.gpu_note.setVisible(not self.has_gpu)
        self.messages = {"gpu": NO_GPU if not self.has_gpu else None}

    def _add(self, plot: pg.PlotItem) -> pg.PlotItem:
        """A plot in the view's scene (a second axis needs the scene); ``_relayout`` places it."""
        self.plots.append(plot)
        self.view.addItem(plot)
        return plot

    def set_gpu(self, has_gpu: bool, title: str = "GPU") -> None:
        """Chart GPUs (``title``: whose) or not, e.g. a server's once connected to one: the
        plots are rebuilt, the series and the plain-decoding line are kept."""
        if (has_gpu, title) == (self.has_gpu, self.gpu_title):
            return
        reference = self.reference.value() if self.reference.isVisible() else None
        self.has_gpu, self.gpu_title = has_gpu, title
        for plot in self.plots:
            self.view.removeItem(plot)
        self.plots, self._status_notes = [], []
        self._build()
        self.set_reference(reference)
        self.apply_palette()
        self._columns = 0  # place the new set of plots
        self._relayout()

    # -- layout ------------------------------------------------------------------------------
    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self._relayout()

    def _relayout(self) -> None:
        """As many plots per row as the width gives ``MIN_PLOT_WIDTH`` each; the height it needs."""
        columns = max(1, min(len(self.plots), self.width() // MIN_PLOT_WIDTH))
        rows = self.rows = math.ceil(len(self.plots) / columns)
        self.setMinimumHeight(rows * MIN_PLOT_HEIGHT + (self.gpu_note.sizeHint().height() if not self.has_gpu else 0))
        if columns == self._columns:
            return
        self._columns = columns
        layout = self.view.ci
        for plot in self.plots:
            layout.removeItem(plot)
        for i, plot in enumerate(self.plots):
            layout.addItem(plot, row=i // columns, col=i % columns)
        for column in range(columns):  # equal widths, whatever the axes' labels need
            layout.layout.setColumnStretchFactor(column, 1)
            layout.layout.setColumnPreferredWidth(column, 1)

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
        for plot in self.plots:
            paint_plot(plot, text)
        self.reference.label.setColor(text)
        for note in self._status_notes:
            note.setColor(text)
            note.fill = pg.mkBrush(background)
            note.update()

    # -- input -------------------------------------------------------------------------------
    def set_reference(self, tok_s: float | None) -> None:
        """The loaded model's measured plain-decoding rate, drawn as a dashed line (None: no line)."""
        shown = tok_s is not None and math.isfinite(tok_s)
        self.reference.setVisible(shown)
        if shown:
            self.reference.setValue(tok_s)

    def add_step(self, step: Step) -> None:
        """One engine step, drawn at the moment it arrived. The decode rate is measured on the
        engine's own clock (``Step.elapsed``) over the run's last ``RATE_WINDOW_S``: steps reach
        the GUI thread in bursts, and rates from arrival times jumped to thousands of tokens per
        second. A step whose ``elapsed`` is lower than the last one's starts a new run."""
        now = time.monotonic() - self._t0
        run = self._run
        if run and step.elapsed < run[-1][0]:
            run.clear()  # the next answer (or the next method of a comparison)
        run.append((step.elapsed, len(step.tokens)))
        while len(run) > 2 and run[1][0] <= step.elapsed - RATE_WINDOW_S:
            run.popleft()  # keep one step before the window: the rate counts the tokens after it
        span = run[-1][0] - run[0][0]
        if len(run) > 1 and span > 0:
            self.series["tok_s"].append((now, sum(tokens for _, tokens in list(run)[1:]) / span))
        if step.drafted:
            self.series["acceptance"].append((now, 100.0 * step.accepted / step.drafted))
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
        now = time.monotonic() - self._t0
        start = max(0.0, now - WINDOW_S)
        for name, curve in self.curves.items():
            points = [(t, v) for t, v in self.series[name] if t >= start]
            if points:
                xs, ys = _broken(points) if name in STEP_SERIES else map(np.asarray, zip(*points))
                curve.setData(xs, ys)
        self.speed.setXRange(start, max(now, start + 10.0), padding=0)  # the linked plots follow

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


def _plot(title: str, left: str, *, legend: bool = False) -> pg.PlotItem:
    plot = pg.PlotItem(title=title)
    plot.setLabel("left", left)
    plot.setLabel("bottom", "time since start (s)")
    for side in ("left", "bottom", "right"):
        plot.getAxis(side).enableAutoSIPrefix(False)  # "RAM GiB (x0.001)" said nothing useful
    plot.setMenuEnabled(False)
    if legend:
        plot.addLegend(offset=(5, 5), labelTextSize="8pt", verSpacing=-6)
    return plot


def _twin_curve(plot: pg.PlotItem, label: str, pen, name: str) -> pg.PlotDataItem:
    """A curve on a scale of its own: the plot's right axis, labelled ``label``, sharing its x axis.

    pyqtgraph has no twin axes; this is its documented way: a second view box in the plot's scene,
    linked to the right axis and kept exactly over the plot's own box."""
    box = pg.ViewBox()
    box.setMouseEnabled(x=False, y=False)
    plot.showAxis("right")
    plot.scene().addItem(box)
    right = plot.getAxis("right")
    right.linkToView(box)
    right.setLabel(label)
    box.setXLink(plot)
    main = plot.getViewBox()

    def follow() -> None:
        box.setGeometry(main.sceneBoundingRect())
        box.linkedViewChanged(main, box.XAxis)

    main.sigResized.connect(follow)
    curve = pg.PlotDataItem(pen=pen, connect="finite", name=name)
    box.addItem(curve)
    if plot.legend is not None:
        plot.legend.addItem(curve, name)
    return curve


def _broken(points: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """The points as arrays with a NaN wherever more than ``GAP_S`` passes between two of them,
    so a curve drawn with ``connect="finite"`` stops there instead of bridging the idle time.

    Example: points at 0, 1 and 5 s give xs ``[0, 1, 1, 5]``, ys ``[a, b, nan, c]``.
    """
    xs, ys = [], []
    previous = None
    for t, v in points:
        if previous is not None and t - previous > GAP_S:
            xs.append(previous)
            ys.append(float("nan"))
        xs.append(t)
        ys.append(v)
        previous = t
    return np.asarray(xs), np.asarray(ys)


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
