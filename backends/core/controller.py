"""What drafters learn from their own history, and the one rule for whether to draft at all.

How much to verify is the planner's call (``backends.core.planner``) from per-node chances; this
module holds where those chances come from and how they stay honest:

- ``Sizer``: a drafter's raw per-node estimates (a datastore's shares, a head's probabilities, a
  chain's prior) calibrated per bucket and depth on what was accepted, and handed to the planner;
- ``Ledger``: guesses that were not verified, scored against what the target then wrote, which
  under greedy decoding is exactly the acceptance they would have had, and under sampling as
  likely (a one-hot guess ``x`` is accepted with the chance the target samples ``x``);
- ``Bandit``: the one way a choice between options is learned from measured speed, used per step
  by ``Gate`` (does a costly drafter draft now?) and per answer by ``auto`` (which method?).

Estimates are counts with exponential forgetting, so they follow a text that changes character
halfway.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

from backends.core.costs import CostModel
from backends.core.planner import MIN_GAIN, best_size, cost_at, could_pay
from backends.core.tree import tree_depths
from backends.core.types import EMPTY_PROPOSAL, Budget, Proposal, RankedTree, TargetOutput, Verdict


class Sizer:
    """How many of a drafter's ranked nodes to verify, from its raw estimates calibrated on its own
    history: one mechanism for chains and trees alike (a chain is a tree).

    Every node comes with a raw estimate ``p`` that the target accepts its path: a datastore's
    share, a head's probability, or for a chain guess that knows nothing more its prior ``a ** d``
    at depth ``d`` (``chain_tree``). Its chance is ``f[bucket, d] * p``, at most 1 and never above
    its parent's. The factor is learned per bucket and depth as ``r = A / P``: paths accepted that
    deep over the raw estimates' sum there (one node per depth at most lies on the accepted path,
    so that sum is the expected count), both with exponential forgetting, and averaged with
    ``prior`` as if the prior were ``prior_weight`` trees: ``f = (N r + w prior) / (N + w)`` after
    ``N`` trees. For a chain of prior estimates, ``f * p`` is thus the share of its bucket's
    chains whose first ``d`` tokens held, pulled toward ``a ** d`` by two pseudo-trials.
    ``choose`` gives the chances to the planner (``best_size``), drafting's own cost priced in.

    A drafter that cannot score withheld guesses for free (a draft model: its guesses cost
    forwards) sets ``probe_every``: after that many steps held back although drafting could have
    paid, it drafts the full length once, so its factors do not freeze at "never pays".

    Example: raw ``[0.6, 0.3]`` at depths 1 and 2, verify costs ``[1, 1.3, 1.5]``, factors 1:
    speeds 1.23 and 1.27, so two nodes; after 30 such trees with nothing accepted, none.
    """

    def __init__(self, costs: CostModel, *, max_nodes: int, prior: float = 1.0, prior_weight: float = 2.0,
                 decay: float = 0.95, probe_every: int | None = None, min_gain: float = MIN_GAIN) -> None:
        self.costs = costs
        self.max_nodes = max_nodes
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.probe_every = probe_every
        self.min_gain = min_gain  # expected speedup a verify must promise (covers estimation noise)
        self._sums: dict[Hashable, np.ndarray] = {}  # bucket -> [depth, (accepted, predicted, trees)]
        self._idle: dict[Hashable, int] = {}

    def factors(self, bucket: Hashable, depth: int) -> np.ndarray:
        """The calibration factor at depths 1..``depth`` ([depth])."""
        sums = np.zeros((depth, 3))
        known = self._sums.get(bucket, sums)[:depth]
        sums[: len(known)] = known
        accepted, predicted, trees = sums.T
        ratio = np.divide(accepted, predicted, out=np.full(depth, self.prior), where=predicted > 0)
        return (trees * ratio + self.prior_weight * self.prior) / (trees + self.prior_weight)

    def chances(self, tree: RankedTree) -> np.ndarray:
        """Each node's calibrated chance ([n]); parents come first in a ranking."""
        depths = tree_depths(tree.parents)
        out = np.minimum(1.0, self.factors(tree.bucket, int(depths.max(initial=0)))[depths - 1] * tree.probs)
        for i, parent in enumerate(tree.parents):
            if parent >= 0:
                out[i] = min(out[i], out[parent])
        return out

    def choose(self, tree: RankedTree, *, context: int, limit: int | None = None, fixed_cost: float = 0.0,
               per_node: float = 0.0) -> int:
        """How many of the first ``limit`` ranked nodes to verify now (0: none)."""
        return self.plan(tree, context=context, limit=limit, fixed_cost=fixed_cost, per_node=per_node)[0]

    def plan(self, tree: RankedTree, *, context: int, limit: int | None = None, fixed_cost: float = 0.0,
             per_node: float = 0.0) -> tuple[int, np.ndarray]:
        """``choose``'s count and the chances it weighed (what the proposal then carries)."""
        chances = self.chances(tree)
        limit = min(len(chances), self.max_nodes, len(chances) if limit is None else limit)
        relative = self.costs.relative(context)
        n = best_size(chances[:limit].tolist(), relative, fixed_cost=fixed_cost, per_node=per_node,
                      min_gain=self.min_gain)
        if n or not self.probe_every or not could_pay([1.0] * limit, relative, lambda k: fixed_cost + k * per_node,
                                                      min_gain=self.min_gain):
            return n, chances
        idle = self._idle.get(tree.bucket, 0) + 1
        self._idle[tree.bucket] = idle % self.probe_every
        return (limit if idle >= self.probe_every else 0), chances  # keep learning: the full length once

    def update(self, tree: RankedTree, verified: int, accepted: int) -> None:
        """The first ``verified`` nodes were verified (or scored unverified); ``accepted`` held."""
        depths = tree_depths(tree.parents[:verified])
        mass = np.bincount(depths - 1, weights=tree.probs[:verified]) if verified else np.zeros(0)
        sums = self._sums.get(tree.bucket, np.zeros((0, 3)))
        if len(sums) < len(mass):
            sums = np.vstack([sums, np.zeros((len(mass) - len(sums), 3))])
        sums *= self.decay
        sums[: len(mass), 1:] += np.stack([mass, np.ones(len(mass))], axis=1)
        sums[: min(accepted, len(mass)), 0] += 1.0
        self._sums[tree.bucket] = sums


