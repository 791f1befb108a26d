"""``specinfer``: several drafters at once, merged into one token tree, verified in one forward.

SpecInfer (Miao et al.) verifies the guesses of several small speculators together: where they
agree the tree shares nodes, where they differ it branches, and the target keeps the longest path
it agrees with. Any drafters work; the useful pairs are complementary, e.g. a draft model (good
on free text) with prompt lookup (free, and right when the answer quotes). A draft model that
cannot pay on this machine even if every guess held is left out by the registry (see
``backends.drafters.could_pay_here``); with one drafter left, specinfer runs it as if alone.

Merging (``backends.drafters.merge``): each sub-drafter proposes as if it were alone (its own
controller picks its length); the proposals become one trie, which is then cut to the nodes worth
verifying together (see ``SpecInferDrafter``).

Feedback. Each sub-drafter sees the verdict projected onto its own proposal: the part of the
accepted path that runs through its nodes, and the tokens the step emitted (a draft model's cache
must follow the text, whoever guessed it). So each one's gate and controller learn what its own
nodes won, as if it had drafted alone, and a costly drafter that does not pay stops drafting by
the same measurement that would stop it alone. The verify time is folded into the shared cost
model once, with the merged tree's size, not once per sub-drafter.

Example: pld proposes ``the cat sat``, draft proposes ``the dog``: the tree is
``the -> (cat -> sat, dog)``; if the target says ``the dog ran``, pld's projection accepts 1 of 3
and draft's 2 of 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from backends.core.costs import CostModel
from backends.core.planner import plan_nodes
from backends.core.protocols import Drafter, prompt_states_of
from backends.core.types import EMPTY_PROPOSAL, TREE, Budget, Proposal, TargetOutput, Verdict
from backends.drafters.merge import merge, project, select
from backends.models.datastore import DATASTORE_FILE

_MAX_DRAFTERS = 4


@dataclass(frozen=True)
class SpecInferSettings:
    drafters: str = "draft,pld"  # comma-separated methods whose proposals are merged
    rest_datastore: str = field(default="", metadata=DATASTORE_FILE)  # the datastore when the drafters include rest
    adaptive: bool = True  # passed on: False makes every drafter propose its full length

    def __post_init__(self) -> None:
        names = self.names
        if not 1 <= len(names) <= _MAX_DRAFTERS:
            raise ValueError(f"specinfer merges 1..{_MAX_DRAFTERS} drafters, got {len(names)} ({self.drafters!r})")
        if len(set(names)) != len(names):
            raise ValueError(f"specinfer drafters repeat a method: {self.drafters!r}")
        if any(n in ("specinfer", "ar") for n in names):
            raise ValueError("specinfer merges drafting methods (not ar or specinfer itself)")

    @property
    def names(self) -> list[str]:
        return [n.strip() for n in self.drafters.split(",") if n.strip()]


class SpecInferDrafter(Drafter):
    """Merges the sub-drafters' proposals, then keeps the nodes worth verifying together.

    Each sub-drafter sized its proposal as if verified alone; together they cost more. So the
    merged tree, with each node's chance (see ``merge``), goes through the planner
    (``backends.core.planner``): the count of likeliest nodes that maximizes expected tokens per
    unit of measured verify cost, which is never worse than the better sub-proposal alone by the
    drafters' own estimates. There is no calibration here: each chance comes from a drafter that
    calibrates itself, also from the steps where it was not verified. When only
    one drafter proposed, its proposal goes to the target as it is: it was sized for exactly that,
    by the drafter's own controller, so specinfer then decodes as that drafter alone would.
    """

    def __init__(self, drafters: Sequence[Drafter], *, costs: CostModel | None = None, playing: str = "") -> None:
        """``playing``: which drafters run, when the registry left one out (shown in stats)."""
        self.playing = playing
        self.drafters = list(drafters)
        self.requires = frozenset({TREE}).union(*(d.requires for d in self.drafters))
        self.prompt_states = prompt_states_of(self.drafters)
        self.costs = costs or CostModel.from_relative([1.0] * 65)
        self._last: list[Proposal] = []
        self._maps: tuple[tuple[int, ...], ...] = ()
        self._context_len = 0

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        for d in self.drafters:
            d.begin(prompt, hidden)

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        if len(self.drafters) == 1:  # nothing to merge: it drafts, and learns, as if alone
            return self.drafters[0].propose(context, budget)
        self._context_len = len(context)
        self._last = [drafter.propose(context, budget).pruned(budget) for drafter in self.drafters]
        live = [prop for prop in self._last if prop.size]
        if len(live) <= 1:  # nobody drafts (the common case on a CPU), or one proposal, sized by its
            # drafter for being verified alone: nothing to merge or re-size
            self._maps = tuple(tuple(range(prop.size)) for prop in self._last)
            return live[0] if live else EMPTY_PROPOSAL
        tree = merge(self._last)
        chosen = select(tree, plan_nodes(tree.proposal, self.costs.relative(len(context)), budget))
        self._maps = chosen.maps
        return chosen.proposal

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        if len(self.drafters) == 1:
            self.drafters[0].observe(out, verdict)  # it times the verify itself
            return
        self.costs.observe(verdict.drafted, self._context_len, out.seconds)
        quiet = replace(out, seconds=0.0)  # timed once above, with the merged size
        for drafter, prop, mapping in zip(self.drafters, self._last, self._maps):
            drafter.observe(quiet, project(verdict, prop, mapping))
