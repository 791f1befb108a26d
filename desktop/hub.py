"""Search the Hugging Face Hub and download models into the library, from inside the app.

Searching and listing files are short jobs on the thread pool. A download can take an hour, so it
gets a thread of its own (the pool is for short jobs), publishes a ``DownloadProgress`` record,
and the dialog polls that record on a timer: the GUI thread never waits on the network, and the
download thread never touches a widget. Closing the dialog only hides it; the download goes on,
and the library lists the model when it has been checked and renamed into place.

With a model loaded, "EAGLE-3 heads for ..." searches for heads published for it
(``backends/heads/from_hub.py``); downloading one of those checks its config against the model
before the weights come, and keeps it among the user's heads, not in the model library.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from PySide6.QtCore import QItemSelection, QItemSelectionModel, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from backends.heads.from_hub import install_head, search_heads
from backends.models.hub import (
    DownloadProgress,
    HubError,
    HubFile,
    HubModel,
    download_files,
    expand_selection,
    list_files,
    local_path,
    search_models,
)
from backends.models.paths import library_dir
from desktop.jobs import run_job

POLL_MS = 100
_KIND_NOTE = {
    "gguf": "",
    "safetensors": "weights (download with config.json and the tokenizer files)",
    "config": "",
    "pickle": "pickled weights: SpecDeck loads GGUF or safetensors only",
    "other": "",
}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _table(columns: tuple[str, ...], name: str) -> QTableWidget:
    table = QTableWidget(0, len(columns))
    table.setObjectName(name)
    table.setHorizontalHeaderLabels(columns)
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.horizontalHeader().setStretchLastSection(True)
    table.verticalHeader().setVisible(False)
    return table


class HubDialog(QDialog):
    """Search, pick files, download with progress, cancel and resume."""

    downloaded = Signal(list)  # the paths now in the library
    head_installed = Signal(str)  # a head from the Hub, saved for the loaded model (its JSON)

    def __init__(self, endpoint: str | None = None, root: Path | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("SpecDeck - download from Hugging Face")
        self.endpoint, self.root = endpoint, root or library_dir()
        self.repo: str | None = None
        self.model_path: str | None = None  # the loaded model, which heads are searched for
        self.heads_listed = False  # the results are head repositories: Download installs one for the model
        self.files: list[HubFile] = []
        self.state: DownloadProgress | None = None
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._timer = QTimer(self, interval=POLL_MS)
        self._timer.timeout.connect(self._poll)
        self._build()

    def _build(self) -> None:
        self.query = QLineEdit(placeholderText="search models, e.g. SmolLM2 GGUF")
        self.query.setObjectName("hub_query")
        self.query.returnPressed.connect(self.search)
        self.gguf_only = QCheckBox("GGUF only", checked=True)
        search = QPushButton("Search")
        search.clicked.connect(self.search)
        self.heads_button = QPushButton("EAGLE-3 heads for the loaded model", objectName="hub_heads", enabled=False)
        self.heads_button.clicked.connect(self.search_heads)
        self.results = _table(("repository", "downloads", "likes"), "hub_results")
        self.results.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.results.itemSelectionChanged.connect(self._repo_selected)
        self.file_table = _table(("file", "size", "note"), "hub_files")
        self.file_table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.progress = QProgressBar(objectName="hub_progress", maximum=1000, textVisible=False)
        self.status = QLabel("Files go to " + str(self.root), objectName="hub_status", wordWrap=True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.download_button = QPushButton("Download")
        self.download_button.clicked.connect(self.download_selected)
        self.cancel_button = QPushButton("Cancel download", enabled=False)
        self.cancel_button.clicked.connect(self.cancel)
        top = QHBoxLayout()
        top.addWidget(self.query, 1)
        top.addWidget(self.gguf_only)
        top.addWidget(search)
        top.addWidget(self.heads_button)
        split = QSplitter()
        split.addWidget(self.results)
        split.addWidget(self.file_table)
        bottom = QHBoxLayout()
        bottom.addWidget(self.progress, 1)
        bottom.addWidget(self.download_button)
        bottom.addWidget(self.cancel_button)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(split, 1)
        layout.addLayout(bottom)
        layout.addWidget(self.status)
        self.resize(900, 520)

    # --- search and file list -------------------------------------------------------------

    def set_model(self, path: str | None) -> None:
        """The model now loaded (None: none), whose heads the heads button looks for."""
        self.model_path = path
        self.heads_button.setEnabled(path is not None)
        self.heads_button.setText(f"EAGLE-3 heads for {Path(path).stem}" if path else "EAGLE-3 heads for the loaded model")

    def search(self) -> None:
        text, gguf, endpoint = self.query.text().strip(), self.gguf_only.isChecked(), self.endpoint
        self.heads_listed = False
        self._say(f"Searching for {text!r} ...")
        run_job(self, lambda: search_models(text, gguf_only=gguf, endpoint=endpoint), self._show_results, self._fail)

    def search_heads(self) -> None:
        model, endpoint = self.model_path, self.endpoint
        if model is None:
            return self._say("Load a model first: heads are looked for the loaded one")
        self.heads_listed = True
        self._say(f"Searching for EAGLE-3 heads made for {Path(model).stem} ...")
        run_job(self, lambda: search_heads(model, endpoint=endpoint), self._show_results, self._fail)

    def _show_results(self, models: list[HubModel]) -> None:
        self.results.setRowCount(len(models))
        for row, m in enumerate(models):
            for col, value in enumerate((m.id, f"{m.downloads:,}", f"{m.likes:,}")):
                self.results.setItem(row, col, QTableWidgetItem(value))
        if self.heads_listed:
            self._say(f"{len(models)} head repositories named for this model; pick one and Download: its config is "
                      "checked against the model before the weights come" if models else
                      "No EAGLE-3 head on the Hub is named for this model; the Train button makes one here")
        else:
            self._say(f"{len(models)} repositories found" if models else "Nothing found; try fewer words")

    def _repo_selected(self) -> None:
        row = self.results.currentRow()
        if row < 0 or self.results.item(row, 0) is None:
            return
        repo, endpoint = self.results.item(row, 0).text(), self.endpoint
        self._say(f"Listing the files of {repo} ...")
        run_job(self, lambda: (repo, list_files(repo, endpoint=endpoint)), self._show_files, self._fail)

    def _show_files(self, listed: tuple[str, list[HubFile]]) -> None:
        self.repo, files = listed
        self.files = sorted(files, key=lambda f: (f.kind != "gguf", f.path))
        self._fill_files()
        self._say(f"{self.repo}: {len(self.files)} files; select what to download")

    def _fill_files(self) -> None:
        """One row per file, with what SpecDeck would do with it and what is already here."""
        self.file_table.setRowCount(len(self.files))
        for row, f in enumerate(self.files):
            note = _KIND_NOTE[f.kind] or self._local_note(f)
            for col, value in enumerate((f.path, _mib(f.size), note)):
                item = QTableWidgetItem(value)
                if f.kind == "pickle":
                    item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsEnabled & ~Qt.ItemFlag.ItemIsSelectable)
                    item.setToolTip(note)
                self.file_table.setItem(row, col, item)

    def _local_note(self, f: HubFile) -> str:
        dest = local_path(self.root, self.repo or "", f.path)
        if dest.exists():
            return "in the library"
        partial = next(dest.parent.glob(f"{dest.name}.*.part"), None) if dest.parent.is_dir() else None
        if partial is not None and f.size:
            return f"{partial.stat().st_size / f.size:.0%} downloaded; Download resumes it"
        return ""

    # --- download -------------------------------------------------------------------------

    def select_files(self, paths: list[str]) -> None:
        """Select exactly these files (what a click does, without depending on held modifier keys)."""
        model, selection = self.file_table.selectionModel(), QItemSelection()
        for row, f in enumerate(self.files):
            if f.path in paths:
                selection.select(self.file_table.model().index(row, 0),
                                 self.file_table.model().index(row, self.file_table.columnCount() - 1))
        model.select(selection, QItemSelectionModel.SelectionFlag.ClearAndSelect)

    def selected_paths(self) -> list[str]:
        rows = sorted({i.row() for i in self.file_table.selectedItems()})
        return [self.files[r].path for r in rows]

    def download_selected(self) -> None:
        if self.busy or not self.repo:
            return
        if self.heads_listed and self.model_path:
            return self.start_install(self.repo, self.model_path)
        try:
            files = expand_selection(self.files, self.selected_paths())
        except HubError as exc:
            return self._fail(str(exc))
        if not files:
            return self._say("Select one or more files first")
        self.start_download(self.repo, files)

    def start_download(self, repo: str, files: list[HubFile]) -> None:
        self._start(download_files, (repo, files, self.root),
                    DownloadProgress(files=len(files), total_bytes=sum(f.size for f in files)))

    def start_install(self, repo: str, model: str) -> None:
        """Install the head in ``repo`` for ``model`` (its config, checked, then its weights)."""
        self._start(install_head, (repo, model), DownloadProgress(files=1, total_bytes=0))

    def _start(self, job, args: tuple, state: DownloadProgress) -> None:
        """Run ``job(*args, state, endpoint=, cancel=)`` on a download thread of its own."""
        self.state, self._cancel = state, threading.Event()
        self._thread = threading.Thread(target=job, args=(*args, state),
                                        kwargs={"endpoint": self.endpoint, "cancel": self._cancel},
                                        name="specdeck-download", daemon=True)
        self._started = time.monotonic()
        self._thread.start()
        self.download_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self._timer.start()
        self._poll()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def cancel(self) -> None:
        self._cancel.set()
        self._say("Cancelling ...")

    def _poll(self) -> None:
        state = self.state
        if state is None:
            return
        self.progress.setValue(int(1000 * state.done_bytes / max(1, state.total_bytes)))
        if state.finished:
            return self._finish(state)
        elapsed = max(1e-3, time.monotonic() - self._started)
        what = "Checking the sha256 of" if state.stage == "verify" else "Downloading"
        self._say(f"{what} {state.current} ({state.file_index + 1} of {state.files}): "
                  f"{_mib(state.done_bytes)} of {_mib(state.total_bytes)}, {state.done_bytes / elapsed / 2**20:.1f} MiB/s")

    def _finish(self, state: DownloadProgress) -> None:
        self._timer.stop()
        self.download_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        if state.paths and state.result is None:
            self.downloaded.emit(list(state.paths))
        if state.result is not None:
            self.head_installed.emit(str(state.result))
            self._say(f"Done: the head from {self.repo} is saved as {state.result.name}; "
                      "eagle3 and eagle3-native use it for this model")
        elif state.error:
            self._fail(state.error)
        elif state.cancelled:
            self._say("Cancelled. The part downloaded so far is kept out of the library; Download resumes it.")
        else:
            self._say(f"Done: {', '.join(p.name for p in state.paths)} in the library ({self.root})")
        self._fill_files()  # "in the library" / "n% downloaded" notes

    def _say(self, text: str) -> None:
        self.status.setStyleSheet("")
        self.status.setText(text)

    def _fail(self, message: str) -> None:
        self.status.setStyleSheet("color: #c0392b; font-weight: bold;")  # the same red as form errors
        self.status.setText(message)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop a running download at its next chunk (the partial file stays for resuming)."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout)
