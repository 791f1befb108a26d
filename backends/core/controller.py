"""Where the planner's per-node chances come from, and whether to draft at all (README: "How
SpecDeck decides how much to verify"): ``Sizer`` calibrates a drafter's raw estimates on what was
accepted, ``Ledger`` scores guesses that were not verified, ``Bandit`` learns a choice from measured
speed (per step in ``TreeSteps``, per answer in ``auto``). All forget: a text may change halfway.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, Sequence

import numpy as np

from backends.core.costs import CostModel
from backends.core.planner import MIN_GAIN, best_size, cost_at, could_pay
from backends.core.tree import depth_list
from backends.core.types import EMPTY_PROPOSAL, Budget, Proposal, RankedTree, TargetOutput, Verdict


class Sizer:
    """How many of a drafter's ranked nodes to verify (a chain is a tree), from raw estimates
    calibrated on its own history.

    A node's raw estimate ``p`` (a datastore's share, a head's probability, a chain's prior ``a **
    d``: ``chain_tree``) becomes the chance ``f[bucket, d] * p``, at most 1 and never above its
    parent's. ``f = (N r + w prior) / (N + w)`` after ``N`` trees, ``r`` being paths accepted that
    deep over the raw estimates' sum there (its expected count), with forgetting. A drafter whose
    withheld guesses cost forwards to score (a draft model) sets ``probe_every``: after that many
    steps held back although drafting could have paid, it drafts the full length once, so its
    factors do not freeze at "never pays". Example: raw ``[0.6, 0.3]``, costs ``[1, 1.3, 1.5]``,
    ``f`` 1: speeds 1.23 and 1.27, two nodes; after 30 such trees with nothing accepted, none.
    """

    def __init__(self, costs: CostModel, *, max_nodes: int, prior: float = 1.0, prior_weight: float = 2.0,
                 decay: float = 0.95, probe_every: int | None = None, min_gain: float = MIN_GAIN) -> None:
        self.costs, self.max_nodes, self.probe_every = costs, max_nodes, probe_every
        self.prior, self.prior_weight, self.decay, self.min_gain = prior, prior_weight, decay, min_gain
        self._sums: dict[Hashable, list[list[float]]] = {}  # bucket -> [depth][accepted, predicted, trees]
        self._idle: dict[Hashable, int] = {}

    # Plain lists, not numpy: on a few depths per step numpy's overhead doubled pld's step (111 us).
    def factors(self, bucket: Hashable, depth: int) -> list[float]:
        """The calibration factor at depths 1..``depth``."""
        sums, prior, weight = self._sums.get(bucket, []), self.prior, self.prior_weight
        out = []
        for accepted, predicted, trees in sums[:depth] + [[0.0, 0.0, 0.0]] * (depth - len(sums)):
            ratio = accepted / predicted if predicted > 0 else prior
            out.append((trees * ratio + weight * prior) / (trees + weight))
        return out

    def chances(self, tree: RankedTree) -> list[float]:
        """Each node's calibrated chance; parents come first in a ranking."""
        parents = tree.parents.tolist()
        depths = depth_list(parents)
        factors = self.factors(tree.bucket, max(depths, default=0))
        out: list[float] = []
        for parent, depth, prob in zip(parents, depths, tree.probs.tolist()):
            chance = min(1.0, factors[depth - 1] * prob)
            out.append(chance if parent < 0 else min(chance, out[parent]))
        return out

    def plan(self, tree: RankedTree, *, context: int, limit: int | None = None, fixed_cost: float = 0.0,
             per_node: float = 0.0) -> tuple[int, list[float]]:
        """How many of the first ``limit`` ranked nodes to verify now (0: none), and the chances it
        weighed (what the proposal then carries)."""
        chances = self.chances(tree)
        limit = min(len(chances), self.max_nodes, len(chances) if limit is None else limit)
        relative = self.costs.relative(context, upto=limit)
        n = best_size(chances[:limit], relative, fixed_cost=fixed_cost, per_node=per_node, min_gain=self.min_gain)
        if n or not self.probe_every or not could_pay([1.0] * limit, relative, lambda k: fixed_cost + k * per_node,
                                                      min_gain=self.min_gain):
            return n, chances
        idle = self._idle.get(tree.bucket, 0) + 1
        self._idle[tree.bucket] = idle % self.probe_every
        return (limit if idle >= self.probe_every else 0), chances  # keep learning: the full length once

    def update(self, tree: RankedTree, verified: int, accepted: int) -> None:
        """The first ``verified`` nodes were verified (or scored unverified); ``accepted`` held."""
        depths = depth_list(tree.parents[:verified])
        mass = [0.0] * max(depths, default=0)  # the raw estimates' sum per depth
        for depth, prob in zip(depths, tree.probs[:verified].tolist()):
            mass[depth - 1] += prob
        sums = self._sums.setdefault(tree.bucket, [])
        sums.extend([0.0, 0.0, 0.0] for _ in range(len(mass) - len(sums)))
        deep, held = len(mass), min(accepted, len(mass))
        for d, row in enumerate(sums):  # True counts as 1
            row[0] = row[0] * self.decay + (d < held)
            row[1] = row[1] * self.decay + (mass[d] if d < deep else 0.0)
            row[2] = row[2] * self.decay + (d < deep)


