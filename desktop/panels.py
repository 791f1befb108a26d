"""The side panels: sampling settings, the method chooser, the hardware report, and the scrolling
column that holds the first two in their dock."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QEvent, QSize, Qt, Signal
from PySide6.QtGui import QStandardItem, QStandardItemModel
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QLabel,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSpinBox,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from backends.core.types import HIDDEN_STATES, LAYER_SKIP, GenerationSettings, SamplingSettings
from backends.drafters import (DATASTORE, DRAFT_MODEL, FIRST_SHOWN, HEAD_NAMES, HEAD_PREFIX, REGISTRY, baseline_method,
                               describe)
from backends.hardware.detect import format_report
from backends.hardware.fit import FitReport
from backends.hardware.recommend import Recommendation, Recommendations
from backends.hardware.types import HardwareReport
from desktop.forms import DataclassForm, PromptBox

MiB = 1024**2


class SamplingPanel(QGroupBox):
    """Sampling, length, system prompt and chat-template override for the next answers."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Sampling", parent)
        form = QFormLayout(self)
        d = SamplingSettings()
        self.temperature = _dspin(0, 5, d.temperature, 0.05)
        self.top_k = _spin(0, 100000, d.top_k)
        self.top_p = _dspin(0, 1, d.top_p, 0.01)
        self.min_p = _dspin(0, 1, d.min_p, 0.01)
        self.repeat_penalty = _dspin(0.5, 3, d.repeat_penalty, 0.05)
        self.seed = _spin(-1, 2**31 - 1, -1)
        self.seed.setSpecialValueText("random")
        self.max_tokens = _spin(1, 1_000_000, 512)
        self.system = PromptBox()
        self.system.setPlaceholderText("System prompt (optional)")
        self.system.setMaximumHeight(70)
        self.override_template = QCheckBox("Override the model's chat template")
        self.template = PromptBox()
        self.template.setPlaceholderText("Jinja2 chat template, as in tokenizer.chat_template")
        self.template.setMaximumHeight(90)
        self.template.setEnabled(False)
        self.override_template.toggled.connect(self.template.setEnabled)
        self.error = QLabel()
        self.error.setStyleSheet("color: #c0392b")
        self.error.setWordWrap(True)
        for label, widget in (("temperature (0 = greedy)", self.temperature), ("top-k", self.top_k), ("top-p", self.top_p),
                              ("min-p", self.min_p), ("repeat penalty", self.repeat_penalty), ("seed", self.seed),
                              ("max new tokens", self.max_tokens)):
            widget.setObjectName(label.split(" (")[0].replace(" ", "_").replace("-", "_"))
            form.addRow(label, widget)
        form.addRow(self.system)
        form.addRow(self.override_template)
        form.addRow(self.template)
        form.addRow(self.error)

    def generation(self) -> GenerationSettings | None:
        try:
            sampling = SamplingSettings(
                temperature=self.temperature.value(), top_k=self.top_k.value(), top_p=self.top_p.value(),
                min_p=self.min_p.value(), repeat_penalty=self.repeat_penalty.value(),
                seed=None if self.seed.value() < 0 else self.seed.value(),
            )
            settings = GenerationSettings(max_new_tokens=self.max_tokens.value(), sampling=sampling)
        except ValueError as exc:
            self.error.setText(str(exc))
            return None
        self.error.setText("")
        return settings

    def template_override(self) -> str | None:
        text = self.template.toPlainText().strip()
        return text if self.override_template.isChecked() and text else None

    def state(self) -> dict:
        return {"temperature": self.temperature.value(), "top_k": self.top_k.value(), "top_p": self.top_p.value(),
                "min_p": self.min_p.value(), "repeat_penalty": self.repeat_penalty.value(), "seed": self.seed.value(),
                "max_tokens": self.max_tokens.value()}

    def restore(self, state: dict) -> None:
        for name, value in state.items():
            widget = getattr(self, name, None)
            if isinstance(widget, (QSpinBox, QDoubleSpinBox)):
                widget.setValue(type(widget.value())(value))


