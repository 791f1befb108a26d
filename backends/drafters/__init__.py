"""The method registry: name -> settings dataclass, what the method needs, how to build it.

Front ends list methods, build settings forms from the dataclass fields and grey out methods whose
``requires`` a session does not offer; nothing outside this module branches on a method's name.
Every method that proposes tokens requires ``ROLLBACK``, in its ``MethodSpec.requires`` (so the
method chooser greys it out on a recurrent model, and says why) and in its ``Drafter.requires``
(the session refuses to build one over a target that cannot forget rejected guesses).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Hashable, Sequence, TypeVar

import numpy as np

from backends.core.controller import Bandit, Sizer
from backends.core.costs import CostModel
from backends.core.planner import could_pay
from backends.core.errors import SpecDeckError, UnknownMethodError
from backends.core.protocols import Drafter, Target
from backends.core.settings import Settings, bounded
from backends.core.types import (HIDDEN_STATES, LAYER_SKIP, LAYER_STATES, NATIVE_EAGLE3, NATIVE_MTP, ROLLBACK, TREE,
                                 SamplingSettings)
from backends.drafters.ar import ARDrafter, ARSettings
from backends.drafters.auto import AutoDrafter, MethodSelector
from backends.drafters.draft_model import DraftModelDrafter, DraftSettings
from backends.drafters.eagle import CONTEXT_ROWS, EagleDrafter, EagleSettings, LevelStats
from backends.drafters.lookahead import LookaheadDrafter, LookaheadSettings
from backends.drafters.medusa import MedusaDrafter, MedusaSettings
from backends.drafters.pld import PLDDrafter, PLDSettings
from backends.drafters.rest import RESTDrafter, RESTSettings
from backends.drafters.self_spec import SelfDrafter, SelfSettings, SelfState
from backends.drafters.specinfer import SpecInferDrafter, SpecInferSettings
from backends.heads.eagle import EagleHead
from backends.heads.eagle3 import Eagle3Head
from backends.heads.mtp import MTPModuleHead
from backends.heads.files import HeadFile
from backends.heads.medusa import MedusaHeads
from backends.models.datastore import DATASTORE_FILE, Datastore
from backends.models.gguf_info import VocabInfo

DRAFT_MODEL = "draft_model"  # a requirement: a compatible draft model is loaded
DATASTORE = "datastore"  # a requirement of methods whose settings name a REST datastore
HEAD_PREFIX = "head:"  # "head:medusa": a head of that kind trained for the loaded model is at hand
HEAD_NAMES = {"eagle": "an EAGLE", "eagle3": "an EAGLE-3", "medusa": "a Medusa", "mtp": "an MTP"}  # a kind of head in words


def head_requirement(kind: str) -> str:
    return HEAD_PREFIX + kind

REQUIREMENT_TEXT = {
    DRAFT_MODEL: "a draft model with the target's vocabulary (--draft-model)",
    DATASTORE: "a REST datastore built for this model's tokenizer (`specdeck datastore build`)",
    TREE: "a target that verifies token trees",
    HIDDEN_STATES: "a target that returns hidden states",
    LAYER_STATES: "a model whose llama.cpp graph hands out the inputs of its layers (Llama, Qwen3, Gemma 4, "
                  "gpt-oss and some others; not this one)",
    NATIVE_MTP: "a model file with a next-n (MTP) block of its own, as DeepSeek-V3, GLM-4.5 or MiMo have "
                "(this model has none)",
    NATIVE_EAGLE3: "a backend that runs EAGLE-3 heads in its own engine (llama.cpp, for a model whose graph "
                   "hands out the inputs of its layers)",
    LAYER_SKIP: "a backend that can run a subset of the model's layers (the PyTorch backend: --backend torch)",
    ROLLBACK: "a model whose cache can forget rejected guesses (recurrent and hybrid models such as Mamba, "
              "RWKV, LFM2, Granite-H and Qwen3-Next cannot)",
}


def describe(requirements: frozenset[str]) -> str:
    """Requirements in words, for error messages and greyed-out GUI entries."""
    return "; ".join(_requirement_text(r) for r in sorted(requirements))


def _requirement_text(requirement: str) -> str:
    if requirement.startswith(HEAD_PREFIX):
        kind = requirement[len(HEAD_PREFIX):]
        return f"{HEAD_NAMES.get(kind, f'a {kind}')} head trained for this model (`specdeck train {kind} --model MODEL`)"
    return REQUIREMENT_TEXT.get(requirement, requirement)


@dataclass(frozen=True)
class DrafterResources:
    """What a session hands a drafter: sampling, sizes, measured costs, a draft model."""

    sampling: SamplingSettings
    target_vocab: int
    # Measured lazily, only for methods that draft: the target's verify cost model, and the
    # draft model's own.
    costs: Callable[[], CostModel | None] = lambda: None
    draft: Target | None = None
    draft_costs: Callable[[], CostModel | None] = lambda: None
    # What drafters learned in earlier answers of this session (acceptance statistics), by key.
    memory: dict = field(default_factory=dict)
    vocab: VocabInfo | None = None  # the target's tokenizer (datastores are checked against it)
    stop: Callable[[], bool] | None = None  # Stop pressed: long work of a drafter's own (a draft model's prefill) ends
    # A trained head of a kind ("medusa") for the target, from a file (a settings field) or the one
    # found for the model (""); raises with the reason when none fits.
    head: Callable[[str, str], HeadFile] | None = None
    # What the session offers (capabilities, "head:KIND" for the trained heads at hand).
    offers: frozenset[str] = frozenset()
    # The target's token embeddings (ids [n] -> rows [n, d]), for heads that read tokens (EAGLE).
    embeddings: Callable[[], Callable[[np.ndarray], np.ndarray]] | None = None
    # The model's own draft head, run by the backend (``NATIVE_MTP``: its next-n block); the same
    # interface as a numpy ``EagleHead``.
    native_head: Callable[[], Any] | None = None
    # An EAGLE-3 head (a ``HeadFile``, or the path of an ``eagle3`` GGUF) run by the backend's own
    # engine (``NATIVE_EAGLE3``), with the same interface.
    engine_head: Callable[[HeadFile | str], Any] | None = None
    # The target itself, for a drafter that drafts with part of it (``LAYER_SKIP``: ``skipping``).
    target: Target | None = None
    # Where a drafter keeps what it found out about this model on this machine, for later sessions
    # (a search's result), by name: one file per model file and runtime; None where nowhere.
    kept: Callable[[str], Path | None] = lambda name: None


TASKS = ("chat", "summarize", "code", "rag")  # the kinds of work the recommender ranks methods for


def _no_pool(n_ctx: int) -> int:
    return 0


@dataclass(frozen=True)
class MethodSpec:
    """A method as front ends and the recommender see it.

    ``prior_acceptance`` is the chance that a drafted token is accepted, per task, to assume
    before SpecDeck has measured the method on a model, and ``prior_draft`` the longest draft
    the recommender considers; deliberately on the low side of published figures, since a
    recommendation that promises too much costs the user's trust. ``pool_bytes`` is the method's
    own memory for an n_ctx-token context (n-gram pools and the like); draft models are counted
    separately.
    """

    name: str
    summary: str
    settings_type: type
    build: Callable[[Any, DrafterResources], Drafter]
    requires: frozenset[str] = frozenset()
    lossless: bool = True
    prior_acceptance: Mapping[str, float] = field(default_factory=dict)
    prior_draft: int = 0
    pool_bytes: Callable[[int], int] = _no_pool
    datastore_field: str | None = None  # the setting naming a REST datastore, if the method takes one
    datastore_required: bool = False
    # What a session must offer for these settings; ``requires`` is the answer for the defaults.
    requires_for: Callable[[Any], frozenset[str]] | None = None
    # The methods a merging method runs for these settings: a refusal names the ones that lack something.
    parts: Callable[[Any], Sequence[str]] | None = None
    # Plain decoding: drafts nothing, and every other method's speed and output are measured
    # against it (exactly one method is the baseline).
    baseline: bool = False

    @property
    def head_kind(self) -> str | None:
        """The kind of trained head the method needs ("eagle"), if any."""
        kinds = sorted(r[len(HEAD_PREFIX):] for r in self.requires if r.startswith(HEAD_PREFIX))
        return kinds[0] if kinds else None

    def requirements(self, settings: Any) -> frozenset[str]:
        """What a session must offer for ``settings``; a head given by path needs none found for
        the model (the build loads it and checks it against the model itself)."""
        needs = self.requires if self.requires_for is None else self.requires_for(settings)
        if getattr(settings, "head", ""):
            needs = frozenset(r for r in needs if not r.startswith(HEAD_PREFIX))
        return needs

    def parts_needing(self, settings: Any, missing: frozenset[str]) -> list[str]:
        """The merged methods (``parts``) that need something in ``missing``: "specinfer needs an
        MTP head" leaves a user to guess which of the drafters they listed wants it."""
        names = self.parts(settings) if self.parts is not None else []
        return [n for n in names if method_spec(n).requirements(method_spec(n).settings()) & missing]

    @property
    def needs_datastore(self) -> bool:
        """The method cannot run without a REST datastore."""
        return self.datastore_field is not None and self.datastore_required

    def settings(self, **overrides: Any) -> Any:
        """Settings from keyword overrides; unknown names are a clear error."""
        known = {f.name for f in fields(self.settings_type)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise SpecDeckError(f"{self.name} has no setting {', '.join(unknown)} (it has: {', '.join(sorted(known)) or 'none'})")
        return self.settings_type(**overrides)


D = TypeVar("D", bound=Drafter)


def _learning(res: DrafterResources, key: Hashable, make: Callable[[Sizer | None, Bandit | None], D]) -> D:
    """``make(sizer, gate)``: a drafter given the calibration and gate record that ``key``'s drafter
    learned in the session's earlier answers (None at first: it starts fresh ones), and whose own
    are kept for the next answer."""
    drafter = make(res.memory.get((key, "sizer")), res.memory.get((key, "gate")))
    res.memory[(key, "sizer")], res.memory[(key, "gate")] = drafter.sizer, drafter.gate
    return drafter


def _build_draft(settings: DraftSettings, res: DrafterResources) -> Drafter:
    if res.draft is None:
        raise SpecDeckError("the draft method needs a draft model with the target's vocabulary (--draft-model)")
    return _learning(res, ("draft", settings), lambda sizer, gate: DraftModelDrafter(
        res.draft, settings, sampling=res.sampling, target_vocab=res.target_vocab, costs=res.costs(),
        draft_costs=res.draft_costs(), sizer=sizer, gate=gate, stop=res.stop))


def _build_self(settings: SelfSettings, res: DrafterResources) -> Drafter:
    if res.target is None or LAYER_SKIP not in res.offers:
        raise SpecDeckError("self needs a backend that can leave layers out (--backend torch)")
    state = res.memory.setdefault(("self", settings.skip, settings.probe_tokens), SelfState())
    return SelfDrafter(settings, target=res.target, sampling=res.sampling, target_vocab=res.target_vocab,
                       costs=res.costs(), state=state, stop=res.stop, memory=res.memory, kept=res.kept("self-skip"))


def _build_pld(settings: PLDSettings, res: DrafterResources) -> Drafter:
    return _learning(res, ("pld", settings), lambda sizer, _: PLDDrafter(settings, costs=res.costs(), sizer=sizer))


def open_datastore(path: str, res: DrafterResources) -> Datastore:
    """A datastore checked against the target's tokenizer, opened once per session and file."""
    if not path:
        raise SpecDeckError("rest needs a datastore: build one with `specdeck datastore build --model MODEL "
                            "--source FOLDER --out FILE`, then choose it (--set rest.datastore=FILE)")
    file = Path(path).expanduser()
    key = ("datastore", str(file.resolve()), file.stat().st_mtime_ns if file.exists() else 0)
    store = res.memory.get(key)
    if store is None:
        store = Datastore(file)
        if res.vocab is not None:
            store.check_vocab(res.vocab)
        res.memory[key] = store
    return store


def _build_rest(settings: RESTSettings, res: DrafterResources) -> Drafter:
    store = open_datastore(settings.datastore, res)
    conversation = None
    if settings.conversation:  # its own statistics: how often a chat repeats itself is not pld's business
        conversation = _learning(res, ("rest", settings, "conversation"),
                                 lambda sizer, _: PLDDrafter(costs=res.costs(), sizer=sizer))
    return _learning(res, ("rest", settings), lambda sizer, gate: RESTDrafter(
        store, settings, costs=res.costs(), sizer=sizer, conversation=conversation, gate=gate))


def _build_lookahead(settings: LookaheadSettings, res: DrafterResources) -> Drafter:
    drafter = LookaheadDrafter(settings, costs=res.costs(), bandit=res.memory.get(("lookahead", settings)))
    res.memory[("lookahead", settings)] = drafter.bandit  # what it measured carries over to the next answer
    return drafter


def _build_medusa(settings: MedusaSettings, res: DrafterResources) -> Drafter:
    if res.head is None:
        raise SpecDeckError("medusa needs a target that gives hidden states, and a trained Medusa head")
    head = res.head("medusa", settings.head)
    heads = res.memory.get(("medusa heads", id(head)))
    if heads is None:
        heads = res.memory[("medusa heads", id(head))] = MedusaHeads(head)
    return _learning(res, ("medusa", settings),
                     lambda sizer, gate: MedusaDrafter(heads, settings, costs=res.costs(), sizer=sizer, gate=gate))


def _eagle_builder(kind: str, make_head: Callable[[HeadFile, Callable], Any]) -> Callable[[EagleSettings, DrafterResources], Drafter]:
    """The builder of a method drafting EAGLE-2 trees from a trained head of ``kind``."""

    def build(settings: EagleSettings, res: DrafterResources) -> Drafter:
        if res.head is None or res.embeddings is None:
            raise SpecDeckError(f"a {kind} head needs a target that gives hidden states and token embeddings")
        head = res.head(kind, settings.head)
        layer = res.memory.get((kind, "head", id(head)))
        if layer is None:
            layer = res.memory[(kind, "head", id(head))] = make_head(head, res.embeddings())
        levels = res.memory.setdefault(((kind, settings), "levels"), LevelStats())
        return _learning(res, (kind, settings), lambda sizer, gate: EagleDrafter(
            layer, settings, costs=res.costs(), sizer=sizer, gate=gate, levels=levels))

    return build


def _specinfer_requires(settings: SpecInferSettings) -> frozenset[str]:
    return frozenset({TREE}).union(*(method_spec(n).requires for n in settings.names))


def _build_specinfer(settings: SpecInferSettings, res: DrafterResources) -> Drafter:
    """The sub-drafters, less a draft model that cannot pay on this machine (``could_pay_here``)
    when others are there to draft: its own sizer would never let it draft, and only its
    prompt prefill and bookkeeping would remain (on 2 CPU cores that prefill costs 0.8 of the
    target's, nearly doubling the wait for the first token). ``adaptive=False`` keeps it."""
    names = settings.names
    playing = ""
    free = [n for n in names if DRAFT_MODEL not in method_spec(n).requires]
    if settings.adaptive and free and len(free) < len(names) and res.draft is not None and not could_pay_here("draft", res):
        names = free
        playing = ",".join(names) + " (the draft model cannot pay here)"
    subs = []
    for name in names:
        spec = method_spec(name)
        overrides: dict[str, Any] = {spec.datastore_field: settings.rest_datastore} if spec.datastore_field else {}
        own = {f.name for f in fields(spec.settings_type)}
        if not settings.adaptive and "adaptive" in own:
            overrides["adaptive"] = False
        if "pld" in names and "conversation" in own:  # pld already searches the conversation
            overrides["conversation"] = False
        subs.append(spec.build(spec.settings(**overrides), res))
    return SpecInferDrafter(subs, costs=res.costs(), playing=playing, cascade=settings.cascade)


@dataclass(frozen=True)
class AutoSettings:
    datastore: str = field(default="", metadata=DATASTORE_FILE)  # a REST datastore to draft from as well (optional)


def could_pay_here(name: str, res: DrafterResources) -> bool:
    """Whether method ``name``'s costly drafter (a draft model, a trained head) could beat plain
    decoding on this machine in the best case (``planner.could_pay``), at the shortest measured
    context, where verifying is cheapest: a draft model if the target accepted every guess, with
    a draft forward's measured cost per token; a head at its recorded held-out agreement, with its
    own time per depth (timed once). On 2 CPU cores a Q4_1 SmolLM2 forward costs 0.78 of an F16
    one, and the draft's best k would run at 1.01x, short of the 5% margin; on a GPU the same pair
    pays. Whatever fails here would only cost the answers it is tried on (and its prompt prefill,
    for a draft model), so ``auto`` leaves it out and ``specinfer`` drafts without it.

    Decided once per method and cost models, from their first figures: near the margin, the
    corrections learned while generating would flip it from answer to answer, and every flip
    would give ``auto`` other arms and make it start learning over. Nothing measured yet (no cost
    model): True, and the gates find out by playing it.
    """
    spec = method_spec(name)
    costs = res.costs()
    needs_draft = DRAFT_MODEL in spec.requires
    if not (res.draft is not None if needs_draft else spec.requires <= res.offers):
        return False
    draft_costs = res.draft_costs() if needs_draft else None
    if costs is None or (needs_draft and draft_costs is None):
        return True
    key = ("could pay", name, costs, draft_costs)  # the models themselves: a re-measured pair decides again
    if key not in res.memory:
        context = costs.contexts[0]
        one = costs.seconds(0, context)
        if needs_draft:
            per_token = draft_costs.seconds(0, context) / one
            chances, drafting = [1.0] * DraftSettings().max_draft, lambda n: n * per_token
        else:
            agreement = [float(a) for a in res.head(spec.head_kind, "").training.get("agreement", [])]
            chances = np.cumprod(agreement).tolist()  # agreement per depth is conditional
            drafting = spec.build(spec.settings(adaptive=False), res).head_forwards(one)
        res.memory[key] = could_pay(chances, costs.relative(context), drafting)
    return res.memory[key]


@dataclass(frozen=True)
class ChainHeadSettings(Settings):
    """A head the backend runs (llama.cpp keeps one chain per sequence): the EAGLE-2 drafter
    expands one node per depth, each offering ``top_k`` children."""

    top_k: int = bounded(4, 1, 16)  # children each drafted node offers (siblings are verified too)
    depth: int = bounded(4, 1, 16)  # deepest draft level: every level is one forward of the MTP block
    max_nodes: int = bounded(16, 1, 64)  # most tree nodes verified in one step
    context_rows: int = bounded(CONTEXT_ROWS, 1, 1 << 20)  # prompt rows the block reads at the start of an answer
    min_chance: float = bounded(0.05, 0.0, 1.0)  # draft no deeper once the best path's chance falls below this
    adaptive: bool = True  # False: always verify max_nodes nodes, run the block every step

    def eagle(self) -> EagleSettings:
        """The EAGLE-2 drafter's settings for it: one node expanded per depth."""
        return EagleSettings(top_k=self.top_k, expand=1, depth=self.depth, max_nodes=self.max_nodes,
                             context_rows=self.context_rows, min_chance=self.min_chance, adaptive=self.adaptive)


MTPSettings = ChainHeadSettings  # the model's own next-n block


@dataclass(frozen=True)
class EngineEagle3Settings(ChainHeadSettings):
    # a head from `specdeck train eagle3` (.json) or an EAGLE-3 GGUF of llama.cpp's eagle3
    # architecture published for the model (.gguf); empty: the EAGLE-3 head found for the model
    head: str = ""


def _chain_drafter(key: str, head: Any, settings: ChainHeadSettings, res: DrafterResources) -> Drafter:
    """The EAGLE-2 drafter over a head the backend runs; what it learned is kept under ``key``."""
    levels = res.memory.setdefault(((key, settings), "levels"), LevelStats())
    return _learning(res, (key, settings), lambda sizer, gate: EagleDrafter(
        head, settings.eagle(), costs=res.costs(), sizer=sizer, gate=gate, levels=levels))


def _build_mtp(settings: MTPSettings, res: DrafterResources) -> Drafter:
    if res.native_head is None:
        raise SpecDeckError(f"mtp needs {REQUIREMENT_TEXT[NATIVE_MTP]}")
    return _chain_drafter("mtp", res.native_head(), settings, res)


def _build_engine_eagle3(settings: EngineEagle3Settings, res: DrafterResources) -> Drafter:
    if res.engine_head is None:
        raise SpecDeckError(f"eagle3-native needs {REQUIREMENT_TEXT[NATIVE_EAGLE3]}")
    published = settings.head.endswith(".gguf")
    if not published and res.head is None:
        raise SpecDeckError("eagle3-native needs a target that gives hidden states, and a trained EAGLE-3 head")
    head = res.engine_head(settings.head if published else res.head("eagle3", settings.head))
    return _chain_drafter("eagle3-native", head, settings, res)


HEAD_ARMS = ("eagle3-native", "eagle3", "eagle2", "mtp-trained", "medusa")  # auto's arms that need a trained head, best first


def head_arm(text: str, head: str) -> str:
    """The name of ``auto``'s arm that drafts with ``head`` where the lookup ``text`` found nothing."""
    return f"{text} then {head}"


def _build_auto(settings: AutoSettings, res: DrafterResources) -> Drafter:
    """Arms: prompt lookup, or with a datastore ``rest`` (the conversation as prompt lookup
    searches it, then the datastore where it pays); and when the measured costs leave a draft
    model a chance, everything merged.

    ``rest`` takes prompt lookup's place rather than joining it as a second arm: it drafts from the
    conversation exactly as prompt lookup does and consults the datastore only where its gate
    measured that the datastore pays, so it is never much slower than prompt lookup. Two arms that
    close would cost answers to tell apart, and from 10% scatter between answers they cannot be:
    with both, ``auto`` played REST for 80 of 141 answers on SmolLM2 F16, where REST (ungated then)
    ran 1.6% slower. A merged tree of prompt lookup and the datastore paid 7% less than prompt
    lookup. A draft model that cannot pay is left out: playing it only costs answers, and its
    prefill doubles the wait for the first token.
    A method with a trained head for the model (``HEAD_ARMS``) joins when ``could_pay_here`` says
    it could beat plain decoding here; otherwise trying it would only cost answers, and the
    prompt's hidden states it reads make every answer's prefill compute logits for every row
    (1.28x the time to first token on SmolLM2 F16), whichever arm then played. It joins behind
    the lookup (``text then head``: ``specinfer``'s ``cascade``), drafting only where the lookup
    found nothing: SmolLM2 F16, 2 CPU cores, mt_bench, qa and math_reasoning, 5 prompts each, the
    EAGLE-3 head alone 1.15x, behind prompt lookup 1.25x, prompt lookup alone 1.22x.
    """
    text = "rest" if settings.datastore else "pld"
    if settings.datastore:
        arms = {text: _build_rest(RESTSettings(datastore=settings.datastore), res)}
    else:
        arms = {text: _build_pld(PLDSettings(), res)}
    if could_pay_here("draft", res):
        merged = SpecInferSettings(drafters=",".join(["pld", "draft"] + (["rest"] if settings.datastore else [])),
                                   rest_datastore=settings.datastore)
        arms["specinfer:" + merged.drafters] = _build_specinfer(merged, res)
    for name in HEAD_ARMS:
        if could_pay_here(name, res):
            behind = SpecInferSettings(drafters=f"{text},{name}", rest_datastore=settings.datastore, cascade=True)
            arms[head_arm(text, name)] = _build_specinfer(behind, res)
    selector = res.memory.setdefault(("auto", settings, tuple(arms)), MethodSelector(list(arms)))
    return AutoDrafter(arms, costs=res.costs() or CostModel.from_relative([1.0] * 17), selector=selector)


REGISTRY: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("ar", "plain decoding, one token per forward: the baseline", ARSettings, lambda s, r: ARDrafter(s),
                   baseline=True),
        MethodSpec(
            "auto",
            "per prompt, whichever has been fastest here on such prompts: prompt lookup (with a datastore: "
            "rest), a draft model that can pay here merged with it into one tree, a trained head that can pay "
            "here drafting where the lookup has no guess, or plain decoding",
            AutoSettings,
            _build_auto,
            requires=frozenset({ROLLBACK}),
            prior_acceptance=MappingProxyType({"chat": 0.3, "summarize": 0.6, "code": 0.6, "rag": 0.55}),
            prior_draft=8,
            pool_bytes=PLDDrafter.pool_bytes,
            datastore_field="datastore",
        ),
        MethodSpec(
            "pld",
            "prompt lookup: no extra memory, best when the answer repeats the prompt (summaries, code edits, RAG)",
            PLDSettings,
            _build_pld,
            requires=frozenset({ROLLBACK}),
            prior_acceptance=MappingProxyType({"chat": 0.3, "summarize": 0.6, "code": 0.6, "rag": 0.55}),
            prior_draft=8,
            pool_bytes=PLDDrafter.pool_bytes,
        ),
        MethodSpec(
            "draft",
            "a small draft model with the same vocabulary guesses ahead; the target checks its guesses",
            DraftSettings,
            _build_draft,
            requires=frozenset({DRAFT_MODEL, ROLLBACK}),
            prior_acceptance=MappingProxyType({"chat": 0.6, "summarize": 0.65, "code": 0.7, "rag": 0.65}),
            prior_draft=8,
        ),
        MethodSpec(
            "self",
            "self-speculative: the model drafts for itself with some of its layers left out (searched on this "
            "machine), then checks with all of them; no second model",
            SelfSettings,
            _build_self,
            requires=frozenset({LAYER_SKIP, ROLLBACK}),
            prior_acceptance=MappingProxyType({"chat": 0.5, "summarize": 0.55, "code": 0.55, "rag": 0.55}),
            prior_draft=4,
        ),
        MethodSpec(
            "rest",
            "retrieval: drafts what followed the same words in the conversation or in a datastore of your "
            "own texts (code, docs, chats)",
            RESTSettings,
            _build_rest,
            requires=frozenset({TREE, ROLLBACK}),
            prior_acceptance=MappingProxyType({"chat": 0.25, "summarize": 0.25, "code": 0.4, "rag": 0.3}),
            prior_draft=4,
            datastore_field="datastore",
            datastore_required=True,
        ),
        MethodSpec(
            "lookahead",
            "Jacobi iteration plus an n-gram pool: no draft model, no extra memory to speak of; "
            "pays where verifying many tokens at once is cheap (GPUs)",
            LookaheadSettings,
            _build_lookahead,
            requires=frozenset({TREE, ROLLBACK}),
            prior_acceptance=MappingProxyType({"chat": 0.3, "summarize": 0.45, "code": 0.45, "rag": 0.4}),
            prior_draft=6,
            pool_bytes=PLDDrafter.pool_bytes,
        ),
        MethodSpec(
            "medusa",
            "Medusa heads trained for this model on its own answers read its last hidden state and guess "
            "the next tokens (`specdeck train medusa`)",
            MedusaSettings,
            _build_medusa,
            requires=frozenset({HIDDEN_STATES, TREE, ROLLBACK, head_requirement("medusa")}),
            requires_for=lambda s: frozenset({HIDDEN_STATES, ROLLBACK, head_requirement("medusa")}
                                             | ({TREE} if s.width > 1 else set())),
            # SmolLM2-135M's shipped head: 21% held-out top-1 agreement for the first guess, 10% the second
            prior_acceptance=MappingProxyType({"chat": 0.2, "summarize": 0.2, "code": 0.2, "rag": 0.2}),
            prior_draft=2,
        ),
        MethodSpec(
            "eagle2",
            "an EAGLE head trained for this model on its own answers runs it ahead in its hidden states "
            "and drafts a dynamic tree (EAGLE-2; `specdeck train eagle`)",
            EagleSettings,
            _eagle_builder("eagle", EagleHead),
            requires=frozenset({HIDDEN_STATES, TREE, ROLLBACK, head_requirement("eagle")}),
            prior_acceptance=MappingProxyType({"chat": 0.3, "summarize": 0.3, "code": 0.3, "rag": 0.3}),
            prior_draft=3,
        ),
        MethodSpec(
            "eagle3",
            "an EAGLE-3 head trained for this model on its own answers fuses a low, a middle and a high layer "
            "of it and drafts a dynamic tree (`specdeck train eagle3`)",
            EagleSettings,
            _eagle_builder("eagle3", Eagle3Head),
            requires=frozenset({HIDDEN_STATES, LAYER_STATES, TREE, ROLLBACK, head_requirement("eagle3")}),
            prior_acceptance=MappingProxyType({"chat": 0.3, "summarize": 0.3, "code": 0.3, "rag": 0.3}),
            prior_draft=3,
        ),
        MethodSpec(
            "eagle3-native",
            "the same EAGLE-3 head run by the backend's own engine (llama.cpp's eagle3 architecture: its "
            "kernels, and the GPU where the model is), drafting a chain with the likeliest siblings; also "
            "runs EAGLE-3 GGUFs published for the model",
            EngineEagle3Settings,
            _build_engine_eagle3,
            requires=frozenset({HIDDEN_STATES, LAYER_STATES, TREE, ROLLBACK, NATIVE_EAGLE3, head_requirement("eagle3")}),
            prior_acceptance=MappingProxyType({"chat": 0.3, "summarize": 0.3, "code": 0.3, "rag": 0.3}),
            prior_draft=3,
        ),
        MethodSpec(
            "mtp-trained",
            "a multi-token-prediction module shaped as DeepSeek-V3's, trained for this model on its own "
            "answers (for models without a next-n block of their own; `specdeck train mtp`), drafting a "
            "dynamic tree",
            EagleSettings,
            _eagle_builder("mtp", MTPModuleHead),
            requires=frozenset({HIDDEN_STATES, TREE, ROLLBACK, head_requirement("mtp")}),
            prior_acceptance=MappingProxyType({"chat": 0.3, "summarize": 0.3, "code": 0.3, "rag": 0.3}),
            prior_draft=3,
        ),
        MethodSpec(
            "mtp",
            "the model's own multi-token-prediction (next-n) block, run by llama.cpp, guesses the next "
            "tokens from its hidden state (DeepSeek-V3, GLM-4.5, MiMo and other files that ship one)",
            MTPSettings,
            _build_mtp,
            requires=frozenset({HIDDEN_STATES, TREE, ROLLBACK, NATIVE_MTP}),
            # DeepSeek-V3 reports 85-90% acceptance of its MTP token; on the low side here
            prior_acceptance=MappingProxyType({"chat": 0.6, "summarize": 0.6, "code": 0.6, "rag": 0.6}),
            prior_draft=2,
        ),
        MethodSpec(
            "specinfer",
            "several drafters at once (by default a draft model and prompt lookup), merged into one token tree",
            SpecInferSettings,
            _build_specinfer,
            requires=frozenset({TREE, DRAFT_MODEL, ROLLBACK}),
            requires_for=_specinfer_requires,
            parts=lambda settings: settings.names,
            prior_acceptance=MappingProxyType({"chat": 0.6, "summarize": 0.7, "code": 0.7, "rag": 0.7}),
            prior_draft=8,
            pool_bytes=PLDDrafter.pool_bytes,
            datastore_field="rest_datastore",
        ),
    )
}


FIRST_COMPARED = ("ar", "pld")  # the comparison panel's methods until the user picks others
FIRST_SHOWN = "pld"  # the method chooser's choice before the advice for a model arrives


def baseline_method() -> str:
    """The name of plain decoding, the reference of every comparison."""
    return next(name for name, spec in REGISTRY.items() if spec.baseline)


def is_baseline(name: str) -> bool:
    """Whether ``name`` is plain decoding (a name outside the registry, a bench peer, is not)."""
    spec = REGISTRY.get(name)
    return spec is not None and spec.baseline


def method_spec(name: str) -> MethodSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(f"unknown method '{name}' (known: {', '.join(REGISTRY)})") from None
