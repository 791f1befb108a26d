"""The model library: the catalog's models plus folders the user adds, with metadata and fit.

Rows appear at once; each file's GGUF header (or Hugging Face config) is read on the thread
pool, since a big vocabulary takes seconds to parse the first time, and its row is filled in
with architecture, size, quantization, context length and the fit label for this machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from backends.hardware.fit import RuntimeSettings, plan, torch_dtype_bytes, torch_kv_bytes
from backends.hardware.shape import as_torch, load_shape
from backends.hardware.types import HardwareReport
from backends.llamacpp.model import mtp_in_header
from backends.models.catalog import CATALOG, list_models
from backends.models.gguf_info import read_gguf_info
from backends.models.hf_folder import is_hf_folder
from backends.models.paths import library_dir
from desktop.addons import AddonOffer
from desktop.jobs import run_job

if TYPE_CHECKING:
    from desktop.hub import HubDialog

_SPLIT_PART = re.compile(r"-(\d{5})-of-\d{5}$")
COLUMNS = ("model", "architecture", "parameters", "quantization", "context", "size", "fit on this machine")
# What runs a model (backends.factory.BACKENDS): a GGUF runs on llama.cpp unless the user picks
# PyTorch; a Hugging Face folder only on PyTorch.
BACKEND_LABELS = {"llamacpp": "llama.cpp", "torch": "PyTorch"}


def torch_installed() -> bool:
    """torch importable: in this Python environment, or as an add-on in SpecDeck's data folder."""
    from backends.addons import available

    return available("torch")


@dataclass(frozen=True)
class LibraryEntry:
    spec: str  # what Session takes: a catalog id or a path
    label: str
    path: Path | None  # None until a derived catalog model is made


@dataclass(frozen=True)
class EntryDetails:
    spec: str
    architecture: str
    parameters: str
    quantization: str
    context: str
    size: str
    fit: str


def scan_folder(folder: Path) -> list[LibraryEntry]:
    """.gguf files (split files by their first part) and Hugging Face folders under ``folder``."""
    entries = []
    for path in sorted(folder.rglob("*.gguf")):
        split = _SPLIT_PART.search(path.stem)
        if split and split.group(1) != "00001":  # llama.cpp loads a split model from its first part
            continue
        entries.append(LibraryEntry(str(path), path.name, path))
    for config in sorted(folder.rglob("config.json")):
        if any(config.parent.glob("*.safetensors")):
            entries.append(LibraryEntry(str(config.parent), config.parent.name + " (safetensors)", config.parent))
    return entries


def entry_details(entry: LibraryEntry, hw: HardwareReport | None, n_ctx: int, backend: str = "llamacpp") -> EntryDetails:
    """Off the GUI thread: header metadata and the fit label (for the backend that would run it:
    PyTorch holds a GGUF dequantized)."""
    path = entry.path
    if path is None or not path.exists():
        return EntryDetails(entry.spec, "-", "-", "-", "-", "-", "made on first use")
    shape = load_shape(path)
    architecture = shape.architecture
    if shape.format == "gguf":
        info = read_gguf_info(path)
        quant, params, size = info.file_type, info.n_params, info.file_size
        if mtp_in_header(path):
            architecture += " + MTP"  # its own next-n block: the mtp method drafts with it
    else:
        quant, params = f"{shape.weight_dtype_bytes * 8}-bit", None
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    on_torch = backend == "torch" or shape.format != "gguf"
    runs = as_torch(shape, torch_dtype_bytes(hw), torch_kv_bytes(hw)) if on_torch else shape
    fit = plan(runs, hw, RuntimeSettings(n_ctx=n_ctx)).label if hw is not None else "..."
    return EntryDetails(
        entry.spec, architecture, f"{params / 1e6:.0f} M" if params else "-", quant,
        f"{shape.n_ctx_train:,}", f"{size / 2**20:,.0f} MiB", fit,
    )


