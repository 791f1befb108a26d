"""``rest``: retrieval-based drafting from a datastore of text the user chose (He et al., REST).

Answers about a code base, a manual or earlier chats reuse its phrases. The longest suffix of the
context that occurs in the datastore (``backends.models.datastore``) is looked up, and what
followed its occurrences becomes a token tree: the trie of continuations, each node weighted by
the share of occurrences passing through it. The most frequent nodes are verified in one forward;
the target keeps the longest path it agrees with. No model runs to draft.

Example: after ``def main(`` a Python datastore has continuations ``) :`` (60%), ``args )``
(25%), ``argv )`` (15%): the tree holds ``)`` → ``:`` and ``args`` → ``)`` and so on.

How many nodes to verify is the ``TreeSizer``'s call (measured verify costs against the
predicted gain, calibrated by what was accepted). Lookups cost no forward, so trees that were not
worth verifying are scored against the text that followed (the ``Ledger``) to keep calibrating;
they do cost some CPU, so a run of fruitless lookups spaces the next ones out.

Whether to consult the datastore at all is a ``Bandit``'s call (the gate): every step that looks
up is scored as tokens emitted over its cost in forwards, the verify plus the lookup's own time,
against plain decoding's 1. A datastore that does not pay on this machine and these prompts is
then consulted only now and then, within the bandit's 1% exploration share, and ``rest`` runs as
fast as prompt lookup; one that pays stays on. Measured on SmolLM2 F16 with a datastore of its own
answers to other questions, ungated lookups and their failed drafts cost 1.6% against prompt
lookup; gated, ``rest`` ran at 0.996 of prompt lookup's speed, paired prompt by prompt.

The conversation itself is searched too (``conversation=True``, the default), before the
datastore: an answer repeats its prompt and itself far more often than it repeats anything a
datastore holds. Measured on SmolLM2 with a datastore of its own answers to 204 other Spec-Bench
questions, the datastore alone drafted almost nothing (at most 18 tokens on 10 prompts of a
category), while the conversation paid on every category. llama.cpp's lookup decoding pairs a
static n-gram cache with the context's the same way. The conversation is searched by prompt
lookup's n-gram index and sized by its length controller (``backends.drafters.pld``), whose
statistics are kept apart from the datastore's calibration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from backends.core.controller import Bandit, Ledger, TreeSizer, drafting_gate, length_class
from backends.core.planner import cost_at
from backends.core.costs import CostModel
from backends.core.tree import fit_paths
from backends.core.protocols import Drafter
from backends.core.types import EMPTY_PROPOSAL, ROLLBACK, TREE, Budget, Proposal, TargetOutput, Verdict
from backends.drafters.pld import PLDDrafter
from backends.models.datastore import DATASTORE_FILE, Continuations, Datastore


# A lookup (a few binary searches over the datastore, then the trie of what followed) costs 5% of a
# forward of a 135M model on a CPU. After every 4 lookups in a row that drafted nothing the gap
# between lookups doubles (up to 15 skipped steps); the first draft resets it. Matches come in
# runs, so little is missed. At 7 skipped steps the lookups still cost a fruitless REST 1.3% of
# its speed on SmolLM2 Q4_1 (0.12 ms per token against a 9 ms forward).
LOOKUPS_PER_BACKOFF = 4
MAX_SKIP = 15
DATASTORE = "datastore"  # the gate's arm: look the context up (its baseline: draft nothing)


def new_gate() -> Bandit:
    """The gate's bandit: rounds are steps the conversation had nothing for (most lookups find
    nothing worth verifying; a datastore pays in rare long runs)."""
    return drafting_gate(DATASTORE)


@dataclass(frozen=True)
class RESTSettings:
    datastore: str = field(default="", metadata=DATASTORE_FILE)  # a file from `specdeck datastore build`
    max_nodes: int = 16  # most tree nodes verified in one step
    max_depth: int = 8  # deepest continuation read
    max_match: int = 16  # longest context suffix looked up
    min_match: int = 2  # shortest suffix that may still match (one token matches too much)
    samples: int = 256  # occurrences read per lookup, evenly spaced
    adaptive: bool = True  # False: always verify max_nodes nodes of the datastore's tree
    conversation: bool = True  # also draft from the prompt and answer so far, before the datastore

    def __post_init__(self) -> None:
        if not 1 <= self.max_nodes <= 64:
            raise ValueError(f"max_nodes must be in 1..64, got {self.max_nodes}")
        if not 1 <= self.max_depth <= 32:
            raise ValueError(f"max_depth must be in 1..32, got {self.max_depth}")
        if not 1 <= self.min_match <= self.max_match <= 64:
            raise ValueError(f"need 1 <= min_match <= max_match <= 64, got {self.min_match}, {self.max_match}")
        if not 1 <= self.samples <= 65536:
            raise ValueError(f"samples must be in 1..65536, got {self.samples}")


@dataclass(frozen=True)
class RankedTree:
    """Candidate nodes ranked best first (parents before children), as a proposal prefix takes them."""

    tokens: np.ndarray  # [n] int32
    parents: np.ndarray  # [n] int32, indices into this ranking (-1: root)
    probs: np.ndarray  # [n] float64, share of occurrences through each node
    bucket: int = 0  # class of the matched suffix length (calibration is kept per class)

    def proposal(self, n: int, calibration: float = 1.0) -> Proposal:
        """The first ``n`` nodes; their chances are the shares times ``calibration`` (at most 1)."""
        return Proposal(tuple(int(t) for t in self.tokens[:n]), tuple(int(p) for p in self.parents[:n]),
                        chances=tuple(min(1.0, calibration * float(p)) for p in self.probs[:n]))

    def within_paths(self, max_paths: int) -> RankedTree:
        """The ranking less the nodes that would open more than ``max_paths`` root-to-leaf paths
        (the target's sequence limit), still best first with parents before children."""
        keep = fit_paths(self.parents.tolist(), max_paths)
        if len(keep) == len(self.tokens):
            return self
        new_index = np.full(len(self.tokens) + 1, -1, dtype=np.int32)
        new_index[keep] = np.arange(len(keep), dtype=np.int32)
        parents = np.where(self.parents[keep] < 0, -1, new_index[self.parents[keep]]).astype(np.int32)
        return RankedTree(self.tokens[keep], parents, self.probs[keep], self.bucket)


def rank(cont: Continuations, max_depth: int, top: int | None = None) -> RankedTree:
    """Order trie nodes by share, parents first; drop nodes deeper than ``max_depth``; keep the
    first ``top`` (all by default).

    A child never has a larger count than its parent, and ties keep breadth-first order, so a
    stable sort by count puts every parent before its children. The share is ``count / (total +
    1)``: a continuation seen once is a coin flip, not a certainty.
    """
    depth = np.zeros(len(cont.tokens), dtype=np.int32)
    for i, parent in enumerate(cont.parents):
        depth[i] = 1 if parent < 0 else depth[parent] + 1
    keep = np.flatnonzero(depth <= max_depth)
    order = keep[np.argsort(-cont.counts[keep], kind="stable")][:top]
    new_index = np.full(len(cont.tokens) + 1, -1, dtype=np.int32)
    new_index[order] = np.arange(len(order), dtype=np.int32)
    parents = np.where(cont.parents[order] < 0, -1, new_index[cont.parents[order]])
    return RankedTree(cont.tokens[order], parents.astype(np.int32), cont.counts[order] / (cont.total + 1),
                      length_class(cont.matched))


class RESTDrafter(Drafter):
    requires: frozenset[str] = frozenset({TREE, ROLLBACK})
    ask_cost = 1  # a lookup is a few binary searches: no forward, but not free (see specinfer)

    def __init__(self, store: Datastore, settings: RESTSettings | None = None, *, costs: CostModel | None = None,
                 sizer: TreeSizer | None = None, conversation: PLDDrafter | None = None, gate: Bandit | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``conversation`` searches the conversation; built here when the settings ask for it
        and none is given (pass one, and the ``sizer`` and ``gate``, to keep their statistics
        across answers)."""
        self.store = store
        self.settings = settings or RESTSettings()
        costs = costs or CostModel.from_relative([1.0] * (self.settings.max_nodes + 1))
        self.sizer = sizer or TreeSizer(costs, max_nodes=self.settings.max_nodes)
        self.gate = gate or new_gate()
        self.clock = clock
        if self.settings.conversation and conversation is None:
            conversation = PLDDrafter(costs=self.sizer.costs)
        self.conversation = conversation if self.settings.conversation else None
        self.begin([])

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        if self.conversation is not None:
            self.conversation.begin(prompt)
        self._from_conversation = False  # did the last proposal come from the conversation?
        self._ledger = Ledger()
        self._predicted = 0.0
        self._misses = 0  # lookups in a row that drafted nothing
        self._skip = 0  # steps to draft nothing without looking up
        self._bucket = 0
        self._context_len = len(prompt)
        self._match: tuple[int, int] | None = None  # (longest match length, context length) of the last lookup
        self._lookup_s: float | None = None  # seconds the last step's lookup took (None: no lookup)

    def lookup(self, context: Sequence[int], *, top: int | None = None) -> RankedTree:
        """The ranked continuations of the longest suffix of ``context`` found in the datastore,
        the ``top`` best of them (all by default): only those are built and ranked.

        A suffix that matches now extends one that matched before, so the longest match can be
        at most the previous one plus the tokens appended since: the search for its length starts
        there (most steps then cost one binary search instead of four).
        """
        s = self.settings
        bound = s.max_match if self._match is None else self._match[0] + len(context) - self._match[1]
        cont = self.store.continuations(context, max_len=min(s.max_match, bound), min_len=s.min_match,
                                        depth=s.max_depth, samples=s.samples, top=top)
        self._match = (cont.matched or s.min_match - 1, len(context))
        return rank(cont, s.max_depth, top)

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        self._context_len = len(context)
        self._lookup_s = None
        for _, matched, (predicted, bucket) in self._ledger.resolve(context):
            self.sizer.update(predicted, matched, bucket)
        if self.conversation is not None:
            proposal = self.conversation.propose(context, budget)
            self._from_conversation = proposal.size > 0
            if self._from_conversation:
                return proposal
        if self.settings.adaptive:
            if self._skip > 0:  # recent lookups found nothing worth verifying
                self._skip -= 1
                return EMPTY_PROPOSAL
            if self.gate.choose() != DATASTORE:  # the datastore has not paid lately
                return EMPTY_PROPOSAL
        start = self.clock()
        proposal = self._propose(context, budget)
        self._lookup_s = self.clock() - start
        self._misses = 0 if proposal.size else self._misses + 1
        self._skip = min((1 << (self._misses // LOOKUPS_PER_BACKOFF)) - 1, MAX_SKIP)
        return proposal

    def _propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        if budget.max_nodes <= 0 or budget.max_depth <= 0:
            return EMPTY_PROPOSAL
        tree = self.lookup(context, top=min(self.settings.max_nodes, budget.max_nodes)).within_paths(budget.max_paths)
        limit = min(len(tree.tokens), self.settings.max_nodes, budget.max_nodes)
        if limit == 0 or budget.max_depth <= 0:
            return EMPTY_PROPOSAL
        self._bucket = tree.bucket
        n = self.sizer.choose(tree.probs[:limit], context=len(context), bucket=tree.bucket) if self.settings.adaptive else limit
        if n == 0:
            self._ledger.add(len(context), tree.proposal(limit), (float(tree.probs[:limit].sum()), tree.bucket))
            return EMPTY_PROPOSAL
        self._predicted = float(tree.probs[:n].sum())
        return tree.proposal(n, self.sizer.calibration(tree.bucket))

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        if self._from_conversation and self.conversation is not None:
            self.conversation.observe(out, verdict)  # it also times the verify
            return
        costs = self.sizer.costs
        costs.observe(verdict.drafted, self._context_len, out.seconds)
        if verdict.drafted:
            self.sizer.update(self._predicted, verdict.accepted, self._bucket)
        if self._lookup_s is not None:  # score the lookup with the gate: what its own nodes won, for
            one = costs.seconds(0, self._context_len)  # their verify and the lookup (merged: as if alone)
            cost = cost_at(costs.relative(self._context_len), verdict.drafted) + (self._lookup_s / one if one > 0 else 0.0)
            self.gate.update(DATASTORE, verdict.accepted + 1, cost)
        # The conversation proposed nothing, so it has nothing to learn here: its index follows
        # the text and its withheld guesses are scored when it next proposes.

    def skipped(self, tokens: Sequence[int]) -> None:
        """Not asked this step: no lookup happened, so the gate books none; the ledgers and the
        conversation's index follow the context at the next proposal."""
        self._lookup_s = None
        self._from_conversation = False
