"""``specinfer``: several drafters at once, merged into one token tree, verified in one forward.

SpecInfer (Miao et al.): where complementary drafters (a draft model, prompt lookup) agree the
tree shares nodes, where they differ it branches. Each proposes as if alone, the proposals become
one trie (``backends.drafters.merge``) that the planner cuts, and each then sees the verdict
projected onto its own proposal, so it learns what its own nodes won (and a draft model's cache
follows the text). Example: pld ``the cat sat``, draft ``the dog``: the tree is ``the -> (cat ->
sat, dog)``; if the target says ``the dog ran``, pld's projection accepts 1 of 3, draft's 2 of 2.

``cascade``: instead of merging, the first drafter in the listed order that has a guess drafts
the step alone, and those after it are not run (they are asked with an empty budget, so they
keep their place in the text and the rows of the states they read). A lookup that costs
microseconds first, a head whose every step costs a forward after it: the head runs only where
the lookup found nothing, instead of every step beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from backends.core.costs import CostModel
from backends.core.planner import plan_nodes
from backends.core.protocols import Drafter, pick_states, states_of
from backends.core.types import EMPTY_PROPOSAL, HIDDEN_STATES, TREE, Budget, Proposal, TargetOutput, Verdict
from backends.drafters.merge import merge, project, select
from backends.models.datastore import DATASTORE_FILE

_MAX_DRAFTERS = 4


@dataclass(frozen=True)
class SpecInferSettings:
    drafters: str = "draft,pld"  # comma-separated methods whose proposals are merged
    rest_datastore: str = field(default="", metadata=DATASTORE_FILE)  # the datastore when the drafters include rest
    adaptive: bool = True  # passed on: False makes every drafter propose its full length
    cascade: bool = False  # True: the first drafter in order with a guess drafts the step alone, the rest wait

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
    """Merges the sub-drafters' proposals; the merged tree costs more than each sized itself for, so
    it goes through the planner, each node with the best chance a drafter gave it. A lone proposal
    goes as it is (sized for exactly that). ``costs`` is the one its drafters observe too."""

    def __init__(self, drafters: Sequence[Drafter], *, costs: CostModel | None = None, playing: str = "",
                 cascade: bool = False) -> None:
        """``playing``: which drafters run, when the registry left one out (shown in stats);
        ``cascade``: see the module docstring."""
        self.playing, self.cascade = playing, cascade
        self.drafters = list(drafters)
        self.requires = frozenset({TREE}).union(*(d.requires for d in self.drafters))
        self.prompt_states, self.state_layers, self._blocks = states_of(self.drafters)
        self.costs = costs or CostModel.from_relative([1.0] * 65)
        self._last: list[Proposal] = []
        self._maps: tuple[tuple[int, ...], ...] = ()
        self._context_len = 0

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        for d, blocks in zip(self.drafters, self._blocks):
            d.begin(prompt, pick_states(hidden, blocks, len(self.state_layers)))

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        self._context_len = len(context)
        if self.cascade:
            self._last = self._first_with_a_guess(context, budget)
        else:
            self._last = [drafter.propose(context, budget).pruned(budget) for drafter in self.drafters]
        live = [prop for prop in self._last if prop.size]
        if len(live) <= 1:  # nobody drafts (the common case on a CPU), or one proposal, sized by its
            # drafter for being verified alone: nothing to merge or re-size
            self._maps = tuple(tuple(range(prop.size)) for prop in self._last)
            alone = live[0] if live else EMPTY_PROPOSAL
            return alone if self._states_wanted() else replace(alone, states=False)
        tree = merge(self._last)
        chosen = select(tree, plan_nodes(tree.proposal, self.costs.relative(len(context)), budget))
        self._maps = chosen.maps
        return chosen.proposal

    def _states_wanted(self) -> bool:
        """Whether a drafter that reads hidden states reads this step's: a head whose gate stays
        shut for a while says not (``Proposal.states``), and neither does a lookup, which reads
        none, so a lookup's step before such a head costs no state extraction."""
        return any(prop.states for drafter, prop in zip(self.drafters, self._last) if HIDDEN_STATES in drafter.requires)

    def _first_with_a_guess(self, context: Sequence[int], budget: Budget) -> list[Proposal]:
        """Each drafter's proposal, where only the first with a guess got ``budget``: the others
        after it were asked with room for nothing (a drafter's way of hearing "not this step"), so
        a head spends no forward and its gate books no step, yet still sees where the text is."""
        waiting = replace(budget, max_nodes=0, max_depth=0)
        out: list[Proposal] = []
        for drafter in self.drafters:
            taken = any(prop.size for prop in out)
            out.append(drafter.propose(context, waiting if taken else budget).pruned(budget))
        return out

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        self.costs.observe(verdict.drafted, self._context_len, out.seconds)
        quiet = replace(out, seconds=0.0)  # timed once above, with the merged size
        for drafter, prop, mapping, blocks in zip(self.drafters, self._last, self._maps, self._blocks):
            mine = replace(quiet, hidden=pick_states(out.hidden, blocks, len(self.state_layers)))
            drafter.observe(mine, project(verdict, prop, mapping))