def chain_tree(tokens: Sequence[int], acceptance: float, bucket: Hashable = None) -> RankedTree:
    """A chain as a ranked tree whose raw estimates are its prior: ``acceptance ** d`` at depth ``d``
    (each token held with the same chance). A draft model sizes its chain before drafting it, so
    its ``tokens`` may be placeholders: sizing reads only the estimates."""
    n = len(tokens)
    return RankedTree(np.asarray(tokens, dtype=np.int32), np.arange(-1, n - 1, dtype=np.int32),
                      acceptance ** np.arange(1.0, n + 1), bucket)


class Ledger:
    """Proposals that were not verified, scored against the text the target went on to produce.

    ``add(start, proposal, note)`` records a guess for ``context[start:]`` (a chain is a tree);
    ``resolve(context)`` returns ``(proposal, matched, note)`` for every guess the context now
    settles, ``matched`` being the depth of the deepest node whose path the text followed:
    exactly what greedy verification would have accepted, and under sampling as likely (a
    one-hot guess ``x`` is accepted with the chance the target samples ``x``). So a drafter that
    withholds a free guess still learns what it would have won. Example: the chain ``[5, 6, 7]``
    at 10 resolves to matched 1 once ``context[10:12] == [5, 9]``.
    """

    def __init__(self) -> None:
        self._open: list[tuple[int, Proposal, int, bool, Hashable]] = []  # start, guess, depth, chain?, note

    def add(self, start: int, proposal: Proposal, note: Hashable = None) -> None:
        if proposal.size:
            chain = proposal.is_chain
            depth = proposal.size if chain else int(tree_depths(proposal.parents).max())
            self._open.append((start, proposal, depth, chain, note))

    def resolve(self, context: Sequence[int]) -> list[tuple[Proposal, int, Hashable]]:
        done, still_open = [], []
        for item in self._open:
            start, proposal, depth, chain, note = item
            seen = context[start : start + depth]
            matched, node = 0, -1
            while matched < len(seen):
                node = _child(proposal, chain, node, seen[matched])
                if node is None:
                    break
                matched += 1
            if node is None or matched == depth:
                done.append((proposal, matched, note))
            else:
                still_open.append(item)
        self._open = still_open
        return done


def _child(proposal: Proposal, chain: bool, parent: int, token: int) -> int | None:
    """The child of ``parent`` (-1: the root) that holds ``token``, if any."""
    if chain:
        node = parent + 1
        return node if proposal.tokens[node] == token else None
    return next((i for i, (p, t) in enumerate(zip(proposal.parents, proposal.tokens)) if p == parent and t == token), None)


def length_class(n: int) -> int:
    """Buckets of a matched length (a suffix found again, a quoted span), which estimates are kept
    apart by: 0, 1, 2, 3, 4-7, 8-15, 16+. A long match predicts far better than a short one."""
    return n if n < 4 else 4 if n < 8 else 8 if n < 16 else 16


_UNKNOWN = object()  # a Bandit's best arm, not yet worked out


