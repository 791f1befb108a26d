"""The comparison panel: one prompt through several methods on the loaded model, side by side.

Plain decoding always runs first as the reference. Each method streams into its own pane; when
all are done a table gives decode tokens/s, speedup, tau, acceptance (overall and by draft depth:
the share of guesses at depth k accepted), joules per token (when a power source exists) and
whether the output is identical to plain decoding (with the logit margin of the first
difference, which shows a numerical near-tie). Runs are kept as JSON in the user data directory
and can be reloaded and exported.
"""

from __future__ import annotations

import csv
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from backends.bench import default_prompts, load_prompts
from backends.core.types import Finished, Step
from backends.drafters import FIRST_COMPARED, REGISTRY
from backends.models.paths import data_dir
from backends.remote.client import ServerConfig
from desktop.charts import PALETTE_EVENTS, paint_plot_widget
from desktop.forms import PromptBox
from desktop.panels import ScrollColumn
from desktop.worker import CompareDone, CompareEvent, CompareRow

COLUMNS = ("method", "decode tok/s", "speedup", "tau", "acceptance", "by depth %", "J/token", "identical to ar")
DEPTHS_SHOWN = 4  # draft depths whose acceptance the "by depth" column shows
METHOD_ROWS = 2  # rows of method check boxes above the panes
CHART_MIN_WIDTH = 180  # pixels for the bar chart beside the table
VERDICT_MIN_WIDTH = 110  # pixels for the last column ("identical to ar"); longer verdicts wrap


