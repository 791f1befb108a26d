"""``self``: self-speculative decoding. The target drafts for itself with some of its layers left
out, then verifies with all of them: lossless, and no second model to download or hold.

Which layers to skip is searched on the user's machine, for the loaded model (as SWIFT does, but
cheaper): teacher-forced over a text (the prompt at first, later the answers already generated),
the full model's top token at every position is the reference. Leaving out one layer at a time
ranks the layers by the harm each does alone (``n_layer - 2`` partial forwards of the text; the
first and last layers always stay); then the k least harmful are left out together for k = 2,
4, ... and the agreement with the reference is measured for each. The set kept is the one whose
predicted speed is highest: ``E[tokens per step] / (draft forwards x their cost + verify cost)``,
with the draft's cost ``1 - layer_share x k / n_layer`` of a target forward and the verify cost
from the session's measured cost curve. SmolLM2-135M: 28 + 14 partial forwards of 64 tokens.

The plan is kept in the session (one per model) and in a file per model file and runtime (the
factory's ``kept``), so a later session starts from it instead of searching again; it is searched
again over the latest answers when the acceptance drafting achieves falls well below the
agreement the search measured. Drafting
itself is the ``draft`` method's (``DraftModelDrafter``) over the layer-skipping view of the
target (``Target.skipping``): its own KV cache, the target's weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from backends.core.costs import CostModel
from backends.core.protocols import Drafter, Target
from backends.core.settings import Settings, bounded
from backends.core.types import EMPTY_PROPOSAL, LAYER_SKIP, ROLLBACK, Budget, Proposal, SamplingSettings, TargetOutput, Verdict
from backends.drafters.draft_model import DraftModelDrafter, DraftSettings
from backends.models.paths import write_atomic

MIN_PROBE = 8  # tokens of text below which no search is made (nothing to score on)
RECENT = 256  # generated tokens remembered for the next search
STOP_AGREEMENT = 0.2  # leaving out more layers only lowers agreement: the search stops below this


@dataclass(frozen=True)
class SelfSettings(Settings):
    max_draft: int = bounded(8, 1, 32)  # longest chain drafted in one step
    min_confidence: float = bounded(0.5, 0.0, 1.0, high_open=True)  # stop drafting when the partial model's top probability is lower
    adaptive: bool = True  # let the sizer pick the length (False: always up to max_draft)
    skip: str = ""  # layers to leave out, e.g. "3,5,8"; empty: searched on this machine
    probe_tokens: int = bounded(64, 16, 256)  # tokens of text the search scores each candidate on
    recheck: float = bounded(0.6, 0.0, 1.0, low_open=True)  # search again when acceptance falls below this fraction of the searched agreement

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            self.layers
        except ValueError:
            raise ValueError(f"skip must list layer numbers separated by commas, got {self.skip!r}") from None

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({int(x) for x in self.skip.split(",") if x.strip()}))


@dataclass(frozen=True)
class SkipPlan:
    """Layers to leave out, how often the partial model's top token was the full model's on the
    probe text, and the speed relative to plain decoding that predicts."""

    skip: tuple[int, ...]
    agreement: float
    speed: float

    def save(self, path: Path | None) -> None:
        if path is not None:
            try:
                write_atomic(path, json.dumps(asdict(self)))
            except OSError:
                pass  # an unwritable cache only means searching again next session

    @classmethod
    def load(cls, path: Path | None, n_layer: int) -> SkipPlan | None:
        """A plan kept by an earlier session, None where there is none (or none that fits)."""
        try:
            data = json.loads(path.read_text()) if path is not None else None
            plan = cls(tuple(int(i) for i in data["skip"]), float(data["agreement"]), float(data["speed"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return plan if all(0 < i < n_layer - 1 for i in plan.skip) else None


@dataclass
class SelfState:
    """What the method keeps in the session: the plan, the views made for it, how drafting went."""

    plan: SkipPlan | None = None
    views: dict[tuple[int, ...], Target] = field(default_factory=dict)
    drafted: int = 0
    accepted: int = 0
    recent: list[int] = field(default_factory=list)
    searches: int = 0


def top_tokens(view: Target, text: Sequence[int]) -> np.ndarray:
    """The view's top token after each prefix of ``text`` (teacher-forced, one forward), [len - 1]."""
    view.reset()
    out = view.verify(text[0], Proposal.chain(text[1:-1]))
    tops = out.argmax()
    view.reset()
    return tops


def predicted_speed(agreement: float, draft_cost: float, verify: Sequence[float], max_draft: int) -> float:
    """Best over chain lengths g of E[tokens per step] / (g x draft_cost + verify[g]), where each
    drafted token is accepted with probability ``agreement`` given its predecessors were."""
    best = 1.0
    for g in range(1, min(max_draft, len(verify) - 1) + 1):
        expected = g + 1.0 if agreement >= 1.0 else (1.0 - agreement ** (g + 1)) / (1.0 - agreement)
        best = max(best, expected / (g * draft_cost + verify[g]))
    return best