@dataclass(frozen=True)
class MethodAdvice:
    """What the background estimate found for the loaded model: ranking, fits, drafts."""

    recommendations: Recommendations
    fits: dict[str, FitReport]
    compatible_drafts: tuple[Path, ...]
    rejected_drafts: tuple[tuple[str, str], ...]


class MethodPanel(QGroupBox):
    """Every method with its fit label and predicted speed; unusable ones greyed out with why."""

    method_changed = Signal(str)
    draft_chosen = Signal(str)
    train_requested = Signal(str)  # the kind of head ("medusa") a method lacks: the Train button
    runnable_changed = Signal(dict)  # runnable(): after new advice and after every settings change

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Method", parent)
        layout = QVBoxLayout(self)
        self.combo = QComboBox()
        self.combo.setObjectName("method")
        self.combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)  # labels are never cut
        self.items = QStandardItemModel(self)
        self.combo.setModel(self.items)
        self.reason = QLabel("Load a model to see which methods fit.")
        self.reason.setWordWrap(True)
        self.reason.setTextFormat(Qt.TextFormat.RichText)
        self.recommended = QLabel()
        self.recommended.setWordWrap(True)
        self.recommended.setObjectName("recommendation")
        self.memory = QLabel()
        self.memory.setWordWrap(True)
        self.memory.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.forms = QStackedWidget()
        self.form_of: dict[str, DataclassForm] = {}
        for name, spec in REGISTRY.items():
            self.items.appendRow(_method_item(name, name, None))
            form = DataclassForm(spec.settings_type)
            form.changed.connect(self._on_settings_changed)
            self.form_of[name] = form
            self.forms.addWidget(form)
        self.draft_box = QComboBox()
        self.draft_box.setObjectName("draft_model")
        self.draft_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.draft_items = QStandardItemModel(self)
        self.draft_box.setModel(self.draft_items)
        # shown while no file in the list can draft for the loaded model (each one greyed, saying why)
        self.draft_box.setPlaceholderText("none usable with this model (point at one to see why)")
        self.load_draft = QPushButton("Load draft model")
        self.load_draft.clicked.connect(self._choose_draft)
        self.train = QPushButton("Train a head for this model ...")
        self.train.setObjectName("train_head")
        self.train.hide()
        self.train.clicked.connect(lambda: self.train_requested.emit(self.missing_head() or ""))
        self._offers: frozenset[str] = frozenset()
        layout.addWidget(self.combo)
        layout.addWidget(self.recommended)
        layout.addWidget(self.reason)
        layout.addWidget(self.train)
        layout.addWidget(self.forms)
        layout.addWidget(QLabel("Draft model (same vocabulary only):"))
        layout.addWidget(self.draft_box)
        layout.addWidget(self.load_draft)
        layout.addWidget(self.memory)
        layout.addStretch(1)
        self.advice: MethodAdvice | None = None
        self.chosen = False  # the user (or their saved settings) picked the method: advice keeps it
        self.combo.currentIndexChanged.connect(self._on_method)
        self.combo.activated.connect(self._on_picked)
        self._select(FIRST_SHOWN)  # until the advice for the loaded model arrives

    # -- the chosen method -------------------------------------------------------------------
    def method(self) -> str:
        item = self.items.item(max(0, self.combo.currentIndex()))
        return item.data(_NAME) if item is not None else baseline_method()

    def select(self, name: str) -> bool:
        """Choose ``name`` as the user would: later advice no longer replaces it."""
        picked = self._select(name)
        self.chosen = self.chosen or picked
        return picked

    def _on_picked(self, _row: int) -> None:
        self.chosen = True

    def _select(self, name: str) -> bool:
        for row in range(self.items.rowCount()):
            item = self.items.item(row)
            if item.data(_NAME) == name and item.isEnabled():
                self.combo.setCurrentIndex(row)
                return True
        return False

    def method_settings(self) -> dict | None:
        """Changed settings of the chosen method, or None when its form holds an invalid value or
        lacks what the method cannot run without (the form then says which)."""
        name = self.method()
        form = self.form_of[name]
        if form.settings() is None:
            return None
        missing = self.settings_missing(name)
        if missing:
            form.error.setText(missing)
            return None
        return form.changed_values()

    def settings_missing(self, name: str) -> str | None:
        """What the method's settings must still name before it can run, in the window's words.

        Example: rest without a datastore: "rest drafts from a datastore of your own texts: choose
        its file with the ... button of the datastore setting below"."""
        spec = REGISTRY[name]
        if spec.needs_datastore and not self.form_of[name].values().get(spec.datastore_field):
            return (f"{name} drafts from a datastore of your own texts: choose its file with the ... button of the "
                    f"{spec.datastore_field.replace('_', ' ')} setting below (a datastore is made once from a folder "
                    "of texts, with the specdeck datastore build command)")
        return None

    def runnable(self) -> dict[str, str | None]:
        """Every method -> why it cannot run now (None: it can): greyed out, or settings incomplete."""
        return {name: self.disabled_reason(name) or self.settings_missing(name) for name in REGISTRY}

    def _on_settings_changed(self) -> None:
        self._show_details(self.method())
        self.runnable_changed.emit(self.runnable())

    def _on_method(self, _row: int) -> None:
        name = self.method()
        for form in self.form_of.values():  # the stack as tall as the shown form, not the tallest one
            policy = QSizePolicy.Policy.Preferred if form is self.form_of[name] else QSizePolicy.Policy.Ignored
            form.setSizePolicy(policy, policy)
        self.forms.setCurrentWidget(self.form_of[name])
        self.forms.adjustSize()
        self._show_details(name)
        kind = self.missing_head()
        self.train.setVisible(self.advice is not None and kind is not None)
        self.train.setText(f"Train {HEAD_NAMES.get(kind or '', f'a {kind}')} head for this model ...")
        self.method_changed.emit(name)

    def missing_head(self) -> str | None:
        """A kind of trained head that a method needs and the loaded model lacks (while the model
        gives hidden states to train one on, and the method lacks nothing else), if any: what the
        Train button offers to make. The chosen method's head comes first."""
        if HIDDEN_STATES not in self._offers:
            return None
        current = REGISTRY.get(self.method())
        for spec in ([current] if current else []) + list(REGISTRY.values()):
            missing = sorted(r for r in spec.requires - self._offers if r.startswith(HEAD_PREFIX))
            if missing and all(r.startswith(HEAD_PREFIX) for r in spec.requires - self._offers):  # a head is all it lacks
                return missing[0][len(HEAD_PREFIX):]
        return None

    def _choose_draft(self) -> None:
        path = self.draft_box.currentData()
        if path:
            self.draft_chosen.emit(path)

    # -- advice from the estimator -----------------------------------------------------------
    def set_advice(self, advice: MethodAdvice, offers: frozenset[str]) -> None:
        """Label every method; grey out those the loaded session cannot run, saying why."""
        self.advice = advice
        self._offers = offers
        current = self.method()
        by_name = {r.method: r for r in advice.recommendations.ranked}
        self.combo.blockSignals(True)  # rebuilding the list is not the user choosing a method
        self.items.clear()
        for name, spec in REGISTRY.items():
            rec = by_name.get(name)
            label = name + (f"  ~{rec.predicted_speedup:.2f}x" if rec and rec.predicted_speedup else "")
            label += f"  ·  {advice.fits[name].label}" if name in advice.fits else ""
            why_not = _why_disabled(name, spec.requires - offers, rec)
            self.items.appendRow(_method_item(name, label, why_not, rec.reason if rec and rec.available else spec.summary))
        usable = [r for r in advice.recommendations.ranked if _why_disabled(r.method, REGISTRY[r.method].requires - offers, r) is None]
        best = usable[0] if usable else None
        self.recommended.setText(_recommendation(best, usable) if best is not None else "")
        self._fill_drafts(advice)
        if not (self.chosen and self._select(current)):  # until the user picks one, the recommended one
            self._select(best.method if best else baseline_method())
        self.combo.blockSignals(False)
        self._on_method(self.combo.currentIndex())
        self.runnable_changed.emit(self.runnable())

    def _fill_drafts(self, advice: MethodAdvice) -> None:
        """Usable drafts first, then the others greyed out with why; the user's pick stays picked.

        The list is rebuilt after every load, including the one the pick itself started, so
        without keeping the pick the box would jump back to the first file and no longer show
        which draft is loaded.
        """
        picked = self.draft_box.currentData()
        self.draft_items.clear()
        for path in advice.compatible_drafts:
            item = QStandardItem(Path(path).name)
            item.setData(str(path), Qt.ItemDataRole.UserRole)
            item.setToolTip(str(path))
            self.draft_items.appendRow(item)
        for name, why in advice.rejected_drafts:
            item = QStandardItem(f"{name} (not usable)")
            item.setEnabled(False)
            item.setToolTip(why)
            self.draft_items.appendRow(item)
        row = self.draft_box.findData(picked) if picked else -1
        # with no usable file the placeholder shows, not a greyed-out file as if it were picked
        self.draft_box.setCurrentIndex(row if row >= 0 else 0 if advice.compatible_drafts else -1)
        self.load_draft.setEnabled(bool(advice.compatible_drafts))

    def _show_details(self, name: str) -> None:
        spec = REGISTRY[name]
        row = self.combo.currentIndex()
        item = self.items.item(row) if row >= 0 else None
        about = html.escape(item.toolTip() if item is not None and item.toolTip() else spec.summary)
        missing = self.settings_missing(name)
        self.reason.setText(about + (f"<br><b>Before it can run:</b> {html.escape(missing)}" if missing else ""))
        fit = self.advice.fits.get(name) if self.advice else None
        if fit is not None:
            terms = "<br>".join(f"{t.bytes / MiB:,.1f} MiB · {t.name} ({t.device})" for t in fit.terms)
            self.memory.setText(f"<b>{fit.label}</b>, {fit.total_bytes / MiB:,.0f} MiB at {fit.n_ctx} tokens<br>{terms}")

    def disabled_reason(self, name: str) -> str | None:
        """Why a method is greyed out (None when it can be chosen)."""
        for row in range(self.items.rowCount()):
            item = self.items.item(row)
            if item.data(_NAME) == name:
                return None if item.isEnabled() else item.toolTip()
        return None