class Bandit:
    """Which of several arms to play: the one with the best measured gain per unit of cost.

    An arm's record is its gain (tokens emitted) and cost (in single-forward units), both with
    exponential forgetting. The ``baseline`` arm (plain decoding) is worth exactly 1, needs no
    trials and plays only when every other arm is slower. Every other arm is tried ``min_tries``
    times first; then the best one plays, and exploration has one budget: a play of a losing arm
    costs what it loses against the best (``best speed / its speed - 1`` rounds), and plays of the
    losers may cost ``explore_share`` of all rounds, so a loser is played again once enough rounds
    have passed since its last play, and never sooner than ``min_gap`` rounds (a near-tie costs
    next to nothing, and re-checking it every round would tell nothing new). An arm far behind is
    re-checked rarely, and one that starts winning (a fuller pool, a quieter machine, another kind
    of prompt) is found again. ``ceiling`` (optional) is the most gain an arm can make in one
    round (a draft of depth ``d``: ``d + 1`` tokens): an arm whose remaining trials could not
    lift it to the baseline even at that ends its trials early.

    Example: arms ``a`` (2 tokens for 1.5 forwards) and ``b`` (1 for 1.2): after the trials ``a``
    plays, at 1.33x, and ``b`` (0.83x, losing 0.6 rounds a play) is played again every 60 rounds
    at a 1% share; with ``a`` at 1 token for 1.5 the baseline (1.0x) would play instead.
    """

    def __init__(self, arms: Sequence[Hashable], *, baseline: Hashable = None, min_tries: int = 4,
                 decay: float = 0.97, margin: float = 0.0, ceiling: Mapping[Hashable, float] | None = None,
                 explore_share: float = 0.01, min_gap: int = 32) -> None:
        self.baseline = baseline
        self.margin = margin
        self.ceiling = dict(ceiling or {})
        self.explore_share = explore_share
        self.arms = [a for a in dict.fromkeys(arms) if a != baseline]
        self.min_tries, self.decay, self.min_gap = min_tries, decay, min_gap
        self._gain = {a: 0.0 for a in self.arms}
        self._cost = {a: 0.0 for a in self.arms}
        self._tries = {a: 0 for a in self.arms}
        self._last = {a: 0 for a in self.arms}  # the round an arm last played
        self.chosen: dict[Hashable, int] = {}
        self._round = 0
        self._best: Hashable = _UNKNOWN  # best() until the next update (asked every round)

    def speed(self, arm: Hashable) -> float:
        """Gain per unit of cost (1.0 for the baseline and for an arm never measured)."""
        if arm == self.baseline or self._cost.get(arm, 0.0) <= 0.0:
            return 1.0
        return self._gain[arm] / self._cost[arm]

    def best(self) -> Hashable:
        """The fastest arm, where an arm listed later (the baseline last) must beat the ones before
        it by ``margin``: with estimates this noisy, a near-tie goes to the simpler arm."""
        if self._best is _UNKNOWN:
            best = self.arms[0] if self.arms else self.baseline
            for arm in [*self.arms[1:], self.baseline]:
                if self.speed(arm) > self.speed(best) * (1.0 + self.margin):
                    best = arm
            self._best = best
        return self._best

    def choose(self) -> Hashable:
        self._round += 1
        untried = [a for a in self.arms if self._tries[a] < self.min_tries]
        best = self.best()
        due = [a for a in self.arms if a != best and self._round - self._last[a] >= self._spacing(a, best)]
        arm = untried[0] if untried else min(due, key=self._last.__getitem__) if due else best
        self.chosen[arm] = self.chosen.get(arm, 0) + 1
        if arm != self.baseline:
            self._last[arm] = self._round
        return arm

    def _spacing(self, arm: Hashable, best: Hashable) -> float:
        """Fewest rounds between plays of a losing ``arm`` that keep its cost within its part of
        the share (the losers split it evenly)."""
        if self.explore_share <= 0:
            return float("inf")
        losing = max(1, len(self.arms) - (best in self._gain))
        loss = self.speed(best) / max(self.speed(arm), 1e-6) - 1.0  # rounds lost per play
        return max(float(self.min_gap), loss * losing / self.explore_share)

    def update(self, arm: Hashable, gain: float, cost: float) -> None:
        if arm not in self._gain:
            return
        self._tries[arm] += 1
        self._best = _UNKNOWN
        self._gain[arm] = self._gain[arm] * self.decay + gain
        self._cost[arm] = self._cost[arm] * self.decay + cost
        if self._tries[arm] < self.min_tries and self._hopeless(arm):
            self._tries[arm] = self.min_tries  # its trials are over: it lost

    def _hopeless(self, arm: Hashable) -> bool:
        """Even if every remaining trial reached the arm's ceiling, it would stay below the baseline."""
        top = self.ceiling.get(arm)
        if top is None or self.baseline is None:
            return False
        left = self.min_tries - self._tries[arm]
        per_try = self._cost[arm] / self._tries[arm]
        return (self._gain[arm] + left * top) / (self._cost[arm] + left * per_try) < 1.0

    def settled(self) -> Hashable:
        """The arm chosen most often so far (what this machine settled on)."""
        return max(self.chosen, key=self.chosen.__getitem__) if self.chosen else self.baseline