class ComparePanel(QWidget):
    """Methods on the loaded model; while a server answers, servers instead (each drafts as it was
    started, so a method there is a server launched with it)."""

    run_requested = Signal(str, tuple)  # prompt, methods
    stop_requested = Signal()
    add_server_requested = Signal()
    servers_changed = Signal(tuple)  # ((ServerConfig, ticked), ...): the servers offered for comparison

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history_dir = data_dir() / "comparisons"
        self.panes: dict[str, QTextBrowser] = {}
        self.texts: dict[str, str] = {}
        self.server = ""  # the connected server's name while one answers
        self.server_checks: dict[str, tuple[QCheckBox, ServerConfig]] = {}
        self.last: CompareDone | None = None
        self.running = False
        self._build()
        self.reload_history()

    def _build(self) -> None:
        self.prompt = PromptBox()
        self.prompt.setObjectName("compare_prompt")
        self.prompt.setPlaceholderText("A prompt to run through every selected method (Ctrl+Enter to run)")
        self.prompt.submitted.connect(self.run)
        self.setFocusProxy(self.prompt)  # the tab's own box gets the keys when the tab is shown
        self.prompt.setMaximumHeight(90)
        self.prompt.setMinimumHeight(44)  # two lines: the tab must fit under a 768-pixel screen's charts
        self.category = QComboBox()
        self.category.addItems(["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"])
        self.sample_button = QPushButton("Sample from Spec-Bench")
        self.sample_button.clicked.connect(self.sample_prompt)
        self.checks: dict[str, QCheckBox] = {}
        # the methods on two rows, what to run on the next: a dozen names on one row do not fit 1366 pixels
        methods_row = QGridLayout()
        methods_row.addWidget(QLabel("Methods:"), 0, 0)
        per_row = -(-len(REGISTRY) // METHOD_ROWS)
        for i, name in enumerate(REGISTRY):
            box = QCheckBox(name)
            box.setChecked(name in FIRST_COMPARED)
            if REGISTRY[name].baseline:
                box.setEnabled(False)  # the reference every other method is measured against
            self.checks[name] = box
            methods_row.addWidget(box, i // per_row, 1 + i % per_row)
        methods_row.setColumnStretch(per_row + 1, 1)
        self.methods_box = QWidget()
        self.methods_box.setLayout(methods_row)
        methods_row.setContentsMargins(0, 0, 0, 0)
        self.servers_box = QWidget()
        self.servers_row = QHBoxLayout(self.servers_box)
        self.servers_row.setContentsMargins(0, 0, 0, 0)
        self.server_label = QLabel()
        self.add_server_button = QPushButton("Add a server ...")
        self.add_server_button.setToolTip("Another server (launched with another method, or on another machine) "
                                          "to run the same prompt on; the connected one is the baseline")
        self.add_server_button.clicked.connect(self.add_server_requested)
        self.forget_servers_button = QPushButton("Forget unticked")
        self.forget_servers_button.clicked.connect(self._forget_unticked)
        for w in (self.server_label, self.add_server_button, self.forget_servers_button):
            self.servers_row.addWidget(w)
        self.servers_row.addStretch(1)
        self.servers_box.hide()
        self.run_button = QPushButton("Run")
        self.run_button.clicked.connect(self.run)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.stop_requested)
        run_row = QHBoxLayout()
        run_row.addWidget(QLabel("Spec-Bench category:"))
        for w in (self.category, self.sample_button):
            run_row.addWidget(w)
        run_row.addStretch(1)
        for w in (self.run_button, self.stop_button):
            run_row.addWidget(w)

        self.pane_grid = QGridLayout()
        panes = QWidget()
        panes.setLayout(self.pane_grid)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("compare_table")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        header = self.table.horizontalHeader()
        for column in range(len(COLUMNS) - 1):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.ResizeMode.Stretch)  # long verdicts wrap
        self.table.setWordWrap(True)
        self.chart = pg.PlotWidget()  # horizontal bars, one row per method (its height grows with them): names never overlap
        self.chart.setMinimumHeight(chart_height(2))
        self.chart.setMinimumWidth(CHART_MIN_WIDTH)
        self.chart.invertY(True)
        self.chart.setMouseEnabled(x=False, y=False)
        self.chart.setMenuEnabled(False)
        self.chart.setLabel("bottom", "decode tok/s")
        self.chart.setLabel("left", "method")
        paint_plot_widget(self.chart, self.palette())
        self.export_csv = QPushButton("Export CSV")
        self.export_csv.clicked.connect(lambda: self._export("csv"))
        self.export_json = QPushButton("Export JSON")
        self.export_json.clicked.connect(lambda: self._export("json"))
        self._set_exportable(False)
        self.history = QListWidget()
        self.history.setObjectName("compare_history")
        self.history.setMinimumHeight(44)  # two runs; the list scrolls
        self.history.itemActivated.connect(self._load_history_item)
        self.history.itemClicked.connect(self._load_history_item)
        self.note = QLabel()
        self.note.setWordWrap(True)

        results = QWidget()
        rv = QVBoxLayout(results)
        rv.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        row.addWidget(self.table, 3)
        row.addWidget(self.chart, 2)
        rv.addLayout(row)
        rv.addWidget(self.note)
        buttons = QHBoxLayout()
        buttons.addWidget(self.export_csv)
        buttons.addWidget(self.export_json)
        buttons.addStretch(1)
        buttons.addWidget(QLabel("Earlier runs:"))
        rv.addLayout(buttons)
        rv.addWidget(self.history)

        results.layout().setContentsMargins(0, 0, 4, 0)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(panes)
        split.addWidget(ScrollColumn(results, stretch=False))  # scrolls on a short screen
        layout = QVBoxLayout(self)
        layout.addWidget(self.prompt)
        layout.addWidget(self.methods_box)
        layout.addWidget(self.servers_box)
        layout.addLayout(run_row)
        layout.addWidget(split, 1)
        self._fit_table()

    # -- running -----------------------------------------------------------------------------
    def methods(self) -> tuple[str, ...]:
        return tuple(name for name, box in self.checks.items() if box.isChecked())

    # -- servers -----------------------------------------------------------------------------
    def set_server(self, name: str) -> None:
        """Compare servers (``name``: the connected one, the baseline) or, with "", methods."""
        self.server = name
        self.methods_box.setVisible(not name)
        self.servers_box.setVisible(bool(name))
        self.server_label.setText(f"Servers: <b>{name}</b> (connected, the baseline)" if name else "")
        header = (("server",) + COLUMNS[1:-1] + ("same text as 1st",)) if name else COLUMNS
        self.table.setHorizontalHeaderLabels(header)
        self.chart.setLabel("left", "server" if name else "method")
        self._fit_table()

    def add_server(self, config: ServerConfig, *, checked: bool = True) -> None:
        """Offer ``config``'s server for comparison (an address already offered is replaced)."""
        if config.name in self.server_checks:
            self._drop_server(config.name)
        box = QCheckBox(config.name)
        box.setChecked(checked)
        box.setToolTip(f"{config.base}" + (f" · model {config.model}" if config.model else ""))
        box.toggled.connect(lambda _: self.servers_changed.emit(self.servers()))
        self.server_checks[config.name] = (box, config)
        self.servers_row.insertWidget(self.servers_row.indexOf(self.add_server_button), box)
        self.servers_changed.emit(self.servers())

    def servers(self) -> tuple[tuple[ServerConfig, bool], ...]:
        """Every offered server and whether it is ticked (what is kept for the next start)."""
        return tuple((config, box.isChecked()) for box, config in self.server_checks.values())

    def chosen_servers(self) -> tuple[ServerConfig, ...]:
        """The ticked servers other than the connected one, in the order they were added."""
        return tuple(config for box, config in self.server_checks.values() if box.isChecked() and config.name != self.server)

    def _drop_server(self, name: str) -> None:
        box, _ = self.server_checks.pop(name)
        self.servers_row.removeWidget(box)
        box.deleteLater()

    def _forget_unticked(self) -> None:
        for name in [n for n, (box, _) in self.server_checks.items() if not box.isChecked()]:
            self._drop_server(name)
        self.servers_changed.emit(self.servers())

    def set_available(self, usable: dict[str, str | None]) -> None:
        """Grey out methods that cannot run now (name -> reason or None): the loaded session lacks
        what they need, or their settings in the Method panel are not complete."""
        for name, box in self.checks.items():
            if REGISTRY[name].baseline:
                continue
            why = usable.get(name)
            box.setEnabled(why is None)
            box.setToolTip(why or REGISTRY[name].summary)
            if why is not None:
                box.setChecked(False)

    def sample_prompt(self) -> None:
        try:
            prompts = load_prompts(default_prompts(), per_category=50, categories=(self.category.currentText(),))
        except Exception as exc:  # noqa: BLE001 - the prompt file is optional
            self.note.setText(f"Spec-Bench prompts are not available: {exc}")
            return
        if prompts:
            self.prompt.setPlainText(random.choice(prompts).turns[0])

    def run(self) -> None:
        text = self.prompt.toPlainText().strip()
        if not text or self.running:
            return
        methods = () if self.server else self.methods()
        self._start((self.server, *(c.name for c in self.chosen_servers())) if self.server else methods)  # the panes
        self.run_requested.emit(text, methods)

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt's name
        """The system switched light/dark: the bar chart follows, as the live charts do."""
        if event.type() in PALETTE_EVENTS and hasattr(self, "chart"):
            paint_plot_widget(self.chart, self.palette())
        super().changeEvent(event)

    def _start(self, methods: tuple[str, ...]) -> None:
        self.running = True
        self.run_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.note.setText("")
        self.table.setRowCount(0)
        self.chart.clear()
        self.chart.getAxis("left").setTicks(None)  # the last run's method names go with its bars
        while self.pane_grid.count():  # the previous run's headers and panes
            widget = self.pane_grid.takeAt(0).widget()
            if widget is not None:
                widget.deleteLater()
        self.panes, self.texts = {}, {}
        for name in [m for m in REGISTRY if m in methods] + [m for m in methods if m not in REGISTRY]:  # servers last
            self._add_pane(name)

    def _add_pane(self, name: str) -> QTextBrowser:
        """A column for ``name``'s streamed text (a server answering as it was started gets one
        when its first event arrives)."""
        pane = QTextBrowser()
        pane.setObjectName(f"pane_{name}")
        pane.setMinimumHeight(48)  # three lines; it scrolls
        col = len(self.panes)
        self.panes[name] = pane
        self.texts[name] = ""
        self.pane_grid.addWidget(QLabel(f"<b>{name}</b>"), 0, col)
        self.pane_grid.addWidget(pane, 1, col)
        return pane

    def on_event(self, event: CompareEvent) -> None:
        pane = self.panes.get(event.method)
        if pane is None:
            if not self.running:
                return
            pane = self._add_pane(event.method)
        if isinstance(event.event, Step) and event.event.text:
            self.texts[event.method] += event.event.text
            pane.setPlainText(self.texts[event.method])
        elif isinstance(event.event, Finished):
            pane.setPlainText(event.event.text)

    def on_done(self, done: CompareDone) -> None:
        self._finish()
        if done.cancelled:
            self.note.setText("Stopped; nothing measured.")
            return
        for row in done.rows:
            if row.error and row.method in self.panes:
                self.panes[row.method].setPlainText(f"{row.method} could not run: {row.error}")
        self.show_result(done)
        self._save(done)

    def on_failure(self, message: str) -> None:
        if self.running:
            self._finish()
            self.note.setText(f"The comparison failed: {message}")

    def _finish(self) -> None:
        self.running = False
        self.run_button.setEnabled(True)
        self.stop_button.setEnabled(False)

    # -- results -----------------------------------------------------------------------------
    def _set_exportable(self, on: bool) -> None:
        for button, kind in ((self.export_csv, "CSV"), (self.export_json, "JSON")):
            button.setEnabled(on)
            button.setToolTip(f"Save the results table as {kind}" if on else "Run a comparison first (or open an earlier run)")

    def show_result(self, done: CompareDone) -> None:
        self.last = done
        self._set_exportable(bool(done.rows))
        self.table.setRowCount(len(done.rows))
        for r, row in enumerate(done.rows):
            cells = _cells(row)
            for c, value in enumerate(cells):
                item = QTableWidgetItem(value)
                item.setToolTip(row.divergence_note if c == len(cells) - 1 and row.divergence_note else value)
                item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsEditable)
                self.table.setItem(r, c, item)
        self.table.resizeRowsToContents()
        self._fit_table()
        self.chart.clear()
        ran = [row for row in done.rows if not row.error]
        rates = [row.decode_tok_s if math.isfinite(row.decode_tok_s) else 0.0 for row in ran]
        self.chart.addItem(pg.BarGraphItem(x0=0, y=list(range(len(rates))), width=rates, height=0.6, brush=(60, 140, 230)))
        self.chart.setMinimumHeight(chart_height(max(2, len(rates))))  # as tall as its bars need: the panel scrolls less
        self.chart.setYRange(-0.5, max(1, len(rates)) - 0.5, padding=0.05)
        self.chart.getAxis("left").setTicks([[(i, row.method) for i, row in enumerate(ran)]])
        notes = [f"{row.method} could not run: {row.error}" for row in done.rows if row.error]
        for row in ran:
            if row.declined:
                notes.append(f"{row.method} drafted nothing: {row.declined}.")
            if row.near_tie:
                notes.append(f"{row.method}: {row.divergence_note}. Batched and one-token evaluation round differently; "
                             "within this model's measured batch noise that is not a different distribution.")
            elif not row.identical:
                notes.append(f"{row.method}: {row.divergence_note}.")
        self.note.setText("\n".join(notes))

    def _fit_table(self) -> None:
        """Wide enough for every column but the last at its content's width, and the last (whether
        the output is identical) at ``VERDICT_MIN_WIDTH``, wrapping beyond: so no column is ever
        hidden behind a sideways scroll bar."""
        table, header = self.table, self.table.horizontalHeader()
        columns = sum(max(header.sectionSizeHint(c), table.sizeHintForColumn(c)) for c in range(table.columnCount() - 1))
        frame = 2 * table.frameWidth() + table.verticalHeader().sizeHint().width()
        table.setMinimumWidth(columns + VERDICT_MIN_WIDTH + frame)

    def _save(self, done: CompareDone) -> None:
        self.history_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.history_dir / f"{stamp}-{done.request_id}.json"
        path.write_text(json.dumps({"prompt": done.prompt, "rows": [asdict(r) for r in done.rows], "time": time.time()}))
        self.reload_history()

    def reload_history(self) -> None:
        self.history.clear()
        for path in sorted(self.history_dir.glob("*.json"), reverse=True) if self.history_dir.is_dir() else ():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            item = QListWidgetItem(f"{path.stem[:15]}  {' / '.join(r['method'] for r in data['rows'])}  ·  {data['prompt'][:60]}")
            item.setData(Qt.ItemDataRole.UserRole, str(path))
            self.history.addItem(item)

    def _load_history_item(self, item: QListWidgetItem) -> None:
        data = json.loads(Path(item.data(Qt.ItemDataRole.UserRole)).read_text())
        rows = tuple(CompareRow(**r) for r in data["rows"])
        self.prompt.setPlainText(data["prompt"])
        self._start(tuple(r.method for r in rows))
        self._finish()
        for row in rows:
            if row.method in self.panes:
                self.panes[row.method].setPlainText(row.text)
        self.show_result(CompareDone(-1, data["prompt"], rows))

    def _export(self, kind: str) -> None:
        if self.last is None:
            return
        path, _ = QFileDialog.getSaveFileName(self, "Export comparison", f"comparison.{kind}")
        if path:
            export(self.last, Path(path), kind)