class ModelLibrary(QWidget, AddonOffer):
    load_requested = Signal(str, int, str)  # model spec, n_ctx, backend
    load_refused = Signal(str, str)  # row label, why: its file is known to be unreadable
    folders_changed = Signal(list)
    head_installed = Signal(str)  # a head from the Hub saved for the loaded model

    def __init__(self, folders: list[str], parent: QWidget | None = None, *, hub_endpoint: str | None = None) -> None:
        super().__init__(parent)
        self.folders = [f for f in folders if Path(f).is_dir()]
        self.hub_endpoint = hub_endpoint  # None: huggingface.co (tests give a local server)
        self.loaded_model: str | None = None  # the Hub dialog looks for heads for it
        self.hub: HubDialog | None = None
        self.hardware: HardwareReport | None = None
        self.entries: list[LibraryEntry] = []
        self.unreadable: dict[str, str] = {}  # spec -> why its header could not be read
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("model_library")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.setWordWrap(False)  # one line a model; a long name loses its middle, never its quantization
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.table.cellDoubleClicked.connect(lambda row, _col: self._load_row(row))
        self.ctx = QSpinBox()
        self.ctx.setObjectName("n_ctx")
        self.ctx.setRange(256, 1 << 20)
        self.ctx.setSingleStep(1024)
        self.ctx.setValue(4096)
        self.ctx.setSuffix(" tokens")
        self.ctx.valueChanged.connect(lambda _: self.refresh_details())
        self.backend = QComboBox()
        self.backend.setObjectName("backend")
        self.backend.setToolTip("What runs the model: llama.cpp (GGUF files), or SpecDeck's PyTorch model (GGUF files "
                                "and Hugging Face folders; a CUDA GPU when torch sees one)")
        for name, label in BACKEND_LABELS.items():
            self.backend.addItem(label, name)
        self._torch = torch_installed()
        if not self._torch:
            item = self.backend.model().item(self.backend.findData("torch"))
            item.setText(f"{BACKEND_LABELS['torch']} (install ...)")
            item.setToolTip("torch is not installed: picking this offers to install it (an add-on, downloaded once)")
        self.table.currentCellChanged.connect(lambda row, *_: self._fit_backend(row))
        self.backend.currentIndexChanged.connect(self._backend_picked)
        self.load_button = QPushButton("Load")
        self.load_button.clicked.connect(lambda: self._load_row(self.table.currentRow()))
        self.add_button = QPushButton("Add folder ...")
        self.add_button.clicked.connect(self._add_folder)
        self.hub_button = QPushButton("Hugging Face ...")
        self.hub_button.setToolTip("Search the Hugging Face Hub and download models into the library")
        self.hub_button.clicked.connect(self.open_hub)
        settings = QHBoxLayout()  # two rows: one would widen the Models dock past a 1366-pixel screen's share
        settings.addWidget(QLabel("Context"))
        settings.addWidget(self.ctx)
        settings.addWidget(QLabel("Run with"))
        settings.addWidget(self.backend)
        settings.addStretch(1)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(self.add_button)
        row.addWidget(self.hub_button)
        row.addWidget(self.load_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.table, 1)
        layout.addLayout(settings)
        layout.addLayout(row)
        self.rescan()

    def rescan(self) -> None:
        present = {r["id"]: r for r in list_models()}
        entries = [LibraryEntry(mid, mid + (" (bundled)" if i == 0 else ""), Path(present[mid]["path"]) if present[mid]["present"] else None)
                   for i, mid in enumerate(CATALOG)]
        known = {str(e.path) for e in entries if e.path}
        for folder in [library_dir(), *map(Path, self.folders)]:
            if folder.is_dir():
                found = [e for e in scan_folder(folder) if e.spec not in known]
                known |= {e.spec for e in found}
                entries += found
        self.entries = entries
        self.table.setRowCount(len(entries))
        for r, entry in enumerate(entries):
            item = QTableWidgetItem(entry.label)
            item.setData(Qt.ItemDataRole.UserRole, entry.spec)
            item.setToolTip(str(entry.path) if entry.path else f"{CATALOG[entry.spec].description}: made on first use")
            self.table.setItem(r, 0, item)
        self.table.resizeColumnToContents(0)  # the names tell the rows apart: they get the room first
        self.refresh_details()

    def refresh_made(self) -> None:
        """Rows of catalog models that were made since the list was built (loading a derived
        variant writes its file) get their path and details; nothing else is rescanned."""
        present = {r["id"]: r for r in list_models()}
        for r, entry in enumerate(self.entries):
            row = present.get(entry.spec)
            if entry.path is None and row is not None and row["present"]:
                self.entries[r] = made = LibraryEntry(entry.spec, entry.label, Path(row["path"]))
                self.table.item(r, 0).setToolTip(str(made.path))
                self._fetch_details(made)

    def _fetch_details(self, entry: LibraryEntry) -> None:
        hw, n_ctx, backend = self.hardware, self.ctx.value(), self.backend.currentData()
        run_job(self, lambda: entry_details(entry, hw, n_ctx, backend), self._show_details,
                lambda msg: self._show_error(entry.spec, msg))

    def set_hardware(self, report: HardwareReport) -> None:
        self.hardware = report
        self.refresh_details()

    def refresh_details(self) -> None:
        for entry in self.entries:
            self._fetch_details(entry)

    def _row_of(self, spec: str) -> int | None:
        return next((r for r, e in enumerate(self.entries) if e.spec == spec), None)

    def _show_details(self, d: EntryDetails) -> None:
        self.unreadable.pop(d.spec, None)
        row = self._row_of(d.spec)
        if row is None:
            return
        for col, value in enumerate((d.architecture, d.parameters, d.quantization, d.context, d.size, d.fit), start=1):
            self.table.setItem(row, col, QTableWidgetItem(value))

    def _show_error(self, spec: str, message: str) -> None:
        self.unreadable[spec] = message
        row = self._row_of(spec)
        if row is not None:
            item = QTableWidgetItem("unreadable")
            item.setToolTip(message)
            self.table.setItem(row, len(COLUMNS) - 1, item)

    def _load_row(self, row: int) -> None:
        if not 0 <= row < len(self.entries):
            return
        entry = self.entries[row]
        if entry.spec in self.unreadable:
            self.load_refused.emit(entry.label, self.unreadable[entry.spec])
            return
        self._fit_backend(row)
        self.load_requested.emit(entry.spec, self.ctx.value(), self.backend.currentData())

    def _fit_backend(self, row: int) -> None:
        """A Hugging Face folder runs on PyTorch only: picking one switches the choice there (or
        offers to install torch)."""
        if 0 <= row < len(self.entries) and self.entries[row].path is not None and is_hf_folder(self.entries[row].path):
            if self._torch:
                self.set_backend("torch")
            else:
                self._offer_torch()

    def set_backend(self, name: str) -> None:
        index = self.backend.findData(name)
        if index >= 0 and (name != "torch" or self._torch):
            self.backend.setCurrentIndex(index)

    def _backend_picked(self, _index: int) -> None:
        if self.backend.currentData() == "torch" and not self._torch:
            self.backend.setCurrentIndex(self.backend.findData("llamacpp"))  # until torch is there
            self._offer_torch()
        self.refresh_details()

    def _offer_torch(self) -> None:
        """PyTorch without torch: the add-on dialog (what, how big, where; Install or Cancel)."""
        from backends.addons import has_nvidia

        nvidia = self.hardware is not None and has_nvidia(self.hardware.gpus)
        self.offer_addon("torch", nvidia_gpu=nvidia, installed=self._torch_arrived)

    def _torch_arrived(self, _name: str) -> None:
        self._torch = True
        item = self.backend.model().item(self.backend.findData("torch"))
        item.setText(BACKEND_LABELS["torch"])
        item.setToolTip("")
        self.set_backend("torch")

    def _add_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a folder of models")
        if folder:
            self.add_folder(folder)

    def add_folder(self, folder: str) -> None:
        if folder not in self.folders:
            self.folders.append(folder)
            self.folders_changed.emit(self.folders)
        self.rescan()

    def set_loaded(self, path: str | None) -> None:
        """The model now loaded, or None."""
        self.loaded_model = path
        if self.hub is not None:
            self.hub.set_model(path)

    def open_hub(self) -> HubDialog:
        """One dialog for the app's lifetime: closing it hides it and a download goes on."""
        if self.hub is None:
            from desktop.hub import HubDialog  # huggingface_hub and httpx take 0.2 s to import

            self.hub = HubDialog(self.hub_endpoint, parent=self)
            self.hub.downloaded.connect(lambda _paths: self.rescan())
            self.hub.head_installed.connect(self.head_installed)
            self.hub.set_model(self.loaded_model)
        self.hub.show()
        self.hub.raise_()
        return self.hub

    def shutdown(self) -> None:
        if self.hub is not None:
            self.hub.shutdown()