_NAME = Qt.ItemDataRole.UserRole + 1


def _method_item(name: str, label: str, why_not: str | None, about: str = "") -> QStandardItem:
    item = QStandardItem(label)
    item.setData(name, _NAME)
    item.setEnabled(why_not is None)
    item.setToolTip(why_not or about)
    return item


_HOW = {"measured": "measured on this model", "measured acceptance": "from acceptance measured on this model",
        "prior": "a cautious estimate until SpecDeck has measured it here"}


def _recommendation(best: Recommendation, usable: list[Recommendation]) -> str:
    """The recommendation with its reason. Plain decoding is recommended when no drafting method
    is expected to beat it, and the line says so, naming the closest one and its estimate.

    Example: "Recommended: <b>ar</b> — no drafting method is expected to beat plain decoding on
    this machine yet: the closest, pld, about 0.99x (a cautious estimate ...)".
    """
    if best.basis != "baseline":
        return f"Recommended: <b>{best.method}</b> — {best.reason}"
    closest = next((r for r in usable if r.predicted_speedup and r.basis != "baseline"), None)
    if closest is None:
        return f"Recommended: <b>{best.method}</b> — no drafting method can run with this model here"
    return (f"Recommended: <b>{best.method}</b> — no drafting method is expected to beat plain decoding on this "
            f"machine yet: the closest, {closest.method}, about {closest.predicted_speedup:.2f}x "
            f"({_HOW.get(closest.basis, closest.basis)}); pick it to let SpecDeck measure it")