def chain_tree(tokens: Sequence[int], acceptance: float, bucket: Hashable = None) -> RankedTree:
    """A chain as a ranked tree with prior estimates ``acceptance ** d``; ``tokens`` may be
    placeholders (a draft model sizes its chain before drafting it)."""
    n = len(tokens)
    return RankedTree(np.asarray(tokens, dtype=np.int32), np.arange(-1, n - 1, dtype=np.int32),
                      acceptance ** np.arange(1.0, n + 1), bucket)


class Ledger:
    """Trees that were not verified, scored against the text the target went on to write.

    ``add(start, tree)`` records a guess for ``context[start:]``; ``resolve(context)`` returns
    ``(tree, matched)`` for each guess now settled, ``matched`` being how deep the text followed
    it: what greedy verification would have accepted, and under sampling as likely.
    Example: the chain ``[5, 6, 7]`` at 10 resolves to 1 once ``context[10:12] == [5, 9]``.
    """

    def __init__(self) -> None:
        self._open: list[tuple[int, RankedTree, int, dict[tuple[int, int], int]]] = []  # start, tree, depth, children

    def add(self, start: int, tree: RankedTree) -> None:
        parents = tree.parents.tolist()
        if parents:
            children = {(p, t): i for i, (p, t) in enumerate(zip(parents, tree.tokens.tolist()))}
            self._open.append((start, tree, max(depth_list(parents)), children))

    def resolve(self, context: Sequence[int]) -> list[tuple[RankedTree, int]]:
        done, still_open = [], []
        for start, tree, depth, children in self._open:
            matched, node = 0, -1
            for token in context[start : start + depth]:  # follow the text down the tree
                node = children.get((node, token))
                if node is None:
                    break
                matched += 1
            if node is None or matched == depth:
                done.append((tree, matched))
            else:
                still_open.append((start, tree, depth, children))
        self._open = still_open
        return done


def length_class(n: int) -> int:
    """Buckets of a matched length, estimates kept apart by: 0, 1, 2, 3, 4-7, 8-15, 16+ (a long
    match predicts far better than a short one)."""
    return n if n < 4 else 4 if n < 8 else 8 if n < 16 else 16


