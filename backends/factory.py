"""Wiring a backend to a method, in one place used by the CLI chat, the bench and the GUI worker.

A ``Session`` holds what is expensive to load (the target model and context, an optional draft
model) and builds a fresh, cheap drafter for every answer. Adding a backend touches no drafter and
adding a drafter touches no backend: both only meet here, through the registry and the protocols.

Example::

    with Session(SessionConfig(model="smollm2-135m-f16")) as s:
        prompt = s.model.chat_prompt([{"role": "user", "content": "Hi"}])
        for event in s.generate("pld", prompt, GenerationSettings(max_new_tokens=32)):
            ...
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from backends.core.costs import CostModel
from backends.core.timing import SHORT_CONTEXT, CpuWatch, time_forwards, time_here
from backends.core.engine import generate
from backends.core.errors import IncompatibleDraftError, SpecDeckError
from backends.core.noise import BatchNoise, measure_batch_noise
from backends.core.protocols import Drafter
from backends.core.types import HIDDEN_STATES, NATIVE_EAGLE3, NATIVE_MTP, ROLLBACK, Event, GenerationSettings, Prefilled, SamplingSettings
from backends.drafters import DRAFT_MODEL, DrafterResources, describe, head_requirement, method_spec
from backends.heads.files import HEAD_KINDS, HeadFile, ModelFingerprint, find_heads
from backends.heads.published import KIND as PUBLISHED_KIND, is_published_eagle3, read_published_eagle3
from backends.models.weights import TokenEmbeddings
from backends.hardware.offload import AUTO, resolve_gpu_layers
from backends.llamacpp.model import LlamaModel
from backends.llamacpp.target import LlamaTarget
from backends.models.catalog import resolve_model
from backends.models.chat import ChatFormat, Message
from backends.models.hf_folder import HFModelFolder, is_hf_folder
from backends.models.compat import draft_incompatibility
from backends.models.cost_cache import (COST_CURVE_LENGTH, LONG_CONTEXT, cost_curve_file, load_cost_curves,
                                        measurement_file, save_cost_curves)
from backends.models.gpu_runtime import LABELS
from backends.models.llama_lib import gpu_runtime

MAX_LAYERS = 999  # n_gpu_layers meaning "every layer"
QUIET_CORES = 0.25  # other processes' CPU use (cores) under which a measured cost curve is kept
NOISE_DEPTH = 16  # drafted tokens per chain when measuring batch noise
NOISE_LONG = 600  # tokens of the long prompt the noise is also measured after
NOISE_TEXTS = ("Summarize in one sentence: the city council met on Tuesday to discuss the new park, its playground "
               "and its pond.", "Write a short Python function that returns the sum of a list, and explain it.")
ANSWER_ROOM = 256  # tokens a conversation's prompt leaves free for the answer (at most max_new_tokens)


@dataclass(frozen=True)
class Backend:
    """One way to run the target model, in the backend registry (``BACKENDS``).

    ``open(session, progress)`` builds the session's ``Target``; ``loads_weights`` says whether
    llama.cpp loads the model's weights (else it loads only the GGUF's tokenizer and chat
    template, and the backend reads the weights itself); ``placement(session)`` says where the
    target runs, in words. What a backend can do (trees, hidden states, its limits) its target
    declares in ``offers`` and ``limits``: nothing here names a capability.
    """

    name: str
    label: str
    open: Callable[["Session", Callable[[float], bool] | None], Any]
    loads_weights: bool
    placement: Callable[["Session"], str]
    runtime: Callable[["Session"], tuple] = lambda session: ()  # what keys its measurements besides the file
    folders: bool = False  # runs Hugging Face folders (config.json + safetensors) besides GGUFs

    def resolve(self, spec: str) -> Path:
        """The model file (or folder) ``spec`` names, checked."""
        if self.folders and is_hf_folder(Path(spec).expanduser()):
            return Path(spec).expanduser()
        return resolve_model(spec)

    def text_model(self, path: Path, *, n_gpu_layers: int, progress: Callable[[float], bool] | None):
        """What the session tokenizes and renders chats with: the llama.cpp model itself, or only
        its vocabulary (a folder's: ``HFModelFolder``) when this backend holds the weights."""
        if is_hf_folder(path):
            return HFModelFolder(path)
        if self.loads_weights:
            return LlamaModel(path, n_gpu_layers=n_gpu_layers, progress=progress)
        return LlamaModel(path, vocab_only=True)


def _open_llamacpp(session: "Session", progress: Callable[[float], bool] | None) -> LlamaTarget:
    return session._context(session.model)


def _open_torch(session: "Session", progress: Callable[[float], bool] | None):
    from backends.pytorch.loader import open_torch_target

    model, config = session.model, session.config
    return open_torch_target(model.path, token_piece=model.token_piece, eog_ids=model.eog_ids, n_ctx=config.n_ctx,
                             n_threads=config.n_threads, dtype=config.dtype, name=model.name, progress=progress)


def _llamacpp_placement(session: "Session") -> str:
    gpu = gpu_runtime()
    total = session.model.n_layer + 1  # the blocks and the output layer, as llama.cpp counts them
    ngl = min(session.config.n_gpu_layers, total)
    if gpu is None or gpu.backend is None or ngl <= 0:
        return "CPU"
    device = f"GPU ({LABELS[gpu.backend]}, {gpu.devices[0].description})" if gpu.devices else f"GPU ({gpu.backend})"
    return device if ngl >= total else f"{ngl} of {total} layers on {device}, the rest on CPU"


def _torch_placement(session: "Session") -> str:
    return session.target.placement


def _torch_runtime(session: "Session") -> tuple:
    return ("torch", *session.target.runtime)


BACKENDS: dict[str, Backend] = {
    "llamacpp": Backend("llamacpp", "llama.cpp", _open_llamacpp, True, _llamacpp_placement),
    "torch": Backend("torch", "PyTorch", _open_torch, False, _torch_placement, _torch_runtime, folders=True),
}


def backend_for(spec: str) -> str:
    """The backend a model opens on unless the user picks another: llama.cpp for a GGUF (the
    default), the first backend that runs folders for a Hugging Face folder."""
    if is_hf_folder(Path(spec).expanduser()):
        return next(backend.name for backend in BACKENDS.values() if backend.folders)
    return SessionConfig.backend


def backend_named(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise SpecDeckError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})") from None