_IN_THE_WINDOW = {  # requirements in the words of this window's controls (describe() speaks the CLI's)
    DRAFT_MODEL: "a smaller draft model with the loaded model's vocabulary",
    DATASTORE: "a datastore of your own texts (its datastore setting)",
    LAYER_SKIP: "a backend that can run part of the model's layers (load the model with Run with: PyTorch, in Models)",
}


def _needs(missing: frozenset[str]) -> str:
    return "; ".join(_in_the_window(r) for r in sorted(missing))


def _in_the_window(requirement: str) -> str:
    if requirement.startswith(HEAD_PREFIX):
        return (f"a trained {requirement[len(HEAD_PREFIX):]} head for this model (the Train button below makes one "
                "on this PC)")
    return _IN_THE_WINDOW.get(requirement) or describe(frozenset({requirement}))


def _why_disabled(name: str, missing: frozenset[str], rec: Recommendation | None) -> str | None:
    """Why the loaded session cannot run a method now, in the window's words; None when it can."""
    if rec is not None and not rec.fits:
        return f"{name} does not fit on this machine: {rec.fit_label}"
    if not missing:
        return None
    if DRAFT_MODEL in missing and rec is not None and rec.available and rec.draft_model:
        return f"needs {_needs(missing)}: choose {rec.draft_model} under Draft model below, then Load draft model"
    if DRAFT_MODEL in missing:
        return (f"needs {_needs(missing)}; none in the library can draft for this model (the Draft model list "
                "below says why for each; Add folder ... or Hugging Face ... in Models brings others)")
    return f"needs {_needs(missing)}"