class Bandit:
    """Which arm to play: the best measured gain (tokens) per cost (plain forwards), with forgetting.

    The ``baseline`` (plain decoding) is worth 1 and needs no trials; every other arm is tried
    ``min_tries`` times (one that lost ``L > try_loss`` rounds counts ``L / try_loss``), then the best
    plays. Exploring has one budget: a loser's play costs ``best speed / its speed - 1`` rounds, losers
    may cost ``explore_share`` of all rounds, each re-check it loses doubles its gap (``min_gap`` to
    ``max_gap`` rounds), one it wins resets it: one that starts winning is found again, one that keeps
    losing costs ever less. E.g. ``a`` 2 tokens for 1.5 forwards, ``b`` 1 for 1.2: ``a`` plays (1.33x);
    ``b`` (0.83x, 0.6 rounds lost a play) every 200 rounds at a 0.3% share, then 256, 512 ...
    """

    def __init__(self, arms: Sequence[Hashable], *, baseline: Hashable = None, min_tries: int = 4, decay: float = 0.97,
                 margin: float = 0.0, explore_share: float = 0.003, min_gap: int = 32, max_gap: int = 2048,
                 try_loss: float = float("inf")) -> None:
        self.baseline, self.margin, self.try_loss = baseline, margin, try_loss
        self.arms = [a for a in dict.fromkeys(arms) if a != baseline]
        self.min_tries, self.decay, self.explore_share = min_tries, decay, explore_share
        self.min_gap, self.max_gap, self._gap = min_gap, max_gap, dict.fromkeys(self.arms, min_gap)
        self._gain, self._cost = dict.fromkeys(self.arms, 0.0), dict.fromkeys(self.arms, 0.0)
        self._tries, self._last = dict.fromkeys(self.arms, 0), dict.fromkeys(self.arms, 0)  # _last: round last played
        self.chosen, self._round, self._quiet = {}, 0, (baseline, 0)  # _quiet: the best, the round a loser is due

    def speed(self, arm: Hashable) -> float:
        """Gain per unit of cost (1.0 for the baseline and for an arm never measured)."""
        return 1.0 if arm == self.baseline or self._cost.get(arm, 0.0) <= 0.0 else self._gain[arm] / self._cost[arm]

    def best(self) -> Hashable:
        """The fastest arm, where an arm listed later (the baseline last) must beat the ones before
        it by ``margin``: with estimates this noisy, a near-tie goes to the simpler arm."""
        best = self.arms[0] if self.arms else self.baseline
        for arm in [*self.arms[1:], self.baseline]:
            if self.speed(arm) > self.speed(best) * (1.0 + self.margin):
                best = arm
        return best

    def choose(self) -> Hashable:
        self._round += 1
        if self._round < self._quiet[1]:  # nothing due: a closed gate's step (13 us of Python after a forward)
            self.chosen[self._quiet[0]] += 1
            return self._quiet[0]
        untried = [a for a in self.arms if self._tries[a] < self.min_tries]
        best = self.best()
        due = [a for a in self.arms if a != best and self._round - self._last[a] >= self._spacing(a, best)]
        arm = untried[0] if untried else min(due, key=self._last.__getitem__) if due else best
        if arm == best == self.baseline and not untried:
            self._quiet = (best, min((self._last[a] + self._spacing(a, best) for a in self.arms), default=float("inf")))
        self.chosen[arm] = self.chosen.get(arm, 0) + 1
        if arm != self.baseline:  # a loser's re-check doubles its gap (``update``: one it wins resets it)
            self._last[arm] = self._round
            self._gap[arm] = self.min_gap if untried or arm == best else min(2 * self._gap[arm], self.max_gap)
        return arm

    def quiet_for(self) -> float:
        """How many rounds after this one surely go to plain decoding (no loser is due before)."""
        return max(0.0, self._quiet[1] - self._round - 1)

    def _spacing(self, arm: Hashable, best: Hashable) -> float:
        """Fewest rounds between plays of a losing ``arm``: its gap, and what keeps its cost within
        its part of the share (the losers split it evenly)."""
        if self.explore_share <= 0:
            return float("inf")
        losing = max(1, len(self.arms) - (best in self._gain))
        loss = self.speed(best) / max(self.speed(arm), 1e-6) - 1.0  # rounds lost per play
        return max(float(self._gap[arm]), loss * losing / self.explore_share)

    def update(self, arm: Hashable, gain: float, cost: float) -> None:
        if arm not in self._gain:
            return
        self._quiet = (self.baseline, 0)  # speeds change: due rounds too
        if gain > cost * self.speed(self.best()):  # a play that beat the best: re-check it soon
            self._gap[arm] = self.min_gap
        self._tries[arm] += max(1.0, (cost * self.speed(self.best()) / max(gain, 1e-9) - 1.0) / self.try_loss)
        self._gain[arm], self._cost[arm] = self._gain[arm] * self.decay + gain, self._cost[arm] * self.decay + cost


RUN = "run"  # the gate's arm: let the drafter draft (its baseline: draft nothing)
ONE = "one"  # an arm a drafter may offer beside it: draft one guess, its tree's likeliest node


