""""Connect to a server": point the window at a serving engine (vLLM, llama-server, any
OpenAI-compatible server) instead of a model on this PC.

The dialog checks the address off the GUI thread (a dead host takes seconds to time out and the
window must not freeze), shows what answered (engine, models) and keeps the API key in the OS
keyring or an owner-only file (``backends.remote.keys``), never in the settings file. Connecting
itself happens on the worker thread, like loading a model; until it succeeds the model in use
stays in use.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QFormLayout, QHBoxLayout, QLabel,
                               QLineEdit, QPushButton, QSpinBox, QVBoxLayout, QWidget)

from backends.core.errors import SpecDeckError
from backends.remote.client import RemoteClient, ServerConfig
from backends.remote.keys import load_key, save_key
from backends.remote.session import ServerInfo, engine_of
from desktop.jobs import run_job
from desktop.launch import LaunchDialog


API_CHOICES = {"auto": "chat, or plain completions for a model without a chat template",
               "chat": "chat completions (/v1/chat/completions)",
               "completions": "plain completions (/v1/completions)"}


@dataclass(frozen=True)
class Checked:
    """What a check of an address found."""

    info: ServerInfo


def check_server(config: ServerConfig) -> Checked:
    """Ask ``config``'s server for its models and engine (runs off the GUI thread)."""
    with RemoteClient(config) as client:
        models = client.ready_models()
        if not models:
            raise SpecDeckError(f"{config.base} serves no model")
        engine, counters, gpus = engine_of(client)
    return Checked(ServerInfo(base=config.base, engine=engine, models=tuple(models), model=models[0], counters=counters,
                              gpu_metrics=gpus))


class ConnectDialog(QDialog):
    """Address, key, a check that lists the server's models, and Connect (or, for the comparison
    panel, Add: ``action`` names the button)."""

    connect_requested = Signal(object)  # ServerConfig

    def __init__(self, url: str = "", parent: QWidget | None = None, *, ca_file: str = "",
                 stall_timeout: float = ServerConfig.stall_timeout, retries: int = ServerConfig.retries,
                 action: str = "Connect", api: str = ServerConfig.api) -> None:
        super().__init__(parent)
        self.setWindowTitle("Connect to a server" if action == "Connect" else "A server to compare with")
        self.url = QLineEdit(url)
        self.url.setPlaceholderText("http://gpu-box:8000  (vLLM, llama-server or any OpenAI-compatible server)")
        self.key = QLineEdit((load_key(url) or "") if url else "")
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("API key, if the server needs one")
        self.ca = QLineEdit(ca_file)
        self.ca.setPlaceholderText("CA certificate file, for an HTTPS server with a self-signed certificate")
        self.remember = QCheckBox("Remember the key (system keyring, or a file only you can read)")
        self.remember.setChecked(True)
        # How patient to be: a big model on a busy server can take minutes to its first token
        # (the prompt is read first); a user on a flaky link wants more retries, one on a LAN fewer.
        self.patience = QSpinBox()
        self.patience.setRange(5, 3600)
        self.patience.setSuffix(" s")
        self.patience.setValue(round(stall_timeout))
        self.patience.setToolTip("The longest silence accepted from the server, the time to its first token included")
        self.retries = QSpinBox()
        self.retries.setRange(0, 10)
        self.retries.setValue(retries)
        self.retries.setToolTip("Retries, with growing waits, when the server cannot be reached, is overloaded (429, "
                                "502-504) or drops the connection before answering")
        patience = QHBoxLayout()
        patience.addWidget(self.patience)
        patience.addWidget(QLabel("of silence from the server · retries"))
        patience.addWidget(self.retries)
        patience.addStretch(1)
        self.api = QComboBox()
        for value, text in API_CHOICES.items():
            self.api.addItem(text, value)
        self.api.setCurrentIndex(max(0, self.api.findData(api)))
        self.api.setToolTip("Base models without a chat template are asked through /v1/completions, the "
                            "conversation written as 'User: ... Assistant:'")
        self.models = QComboBox()
        self.models.setEnabled(False)
        self.check_button = QPushButton("Check")
        self.check_button.clicked.connect(self.check)
        self.status = QLabel("Check the address to see what it serves.")
        self.status.setWordWrap(True)
        row = QHBoxLayout()
        row.addWidget(self.url, 1)
        row.addWidget(self.check_button)
        form = QFormLayout()
        form.addRow("Address", row)
        form.addRow("API key", self.key)
        form.addRow("", self.remember)
        form.addRow("TLS", self.ca)
        form.addRow("Wait up to", patience)
        form.addRow("Model", self.models)
        form.addRow("Endpoint", self.api)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.connect_button = self.buttons.addButton(action, QDialogButtonBox.ButtonRole.AcceptRole)
        self.connect_button.setEnabled(False)
        self.launch_button = self.buttons.addButton("Launch command ...", QDialogButtonBox.ButtonRole.HelpRole)
        self.launch_button.setToolTip("The command that starts vLLM or llama-server with a method chosen here "
                                      "(a server drafts as it was started)")
        self.launch_button.clicked.connect(self.show_launch)
        self.launch_dialog: LaunchDialog | None = None
        self.buttons.accepted.connect(self._connect)
        self.buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.status)
        layout.addWidget(self.buttons)
        self.url.textEdited.connect(lambda _: self._changed())
        self.key.textEdited.connect(lambda _: self._changed())
        self.ca.textEdited.connect(lambda _: self._changed())
        self.resize(560, 0)

    def show_launch(self) -> None:
        if self.launch_dialog is None:
            self.launch_dialog = LaunchDialog(self)
        self.launch_dialog.show()
        self.launch_dialog.raise_()

    def _changed(self) -> None:
        self.connect_button.setEnabled(False)
        self.models.clear()
        self.models.setEnabled(False)

    def config(self) -> ServerConfig:
        """The address and key as typed (ValueError for an address that is not http(s))."""
        model = self.models.currentText() or None
        ca = self.ca.text().strip()
        return ServerConfig(self.url.text().strip(), api_key=self.key.text().strip() or None, model=model,
                            verify=ca or True, stall_timeout=float(self.patience.value()), retries=self.retries.value(),
                            api=self.api.currentData())

    def check(self) -> None:
        try:
            config = self.config()
        except ValueError as exc:
            self.status.setText(str(exc))
            return
        self.check_button.setEnabled(False)
        self.status.setText(f"Asking {config.base} ...")
        run_job(self, lambda: check_server(config), self._checked, self._failed)

    def _checked(self, checked: Checked) -> None:
        self.check_button.setEnabled(True)
        self.models.clear()
        self.models.addItems(list(checked.info.models))
        self.models.setEnabled(True)
        drafting = ("its speculative-decoding counters are charted" if checked.info.counters
                    else "acceptance is shown when the server reports it")
        drafting += "; its GPUs are charted" if checked.info.gpu_metrics else "; no GPU metrics found (dcgm-exporter)"
        self.status.setText(f"{checked.info.engine} at {checked.info.base}: {len(checked.info.models)} model(s); {drafting}.")
        self.connect_button.setEnabled(True)

    def _failed(self, message: str) -> None:
        self.check_button.setEnabled(True)
        self.status.setText(f"Could not use this server: {message}")

    def _connect(self) -> None:
        config = self.config()
        save_key(config.url, config.api_key if self.remember.isChecked() else None)  # unticked: forget it
        self.connect_requested.emit(config)
        self.accept()
