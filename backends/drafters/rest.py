"""``rest``: retrieval-based drafting from a datastore of text the user chose (He et al., REST).

The longest suffix of the context found in the datastore (``backends.models.datastore``) is looked
up, and what followed its occurrences becomes a token tree, each node weighted by its share of
them. Example: after ``def main(`` continuations ``) :`` (60%), ``args )`` (25%), ``argv )``
(15%) give ``)`` → ``:`` and ``args`` → ``)``. Whether to look up and how much to verify is
``TreeSteps``' call, as for the trained heads. The conversation is searched first, by prompt
lookup: an answer repeats its prompt and itself far more often than a datastore's text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from backends.core.controller import Bandit, Sizer, TreeSteps, length_class
from backends.core.costs import CostModel
from backends.core.protocols import Drafter
from backends.core.settings import Settings, bounded
from backends.core.types import EMPTY_PROPOSAL, ROLLBACK, TREE, Budget, Proposal, RankedTree, TargetOutput, Verdict
from backends.drafters.pld import PLDDrafter
from backends.models.datastore import DATASTORE_FILE, Datastore


@dataclass(frozen=True)
class RESTSettings(Settings):
    datastore: str = field(default="", metadata=DATASTORE_FILE)  # a file from `specdeck datastore build`
    max_nodes: int = bounded(16, 1, 64)  # most tree nodes verified in one step
    max_depth: int = bounded(8, 1, 32)  # deepest continuation read
    max_match: int = bounded(16, 1, 64)  # longest context suffix looked up
    min_match: int = bounded(2, 1, 64)  # shortest suffix that may still match (one token matches too much)
    samples: int = bounded(256, 1, 65536)  # occurrences read per lookup, evenly spaced
    adaptive: bool = True  # False: always verify max_nodes nodes of the datastore's tree
    conversation: bool = True  # also draft from the prompt and answer so far, before the datastore

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_match > self.max_match:
            raise ValueError(f"min_match ({self.min_match}) is above max_match ({self.max_match})")


class RESTDrafter(Drafter):
    requires: frozenset[str] = frozenset({TREE, ROLLBACK})

    def __init__(self, store: Datastore, settings: RESTSettings | None = None, *, costs: CostModel | None = None,
                 sizer: Sizer | None = None, conversation: PLDDrafter | None = None, gate: Bandit | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """Pass ``conversation`` (a prompt lookup), ``sizer`` and ``gate`` to keep their statistics
        across answers."""
        self.store = store
        self.settings = settings or RESTSettings()
        costs = costs or CostModel.from_relative([1.0] * (self.settings.max_nodes + 1))
        self.steps = TreeSteps(costs, max_nodes=self.settings.max_nodes, adaptive=self.settings.adaptive,
                               sizer=sizer, gate=gate, clock=clock)
        self.sizer, self.gate = self.steps.sizer, self.steps.gate
        self.conversation = (conversation or PLDDrafter(costs=costs)) if self.settings.conversation else None
        self.begin([])

    @property
    def declined(self) -> str:  # type: ignore[override]
        return self.steps.declined

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        if self.conversation is not None:
            self.conversation.begin(prompt)
        self.steps.begin()
        self._from_conversation = False  # did the last proposal come from the conversation?
        self._match: tuple[int, int] | None = None  # (longest match length, context length) of the last lookup

    def lookup(self, context: Sequence[int], *, top: int | None = None) -> RankedTree:
        """The ``top`` best continuations (all by default) of the longest suffix of ``context`` in
        the datastore. A match now extends the last one, so it is at most that plus the tokens
        appended since: the search starts there (mostly one binary search instead of four)."""
        s = self.settings
        bound = s.max_match if self._match is None else self._match[0] + len(context) - self._match[1]
        cont = self.store.continuations(context, max_len=min(s.max_match, bound), min_len=s.min_match,
                                        depth=s.max_depth, samples=s.samples, top=top)
        self._match = (cont.matched or s.min_match - 1, len(context))
        return cont.ranked(s.max_depth, top, length_class(cont.matched))

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        if self.conversation is not None:
            proposal = self.conversation.propose(context, budget)
            self._from_conversation = proposal.size > 0
            if self._from_conversation:
                return proposal
        if not self.steps.open(context, budget):
            return EMPTY_PROPOSAL
        top = min(self.settings.max_nodes, budget.max_nodes)
        return self.steps.propose(self.lookup(context, top=top).within_paths(budget.max_paths))

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        if self._from_conversation and self.conversation is not None:
            self.conversation.observe(out, verdict)  # it also times the verify
        else:  # the conversation proposed nothing, so it has nothing to learn here: its index
            self.steps.observe(out, verdict)  # follows the text, its withheld guesses are scored later
