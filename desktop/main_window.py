"""The SpecDeck main window: model library, hardware, method chooser, chat, live charts, comparison.

The window owns no model. It sends requests to the worker thread (``desktop.worker``) through
queued signals and shows what comes back; anything slow that does not touch llama.cpp (GGUF
headers, hardware probes, fit estimates, recommendations) runs on the thread pool. So the GUI
thread only ever draws, and a failure anywhere becomes a message in the window.
"""

from __future__ import annotations

import html
import itertools
import json
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QEvent, QMetaObject, QSettings, QSize, Qt, QThread, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QDockWidget,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from backends.addons import has_nvidia
from backends.core.errors import BackendError
from backends.core.types import Finished, Step
from backends.drafters import REGISTRY
from backends.factory import SessionConfig
from backends.hardware.detect import detect_hardware
from backends.hardware.fit import RuntimeSettings, method_extra, plan, trained_head_bytes
from backends.hardware.recommend import recommend
from backends.hardware.shape import load_shape
from backends.hardware.telemetry import Sampler
from backends.hardware.types import HardwareReport
from backends.models.llama_lib import cpu_runtime
from backends.models.catalog import CATALOG, DEFAULT_MODEL, is_present, resolve_model
from backends.remote.client import ServerConfig
from backends.remote.keys import load_key
from desktop.charts import LiveCharts, follow_palette
from desktop.chat import ChatPanel
from desktop.compare import ComparePanel
from desktop.jobs import run_job
from desktop.library import ModelLibrary
from backends.remote.gpu import ServerGpus
from desktop.server import ConnectDialog
from desktop.panels import HardwarePanel, MethodAdvice, MethodPanel, SamplingPanel, ScrollColumn
from desktop.store import ConversationStore
from desktop.train import TrainDialog
from desktop.welcome import WELCOME_DONE, WelcomePage
from desktop.worker import (
    AnswerEvent,
    AnswerRequest,
    CompareDone,
    CompareEvent,
    CompareRequest,
    ConnectRequest,
    Failure,
    LoadRequest,
    ModelReady,
    Worker,
)

TITLE = "SpecDeck"
PREFERRED_SIZE = QSize(1800, 1000)  # the first window where the screen has room (a 1920x1080 one)
WIDE_LAYOUT = 1700  # window width from which Models and Method and sampling each get a side
SIDE_WIDTH = 520  # Models' table and buttons (or the shared column on a narrower window)
METHOD_WIDTH = 360  # Method and sampling on the right, in the wide layout


def settings_list(settings: QSettings, key: str) -> list[str]:
    """A list of strings as it was stored, on every settings backend.

    The INI and Linux backends write a one-element list as a plain string and read it back as
    ``str``; ``list("/home/me")`` would then be its characters (one folder became ``['/', 'h',
    ...]`` and the library scanned the whole disk)."""
    value = settings.value(key, [])
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    return [str(v) for v in value]