class TreeSteps:
    """Around a drafter whose drafting costs time (a lookup, a head's or a draft model's forwards):
    whether it drafts this step, how much of its ranked tree to verify, and what both teach.

    Whether: the ``gate``, a ``Bandit`` of ``arms`` against drafting nothing, scored per step drafted
    as tokens over the verify's cost plus the drafter's own seconds, in plain forwards, so "cannot
    pay here" is a measurement, not a flag; kept across a session's answers with a slow memory
    (about 100 steps: drafting that pays only in rare runs); 16 tries, a head's losing 1.5 steps
    count 3. How much: the ``sizer``; a withheld tree goes to a ``Ledger``. With the arm ``ONE``
    (offered by a drafter whose every tree level costs time), a step verifies its likeliest guess
    alone and ``limit`` tells the drafter to grow no further: the cheapest drafting there is,
    measured beside the sizer's trees, whose estimates are noisiest exactly where the margin is
    thin (SmolLM2 F16's EAGLE-3 head run by llama.cpp, 2 CPU cores: sized trees 0.97x with the gate
    mostly shut, one guess a step 1.11x). Per step: ``open`` (False: don't draft), rank,
    ``propose(tree)``, ``observe``; a drafter that sizes first calls ``drafted``. Why an answer
    drafted nothing: ``declined``.
    """

    def __init__(self, costs: CostModel, *, max_nodes: int, adaptive: bool, prior: float = 0.7, sizer: Sizer | None = None,
                 gate: Bandit | None = None, arms: Sequence[str] = (RUN,),
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.sizer = sizer or Sizer(costs, max_nodes=max_nodes, prior=prior)
        self.gate = gate or Bandit(arms, baseline="off", min_tries=16, decay=0.99, try_loss=0.5)
        self.costs, self.adaptive, self.clock = self.sizer.costs, adaptive, clock
        self.begin()

    def begin(self) -> None:
        self._ledger = Ledger()
        self._verified: tuple[RankedTree, int] | None = None  # this step's tree and how many nodes went
        self._context_len, self._start, self.quiet = 0, 0.0, False
        self._ran: float | None = None  # seconds spent drafting this step (None: it did not draft)
        self._arm: str = RUN  # the gate's arm this step
        self._withheld = self._sent = False  # at some step of this answer the sizer sent nothing / some nodes

    @property
    def declined(self) -> str:
        """Why this answer drafted nothing, in words (``Drafter.declined``), when these steps chose
        so: the gate, with the speed measured where it drafted, or trees whose every node was too
        unlikely to repay its verify. A user who trained a head for half an hour and sees tau 1.00
        is owed the reason."""
        if self._sent or not self.adaptive:
            return ""
        if self.losing:
            speed = max(self.gate.speed(arm) for arm in self.gate.arms)
            return (f"drafting lost to plain decoding here: {speed:.2f}x its speed in the "
                    "steps that drafted (it is re-tried now and then)")
        if self._withheld:
            return "no guess was likely enough to repay its verify on this machine's measured cost curve"
        return ""

    @property
    def limit(self) -> int | None:
        """Most nodes this step verifies, where its arm sets them (``ONE``: 1)."""
        return 1 if self._arm == ONE else None

    @property
    def losing(self) -> bool:
        """The gate finds that no way of drafting beats drafting nothing here."""
        return self.gate.best() == self.gate.baseline

    def open(self, context: Sequence[int], budget: Budget, *, ready: bool = True, lead: int = 0) -> bool:
        """A step starts: settle withheld trees; whether to draft now (``ready``: the drafter has what
        it reads this step, or is ``quiet``); if so the clock starts. ``quiet``: the gate stays shut
        ``lead`` steps more, so the step's hidden states will not be read (``QUIET_PROPOSAL``)."""
        self._context_len = len(context)
        self._verified = self._ran = None
        for tree, matched in self._ledger.resolve(context):
            self.sizer.update(tree, len(tree.tokens), matched)
        can = ready and budget.max_nodes > 0 and budget.max_depth > 0
        self._arm = self.gate.choose() if can and self.adaptive else RUN
        if not can or self._arm == self.gate.baseline:
            self.quiet = self.adaptive and 0 < lead <= self.gate.quiet_for()
            return False
        self._ran, self._start, self.quiet = 0.0, self.clock(), False
        return True

    def drafted(self) -> None:
        """Drafting is done for this step: the clock stops."""
        if self._ran is not None:
            self._ran += self.clock() - self._start

    def aside(self, seconds: float) -> None:
        """``seconds`` of this step's drafting were paid for a run of steps, not for this one (a
        head reading a backlog of states: the prompt's, or those of steps the gate kept shut):
        kept out of what the gate scores the step, or every answer's first step and every re-try
        would look like a loss and a head that pays step by step would never be let draft."""
        if self._ran is not None:
            self._ran -= seconds

    def propose(self, tree: RankedTree) -> Proposal:
        """``tree`` ranked best first: the prefix worth verifying (or nothing, and the ledger)."""
        self.drafted()
        if self.limit is not None:  # the arm's own size: measured as it is, not sized on estimates
            n, chances = min(self.limit, len(tree.tokens)), self.sizer.chances(tree)
        elif self.adaptive:
            n, chances = self.sizer.plan(tree, context=self._context_len)
        else:
            n, chances = len(tree.tokens), self.sizer.chances(tree)
        if n == 0:
            self._ledger.add(self._context_len, tree)
            self._withheld |= len(tree.tokens) > 0  # guesses there were (a lookup may find none)
            return EMPTY_PROPOSAL
        self._verified, self._sent = (tree, n), True
        return tree.proposal(n, chances)

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        """The verify's time goes to the cost model; the sizer learns what its nodes won, the gate
        what the step paid (what its own nodes won, over their verify and the drafting time)."""
        self.costs.observe(verdict.drafted, self._context_len, out.seconds)
        if verdict.drafted and self._verified is not None:
            self.sizer.update(*self._verified, verdict.accepted)
        if self._ran is not None:
            one = self.costs.seconds(0, self._context_len)
            cost = cost_at(self.costs.relative(self._context_len), verdict.drafted) + (self._ran / one if one > 0 else 0.0)
            self.gate.update(self._arm, verdict.accepted + 1, cost)
            self._ran = None
