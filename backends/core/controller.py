"""What drafters learn from their own history, and the one rule for whether to draft at all.

How much to verify is the planner's call (``backends.core.planner``) from per-node chances; this
module holds where those chances come from and how they stay honest:

- ``AcceptanceStats``: per-position acceptance of chains, counted per bucket (prompt lookup, the
  draft model), which ``LengthController`` turns into a draft length;
- ``TreeSizer``: a calibration of a ranked tree's own estimates (a datastore's shares, a head's
  probabilities), per bucket;
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

from backends.core.costs import CostModel
from backends.core.planner import MIN_GAIN, best_size, cost_at, could_pay
from backends.core.tree import tree_depths
from backends.core.types import EMPTY_PROPOSAL, Budget, Proposal, RankedTree, TargetOutput, Verdict


class AcceptanceStats:
    """Per-position acceptance counts, one set per ``bucket``, with exponential forgetting.

    A drafter keeps one of these for the whole session (not per answer), so what it learned about
    this model's habits carries over to the next answer. ``prior`` gives each bucket's starting
    estimate (a number, or a function of the bucket).
    """

    def __init__(self, *, prior: float | Callable[[Hashable], float] = 0.3, prior_weight: float = 2.0,
                 decay: float = 0.97) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay
        self._counts: dict[Hashable, list[list[float]]] = {}  # bucket -> [[accepted, tried] per position]

    def acceptance(self, bucket: Hashable = None, positions: int = 16) -> list[float]:
        """Estimated conditional acceptance per draft position, smoothed toward the prior."""
        prior = self.prior(bucket) if callable(self.prior) else self.prior
        counts = self._counts.get(bucket, [])
        rates = []
        for d in range(positions):
            acc, tried = counts[d] if d < len(counts) else (0.0, 0.0)
            rates.append((acc + prior * self.prior_weight) / (tried + self.prior_weight))
        return rates

    def update(self, drafted: int, accepted: int, bucket: Hashable = None) -> None:
        """Record one verdict: positions 1..accepted+1 were tried, 1..accepted accepted."""
        counts = self._counts.setdefault(bucket, [])
        for row in counts:
            row[0] *= self.decay
            row[1] *= self.decay
        while len(counts) < drafted:
            counts.append([0.0, 0.0])
        for d in range(min(drafted, accepted + 1)):
            counts[d][1] += 1.0
            if d < accepted:
                counts[d][0] += 1.0


class LengthController:
    """A chain's length: what the planner picks (``best_size``) from this bucket's per-position
    acceptance, with drafting's own cost priced in. A drafter whose guesses cost forwards cannot
    score withheld ones for free, so with ``probe_every`` it drafts the full length once after that
    many steps it held back although drafting could have paid."""

    def __init__(
        self,
        costs: CostModel,
        *,
        max_len: int,
        stats: AcceptanceStats | None = None,
        probe_every: int | None = None,
        min_gain: float = MIN_GAIN,
    ) -> None:
        self.costs = costs
        self.max_len = min(max_len, costs.k_max)
        self.stats = stats or AcceptanceStats()
        self.probe_every = probe_every
        self.min_gain = min_gain  # expected speedup a draft must promise (covers estimation noise)
        self._idle: dict[Hashable, int] = {}

    def acceptance(self, bucket: Hashable = None) -> list[float]:
        return self.stats.acceptance(bucket, self.max_len)

    def update(self, drafted: int, accepted: int, bucket: Hashable = None) -> None:
        self.stats.update(drafted, accepted, bucket)

    def can_pay(self, limit: int, *, context: int, draft_cost: float = 0.0, fixed_cost: float = 0.0) -> bool:
        """Whether even perfect acceptance would beat plain decoding."""
        return could_pay([1.0] * min(limit, self.max_len), self.costs.relative(context),
                         lambda n: fixed_cost + n * draft_cost, min_gain=self.min_gain)

    def choose(self, available: int, *, context: int, bucket: Hashable = None, draft_cost: float = 0.0,
               fixed_cost: float = 0.0) -> int:
        """How many of ``available`` candidate tokens to draft now (0: none)."""
        limit = min(available, self.max_len)
        if limit <= 0:
            return 0
        chances = chain_path_probs(self.acceptance(bucket), limit)
        best = best_size(chances, self.costs.relative(context), fixed_cost=fixed_cost, per_node=draft_cost,
                         min_gain=self.min_gain)
        if best:
            return best
        if self.probe_every and self.can_pay(limit, context=context, draft_cost=draft_cost, fixed_cost=fixed_cost):
            idle = self._idle.get(bucket, 0) + 1
            self._idle[bucket] = idle
            if idle >= self.probe_every:  # keep learning: try the full length once
                self._idle[bucket] = 0
                return limit
        return 0


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


def chain_path_probs(acceptance: Sequence[float], n: int) -> list[float]:
    """Chance that each of the first ``n`` chain positions is accepted: running products of the
    per-position conditional acceptance (positions past the estimates reuse the last one)."""
    out, survive = [], 1.0
    for d in range(n):
        survive *= acceptance[min(d, len(acceptance) - 1)] if acceptance else 0.0
        out.append(survive)
    return out


def length_class(n: int) -> int:
    """Buckets of a matched length (a suffix found again, a quoted span), which estimates are kept
    apart by: 0, 1, 2, 3, 4-7, 8-15, 16+. A long match predicts far better than a short one."""
    return n if n < 4 else 4 if n < 8 else 8 if n < 16 else 16


class TreeSizer:
    """How many nodes of a ranked candidate tree to verify, or none.

    A drafter that builds trees (retrieval, merged drafts) knows, for every candidate node, an
    estimate ``p_i`` that the target accepts the node's whole path (for REST: the share of the
    datastore's continuations that pass through it). Nodes are ranked by ``p`` with parents before
    children, so the best tree of ``n`` nodes is the first ``n``. Verifying them emits on average
    ``E(n) = 1 + sum(min(1, c * p_i) for i < n)`` tokens, where ``c`` is a calibration learned
    online per ``bucket`` (accepted tokens over predicted ones, with exponential forgetting; REST
    keeps one per length of the matched suffix, since a long match predicts far better than a
    two-token one), and costs ``cost[n]`` forwards: ``choose`` maximizes ``E(n) / cost[n]`` and
    returns 0 unless the best beats plain decoding by ``min_gain``.

    Example: cost ``[1, 1.3, 1.5]``, ``p = [0.6, 0.3]``, ``c = 1``: speeds 1, 1.23, 1.27: two nodes.
    """

    def __init__(self, costs: CostModel, *, max_nodes: int, min_gain: float = MIN_GAIN, prior: float = 0.7,
                 prior_weight: float = 2.0, decay: float = 0.95) -> None:
        self.costs = costs
        self.max_nodes = max_nodes
        self.min_gain = min_gain
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self._sums: dict[Hashable, list[float]] = {}  # bucket -> [accepted, predicted]

    def calibration(self, bucket: Hashable = None) -> float:
        """Accepted tokens per predicted one, smoothed toward ``prior`` (deliberately below 1:
        an estimate from a handful of continuations flatters itself)."""
        accepted, predicted = self._sums.get(bucket, (0.0, 0.0))
        return (accepted + self.prior * self.prior_weight) / (predicted + self.prior_weight)

    def choose(self, probs: Sequence[float], *, context: int, bucket: Hashable = None) -> int:
        c = self.calibration(bucket)
        return best_size([min(1.0, c * p) for p in probs[: self.max_nodes]], self.costs.relative(context),
                         min_gain=self.min_gain)

    def update(self, predicted: float, accepted: int, bucket: Hashable = None) -> None:
        """One verified (or shadow-scored) tree: how many tokens it was predicted to and did yield."""
        sums = self._sums.setdefault(bucket, [0.0, 0.0])
        sums[0] = sums[0] * self.decay + accepted
        sums[1] = sums[1] * self.decay + predicted


_UNKNOWN = object()  # a Bandit's best arm, not yet worked out


class Bandit:
    """Which of several arms to play: the one with the best measured gain per unit of cost.

    An arm's record is its gain (tokens emitted) and cost (in single-forward units), both with
    exponential forgetting. The ``baseline`` arm (plain decoding) is worth exactly 1, needs no
    trials and plays only when every other arm is slower. Every other arm is tried ``min_tries``
    times first; after that the best one plays, and an arm that lost is tried again once after
    ``probe_every`` rounds, then after twice as many, and so on up to ``max_interval``:
    re-checking an arm that keeps losing costs less and less, while one that starts winning (a
    fuller pool, a quieter machine, another kind of prompt) is found again.

    Exploring costs what the explored arm loses against the best one, so it is kept to a budget:

    - ``ceiling`` (optional): the most gain an arm can make in one round (for a draft of depth
      ``d``, ``d + 1`` tokens). An arm whose remaining trials could not lift it to the baseline even
      if each of them reached the ceiling ends its trials early. On 2 CPU cores a 10-node
      lookahead tree costs 4.5 forwards on SmolLM2 Q4_1 and can emit at most 5 tokens, so after
      one fruitless trial of two, (1 + 5) / (2 * 4.5) < 1 rules it out.
    - ``explore_share``: the share of rounds that probing the losing arms may cost, split among
      them. A round of a losing arm costs what it loses against the best arm (``best speed / its
      speed - 1`` rounds), so with 4 losing arms and a 1% share, one at a quarter of the best
      speed is re-probed no sooner than 1200 rounds after its last probe, one 5% behind after the
      usual ``probe_every``. Where nothing beats plain decoding (lookahead on a CPU) the share is
      what exploring costs, so it is kept well inside the 3% a method may lose.

    Example: arms ``a`` (2 tokens for 1.5 forwards) and ``b`` (1 for 1.2): after the trials ``a``
    plays, at 1.33x; with ``a`` at 1 token for 1.5 the baseline (1.0x) would play instead.
    """

    def __init__(self, arms: Sequence[Hashable], *, baseline: Hashable = None, min_tries: int = 4,
                 probe_every: int = 32, max_interval: int = 2048, decay: float = 0.97, margin: float = 0.0,
                 ceiling: Mapping[Hashable, float] | None = None, explore_share: float = 0.01) -> None:
        self.baseline = baseline
        self.margin = margin
        self.ceiling = dict(ceiling or {})
        self.explore_share = explore_share
        self.arms = [a for a in dict.fromkeys(arms) if a != baseline]
        self.min_tries, self.probe_every, self.max_interval, self.decay = min_tries, probe_every, max_interval, decay
        self._gain = {a: 0.0 for a in self.arms}
        self._cost = {a: 0.0 for a in self.arms}
        self._tries = {a: 0 for a in self.arms}
        self._last = {a: 0 for a in self.arms}
        self._interval = {a: probe_every for a in self.arms}
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
        due = [] if untried or not self.probe_every else [  # the spacing only once the interval is up
            a for a in self.arms if a != best and self._round - self._last[a] >= self._interval[a]
            and self._round - self._last[a] >= self._spacing(a, best)]
        if untried:
            arm = untried[0]
        elif due:
            arm = min(due, key=self._last.__getitem__)
            self._interval[arm] = min(self._interval[arm] * 2, self.max_interval)
        else:
            arm = best
            if arm != self.baseline:
                self._interval[arm] = self.probe_every  # a winner is re-checked promptly if it loses
        self.chosen[arm] = self.chosen.get(arm, 0) + 1
        if arm != self.baseline:
            self._last[arm] = self._round
        return arm

    def _spacing(self, arm: Hashable, best: Hashable) -> float:
        """Fewest rounds between probes of a losing ``arm`` that keep its cost within its part of
        the share."""
        speed = self.speed(arm)
        if self.explore_share <= 0 or speed <= 0:
            return 0.0
        losing = max(1, len(self.arms) - (best in self._gain))
        return (self.speed(best) / speed - 1.0) * losing / self.explore_share

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
    return Bandit([RUN], baseline="off", min_tries=16, probe_every=32, decay=0.99)


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
    around its own guessing: the ``Gate`` (draft at all this step?), the ``TreeSizer`` (how many
    of the ranked nodes to verify) and a ``Ledger`` (a tree the sizer withheld is still scored
    against the text that follows, so the calibration does not freeze at "never pays").
    Per step: ``open``, rank a tree, ``propose(tree)``, and after the verify ``observe``."""

    def __init__(self, costs: CostModel, *, max_nodes: int, adaptive: bool, prior: float = 0.7,
                 sizer: TreeSizer | None = None, gate: Bandit | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.sizer = sizer or TreeSizer(costs, max_nodes=max_nodes, prior=prior)
        self.gate = Gate(costs, bandit=gate, adaptive=adaptive, clock=clock)
        self.adaptive = adaptive
        self.begin()

    def begin(self) -> None:
        self._ledger = Ledger()
        self._predicted = 0.0
        self._bucket: Hashable = None
        self._context_len = 0

    def open(self, context: Sequence[int], budget: Budget, *, ready: bool = True) -> bool:
        """A step starts: settle withheld trees; whether to draft now (``ready``: the drafter has
        what it reads this step)."""
        self._context_len = len(context)
        self._predicted = 0.0
        for _, matched, (predicted, bucket) in self._ledger.resolve(context):
            self.sizer.update(predicted, matched, bucket)
        return self.gate.open(ready and budget.max_nodes > 0 and budget.max_depth > 0)

    def propose(self, tree: RankedTree) -> Proposal:
        """``tree`` ranked best first: the prefix worth verifying (or nothing, and the ledger)."""
        self.gate.close()
        self._bucket = tree.bucket
        n = self.sizer.choose(tree.probs, context=self._context_len, bucket=tree.bucket) if self.adaptive \
            else len(tree.tokens)
        if n == 0:
            self._ledger.add(self._context_len, tree.proposal(len(tree.tokens)), (float(tree.probs.sum()), tree.bucket))
            return EMPTY_PROPOSAL
        self._predicted = float(tree.probs[:n].sum())
        return tree.proposal(n, self.sizer.calibration(tree.bucket))

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        self.sizer.costs.observe(verdict.drafted, self._context_len, out.seconds)
        if verdict.drafted:
            self.sizer.update(self._predicted, verdict.accepted, self._bucket)
        self.gate.score(verdict, self._context_len)