def search_skip(make: Callable[[tuple[int, ...]], Target], text: Sequence[int], *, n_layer: int,
                draft_cost: Callable[[int], float], verify: Sequence[float], max_draft: int,
                stop: Callable[[], bool] | None = None) -> SkipPlan:
    """The skip set with the highest predicted speed (see the module docstring); ``draft_cost(k)``:
    a forward without k layers relative to a full one."""
    reference = top_tokens(make(()), text)

    def agreement(skip: tuple[int, ...]) -> float:
        return float(np.mean(top_tokens(make(skip), text) == reference))

    harm: dict[int, float] = {}
    for layer in range(1, n_layer - 1):
        if stop is not None and stop():
            break
        harm[layer] = 1.0 - agreement((layer,))
    order = sorted(harm, key=lambda il: (harm[il], il))
    best = SkipPlan((), 1.0, 1.0)
    for k in range(2, len(order) + 1, 2):
        if stop is not None and stop():
            break
        skip = tuple(sorted(order[:k]))
        a = agreement(skip)
        speed = predicted_speed(a, draft_cost(k), verify, max_draft)
        if speed > best.speed:
            best = SkipPlan(skip, a, speed)
        if a < STOP_AGREEMENT:
            break
    return best


class SelfDrafter(Drafter):
    """Drafts with the target's own layers minus a searched skip set (see the module docstring)."""

    requires = frozenset({LAYER_SKIP, ROLLBACK})

    def __init__(self, settings: SelfSettings, *, target: Target, sampling: SamplingSettings, target_vocab: int,
                 costs: CostModel | None, state: SelfState, stop: Callable[[], bool] | None = None,
                 memory: dict | None = None, kept: Path | None = None) -> None:
        self.settings = settings
        self.target = target
        self.sampling = sampling
        self.target_vocab = target_vocab
        self.costs = costs
        self.state = state
        self._stop = stop
        self._memory = memory if memory is not None else {}
        self._kept = kept
        self.inner: DraftModelDrafter | None = None

    # -- planning ------------------------------------------------------------------------------
    def _plan(self, prompt: Sequence[int]) -> SkipPlan | None:
        s, state = self.settings, self.state
        if s.layers:
            return SkipPlan(s.layers, float("nan"), float("nan"))
        if state.plan is None and state.searches == 0:
            state.plan = SkipPlan.load(self._kept, self.target.n_layer)  # found in an earlier session
        stale = (state.plan is not None and state.drafted >= 64
                 and state.accepted / state.drafted < s.recheck * state.plan.agreement)
        if state.plan is not None and not stale:
            return state.plan
        text = (state.recent if len(state.recent) >= s.probe_tokens else list(prompt))[-s.probe_tokens:]
        if len(text) < MIN_PROBE:
            return state.plan
        n_layer = self.target.n_layer
        verify = self.costs.relative(len(prompt)) if self.costs is not None else [1.0 + 0.1 * g for g in range(s.max_draft + 1)]

        def make(skip: tuple[int, ...]) -> Target:
            return self.target.skipping(skip, n_ctx=len(text) + 1)

        share = self.target.layer_share
        state.plan = search_skip(make, text, n_layer=n_layer, draft_cost=lambda k: 1.0 - share * k / n_layer,
                                 verify=verify, max_draft=s.max_draft, stop=self._stop)
        state.searches += 1
        state.drafted = state.accepted = 0
        if self._stop is None or not self._stop():  # a search cut short by Stop is not kept
            state.plan.save(self._kept)
        return state.plan

    def _view(self, skip: tuple[int, ...]) -> Target:
        if skip not in self.state.views:
            self.state.views = {skip: self.target.skipping(skip)}  # one at a time: each holds a cache
        return self.state.views[skip]

    def _draft_costs(self, skip: tuple[int, ...]) -> CostModel | None:
        """The target's measured curves times the share of its weights the draft still reads."""
        if self.costs is None:
            return None
        scale = 1.0 - self.target.layer_share * len(skip) / self.target.n_layer
        return CostModel({c: [scale * x for x in curve] for c, curve in self.costs.curves.items()})

    # -- the drafter protocol ------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        self.declined = ""
        plan = self._plan(prompt)
        if plan is None or not plan.skip:
            self.inner = None
            self.playing = ""
            self.declined = ("no set of layers to leave out pays here (the search predicted no speedup)" if plan
                             else "too little text yet to search which layers to leave out")
            return
        s = self.settings
        key = ("self", s, plan.skip)
        self.inner = DraftModelDrafter(
            self._view(plan.skip), DraftSettings(max_draft=s.max_draft, min_confidence=s.min_confidence,
                                                 adaptive=s.adaptive),
            sampling=self.sampling, target_vocab=self.target_vocab, costs=self.costs,
            draft_costs=self._draft_costs(plan.skip), sizer=self._memory.get(key), stop=self._stop)
        self._memory[key] = self.inner.sizer
        self.playing = f"self (without {len(plan.skip)} of {self.target.n_layer} layers)"
        self.inner.begin(prompt)

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        if self.inner is None:
            return EMPTY_PROPOSAL
        proposal = self.inner.propose(context, budget)
        if self.inner.declined:
            self.declined = self.inner.declined
        return proposal

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        state = self.state
        state.drafted += verdict.drafted
        state.accepted += verdict.accepted
        state.recent = (state.recent + list(verdict.tokens))[-RECENT:]
        if self.inner is not None:
            self.inner.observe(out, verdict)