RUN = "run"  # a gate's arm: let the drafter draft (its baseline: draft nothing)


def gate_bandit() -> Bandit:
    """A fresh record for a ``Gate`` (a session keeps one per method, across answers)."""
    return Bandit([RUN], baseline="off", min_tries=16, decay=0.99)


class Gate:
    """Whether a drafter whose drafting costs time (a datastore lookup, a head's or a draft
    model's forwards) drafts this step: one ``Bandit`` arm against drafting nothing.

    Every step it drafted is scored as tokens emitted over that step's cost in plain forwards: the
    measured verify of what it proposed plus its own seconds. "This drafter cannot pay here" is
    thus a measurement, not a flag: after 16 trials that lost to plain decoding it is re-checked
    only within the bandit's exploration share, and one that starts to win (another kind of text,
    a quieter machine) is found again. Such drafting pays in rare runs, so the record forgets
    slowly (about 100 steps). Per step: ``open`` (False: draft nothing), draft, ``close``, and after
    the verify ``score``.
    """

    def __init__(self, costs: CostModel, *, bandit: Bandit | None = None, adaptive: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.costs = costs
        self.bandit = bandit or gate_bandit()
        self.adaptive = adaptive
        self.clock = clock
        self._ran: float | None = None  # seconds spent drafting this step (None: it did not draft)
        self._start = 0.0

    def open(self, ready: bool = True) -> bool:
        """Whether to draft now (``ready``: the drafter has what it needs); the clock starts."""
        self._ran = None
        if not ready or (self.adaptive and self.bandit.choose() != RUN):
            return False
        self._ran, self._start = 0.0, self.clock()
        return True

    def close(self) -> None:
        """Drafting is done for this step: the clock stops."""
        if self._ran is not None:
            self._ran += self.clock() - self._start

    def score(self, verdict: Verdict, context: int) -> None:
        """Book a step that drafted: what its own nodes won, over their verify and its time."""
        if self._ran is None:
            return
        one = self.costs.seconds(0, context)
        cost = cost_at(self.costs.relative(context), verdict.drafted) + (self._ran / one if one > 0 else 0.0)
        self.bandit.update(RUN, verdict.accepted + 1, cost)
        self._ran = None


class TreeSteps:
    """What a drafter that ranks candidate trees at a cost (REST's datastore, trained heads) does
    around its own guessing: the ``Gate`` (draft at all this step?), the ``Sizer`` (how many of
    the ranked nodes to verify) and a ``Ledger`` (a tree the sizer withheld is still scored
    against the text that follows, so the calibration does not freeze at "never pays").
    Per step: ``open``, rank a tree, ``propose(tree)``, and after the verify ``observe``."""

    def __init__(self, costs: CostModel, *, max_nodes: int, adaptive: bool, prior: float = 0.7,
                 sizer: Sizer | None = None, gate: Bandit | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.sizer = sizer or Sizer(costs, max_nodes=max_nodes, prior=prior)
        self.gate = Gate(costs, bandit=gate, adaptive=adaptive, clock=clock)
        self.adaptive = adaptive
        self.begin()

    def begin(self) -> None:
        self._ledger = Ledger()
        self._verified: tuple[RankedTree, int] | None = None  # this step's tree and how many nodes went
        self._context_len = 0

    def open(self, context: Sequence[int], budget: Budget, *, ready: bool = True) -> bool:
        """A step starts: settle withheld trees; whether to draft now (``ready``: the drafter has
        what it reads this step)."""
        self._context_len = len(context)
        self._verified = None
        for _, matched, tree in self._ledger.resolve(context):
            self.sizer.update(tree, len(tree.tokens), matched)
        return self.gate.open(ready and budget.max_nodes > 0 and budget.max_depth > 0)

    def propose(self, tree: RankedTree) -> Proposal:
        """``tree`` ranked best first: the prefix worth verifying (or nothing, and the ledger)."""
        self.gate.close()
        if self.adaptive:
            n, chances = self.sizer.plan(tree, context=self._context_len)
        else:
            n, chances = len(tree.tokens), self.sizer.chances(tree)
        if n == 0:
            self._ledger.add(self._context_len, tree.proposal(len(tree.tokens)), tree)
            return EMPTY_PROPOSAL
        self._verified = (tree, n)
        return tree.proposal(n, chances)

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        self.sizer.costs.observe(verdict.drafted, self._context_len, out.seconds)
        if verdict.drafted and self._verified is not None:
            self.sizer.update(*self._verified, verdict.accepted)
        self.gate.score(verdict, self._context_len)
