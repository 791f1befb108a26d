"""The real SpecDeck window on a screen of a given size, measured for tests/test_desktop_layout.py.

    python -m tests.layout_driver 1366x768 OUT_DIR [nvml_rtx4090.json]

Runs in a process of its own because the screen is fixed when Qt starts: the offscreen platform
gets one screen of exactly that size (a ``configfile``), and the window opens there as a new user
would see it (a fresh data directory and settings file, no saved geometry), on the bundled model.
It answers one short message, runs a short comparison (so footers, charts and the results table
hold real content), then prints one JSON report on stdout: the screen, the window's frame, every
dock's width against its minimum, each control that is drawn smaller than it needs (its
``minimumSizeHint``, or for wrapped text the height its width needs), tables whose columns do not
fit, and the plots' heights; then the same for each dock that shares a tab group, raised in
turn. Screenshots of both tabs and of those docks go to OUT_DIR for a person to look at. With a
recording from tests/data/hw as third argument the sampler reads that GPU (its plots are drawn).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from PySide6.QtWidgets import QApplication

from desktop.headless import settle


DOCK_TITLE_BUTTONS = 48  # pixels of a dock's title bar taken by its float and close buttons


def clipped(root) -> list[str]:
    """Visible controls drawn smaller than their content needs, as ``"kind 'text': w x h < need"``."""
    from PySide6.QtWidgets import QAbstractButton, QAbstractSpinBox, QComboBox, QDockWidget, QLabel, QLineEdit, QWidget

    out = []
    for dock in root.findChildren(QDockWidget):  # a dock's title ("M..." in a squeezed one), beside its two buttons
        need = dock.fontMetrics().horizontalAdvance(dock.windowTitle()) + DOCK_TITLE_BUTTONS
        if shown(dock) and dock.width() < need:
            out.append(f"QDockWidget title {dock.windowTitle()!r}: {dock.width()} < {need}")
    kinds = (QLabel, QAbstractButton, QComboBox, QAbstractSpinBox, QLineEdit)
    for widget in root.findChildren(QWidget):
        if not isinstance(widget, kinds) or not shown(widget) or widget.window() is not root:
            continue
        if isinstance(widget.parentWidget(), (QAbstractSpinBox, QComboBox)):
            continue  # a spin box's own line edit: the spin box is checked
        if type(widget).__name__ in ("QToolButton",) and not getattr(widget, "text", lambda: "")():
            continue  # dock title buttons, scroll arrows
        need = widget.minimumSizeHint()
        if isinstance(widget, QLabel) and widget.wordWrap() and widget.text():
            need.setHeight(widget.heightForWidth(widget.width()))
            need.setWidth(min(need.width(), widget.width()))
        w, h = widget.width(), widget.height()
        short = w < need.width() or h < need.height() or _outside_viewport(widget)
        if short:
            text = widget.text() if hasattr(widget, "text") and callable(widget.text) else widget.objectName()
            if isinstance(widget, QComboBox):
                text = widget.currentText()
            out.append(f"{type(widget).__name__} {str(text)[:40]!r}: {w}x{h} < {need.width()}x{need.height()}")
    return out


def shown(widget) -> bool:
    """Drawn on screen now: visible and not hidden behind another tab (of a dock or a tab widget)."""
    return widget.isVisible() and not widget.visibleRegion().isEmpty()


def _outside_viewport(widget) -> bool:
    """Cut off by a scroll area that scrolls sideways (the control's right edge is out of view)."""
    from PySide6.QtCore import QPoint
    from PySide6.QtWidgets import QScrollArea

    parent = widget.parentWidget()
    while parent is not None and not isinstance(parent, QScrollArea):
        parent = parent.parentWidget()
    if parent is None:
        return False
    viewport = parent.viewport()
    right = widget.mapTo(viewport, QPoint(widget.width(), 0)).x()
    return right > viewport.width() + 1


def tabbed_docks(window, out: Path, name: str) -> dict[str, list[str]]:
    """Raise each dock that shares a tab group, grab it and list what it clips; then raise the first again."""
    from PySide6.QtWidgets import QDockWidget

    found = {}
    docks = window.findChildren(QDockWidget)
    for dock in docks:
        if not window.tabifiedDockWidgets(dock):
            continue
        dock.raise_()
        settle(QApplication.instance(), 0.3)
        found[dock.windowTitle()] = clipped(window)
        dock.grab().save(str(out / f"{name}-{dock.objectName()}.png"))
    first = [d for d in docks if window.tabifiedDockWidgets(d)]
    if first:
        (next((d for d in first if d.objectName() == "dock_Method"), first[0])).raise_()
        settle(QApplication.instance(), 0.3)
    return found


def report(window) -> dict:
    from PySide6.QtWidgets import QDockWidget, QTableWidget

    screen = window.screen().availableGeometry()
    frame = window.frameGeometry()
    docks = {}
    for dock in window.findChildren(QDockWidget):
        if not shown(dock):
            continue
        docks[dock.windowTitle()] = {"width": dock.width(), "height": dock.height(),
                                     "min_width": dock.minimumSizeHint().width(),
                                     "content_min_width": dock.widget().minimumSizeHint().width(),
                                     "content_min_height": dock.widget().minimumSizeHint().height()}
    tables = {}
    for table in window.findChildren(QTableWidget):
        if table.isVisible():
            bar = table.horizontalScrollBar()
            tables[table.objectName() or "table"] = {"scrolls_sideways": bar.maximum() > 0}
    plots = {plot.titleLabel.text: int(plot.height()) for plot in _plots(window.charts)}
    return {"screen": [screen.width(), screen.height()], "frame": [frame.x(), frame.y(), frame.width(), frame.height()],
            "docks": docks, "clipped": clipped(window), "tables": tables, "plots": plots, "axes": axes(window)}


def axes(window) -> dict[str, dict[str, tuple[str, bool]]]:
    """Every chart drawn now: ``{plot title: {side: (axis label, numeric)}}`` for each axis shown.
    A numeric axis needs its unit in the label; one with fixed ticks (method names) a name."""
    import pyqtgraph as pg

    plots = list(_plots(window.charts))
    plots += [w.getPlotItem() for w in window.findChildren(pg.PlotWidget) if shown(w)]
    found = {}
    for plot in plots:
        title = plot.titleLabel.text or plot.getViewWidget().objectName() or "plot"
        sides = {}
        for side in ("left", "bottom", "right"):
            axis = plot.getAxis(side)
            if axis.isVisible():
                sides[side] = (axis.labelText, axis._tickLevels is None)
        found[title] = sides
    return found


def _plots(charts) -> list:
    """The plots drawn in the live-charts dock now."""
    import pyqtgraph as pg

    return [item for item in charts.view.ci.items if isinstance(item, pg.PlotItem) and item.isVisible()]


def main(size: str, out: Path, gpu_recording: str | None = None) -> int:
    os.environ.setdefault("SPECDECK_DATA_DIR", tempfile.mkdtemp(prefix="specdeck-layout-"))
    from PySide6.QtCore import QSettings

    from backends.hardware.telemetry import Rapl, Sampler
    from desktop.app import create_app
    from desktop.main_window import MainWindow
    from desktop.headless import offscreen_screen, wait_until
    from desktop.store import ConversationStore

    app = create_app([sys.argv[0], "-platform", offscreen_screen(size)])
    home = Path(os.environ["SPECDECK_DATA_DIR"])
    gpus = None
    if gpu_recording:
        from backends.hardware.gpus import NvmlSession
        from tests.hw_replay import load_replay

        gpus = NvmlSession(load_replay(gpu_recording))
    sampler = Sampler(interval=0.25, gpus=gpus, rapl=Rapl("/nonexistent")).start()
    window = MainWindow(sampler=sampler, store=ConversationStore(home / "c.sqlite3"),
                        settings=QSettings(str(home / "s.ini"), QSettings.Format.IniFormat))
    window.show()
    wait_until(app, lambda: window.model is not None, 300)
    wait_until(app, lambda: window.methods.advice is not None and window.hardware is not None, 300)
    wait_until(app, lambda: not window.busy, 60)
    tag = f"{size}-gpu" if gpu_recording else size
    welcome = None  # a returning user (the second launch of a test) gets no welcome page
    if window.welcome is not None:
        page = window.welcome
        wait_until(app, lambda: page.start.isEnabled(), 60)
        settle(app)
        welcome = {"current": window.tabs.currentWidget() is page, "clipped": clipped(window),
                   "text": [label.text() for label in (page.hardware, page.model, page.method)]}
        window.grab().save(str(out / f"welcome-{tag}.png"))
        page.start.click()  # the new user's one click
        settle(app)
        welcome["after"] = {"chat_in_front": window.tabs.currentWidget() is window.chat,
                            "focus_in_box": window.chat.input.hasFocus(), "tabs": window.tabs.count()}
    window.sampling.max_tokens.setValue(24)
    window.chat.input.setPlainText("Give me three tips for keeping houseplants alive.")
    window.chat.send()
    wait_until(app, lambda: not window.chat.streaming, 300)
    settle(app)
    out.mkdir(parents=True, exist_ok=True)
    chat = report(window)
    window.grab().save(str(out / f"chat-{tag}.png"))
    window.tabs.setCurrentWidget(window.compare)
    window.compare.prompt.setPlainText("Summarize in one sentence: the council met on Tuesday to plan the new park.")
    for name, box in window.compare.checks.items():
        box.setChecked(box.isEnabled() and name in ("ar", "pld", "lookahead", "auto"))
    window.compare.run()
    wait_until(app, lambda: not window.compare.running, 600)
    settle(app)
    compare = report(window)
    window.grab().save(str(out / f"compare-{tag}.png"))
    docks = tabbed_docks(window, out, tag)
    print(json.dumps({"welcome": welcome, "chat": chat, "compare": compare, "tabbed_docks": docks}), flush=True)
    window.close()
    sampler.stop()
    QApplication.processEvents()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:4]))