class ScrollColumn(QScrollArea):
    """Panels stacked in a column that scrolls up and down, never sideways.

    A plain ``QScrollArea`` asks its dock for almost no width, so the dock could be squeezed to
    70 pixels with every label cut ("M...", "Recor"). This one asks for the width its panels need
    (their minimum plus the vertical scroll bar) and asks again whenever their content changes,
    so the dock is never narrower than what it holds and only the height scrolls. (The Method and
    sampling dock; the comparison's results, which on a short screen scroll rather than push the
    window past its bottom edge.)
    """

    def __init__(self, *panels: QWidget, stretch: bool = True, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        column = QWidget()
        layout = QVBoxLayout(column)
        for panel in panels:
            layout.addWidget(panel)
        if stretch:
            layout.addStretch(1)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setWidget(column)
        column.installEventFilter(self)

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt's name
        if watched is self.widget() and event.type() == QEvent.Type.LayoutRequest:
            self.updateGeometry()  # what the panels need changed (new advice, another method's form)
        return super().eventFilter(watched, event)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        need = self.widget().minimumSizeHint().width() + self.verticalScrollBar().sizeHint().width() + 2 * self.frameWidth()
        return QSize(need, super().minimumSizeHint().height())

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        hint = super().sizeHint()
        return QSize(max(hint.width(), self.minimumSizeHint().width()), hint.height())


class HardwarePanel(QWidget):
    """The hardware report. No title of its own: the dock it sits in is titled "Hardware"."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        self.text = QLabel("Detecting CPU, RAM, GPUs and the llama.cpp build ...")
        self.text.setObjectName("hardware_report")
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.text.setStyleSheet("font-family: monospace")
        layout.addWidget(self.text)
        layout.addStretch(1)

    def show_report(self, report: HardwareReport) -> None:
        self.text.setText(format_report(report))


def _spin(lo: int, hi: int, value: int) -> QSpinBox:
    box = QSpinBox()
    box.setRange(lo, hi)
    box.setValue(value)
    return box


def _dspin(lo: float, hi: float, value: float, step: float) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(lo, hi)
    box.setDecimals(3)
    box.setSingleStep(step)
    box.setValue(value)
    return box