class MainWindow(QMainWindow):
    load_request = Signal(object)
    answer_request = Signal(object)
    compare_request = Signal(object)
    heads_changed = Signal()
    connect_request = Signal(object)  # ConnectRequest
    disconnect_request = Signal()

    def __init__(self, *, sampler: Sampler | None, store: ConversationStore, settings: QSettings,
                 autoload: str | None = DEFAULT_MODEL) -> None:
        super().__init__()
        self.settings = settings
        self.sampler = sampler
        self.hardware: HardwareReport | None = None
        self.model: ModelReady | None = None
        self.busy = False
        self._ids = itertools.count(1)
        self._answer: AnswerRequest | None = None
        self._compare: CompareRequest | None = None
        self._load: LoadRequest | None = None
        self._ask_after_load: list | None = None
        self._startup_error: str | None = None
        self._startup_note: str | None = None  # a CPU variant died in the probe just now
        self._sticky = ""  # banner text only the user dismisses (a crash report, an unusable build)
        self._error = ""  # the banner's ordinary error, cleared when things work again
        self.setWindowTitle(TITLE)
        follow_palette(self)
        self._start_worker()
        self._build(store)
        if self._startup_error:
            self.show_error("llama.cpp cannot run on this PC", self._startup_error, sticky=True)
        if store.recovered:
            self.show_error("Conversations", store.recovered, sticky=True)
        if self._startup_note:
            self.statusBar().showMessage(f"Note: {self._startup_note}", 60000)
        self._restore()
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, activated=self.stop)
        QShortcut(QKeySequence("Ctrl+PgDown"), self, activated=lambda: self._next_tab(1))
        QShortcut(QKeySequence("Ctrl+PgUp"), self, activated=lambda: self._next_tab(-1))
        QShortcut(QKeySequence.StandardKey.New, self, activated=self._new_chat)  # Ctrl+N
        run_job(self, detect_hardware, self._on_hardware, lambda msg: self.show_error("Hardware detection failed", msg))
        model = autoload and (self.settings.value("model/last", autoload) or autoload)
        if model:
            backend = str(self.settings.value("model/backend", "llamacpp"))
            self.library.set_backend(backend)
            self.load_model(str(model), int(self.settings.value("model/n_ctx", 4096)), backend=backend)
        self.chat.input.setFocus()

    # -- construction ------------------------------------------------------------------------
    def _start_worker(self) -> None:
        # Load llama.cpp and install its log callback here, on the GUI thread, before the worker
        # exists: initialising it lazily on the worker thread while the GUI thread ran Python
        # crashed the process now and then (a ctypes callback set up mid-flight).
        try:
            runtime = cpu_runtime()
        except BackendError as exc:  # no CPU code of this llama.cpp runs here: say so, keep the window
            self._startup_error = str(exc)
        else:
            self._startup_note = runtime.fallback_note if runtime is not None and not runtime.cached else None
        self.thread = QThread(self)
        self.thread.setObjectName("specdeck-inference")
        self.worker = Worker(self.sampler)
        self.worker.moveToThread(self.thread)
        self.load_request.connect(self.worker.load)
        self.answer_request.connect(self.worker.answer)
        self.compare_request.connect(self.worker.compare)
        self.heads_changed.connect(self.worker.refresh_heads)
        self.connect_request.connect(self.worker.connect_server)
        self.disconnect_request.connect(self.worker.disconnect_server)
        w = self.worker
        w.loading.connect(self._on_loading)
        w.ready.connect(self._on_ready)
        w.unloaded.connect(self._on_unloaded)
        w.answer_event.connect(self._on_answer_event)
        w.compare_event.connect(self._on_compare_event)
        w.compare_done.connect(self._on_compare_done)
        w.failed.connect(self._on_failure)
        w.notice.connect(lambda text: self.statusBar().showMessage(f"Note: {text}", 15000))
        w.busy.connect(self._on_busy)
        self.thread.start()

    def _build(self, store: ConversationStore) -> None:
        self.chat = ChatPanel(store)
        self.chat.send_requested.connect(self.ask)
        self.chat.stop_requested.connect(self.stop)
        self.compare = ComparePanel()
        self.compare.run_requested.connect(self.run_comparison)
        self.compare.stop_requested.connect(self.stop)
        self.compare.add_server_requested.connect(self._add_compare_server)
        for config, ticked in saved_servers(self.settings):
            self.compare.add_server(config, checked=ticked)
        self.compare.servers_changed.connect(self._keep_compare_servers)
        self.tabs = QTabWidget()
        self.tabs.addTab(self.chat, "Chat")
        self.tabs.addTab(self.compare, "Compare methods")
        self.welcome: WelcomePage | None = None
        if not self.settings.value(WELCOME_DONE, False, type=bool):  # the first start: say what was found and chosen
            self.welcome = WelcomePage()
            self.welcome.start_requested.connect(self.start_chatting)
            self.tabs.insertTab(0, self.welcome, "Welcome")
            self.tabs.setCurrentWidget(self.welcome)
        self.tabs.currentChanged.connect(lambda _: self.tabs.currentWidget().setFocus())  # its own box
        self.banner = QLabel()
        self.banner.setObjectName("error_banner")
        self.banner.setWordWrap(True)
        # Palette roles, not fixed colours, so the banner reads in dark mode too.
        self.banner.setStyleSheet("background: palette(alternate-base); color: palette(text); padding: 6px; "
                                  "border: 2px solid #c0392b; border-radius: 3px")
        self.banner_close = QPushButton("Dismiss")
        self.banner_close.clicked.connect(self.dismiss_error)
        banner_row = QHBoxLayout()
        banner_row.addWidget(self.banner, 1)
        banner_row.addWidget(self.banner_close)
        central = QWidget()
        cv = QVBoxLayout(central)
        cv.setContentsMargins(4, 4, 4, 4)
        cv.addLayout(banner_row)
        cv.addWidget(self.tabs, 1)
        self.setCentralWidget(central)
        self.clear_error()

        self.library = ModelLibrary(settings_list(self.settings, "library/folders"))
        self.library.load_requested.connect(lambda spec, n_ctx, backend: self.load_model(spec, n_ctx, backend=backend))
        self.library.head_installed.connect(lambda _path: self.heads_changed.emit())
        self.library.load_refused.connect(lambda name, why: self.show_error(f"{name} cannot be loaded", why))
        self.library.folders_changed.connect(lambda folders: self.settings.setValue("library/folders", folders))
        self.hardware_panel = HardwarePanel()
        self.methods = MethodPanel()
        self.methods.draft_chosen.connect(self.load_draft)
        self.methods.train_requested.connect(self.open_train_dialog)
        self.train_dialog: TrainDialog | None = None
        self.connect_dialog: ConnectDialog | None = None
        self._local_gpus: tuple = ()  # (the sampler's own GPU source,) while a server's GPUs are read
        self.methods.runnable_changed.connect(self.compare.set_available)  # greyed, or settings incomplete
        self.sampling = SamplingPanel()
        self.charts = LiveCharts(self.sampler, has_gpu=bool(self.sampler and self.sampler.has_gpu))
        self.worker.plain_rate.connect(self.charts.set_reference)  # measured after each plain-decoding run
        self.docks = {
            "models": self._dock("Models", self.library, Qt.DockWidgetArea.LeftDockWidgetArea),
            "hardware": self._dock("Hardware", self.hardware_panel, Qt.DockWidgetArea.LeftDockWidgetArea),
            "method": self._dock("Method and sampling", ScrollColumn(self.methods, self.sampling),
                                 Qt.DockWidgetArea.RightDockWidgetArea),
            "charts": self._dock("Live charts", self.charts, Qt.DockWidgetArea.BottomDockWidgetArea),
        }
        # The side columns run the full height; the charts sit under the conversation only.
        self.setCorner(Qt.Corner.BottomLeftCorner, Qt.DockWidgetArea.LeftDockWidgetArea)
        self.setCorner(Qt.Corner.BottomRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)

        self.status_label = QLabel("No model loaded")
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setMaximumWidth(200)
        self.cancel_load = QPushButton("Cancel loading")
        self.cancel_load.clicked.connect(self.stop)
        self.server_button = QPushButton("Connect to a server ...")
        self.server_button.setToolTip("Use vLLM, llama-server or another OpenAI-compatible server instead of a model "
                                      "on this PC; the charts read the server's own counters")
        self.server_button.clicked.connect(self._server_clicked)
        self.statusBar().addWidget(self.status_label, 1)
        self.statusBar().addPermanentWidget(self.progress)
        self.statusBar().addPermanentWidget(self.cancel_load)
        self.statusBar().addPermanentWidget(self.server_button)
        self.progress.hide()
        self.cancel_load.hide()
        self.progress_timer = QTimer(self)
        self.progress_timer.setInterval(100)
        self.progress_timer.timeout.connect(self._on_progress)

    def _dock(self, title: str, widget: QWidget, area: Qt.DockWidgetArea) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(f"dock_{title.split()[0]}")
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        return dock

    def _new_chat(self) -> None:
        """A new conversation, shown with the cursor in its message box (not while one streams)."""
        self.tabs.setCurrentWidget(self.chat)
        self.chat.new_chat()

    def _next_tab(self, step: int) -> None:
        self.tabs.setCurrentIndex((self.tabs.currentIndex() + step) % self.tabs.count())

    # -- settings ----------------------------------------------------------------------------
    def _restore(self) -> None:
        geometry, state = self.settings.value("window/geometry"), self.settings.value("window/state")
        if geometry is None or not self.restoreGeometry(geometry):
            self._default_geometry()
        if state is None or self.settings.value("window/screen") != self._screen_size() or not self.restoreState(state):
            self._default_docks()  # first launch, or the docks were arranged for another screen
        sampling = self.settings.value("sampling/state")
        if isinstance(sampling, dict):
            self.sampling.restore(sampling)
        self.sampling.system.setPlainText(str(self.settings.value("sampling/system", "") or ""))
        self._wanted_method = str(self.settings.value("method/name", "") or "")  # first launch: the recommended one
        self.methods.select(self._wanted_method)

    def _default_geometry(self) -> None:
        """``PREFERRED_SIZE`` centred where the screen has room for it, else maximized (a laptop's
        1366x768): the window is never larger than the screen it opens on."""
        available = self.screen().availableGeometry()
        if available.width() >= PREFERRED_SIZE.width() + 40 and available.height() >= PREFERRED_SIZE.height() + 60:
            self.resize(PREFERRED_SIZE)
            self.move(available.center() - self.rect().center())
        else:
            self.resize(available.size())
            self.setWindowState(Qt.WindowState.WindowMaximized)

    def _default_docks(self) -> None:
        """Models and Hardware on the left and Method and sampling on the right where the window is
        wide enough for all three beside the conversation (``WIDE_LAYOUT``); on a narrower one the
        three share one column as tabs, so each keeps the width it needs. Once shown, the charts
        get a quarter of the height per row of plots, at most two fifths (``_default_dock_sizes``)."""
        d = self.docks
        width = self.screen().availableGeometry().width() if self.windowState() & Qt.WindowState.WindowMaximized else self.width()
        if width >= WIDE_LAYOUT:
            self.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, d["models"])
            self.tabifyDockWidget(d["models"], d["hardware"])
            self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, d["method"])
            d["models"].raise_()
        else:
            self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, d["method"])
            self.tabifyDockWidget(d["method"], d["models"])
            self.tabifyDockWidget(d["models"], d["hardware"])
            d["method"].raise_()
        for dock in d.values():
            dock.show()
        self._size_docks_when_shown = True

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        """Dock sizes set before the first show are scaled away when the window takes its final
        size (maximized on a small screen), so the default ones are set once it has it."""
        super().showEvent(event)
        if getattr(self, "_size_docks_when_shown", False):
            self._size_docks_when_shown = False
            QTimer.singleShot(0, self._default_dock_sizes)

    def _default_dock_sizes(self) -> None:
        d = self.docks
        if d["models"].isFloating() or self.dockWidgetArea(d["models"]) == Qt.DockWidgetArea.LeftDockWidgetArea:
            self.resizeDocks([d["models"], d["method"]], [SIDE_WIDTH, METHOD_WIDTH], Qt.Orientation.Horizontal)
        else:
            self.resizeDocks([d["method"]], [SIDE_WIDTH], Qt.Orientation.Horizontal)
        wanted = min(self.charts.rows * self.height() // 4, self.height() * 2 // 5)  # a quarter per row of plots
        self.resizeDocks([d["charts"]], [max(self.charts.minimumHeight(), wanted)], Qt.Orientation.Vertical)

    def _screen_size(self) -> str:
        """The screen's available size, saved with the docks: arranged for a larger screen (an
        external monitor), they would not fit this one, so they are arranged again."""
        size = self.screen().availableGeometry().size()
        return f"{size.width()}x{size.height()}"

    def save_settings(self) -> None:
        s = self.settings
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/state", self.saveState())
        s.setValue("window/screen", self._screen_size())
        s.setValue("sampling/state", self.sampling.state())
        s.setValue("sampling/system", self.sampling.system.toPlainText())
        s.setValue("method/name", self.methods.method())
        if self.model is not None and not self.model.server:  # the next start loads a model, not an address
            s.setValue("model/last", self.model.model)
            s.setValue("model/n_ctx", self.model.n_ctx)
            s.setValue("model/backend", self.model.backend)
        s.sync()

    # -- model loading -----------------------------------------------------------------------
    def load_model(self, spec: str, n_ctx: int = 4096, draft: str | None = None, backend: str = "llamacpp") -> None:
        if self.busy:
            self.show_error("Busy", "Stop the current answer or comparison before loading a model.")
            return
        self._load = LoadRequest(SessionConfig(model=spec, draft_model=draft, n_ctx=n_ctx, backend=backend))
        self.load_request.emit(self._load)

    def _server_clicked(self) -> None:
        if self.model is not None and self.model.server:
            self.disconnect_request.emit()
            return
        saved = self.settings
        dialog = ConnectDialog(str(saved.value("server/url", "")), self, ca_file=str(saved.value("server/ca", "")),
                               stall_timeout=float(saved.value("server/stall_s", ServerConfig.stall_timeout)),
                               retries=int(saved.value("server/retries", ServerConfig.retries)),
                               api=str(saved.value("server/api", ServerConfig.api)))
        dialog.connect_requested.connect(self.connect_server)
        dialog.open()
        self.connect_dialog = dialog

    def _add_compare_server(self) -> None:
        """The Connect dialog, adding a server to the comparison panel instead of connecting."""
        saved = self.settings
        dialog = ConnectDialog("", self, stall_timeout=float(saved.value("server/stall_s", ServerConfig.stall_timeout)),
                               retries=int(saved.value("server/retries", ServerConfig.retries)), action="Add")
        dialog.connect_requested.connect(self.compare.add_server)
        dialog.open()
        self.connect_dialog = dialog

    def _compare_servers(self, name: str) -> None:
        """While the server ``name`` answers, the comparison tab compares servers; with "", methods."""
        self.compare.set_server(name)
        self.tabs.setTabText(self.tabs.indexOf(self.compare), "Compare servers" if name else "Compare methods")

    def _keep_compare_servers(self, servers: tuple) -> None:
        """The comparison's servers for the next start: addresses, models, CA files, endpoint and
        patience (keys stay in the keyring or the owner-only file, where the dialog put them)."""
        self.settings.setValue("server/compare", json.dumps([
            {"url": c.url, "model": c.model, "ca": c.verify if isinstance(c.verify, str) else "", "api": c.api,
             "stall_s": c.stall_timeout, "retries": c.retries, "ticked": ticked}
            for c, ticked in servers]))

    def _chart_gpus(self, server_metrics: str) -> None:
        """The GPU charts read the server's GPUs (``server_metrics``: its dcgm-exporter) or, with
        "", this PC's again."""
        if self.sampler is None:
            return
        if server_metrics:
            previous = self.sampler.use_gpus(ServerGpus(server_metrics))
            if self._local_gpus:
                if previous is not None:
                    previous.close()  # another server's
            else:
                self._local_gpus = (previous,)
        elif self._local_gpus:
            current = self.sampler.use_gpus(self._local_gpus[0])
            if current is not None:
                current.close()
            self._local_gpus = ()
        self.charts.set_gpu(self.sampler.has_gpu, "server GPU" if server_metrics else "GPU")

    def connect_server(self, config) -> None:
        """Answer from the server at ``config`` (a ServerConfig) from now on; until it answers the
        check, the model in use stays in use."""
        if self.busy:
            self.show_error("Busy", "Stop the current answer or comparison before connecting to a server.")
            return
        self.settings.setValue("server/url", config.url)
        self.settings.setValue("server/ca", config.verify if isinstance(config.verify, str) else "")
        self.settings.setValue("server/stall_s", config.stall_timeout)
        self.settings.setValue("server/retries", config.retries)
        self.settings.setValue("server/api", config.api)
        self.connect_request.emit(ConnectRequest(config))

    def open_train_dialog(self, kind: str) -> None:
        """The train dialog for the loaded model (one at a time; a running one is shown again)."""
        if self.model is None:
            self.show_error("No model loaded", "load the model to train a head for first")
            return
        dialog = self.train_dialog
        if dialog is None or not dialog.running():
            if dialog is not None:
                dialog.deleteLater()
            nvidia = self.hardware is not None and has_nvidia(self.hardware.gpus)
            dialog = self.train_dialog = TrainDialog(self.model.path, kind or "medusa", self, nvidia_gpu=nvidia)
            dialog.trained.connect(lambda _path: self.heads_changed.emit())
        dialog.show()
        dialog.raise_()

    def load_draft(self, draft_path: str) -> None:
        if self.model is None:
            self.show_error("No model loaded", "load a target model first; the draft model drafts for it")
            return
        self.load_model(self.model.model, self.model.n_ctx, draft=draft_path, backend=self.model.backend)

    def start_chatting(self) -> None:
        """The welcome page's one click: to the chat, cursor in the message box; not shown again."""
        self.settings.setValue(WELCOME_DONE, True)
        if self.welcome is not None:
            self.tabs.removeTab(self.tabs.indexOf(self.welcome))
            self.welcome.deleteLater()
            self.welcome = None
        self.tabs.setCurrentWidget(self.chat)
        self.chat.input.setFocus()

    def _on_loading(self, spec: str) -> None:
        """A load started; the model loaded before stays in use (and shown) until it is ready."""
        if self.welcome is not None:
            self.welcome.set_loading(spec)
        kept = f" · {self.model.name} stays loaded until then" if self.model is not None else ""
        self.status_label.setText(f"Loading {spec} ...{kept}")
        self.progress.setValue(0)
        self.progress.show()
        self.cancel_load.show()
        self.progress_timer.start()

    def _on_progress(self) -> None:
        fraction = self.worker.load_fraction
        if 0.0 <= fraction <= 1.0:
            self.progress.setValue(round(fraction * 100))

    def _on_ready(self, ready: ModelReady) -> None:
        self.model = ready
        self._end_load()
        self.library.refresh_made()  # a row made on first use (a derived variant) now has a file
        self.library.set_loaded(ready.path)
        self.status_label.setText(self._ready_text(ready))
        self.server_button.setText("Disconnect" if ready.server else "Connect to a server ...")
        self._chart_gpus(ready.gpu_metrics if ready.server else "")
        self._compare_servers(ServerConfig(ready.server).name if ready.server else "")
        self._set_title(ready.name)
        self.charts.set_reference(ready.plain_tok_s)  # this model's measured plain decoding, or no line
        self.clear_error()
        self._refresh_advice()

    def _ready_text(self, ready: ModelReady) -> str:
        if ready.server:
            return (f"{ready.name} · {ready.placement} at {ready.server} · connected in {ready.seconds:.1f} s · "
                    "the server drafts as it was started")
        draft = f" + draft {Path(ready.draft_model).name}" if ready.draft_model else ""
        return f"{ready.name}{draft} · on {ready.placement} · context {ready.n_ctx} · loaded in {ready.seconds:.1f} s · ready"

    def _end_load(self) -> None:
        self._load = None
        self.progress_timer.stop()
        self.progress.hide()
        self.cancel_load.hide()

    def _on_unloaded(self) -> None:
        self.model = None
        self.server_button.setText("Connect to a server ...")
        self._chart_gpus("")
        self._compare_servers("")
        self.library.set_loaded(None)
        self._end_load()
        self.status_label.setText("No model loaded")
        self._set_title(None)

    def _set_title(self, name: str | None) -> None:
        """The loaded model in the title. Where the application's display name is SpecDeck, Qt
        appends it itself ("smollm2-135m-f16 — SpecDeck"), so it is not written twice."""
        if QGuiApplication.applicationDisplayName() == TITLE:
            self.setWindowTitle(name or "")
        else:
            self.setWindowTitle(f"{TITLE} — {name}" if name else TITLE)

    # -- advice: fit labels, recommendation, usable methods ----------------------------------
    def _on_hardware(self, report: HardwareReport) -> None:
        self.hardware = report
        if self.welcome is not None:
            self.welcome.set_hardware(report)
        self.hardware_panel.show_report(report)
        self.library.set_hardware(report)
        self._refresh_advice()

    def _refresh_advice(self) -> None:
        if self.model is not None:  # a server drafts as it was started: nothing to choose here
            self.methods.setEnabled(not self.model.server)
            self.methods.setToolTip("The server decides how it drafts (see `specdeck launch`)" if self.model.server else "")
        if self.model is None or self.hardware is None or self.model.server:
            return
        ready, hw = self.model, self.hardware
        run_job(self, lambda: compute_advice(ready, hw), self._on_advice,
                lambda msg: self.show_error("Could not estimate the methods", msg))

    def _on_advice(self, advice: MethodAdvice) -> None:
        if self.model is None:
            return
        self.methods.set_advice(advice, self.model.offers)
        if self._wanted_method:
            self.methods.select(self._wanted_method)
            self._wanted_method = ""
        if self.welcome is not None:
            fit = advice.fits.get(self.methods.method())
            self.welcome.set_model(self.model.name, fit.label if fit else f"runs on {self.model.placement}",
                                   bundled=self.model.model == DEFAULT_MODEL)
            self.welcome.set_method(self.methods.recommended.text())

    # -- chat --------------------------------------------------------------------------------
    def ask(self, conversation: list) -> None:
        generation = self.sampling.generation()
        method_settings = self.methods.method_settings()
        if self.model is None or generation is None or method_settings is None:
            why = "Load a model first." if self.model is None else "Fix the highlighted setting first."
            self.chat.on_failure(why)
            return
        system = self.sampling.system.toPlainText().strip()
        messages = tuple(([{"role": "system", "content": system}] if system else []) + conversation)
        self._answer = AnswerRequest(next(self._ids), messages, self.methods.method(), generation, method_settings,
                                     template=self.sampling.template_override())
        self.answer_request.emit(self._answer)

    def _on_answer_event(self, ev: AnswerEvent) -> None:
        if self._answer is None or ev.request_id != self._answer.request_id:
            return
        self.chat.on_event(ev.event, ev.draft_text)
        if isinstance(ev.event, Step):
            self.charts.add_step(ev.event)
        elif isinstance(ev.event, Finished):
            self._answer = None

    # -- comparison --------------------------------------------------------------------------
    def run_comparison(self, prompt: str, methods: tuple) -> None:
        generation = self.sampling.generation()
        if self.model is None or generation is None:
            self.compare.on_failure("Load a model first." if self.model is None else "Fix the sampling settings first.")
            return
        settings = {m: self.methods.form_of[m].changed_values() for m in methods}
        servers = tuple(with_saved_key(c) for c in self.compare.chosen_servers()) if self.model.server else ()
        self._compare = CompareRequest(next(self._ids), prompt, methods, generation, settings, servers)
        self.compare_request.emit(self._compare)

    def _on_compare_event(self, ev: CompareEvent) -> None:
        if self._compare is not None and ev.request_id == self._compare.request_id:
            self.compare.on_event(ev)
            if isinstance(ev.event, Step):
                self.charts.add_step(ev.event)

    def _on_compare_done(self, done: CompareDone) -> None:
        if self._compare is not None and done.request_id == self._compare.request_id:
            self._compare = None
            self.compare.on_done(done)

    # -- stopping, errors --------------------------------------------------------------------
    def stop(self) -> None:
        """Esc: stop whatever runs (answer, comparison or load) within one step."""
        for request in (self._answer, self._compare, self._load):
            if request is not None:
                request.cancel.set()

    def _on_busy(self, busy: bool) -> None:
        self.busy = busy

    def _on_failure(self, failure: Failure) -> None:
        if self._answer is not None and failure.request_id == self._answer.request_id:
            self._answer = None
            self.chat.on_failure(failure.message, refused=failure.refused)
        elif self._compare is not None and failure.request_id == self._compare.request_id:
            self._compare = None
            self.compare.on_failure(failure.message)
        elif failure.request_id is None and failure.kept_model and self.model is not None:
            self._end_load()  # a load failed; the model loaded before is still the one in use
            self.status_label.setText(f"{self._ready_text(self.model)} · kept: the new model did not load")
        if failure.request_id is None and self.model is None and self.welcome is not None:
            self.welcome.set_failed(failure.message)  # the first start's model did not load
        self.show_error(failure.title, failure.message)

    def show_error(self, title: str, message: str, *, sticky: bool = False) -> None:
        """The banner. A ``sticky`` message (a crash report, an unusable build) stays until the
        user dismisses it; routine successes, such as a model becoming ready, clear only the
        ordinary error shown below it."""
        text = f"<b>{title}</b>: {html.escape(message, quote=False)}"
        if sticky:
            self._sticky = text
        else:
            self._error = text
        self._show_banner()

    def _show_banner(self) -> None:
        text = "<br>".join(t for t in (self._sticky, self._error) if t)
        self.banner.setText(text)
        self.banner.setVisible(bool(text))
        self.banner_close.setVisible(bool(text))

    def dismiss_error(self) -> None:
        self._sticky = self._error = ""
        self._show_banner()

    def clear_error(self) -> None:
        self._error = ""
        self._show_banner()

    def error_text(self) -> str:
        return self.banner.text() if self.banner.isVisible() else ""

    # -- closing -----------------------------------------------------------------------------
    def closeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self.save_settings()
        if self.train_dialog is not None:
            self.train_dialog.close()  # stops its training; what it made so far is kept
        self.stop()  # the worker finishes its current step, then frees the models
        QMetaObject.invokeMethod(self.worker, "shutdown", Qt.ConnectionType.BlockingQueuedConnection)
        self.thread.quit()
        self.thread.wait(10_000)
        QCoreApplication.sendPostedEvents(None, QEvent.Type.MetaCall)  # the worker's last events (the answer so far) before the store closes
        self.chat.store.close()
        self.library.shutdown()  # a download stops at its next chunk; its partial file resumes next time
        super().closeEvent(event)


def compute_advice(ready: ModelReady, hw: HardwareReport) -> MethodAdvice:
    """Off the GUI thread: rank the methods, fit each one, sort drafts into usable and not."""
    from backends.hardware.bandwidth import cpu_bandwidth
    from backends.hardware.commands import measured_costs
    from backends.hardware.offload import with_gpu_module

    drafts = [resolve_model(m) for m in CATALOG if is_present(m)]
    hw = with_gpu_module(hw)  # a device only the GPU module knows (no NVML, no sysfs) still has its memory
    rt = RuntimeSettings(n_ctx=ready.n_ctx)
    # What the loaded model offers, not what a transformer would: a recurrent one cannot roll back.
    recs = recommend(ready.path, hw, drafts=drafts, rt=rt, cpu_bandwidth=cpu_bandwidth(hw.cpu, hw.ram.total_bytes),
                     target_offers=ready.offers, costs=measured_costs)
    shape = load_shape(ready.path)
    compatible = recs.compatible_drafts
    draft = load_shape(ready.draft_model) if ready.draft_model else (compatible[0] if compatible else None)
    fits = {name: plan(shape, hw, rt, method_extra(spec, rt.n_ctx, draft=draft, hidden_size=shape.n_embd,
                                                    heads_bytes=trained_head_bytes(spec, ready.path, rt.n_ctx)))
            for name, spec in REGISTRY.items()}
    return MethodAdvice(recs, fits, tuple(Path(s.path) for s in compatible), recs.rejected_drafts)


def saved_servers(settings: QSettings) -> list[tuple[ServerConfig, bool]]:
    """The comparison panel's servers kept by ``_keep_compare_servers`` (a damaged entry is skipped:
    a settings file edited by hand must not stop the window from opening). Their keys are looked up
    when a comparison runs (``with_saved_key``), not at start: a locked keyring would ask for its
    password before the window even showed."""
    try:
        entries = json.loads(str(settings.value("server/compare", "[]")))
    except ValueError:
        return []
    out = []
    for entry in entries if isinstance(entries, list) else ():
        try:
            url = entry["url"]
            out.append((ServerConfig(url, model=entry.get("model") or None,
                                     verify=entry.get("ca") or True, api=entry.get("api") or ServerConfig.api,
                                     stall_timeout=float(entry.get("stall_s", ServerConfig.stall_timeout)),
                                     retries=int(entry.get("retries", ServerConfig.retries))),
                        bool(entry.get("ticked", True))))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out


def with_saved_key(config: ServerConfig) -> ServerConfig:
    """``config`` with the key kept for its address, unless it carries one."""
    return config if config.api_key else replace(config, api_key=load_key(config.url))