@dataclass(frozen=True)
class FittedPrompt:
    """A conversation's prompt and the oldest messages left out of it to fit the context."""

    tokens: list[int]
    dropped: int
    messages: list[Message]  # the messages the prompt holds


@dataclass(frozen=True)
class SessionConfig:
    model: str  # a known id or a path to a .gguf file
    draft_model: str | None = None
    n_ctx: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int = AUTO  # AUTO: what the fit estimator places on the running GPU backend (none: 0)
    flash_attn: str = "auto"
    heads: tuple[str, ...] = ()  # trained head files to use (else those found for the model)
    backend: str = "llamacpp"  # which entry of BACKENDS runs the target
    dtype: str = "auto"  # the torch backend's precision (backends.pytorch.loader.DTYPES)



class Session:
    """A loaded target (and maybe a draft model), ready to answer with any method it can run."""

    def __init__(self, config: SessionConfig, *, progress: Callable[[float], bool] | None = None) -> None:
        """``progress`` sees the target's load progress (0..1) and may return False to cancel it."""
        self.backend = backend_named(config.backend)
        path = self.backend.resolve(config.model)
        draft_path = resolve_model(config.draft_model) if config.draft_model else None
        if self.backend.loads_weights:
            ngl, self.offload = resolve_gpu_layers(config.n_gpu_layers, path, n_ctx=config.n_ctx, draft=draft_path)
        else:
            ngl, self.offload = 0, None
        self.config = config = replace(config, n_gpu_layers=ngl)
        # The estimator puts a draft on the GPU only beside a fully offloaded target.
        self._draft_gpu_layers = ngl if self.offload is None else (
            MAX_LAYERS if self.offload.gpu_layers >= self.offload.total_layers else 0)
        loads = self.backend.loads_weights
        self.model = self.backend.text_model(path, n_gpu_layers=ngl, progress=progress)
        self.draft_model: LlamaModel | None = None
        self.draft_target: LlamaTarget | None = None
        self._costs: CostModel | None = None
        self._draft_costs: CostModel | None = None
        self._noise: BatchNoise | None = None
        self._memory: dict = {}  # what drafters learned in earlier answers (see DrafterResources)
        self._path = path
        self._heads: dict[tuple[str, str], HeadFile] = {}
        try:
            self.target = self.backend.open(self, None if loads else progress)
            if config.draft_model:
                self._load_draft(config.draft_model)
        except BaseException:
            self.close()
            raise

    def _context(self, model: LlamaModel, n_ctx: int | None = None) -> LlamaTarget:
        if n_ctx is None:
            n_ctx = min(self.config.n_ctx, model.n_ctx_train) if model.n_ctx_train > 0 else self.config.n_ctx
        return LlamaTarget(model, n_ctx=n_ctx, n_threads=self.config.n_threads, flash_attn=self.config.flash_attn)

    def _load_draft(self, spec: str) -> None:
        """The draft model in a context as long as the target's: a draft shorter than every prompt
        the target takes would fail on the long ones (past its training length a draft only
        guesses worse, and guesses are verified)."""
        draft = LlamaModel(resolve_model(spec), n_gpu_layers=self._draft_gpu_layers)
        reasons = draft_incompatibility(self.model.vocab_info, draft.vocab_info)
        if not draft.can_roll_back:
            reasons.append("it is a recurrent or hybrid model, whose cache cannot forget rejected guesses")
        if reasons:
            draft.close()
            raise IncompatibleDraftError(f"{spec} cannot draft for {self.config.model}: " + "; ".join(reasons))
        self.draft_model = draft
        self.draft_target = self._context(draft, self.target.n_ctx)

    def reset(self) -> None:
        """Empty every KV cache (the next answer computes its whole prompt)."""
        self.target.reset()
        if self.draft_target is not None:
            self.draft_target.reset()

    @property
    def memory(self) -> dict:
        """What drafters learned in this session (acceptance statistics, bandits), by key."""
        return self._memory

    @property
    def placement(self) -> str:
        """Where the target runs, in words: "CPU", "GPU (Vulkan, llvmpipe ...)" or "12 of 31 layers on
        GPU (CUDA, NVIDIA GeForce RTX 3060), the rest on CPU"; what the status bar and the CLI say."""
        return self.backend.placement(self)

    def observed_method(self, method: str) -> str:
        """The name a method's measured speeds are kept under for this model (the observed-speeds
        store): another backend's runs are another method's ("torch:ar"), as the bench names them."""
        return method if self.backend.loads_weights else f"{self.backend.name}:{method}"

    # -- capabilities and costs ----------------------------------------------------------------
    @property
    def offers(self) -> frozenset[str]:
        heads = {head_requirement(k) for k in self.head_kinds} if HIDDEN_STATES in self.target.offers else set()
        return self.target.offers | heads | ({DRAFT_MODEL} if self.draft_target is not None else frozenset())

    @property
    def head_kinds(self) -> tuple[str, ...]:
        """The kinds of trained heads at hand for this model (given, or found next to it, among the
        user's trained heads or the shipped ones); looked up each time (a few directory listings),
        so a head trained while the model is loaded counts at once."""
        given = {HeadFile.kind_of(p) for p in self.config.heads}
        return tuple(k for k in HEAD_KINDS if k in given or find_heads(self._path, k, fingerprint=self.fingerprint))

    def forget_heads(self) -> None:
        """Look heads up again at their next use (one was trained or replaced meanwhile)."""
        self._heads.clear()

    @cached_property
    def fingerprint(self) -> ModelFingerprint:
        """What trained heads are checked against (from the GGUF header or the folder's config)."""
        return ModelFingerprint.of(self._path)

    @cached_property
    def embeddings(self) -> TokenEmbeddings:
        """The target's token embeddings, rows read from its file(s) when a head first needs them."""
        return TokenEmbeddings(self._path)

    def head(self, kind: str, path: str = "") -> HeadFile:
        """A trained head of ``kind`` for the loaded model: ``path``, one given in the config, or the
        best one found; loaded once. A head made for another model is refused, naming both."""
        key = (kind, path)
        if key not in self._heads:
            given = [p for p in self.config.heads if HeadFile.kind_of(p) == kind]
            candidates = [path] if path else given or [str(p) for p in find_heads(self._path, kind,
                                                                                   fingerprint=self.fingerprint)]
            if not candidates:
                raise SpecDeckError(f"no {kind} head has been trained for {self.model.name}: "
                                    f"`specdeck train {kind} --model {self.config.model}` makes one")
            if kind == PUBLISHED_KIND and is_published_eagle3(candidates[0]):  # an EAGLE / SpecForge folder
                head = read_published_eagle3(candidates[0], self._path)
            else:
                head = HeadFile.load(candidates[0])
            head.check_for(self.fingerprint, kind)
            self._heads[key] = head.attach(self._path)
        return self._heads[key]

    def engine_head(self, head: HeadFile | str):
        """An EAGLE-3 head run by the target's engine (``NATIVE_EAGLE3``): a trained ``HeadFile``
        (exported to a GGUF once) or the path of an ``eagle3`` GGUF someone published."""
        if isinstance(head, HeadFile):
            from backends.heads.eagle3_gguf import exported_gguf

            head = str(exported_gguf(head, self._path))
        return self.target.engine_head(str(Path(head).expanduser()))

    def cost_model(self) -> CostModel:
        """The target's verify cost model: measured once per model file, thread count and build."""
        if self._costs is None:
            self._costs = CostModel(self._cached_curves(self.target, self.model))
        return self._costs

    def draft_cost_model(self) -> CostModel | None:
        """The same for the draft model (its forwards and catch-ups), None without one."""
        if self._draft_costs is None and self.draft_target is not None and self.draft_model is not None:
            self._draft_costs = CostModel(self._cached_curves(self.draft_target, self.draft_model))
        return self._draft_costs

    def _cost_file(self, target: LlamaTarget, model: LlamaModel) -> Path:
        runtime = self.backend.runtime(self) if target is self.target else ()
        return cost_curve_file(model.path, target.n_threads, self.config.n_gpu_layers, self.config.flash_attn, *runtime)

    def _kept_file(self, name: str) -> Path | None:
        """Where a drafter keeps ``name`` for this model file and runtime (as the cost curves are)."""
        runtime = self.backend.runtime(self)
        try:
            return measurement_file(f"kept-{name}", self.model.path, self.target.n_threads, self.config.n_gpu_layers,
                                    self.config.flash_attn, *runtime)
        except OSError:
            return None

    def costs_known(self) -> bool:
        """Whether this model's verify costs were measured here before (none is timed at the first
        drafter then: front ends say "checking what verification costs" only when one will be)."""
        return self._costs is not None or load_cost_curves(self._cost_file(self.target, self.model)) is not None

    def _cached_curves(self, target: LlamaTarget, model: LlamaModel) -> dict[int, list[float]]:
        file = self._cost_file(target, model)
        curves = load_cost_curves(file)
        if curves is not None:
            return curves
        context = max(1, min(SHORT_CONTEXT, target.n_ctx - COST_CURVE_LENGTH - 2))
        with CpuWatch() as watch:
            curves = {context: time_forwards(target, COST_CURVE_LENGTH, context=context)}
        if watch.other_cores < QUIET_CORES:  # a curve taken on a busy machine is used once, never kept
            save_cost_curves(file, curves)
        return curves

    def _measure_long_context(self, cancel: threading.Event | None) -> None:
        """Once per model, on the first prompt of LONG_CONTEXT tokens or more: the cost curve at its
        length, measured on top of the prefilled prompt (which the probes leave as they found it).

        Verifying a draft gets dearer relative to one token as the context grows (F16, 2 cores:
        16 tokens cost 4.0x at 64 tokens of context, 6.1x at 1024); without this the planner
        would only learn that from corrections, a step at a time. It costs this one answer 0.47 s
        of first-token latency (F16 on 2 cores, 600 tokens; Q4_1 0.53 s), and saves the 2 s it
        took to prefill filler text at load. A cancelled answer stops it between probes; the next
        long prompt measures again.
        """
        stop = cancel.is_set if cancel is not None else (lambda: False)
        pairs = [(self.target, self.model, self._costs), (self.draft_target, self.draft_model, self._draft_costs)]
        for target, model, costs in pairs:
            if target is None or model is None or costs is None or max(costs.contexts) >= LONG_CONTEXT:
                continue
            if target.n_past < LONG_CONTEXT or target.n_past + costs.k_max + 2 > target.n_ctx:
                continue
            with CpuWatch() as watch:
                seconds = time_here(target, costs.k_max, stop=stop)
            if seconds is None:
                return
            costs.add_curve(target.n_past, seconds)
            if watch.other_cores < QUIET_CORES:
                save_cost_curves(self._cost_file(target, model), costs.curves)

    # -- answering -----------------------------------------------------------------------------
    def fitting_prompt(self, messages: Sequence[Message], *, max_new_tokens: int,
                       chat_format: ChatFormat | None = None) -> FittedPrompt:
        """The conversation's prompt, leaving out its oldest turns while it would crowd out the answer.

        A long chat must keep working: like other chat apps, the earliest messages (never the
        system prompt or the newest message) are left out until the prompt leaves room for
        ``min(max_new_tokens, ANSWER_ROOM)`` new tokens; the caller tells the user how many. A
        newest message too long for the context even alone still fails, with a clear error from
        the engine. The terminal chat and the desktop worker both use this.

        Example: with a 2048-token context, 600 tokens per turn and 256 of room, a fourth turn
        leaves out the first (3 x 600 + 256 fits, 4 x 600 does not).
        """
        kept = list(messages)
        room = min(max_new_tokens, ANSWER_ROOM)
        prompt = self.model.chat_prompt(kept, chat_format=chat_format)
        dropped = 0
        while len(prompt) + room > self.target.n_ctx:
            older = [i for i, m in enumerate(kept[:-1]) if m["role"] != "system"]
            if not older:
                break
            del kept[older[0]]
            dropped += 1
            prompt = self.model.chat_prompt(kept, chat_format=chat_format)
        return FittedPrompt(prompt, dropped, kept)

    def drafter(self, method: str, sampling: SamplingSettings, *, stop: Callable[[], bool] | None = None,
                **settings: Any) -> Drafter:
        """A fresh drafter for one answer; refused, with the reason, where this session lacks what it
        needs (``stop``: Stop was pressed, for a drafter's own long work)."""
        spec = method_spec(method)
        chosen = spec.settings(**settings)
        missing = spec.requirements(chosen) - self.offers
        if missing:
            raise self._refusal(method, missing, parts=spec.parts_needing(chosen, missing))
        resources = DrafterResources(
            sampling=sampling,
            target_vocab=self.model.n_vocab,
            # every timing probe is rolled back; a target that cannot do that runs no drafter anyway
            costs=self.cost_model if ROLLBACK in self.target.offers else lambda: None,
            draft=self.draft_target,
            draft_costs=self.draft_cost_model,
            memory=self._memory,
            vocab=self.model.vocab_info,
            stop=stop,
            head=self.head,
            offers=self.offers,
            embeddings=lambda: self.embeddings,
            native_head=self.target.native_head if NATIVE_MTP in self.target.offers else None,
            engine_head=self.engine_head if NATIVE_EAGLE3 in self.target.offers else None,
            target=self.target,
            kept=self._kept_file,
        )
        drafter = spec.build(chosen, resources)
        missing = drafter.requires - self.target.offers
        if missing:
            raise self._refusal(method, missing, " with these settings")
        return drafter

    def _refusal(self, method: str, missing: frozenset[str], which: str = "",
                 parts: Sequence[str] = ()) -> SpecDeckError:
        """Why ``method`` cannot run here; a model that cannot roll back is named, with what can;
        of a merging method, the ``parts`` that need what is missing."""
        if parts:
            method = f"{method} ({', '.join(parts)})"
        if ROLLBACK in missing:
            return SpecDeckError(f"{method} cannot run on {self.model.name}: it needs {describe(missing)}; "
                                 "plain decoding (ar) can")
        return SpecDeckError(f"{method}{which} needs {describe(missing)}, which this session does not have")

    def generate(
        self,
        method: str,
        prompt: Sequence[int],
        settings: GenerationSettings,
        *,
        cancel: threading.Event | None = None,
        method_settings: dict[str, Any] | None = None,
    ) -> Iterator[Event]:
        stop = None if cancel is None else cancel.is_set
        drafter = self.drafter(method, settings.sampling, stop=stop, **(method_settings or {}))  # bad settings raise
        return self._measuring(generate(self.target, drafter, prompt, settings, cancel=cancel, method=method), cancel)

    def _measuring(self, events: Iterator[Event], cancel: threading.Event | None) -> Iterator[Event]:
        """The engine's events; between the prefill and the first step, the long-context cost curve
        when this is the first long prompt (so the answer's TTFT, not its decode rate, pays)."""
        for event in events:  # Prefilled comes first: the per-token steps are passed on untouched
            yield event
            if isinstance(event, Prefilled):
                self._measure_long_context(cancel)
                break
        yield from events

    # -- rounding ------------------------------------------------------------------------------
    def batch_noise(self) -> BatchNoise:
        """How far this model's logits move between one-token and batched evaluation here, which
        decides when a difference from plain decoding is a near-tie (``backends.core.noise``).
        Measured once per model file, thread count and build (about 2 s), then read back.
        Leaves the target's cache empty."""
        if self._noise is None:
            file = measurement_file("noise", self.model.path, self.target.n_threads, self.config.n_gpu_layers,
                                    self.config.flash_attn, NOISE_DEPTH, NOISE_LONG, "chain+tree",
                                    *self.backend.runtime(self))
            try:
                self._noise = BatchNoise(**json.loads(file.read_text()))
            except (OSError, ValueError, TypeError):
                self._noise = measure_batch_noise(self.target, self._noise_prompts(), depth=NOISE_DEPTH)
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_text(json.dumps(asdict(self._noise)))
        return self._noise

    def _noise_prompts(self) -> list[list[int]]:
        """Two short chat prompts and one of about ``NOISE_LONG`` tokens: rounding differences grow
        with the context (attention over more cached tokens)."""
        room = self.target.n_ctx - NOISE_DEPTH - 2
        short = [self.model.chat_prompt([{"role": "user", "content": t}]) for t in NOISE_TEXTS]
        long = self.model.tokenize(" ".join(NOISE_TEXTS) * 40)[: min(NOISE_LONG, room)]
        return [p[:room] for p in short] + [long]

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        for obj in (getattr(self, "draft_target", None), getattr(self, "target", None),
                    getattr(self, "draft_model", None), getattr(self, "model", None)):
            if obj is not None:
                obj.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