def export(done: CompareDone, path: Path, kind: str) -> None:
    """The results as JSON or CSV. A figure that does not exist (plain decoding's acceptance rate:
    it drafts nothing) is ``null`` in JSON and an empty cell in CSV, never ``NaN``, which is not
    JSON and which spreadsheets read as text."""
    rows = [{k: _known(v) for k, v in asdict(r).items()} for r in done.rows]
    if kind == "json":
        path.write_text(json.dumps({"prompt": done.prompt, "rows": rows}, indent=1, allow_nan=False))
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["method"])
        writer.writeheader()
        writer.writerows({k: _csv_cell(v) for k, v in row.items()} for row in rows)


def _csv_cell(value):
    """A cell a spreadsheet reads: empty for an unknown figure, a list (acceptance by depth) as its
    numbers separated by spaces rather than Python's tuple text."""
    if value is None:
        return ""
    if isinstance(value, (tuple, list)):
        return " ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in value)
    return value


def _known(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def chart_height(bars: int) -> int:
    """Pixels for the bar chart: a row of text per method, and its axis."""
    return 22 * bars + 50


def _cells(row: CompareRow) -> tuple[str, ...]:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None or not math.isfinite(value) else fmt.format(value)

    if row.error:
        return (row.method, "-", "-", "-", "-", "-", "-", f"failed: {row.error}")
    if row.identical:
        same = "yes"
    elif row.near_tie:
        same = f"yes, up to a near-tie at token {row.divergence_position}"
    elif row.divergence_position is None:  # a server's answer: only its text is known
        same = "NO"
    else:
        same = f"NO from token {row.divergence_position} (margin {num(row.divergence_margin, '{:.3f}')})"
    depths = " ".join(f"{100 * a:.0f}" for a in row.acceptance_by_depth[:DEPTHS_SHOWN]) or "-"  # narrow: 1366 pixels
    return (row.method, num(row.decode_tok_s, "{:.1f}"), num(row.speedup, "{:.2f}x"), num(row.tau, "{:.2f}"),
            num(row.acceptance_rate, "{:.0%}"), depths, num(row.joules_per_token, "{:.3f}"), same)
