"""The inference worker: one object in its own QThread, the only code that touches llama.cpp.

The GUI sends it requests through queued signals and it answers with signals carrying immutable
records, so no model object is ever shared between threads. Stopping never goes through the
event queue (the worker is busy generating, so a queued "stop" would wait behind the answer):
every request carries its own ``threading.Event``, which the GUI sets and the engine loop checks
before each step, so an answer stops within one step and a model load within one progress tick.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil
from PySide6.QtCore import QObject, Signal, Slot

from backends.bench import TurnRun, decode_rate, divergence
from backends.core.errors import Cancelled, PromptTooLongError, SpecDeckError
from backends.core.types import Event, Finished, GenerationSettings, Prefilled, Step
from backends.drafters import baseline_method, is_baseline
from backends.factory import Session, SessionConfig, backend_named
from backends.hardware.observed import ObservedStore
from backends.hardware.telemetry import Sampler, energy_joules
from backends.models.catalog import CATALOG, resolve_model
from backends.models.chat import Message
from backends.models.gguf_info import read_gguf_info
from backends.remote.client import ServerConfig
from backends.remote.session import RemoteSession
from backends.remote.session import connect as connect_remote


# -- requests (GUI -> worker) --------------------------------------------------------------------
@dataclass(frozen=True)
class LoadRequest:
    config: SessionConfig
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)


@dataclass(frozen=True)
class ConnectRequest:
    """Use a server instead of the local model (the local model stays loaded, for Disconnect)."""

    config: ServerConfig


@dataclass(frozen=True)
class AnswerRequest:
    request_id: int
    messages: tuple[Message, ...]
    method: str
    generation: GenerationSettings
    method_settings: dict = field(default_factory=dict)
    template: str | None = None  # a Jinja chat template overriding the GGUF's
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)


@dataclass(frozen=True)
class CompareRequest:
    request_id: int
    prompt: str
    methods: tuple[str, ...]
    generation: GenerationSettings
    method_settings: dict = field(default_factory=dict)  # method -> {setting: value}
    servers: tuple[ServerConfig, ...] = ()  # while a server answers: more servers to run the prompt on, after it
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)


# -- reports (worker -> GUI) ---------------------------------------------------------------------
@dataclass(frozen=True)
class ModelReady:
    model: str  # what the user asked for: a catalog id or a path
    name: str
    path: str
    n_ctx: int
    draft_model: str | None
    offers: frozenset[str]
    has_template: bool
    seconds: float
    plain_tok_s: float | None = None  # this model's plain decoding as measured on this machine (None: never run here)
    placement: str = "CPU"  # where the target runs: "CPU", "GPU (CUDA, ...)", "12 of 31 layers on GPU ..."
    backend: str = "llamacpp"  # what runs it (backends.factory.BACKENDS)
    server: str = ""  # a server's address when a server answers (then the server picks the method)
    gpu_metrics: str = ""  # where that server's GPU readings come from (dcgm-exporter), if anywhere


@dataclass(frozen=True)
class PrefillProgress:
    """How far the prompt has been read: ``done`` of its ``total`` tokens are in the model's cache
    (what a long message shows instead of "thinking" until the answer starts)."""

    done: int
    total: int


@dataclass(frozen=True)
class AnswerEvent:
    request_id: int
    event: Event | PrefillProgress
    draft_text: str = ""  # for a Step: the text of its tokens that came from accepted drafts


@dataclass(frozen=True)
class CompareEvent:
    request_id: int
    method: str
    event: Event


@dataclass(frozen=True)
class CompareRow:
    method: str
    decode_tok_s: float
    speedup: float
    tau: float
    acceptance_rate: float
    new_tokens: int
    joules_per_token: float | None
    identical: bool
    divergence_margin: float | None  # top-1 minus top-2 logit where the output left plain decoding's
    text: str
    error: str | None = None  # the method failed to run: why (its figures are then NaN)
    near_tie: bool | None = None  # that margin is within this model's measured batch noise (a rounding effect)
    divergence_note: str = ""  # the divergence in words: where, the margin, this model's batch noise
    divergence_position: int | None = None  # the answer's token where it first differs
    acceptance_by_depth: tuple[float, ...] = ()  # of the guesses at draft depth k, the share accepted
    declined: str = ""  # why it drafted nothing, where it chose so (its gate: drafting lost here)


@dataclass(frozen=True)
class CompareDone:
    request_id: int
    prompt: str
    rows: tuple[CompareRow, ...]
    cancelled: bool = False


@dataclass(frozen=True)
class Failure:
    request_id: int | None
    title: str
    message: str
    refused: bool = False  # turned down before anything ran (a message too long): the chat gives the text back
    kept_model: bool = False  # a failed load left the model loaded before it in use


class Worker(QObject):
    """Owns the Session. Slots run on the worker thread; signals are delivered to the GUI thread."""

    loading = Signal(str)
    ready = Signal(object)  # ModelReady
    unloaded = Signal()
    answer_event = Signal(object)  # AnswerEvent
    compare_event = Signal(object)  # CompareEvent
    compare_done = Signal(object)  # CompareDone
    failed = Signal(object)  # Failure
    notice = Signal(str)  # something the user should know that is not an error
    plain_rate = Signal(object)  # float: the loaded model's measured plain-decoding tok/s, after each ar run
    busy = Signal(bool)

    def __init__(self, sampler: Sampler | None = None) -> None:
        super().__init__()
        self.session: Session | None = None
        self.remote: RemoteSession | None = None  # a connected server answers instead of the session
        self.sampler = sampler
        self.store = ObservedStore()
        # How far the current load is (0..1). llama.cpp reports it from inside its loader through a
        # ctypes callback; emitting a Qt signal from there crashed PySide, so the GUI polls this.
        self.load_fraction = 0.0
        self._prefill_done = -1  # the prefill progress last reported (see _report_prefill)
        self._load_seconds = 0.0  # how long the loaded model took to load

    # -- loading -------------------------------------------------------------------------------
    @Slot(object)
    def load(self, request: LoadRequest) -> None:
        """Load a model; the one loaded before stays in use until the new one has loaded.

        A file that cannot be read (truncated, not a GGUF, an unknown architecture) is refused
        from its header before anything is unloaded. The old session is closed before the new
        one opens only when both would not fit in RAM; if the new one then fails, the old one is
        opened again, so a failed load never leaves the user without the model they had."""
        self.busy.emit(True)
        self.loading.emit(str(request.config.model))
        start = time.perf_counter()
        self.load_fraction = 0.0

        def on_progress(fraction: float) -> bool:
            self.load_fraction = fraction
            return not request.cancel.is_set()

        previous = self.session.config if self.session is not None else None
        try:
            preflight(request.config)
            if self.session is not None and not _room_for_both(self.session, request.config):
                self._close_session()
            session = Session(request.config, progress=on_progress)
        except Cancelled as exc:
            self._load_failed(Failure(None, "Loading cancelled", str(exc)), previous)
        except (SpecDeckError, OSError, ValueError) as exc:
            self._load_failed(Failure(None, "The model could not be loaded", str(exc)), previous)
        except Exception as exc:  # noqa: BLE001 - the window must survive anything a load does
            self._load_failed(Failure(None, "The model could not be loaded", _unexpected(exc)), previous)
        else:
            self._close_session()
            self._close_remote()  # a model loaded to answer: the server no longer does
            self.session = session
            self._load_seconds = time.perf_counter() - start
            self.ready.emit(self._ready(session, request.config, self._load_seconds))
        finally:
            self.busy.emit(False)

    def _ready(self, session: Session, config: SessionConfig, seconds: float) -> ModelReady:
        return ModelReady(
            model=str(config.model), name=display_name(str(config.model)), path=str(session.model.path),
            n_ctx=session.target.n_ctx, draft_model=config.draft_model, offers=session.offers,
            has_template=session.model.chat_format.template is not None, seconds=seconds, placement=session.placement,
            plain_tok_s=self._plain_rate(session), backend=config.backend,
        )

    def _load_failed(self, failure: Failure, previous: SessionConfig | None) -> None:
        """Report the failure; keep (or reopen) the model that was loaded before."""
        if self.session is None and previous is not None:
            try:
                start = time.perf_counter()
                self.session = Session(previous)
            except Exception as exc:  # noqa: BLE001 - reported with the first failure
                failure = replace(failure, message=f"{failure.message} (and the previous model could not be reopened: {exc})")
            else:
                if self.remote is None:  # while a server answers, the window keeps showing it
                    self.ready.emit(self._ready(self.session, previous, time.perf_counter() - start))
        kept = self.session is not None or self.remote is not None
        self.failed.emit(replace(failure, kept_model=kept))
        if not kept:
            self.unloaded.emit()

    # -- answering -----------------------------------------------------------------------------
    @Slot(object)
    def answer(self, request: AnswerRequest) -> None:
        if self.remote is not None:
            self._run_remote(request.request_id, "The server's answer failed", lambda remote: self._answer_remote(remote, request))
            return
        self._run(request.request_id, "The answer failed", lambda session: self._answer(session, request))

    def _answer(self, session: Session, request: AnswerRequest) -> None:
        self._prefill_done = -1
        default = session.model.chat_format
        fmt = replace(default, template=request.template) if request.template else default
        prompt = self._fitting_prompt(session, list(request.messages), fmt, request.generation.max_new_tokens)
        generation = replace(request.generation, stop=tuple(dict.fromkeys(request.generation.stop + fmt.stop)))
        watch = PrefillWatch(request.cancel, lambda: self._report_prefill(session, request.request_id, len(prompt) - 1))
        for event in session.generate(request.method, prompt, generation, cancel=watch,
                                      method_settings=request.method_settings):
            watch.reading = watch.reading and not isinstance(event, (Prefilled, Finished))
            self.answer_event.emit(AnswerEvent(request.request_id, event, _draft_text(session, event)))
            if isinstance(event, Finished):
                self._record(session, event)

    def _record(self, session: Session, finished: Finished) -> None:
        """Keep what a finished run measured (the recommender and the plain-decoding line use it)."""
        if finished.reason == "cancelled":
            return
        self.store.record_run(session.model.path, "chat", replace(finished.stats, method=session.observed_method(finished.stats.method)))
        if is_baseline(finished.stats.method):
            rate = self._plain_rate(session)
            if rate is not None:
                self.plain_rate.emit(rate)

    def _plain_rate(self, session: Session) -> float | None:
        """Plain decoding's decode rate for this model file on this machine, from finished runs
        (chat answers and comparisons; a running average), or None when it was never run here.
        Estimates (the roofline, one forward's time) leave out sampling and the engine's own work
        and promised 4-5x the real rate, so they are never drawn as the line to beat."""
        seen = self.store.lookup(session.model.path, session.observed_method(baseline_method()), "chat")
        return seen.decode_tok_s if seen is not None else None

    def _report_prefill(self, session: Session, request_id: int, total: int) -> None:
        """Between two chunks of the prompt's prefill (on this thread): how many tokens are in."""
        done = min(session.target.n_past, total)
        if done != self._prefill_done:
            self._prefill_done = done
            self.answer_event.emit(AnswerEvent(request_id, PrefillProgress(done, total)))

    def _run(self, request_id: int, title: str, job: Callable[[Session], None]) -> None:
        """Run one request on the loaded session; whatever fails becomes a Failure for the window."""
        if self.session is None:
            self.failed.emit(Failure(request_id, "No model loaded", "Load a model first."))
            return
        self.busy.emit(True)
        try:
            job(self.session)
        except PromptTooLongError as exc:
            self.failed.emit(Failure(request_id, "The message does not fit the context", str(exc), refused=True))
        except (SpecDeckError, ValueError) as exc:
            self.failed.emit(Failure(request_id, title, str(exc)))
        except Exception as exc:  # noqa: BLE001 - the window must survive anything a request does
            self.failed.emit(Failure(request_id, title, _unexpected(exc)))
        finally:
            self.busy.emit(False)

    def _fitting_prompt(self, session: Session, messages: list[Message], fmt, max_new_tokens: int) -> list[int]:
        """The conversation's prompt, leaving out its oldest turns while it would crowd out the answer.

        A long chat must keep working: like other chat apps, the earliest messages (never the
        system prompt or the newest message) are dropped until the prompt leaves room for the
        answer, and the user is told. A newest message that cannot fit even alone is refused
        before any turn is dropped (PromptTooLongError), so nothing is left out for nothing.
        """
        n_ctx = session.target.n_ctx
        room = min(max_new_tokens, 256)
        prompt = session.model.chat_prompt(messages, chat_format=fmt)
        if len(prompt) + room <= n_ctx:
            return prompt
        _refuse_if_alone_too_long(session, messages, fmt)
        fitted = session.fitting_prompt(messages, max_new_tokens=max_new_tokens, chat_format=fmt)
        if fitted.dropped:
            self.notice.emit(f"the {fitted.dropped} oldest message(s) no longer fit the {n_ctx}-token context "
                             "and were left out of this answer")
        return fitted.tokens

    # -- comparing -----------------------------------------------------------------------------
    @Slot(object)
    def compare(self, request: CompareRequest) -> None:
        """The same prompt through each method on the same loaded target, plain decoding first."""
        if self.remote is not None:
            self._run_remote(request.request_id, "The server's answer failed",
                             lambda remote: self.compare_done.emit(self._compare_remote(remote, request)))
            return
        self._run(request.request_id, "The comparison failed",
                  lambda session: self.compare_done.emit(self._compare(session, request)))

    def _compare(self, session: Session, request: CompareRequest) -> CompareDone:
        """Plain decoding, then each method. A method that fails gets a row saying why and the
        others go on: one bad setting (a datastore that cannot be read) costs its own run only.
        Without plain decoding there is nothing to compare against, so its failure ends the run."""
        prompt = session.model.chat_prompt([{"role": "user", "content": request.prompt}])
        generation = replace(request.generation, stop=request.generation.stop + session.model.chat_format.stop)
        plain = baseline_method()
        methods = [plain] + [m for m in request.methods if m != plain]
        runs: dict[str, TurnRun] = {}
        failed: dict[str, str] = {}
        for method in methods:
            if request.cancel.is_set():
                break
            try:
                runs[method] = self._compare_one(session, request, method, prompt, generation)
            except (SpecDeckError, ValueError, OSError) as exc:
                if method == plain:
                    raise
                failed[method] = str(exc)
            except Exception as exc:  # noqa: BLE001 - one method's bug must not cost the others' results
                if method == plain:
                    raise
                failed[method] = _unexpected(exc)
        cancelled = request.cancel.is_set()
        rows = () if cancelled else tuple(
            _failed_row(m, failed[m]) if m in failed else self._row(session, m, runs, generation)
            for m in methods if m in runs or m in failed)
        return CompareDone(request.request_id, request.prompt, rows, cancelled)

    def _compare_one(self, session: Session, request: CompareRequest, method: str, prompt: list[int],
                     generation: GenerationSettings) -> TurnRun:
        session.reset()  # every method starts from an empty cache
        t0, finished = time.monotonic(), None
        for event in session.generate(method, prompt, generation, cancel=request.cancel,
                                      method_settings=request.method_settings.get(method, {})):
            self.compare_event.emit(CompareEvent(request.request_id, method, event))
            finished = event if isinstance(event, Finished) else finished
        assert finished is not None
        self._record(session, finished)
        return TurnRun(prompt, list(finished.tokens), finished.text, finished.stats, 0.0, t0, time.monotonic())

    def _row(self, session: Session, method: str, runs: dict[str, TurnRun], generation: GenerationSettings) -> CompareRow:
        run, ar = runs[method], runs[baseline_method()]
        div = None if is_baseline(method) else divergence(session, [run], [ar], generation.sampling)
        rate, ar_rate = decode_rate([run]), decode_rate([ar])
        energy = energy_joules(self.sampler.history(), run.t0, run.t1) if self.sampler is not None else None
        return CompareRow(
            method=method, decode_tok_s=rate, speedup=rate / ar_rate if ar_rate > 0 else float("nan"),
            tau=run.stats.tau, acceptance_rate=run.stats.acceptance_rate, new_tokens=run.stats.new_tokens,
            joules_per_token=energy / run.stats.new_tokens if energy is not None and run.stats.new_tokens else None,
            identical=div is None, divergence_margin=None if div is None else div["margin"], text=run.text,
            near_tie=None if div is None else div["near_tie"], divergence_note="" if div is None else div["explained"],
            divergence_position=None if div is None else div["position"],
            acceptance_by_depth=tuple(a / d for a, d in zip(run.stats.accepted_at, run.stats.drafted_at) if d),
            declined="" if run.stats.drafted else run.stats.declined,
        )

    @Slot()
    def refresh_heads(self) -> None:
        """A head was trained for the loaded model: report what the session offers now."""
        if self.session is not None:
            self.session.forget_heads()
            if self.remote is not None:  # a server answers: the local model is reported on Disconnect
                return
            self.ready.emit(replace(self._ready(self.session, self.session.config, 0.0), seconds=self._load_seconds))

    # -- a server instead of the local model ------------------------------------------------------
    @Slot(object)
    def connect_server(self, request: ConnectRequest) -> None:
        """Connect (network only: the local model stays loaded); a failure keeps what was in use."""
        self.busy.emit(True)
        self.loading.emit(request.config.base)
        start = time.perf_counter()
        try:
            remote = RemoteSession(request.config)
        except (SpecDeckError, ValueError, OSError) as exc:
            kept = self.session is not None or self.remote is not None
            self.failed.emit(Failure(None, "Could not connect to the server", str(exc), kept_model=kept))
            if not kept:
                self.unloaded.emit()
        else:
            self._close_remote()
            self.remote = remote
            info = remote.info
            self.ready.emit(ModelReady(model=info.base, name=f"{info.model} (server)", path=info.base, n_ctx=0,
                                       draft_model=None, offers=frozenset(), has_template=True,
                                       seconds=time.perf_counter() - start, placement=info.engine, backend="remote",
                                       server=info.base, gpu_metrics=info.gpu_metrics))
        finally:
            self.busy.emit(False)

    @Slot()
    def disconnect_server(self) -> None:
        """Back to the local model (if one is loaded)."""
        self._close_remote()
        if self.session is not None:
            self.ready.emit(replace(self._ready(self.session, self.session.config, 0.0), seconds=self._load_seconds))
        else:
            self.unloaded.emit()

    def _run_remote(self, request_id: int, title: str, job: Callable[[RemoteSession], None]) -> None:
        """One request to the server; a failure (dead, slow, refusing) becomes a Failure in words."""
        remote = self.remote
        assert remote is not None
        self.busy.emit(True)
        try:
            job(remote)
        except (SpecDeckError, ValueError) as exc:
            self.failed.emit(Failure(request_id, title, str(exc)))
        except Exception as exc:  # noqa: BLE001 - the window must survive anything a server does
            self.failed.emit(Failure(request_id, title, _unexpected(exc)))
        finally:
            self.busy.emit(False)

    def _answer_remote(self, remote: RemoteSession, request: AnswerRequest) -> None:
        for event in remote.generate(request.messages, request.generation, cancel=request.cancel):
            self.answer_event.emit(AnswerEvent(request.request_id, event))

    def _compare_remote(self, remote: RemoteSession, request: CompareRequest) -> CompareDone:
        """The connected server, then each of ``request.servers``, answer the prompt as each was
        started: a server picks its own method, so comparing methods there means comparing servers
        launched with different ones. The first is the baseline, as in ``specdeck bench --server``.
        Another server that fails gets a row saying why; the connected one failing ends the run."""
        runs = {remote.config.name: self._remote_run(remote, request)}
        failed: dict[str, str] = {}
        for config in request.servers:
            if request.cancel.is_set():
                break
            try:
                other = connect_remote(config, request.cancel)  # None: stopped while connecting
                if other is not None:
                    with other:
                        runs[config.name] = self._remote_run(other, request)
            except (SpecDeckError, ValueError, OSError) as exc:
                failed[config.name] = str(exc)
            except Exception as exc:  # noqa: BLE001 - one server's fault must not cost the others' results
                failed[config.name] = _unexpected(exc)
        if request.cancel.is_set() or any(run is None for run in runs.values()):
            return CompareDone(request.request_id, request.prompt, (), cancelled=True)
        first = runs[remote.config.name]
        names = [remote.config.name] + [c.name for c in request.servers]
        rows = tuple(_failed_row(name, failed[name]) if name in failed else _server_row(name, runs[name], first)
                     for name in names if name in runs or name in failed)
        return CompareDone(request.request_id, request.prompt, rows)

    def _remote_run(self, remote: RemoteSession, request: CompareRequest) -> TurnRun | None:
        """One server's answer to the prompt, streamed to its pane; None when stopped."""
        finished, t0 = None, time.monotonic()
        for event in remote.generate([{"role": "user", "content": request.prompt}], request.generation,
                                     cancel=request.cancel):
            self.compare_event.emit(CompareEvent(request.request_id, remote.config.name, event))
            finished = event if isinstance(event, Finished) else finished
        if finished is None or request.cancel.is_set():
            return None
        return TurnRun([], list(finished.tokens), finished.text, finished.stats, 0.0, t0, time.monotonic())

    def _close_remote(self) -> None:
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    # -- lifecycle -----------------------------------------------------------------------------
    @Slot()
    def shutdown(self) -> None:
        self._close_remote()
        self._close_session()

    def _close_session(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def display_name(spec: str) -> str:
    """What the status bar and title call a model: its catalog id or its file name. The GGUF's
    own ``general.name`` is often a training run's ("Smollm2 135M 8k Lc100K Mix1 Ep2") and the
    same for every quantization of it, so it cannot tell a Q4_1 from an F16."""
    return spec if spec in CATALOG else Path(spec).name


def preflight(config: SessionConfig) -> None:
    """Refuse, in words, a model (or draft) file whose GGUF header says it cannot load:
    cheaper than letting llama.cpp fail, and it runs before the working model is unloaded."""
    paths = [backend_named(config.backend).resolve(config.model)]
    paths += [resolve_model(config.draft_model)] if config.draft_model else []
    for path in paths:
        if path.is_file():
            read_gguf_info(path)  # raises ModelFileError: truncated, not a GGUF, corrupt header


def _room_for_both(session: Session, config: SessionConfig) -> bool:
    """Whether the new model's files fit in available RAM beside the loaded one (with 20%
    to spare for contexts and buffers). Only sizes are read: no model is opened."""
    try:
        paths = [backend_named(config.backend).resolve(config.model)]
        paths += [resolve_model(config.draft_model)] if config.draft_model else []
        need = sum(p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.safetensors"))
                   for p in paths) * 1.2
    except (SpecDeckError, OSError):
        return False
    return need < psutil.virtual_memory().available


class PrefillWatch:
    """A request's Stop flag as the engine reads it, which also tells how far a long prompt is.

    The engine asks ``is_set`` between the chunks of the prompt's prefill (so Stop works while a
    long message is read) and before every step. While ``reading`` (until the first event after
    the prefill), each ask first calls ``report``, which reads the target's cache length on the
    worker thread, between two chunks, where nothing else touches it.
    """

    def __init__(self, cancel: threading.Event, report: Callable[[], None]) -> None:
        self.cancel, self.report = cancel, report
        self.reading = True

    def is_set(self) -> bool:
        if self.reading:
            self.report()
        return self.cancel.is_set()


def _server_row(name: str, run: TurnRun, first: TurnRun) -> CompareRow:
    """A server's row: its decode rate against the first server's, and whether it wrote the same
    text (token ids and logits do not travel over the API, so a difference is placed by character)."""
    rate, first_rate = decode_rate([run]), decode_rate([first])
    stats, same = run.stats, run.text == first.text
    at = next((i for i, (a, b) in enumerate(zip(run.text, first.text)) if a != b), min(len(run.text), len(first.text)))
    return CompareRow(method=name, decode_tok_s=rate, speedup=rate / first_rate if first_rate > 0 else float("nan"),
                      tau=stats.tau, acceptance_rate=stats.acceptance_rate, new_tokens=stats.new_tokens,
                      joules_per_token=None, identical=same, divergence_margin=None, text=run.text,
                      divergence_note="" if same else f"its text leaves the first server's at character {at}",
                      declined="" if stats.drafted else stats.declined)


def _failed_row(method: str, error: str) -> CompareRow:
    nan = float("nan")
    return CompareRow(method=method, decode_tok_s=nan, speedup=nan, tau=nan, acceptance_rate=nan, new_tokens=0,
                      joules_per_token=None, identical=False, divergence_margin=None, text="", error=error)


def _refuse_if_alone_too_long(session: Session, messages: list[Message], fmt) -> None:
    """Raise PromptTooLongError, in words, when the newest message (with any system prompt) leaves
    no room for one new token however many earlier turns are left out."""
    alone = [m for m in messages[:-1] if m["role"] == "system"] + messages[-1:]
    n_tokens, n_ctx = len(session.model.chat_prompt(alone, chat_format=fmt)), session.target.n_ctx
    if n_tokens < n_ctx:
        return
    what = "This message, with the system prompt," if len(alone) > 1 else "This message"
    raise PromptTooLongError(
        f"{what} is too long for the model's context: it takes {n_tokens:,} tokens and the context holds "
        f"{n_ctx:,}. Shorten it or split it, or load the model with a larger context. "
        "Nothing was sent and the conversation is unchanged."
    )


def _draft_text(session: Session, event: Event) -> str:
    if not isinstance(event, Step) or not event.accepted:
        return ""
    pieces = b"".join(session.model.token_piece(t) for t in event.tokens[: event.accepted])
    return pieces.decode("utf-8", errors="replace")


def _unexpected(exc: BaseException) -> str:
    """An error SpecDeck did not foresee: its type and message, plus where, for a bug report."""
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    place = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{place}"
