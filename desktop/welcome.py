"""The first-run page: what SpecDeck found on this PC, what it recommends and why, one click to chat.

A new user lands on a window of five docks and two tabs; this page, shown in front of the chat on
the first start only, says in three lines what the window worked out for them: the hardware it
detected, the model it loaded (the bundled one, with how it fits here) and the decoding method it
chose for that model on this machine, with the reason the method chooser gives. "Start chatting"
switches to the chat with the cursor in the message box and does not show the page again; the
same facts stay in the Hardware, Models and Method docks.
"""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QLabel, QPushButton, QVBoxLayout, QWidget

from backends.hardware.types import HardwareReport

WELCOME_DONE = "welcome/done"  # settings key: the page was dismissed once


def hardware_summary(report: HardwareReport) -> str:
    """One line a user can check against what they bought.

    Example: "AMD EPYC 9R14 · 2 cores · AVX2 · 23.4 GiB RAM · no GPU found (CPU only)"."""
    cpu = report.cpu
    parts = [cpu.name]
    if cpu.cores:
        parts.append(f"{cpu.cores} cores")
    widest = next((f.upper().replace("AVX512F", "AVX-512") for f in ("avx512f", "avx2", "avx") if f in cpu.flags), None)
    if widest:
        parts.append(widest)
    parts.append(f"{report.ram.total_bytes / 2**30:.1f} GiB RAM")
    if report.gpus:
        parts += [f"{gpu.name}" + (f" ({gpu.vram_total_bytes / 2**30:.0f} GiB)" if gpu.vram_total_bytes else "")
                  for gpu in report.gpus]
    else:
        parts.append("no GPU found (CPU only)")
    return " · ".join(parts)


class WelcomePage(QWidget):
    """The page itself: filled in as the hardware probe, the model load and the method advice
    arrive (each off the GUI thread), so it never waits on any of them."""

    start_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("welcome")
        title = QLabel("<h2>Welcome to SpecDeck</h2>")
        intro = QLabel("SpecDeck runs language models on this PC and makes them answer faster with speculative "
                       "decoding: a cheap guess of the next tokens, checked by the model itself, so the text is "
                       "exactly what the model alone would write.")
        self.hardware = QLabel("Detecting the CPU, RAM and GPUs ...")
        self.model = QLabel("Loading the bundled model ...")
        self.method = QLabel("The recommended method follows once the model is loaded.")
        for label, name in ((self.hardware, "welcome_hardware"), (self.model, "welcome_model"), (self.method, "welcome_method")):
            label.setObjectName(name)
        self.start = QPushButton("Start chatting")
        self.start.setObjectName("welcome_start")
        self.start.setDefault(True)
        self.start.setEnabled(False)
        self.start.clicked.connect(self.start_requested)
        hint = QLabel("Other models: the <b>Models</b> dock (your own GGUF files, or <i>Hugging Face ...</i> to download one). "
                      "Other methods: <b>Method and sampling</b>. <b>Compare methods</b> runs one prompt through several.")
        card = QFrame()
        card.setFrameShape(QFrame.Shape.StyledPanel)
        box = QVBoxLayout(card)
        for label in (title, intro, self.hardware, self.model, self.method, hint):
            label.setWordWrap(True)
            label.setTextFormat(Qt.TextFormat.RichText)
            box.addWidget(label)
        box.addWidget(self.start, 0, Qt.AlignmentFlag.AlignLeft)
        outer = QVBoxLayout(self)
        outer.addWidget(card)
        outer.addStretch(1)

    def set_hardware(self, report: HardwareReport) -> None:
        self.hardware.setText(f"<b>This PC:</b> {html.escape(hardware_summary(report))}")

    def set_loading(self, spec: str) -> None:
        self.model.setText(f"<b>Model:</b> loading {html.escape(spec)} ...")

    def set_model(self, name: str, fit: str, *, bundled: bool) -> None:
        """``fit``: the fit label of the loaded model with the recommended method ("runs on CPU (fits in RAM)")."""
        what = ", the model that comes with SpecDeck," if bundled else ""
        self.model.setText(f"<b>Model:</b> {html.escape(name)}{what} is loaded: {html.escape(fit)}. Larger models "
                           "answer better; the Models dock says which of them fit here.")

    def set_method(self, recommendation_html: str) -> None:
        """The method chooser's own line ("Recommended: <b>pld</b> — ..."), so the two never disagree."""
        self.method.setText(recommendation_html)
        self.start.setEnabled(True)

    def set_failed(self, message: str) -> None:
        """The model did not load: chatting needs another one, which the Models dock offers."""
        self.model.setText(f"<b>Model:</b> not loaded: {html.escape(message)}. Pick one in the Models dock.")
        self.start.setEnabled(True)
