"""What every trained-head drafter (``medusa``, ``eagle2``) does around its own guessing.

A head ranks candidate nodes with a chance each; the rest is the same for every kind of head:

- the gate (``drafting_gate``): run the head at all this step? Running it costs time even when
  nothing it guesses is accepted, so every step that ran it is scored as tokens emitted over the
  verify's cost plus the head's own time, in target forwards, against plain decoding's 1;
- the sizer (``TreeSizer``): how many of the ranked nodes to verify, from the measured verify
  costs and the chances, calibrated by what the target accepted;
- the ledger: a tree the sizer chose not to verify is still scored against the text that follows,
  so the calibration does not freeze at "never pays".
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from backends.core.controller import Bandit, Ledger, TreeSizer, chain_path_probs, drafting_gate
from backends.core.planner import MIN_GAIN, cost_at, expected_speeds
from backends.core.costs import CostModel
from backends.core.types import EMPTY_PROPOSAL, Budget, Proposal, TargetOutput, Verdict
from backends.drafters.rest import RankedTree

HEADS = "heads"  # the gate's arm: run the heads (its baseline: draft nothing)


class HeadSteps:
    """Gate, sizer, ledger and the head's clock for one drafter."""

    def __init__(self, *, max_nodes: int, adaptive: bool, costs: CostModel | None = None,
                 sizer: TreeSizer | None = None, gate: Bandit | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        costs = costs or CostModel.from_relative([1.0] * (max_nodes + 1))
        self.sizer = sizer or TreeSizer(costs, max_nodes=max_nodes, prior=0.8)
        self.gate = gate or drafting_gate(HEADS)
        self.adaptive = adaptive
        self.clock = clock
        self.head_seconds = 0.0  # time the head took, over the answer
        self.begin()

    def begin(self) -> None:
        self._ledger = Ledger()
        self._predicted = 0.0
        self._context_len = 0
        self._ran: float | None = None  # seconds the head took this step (None: it did not run)
        self._started = 0.0
        self.head_seconds = 0.0

    def open(self, context: Sequence[int], budget: Budget, *, ready: bool = True) -> bool:
        """A step starts: settle old trees; whether the head should run now (the clock starts).
        ``ready``: the head has what it reads (a state) this step."""
        self._context_len = len(context)
        self._predicted = 0.0
        self._ran = None
        for _, matched, predicted in self._ledger.resolve(context):
            self.sizer.update(predicted, matched)
        if not ready or budget.max_nodes <= 0 or budget.max_depth <= 0:
            return False
        if self.adaptive and self.gate.choose() != HEADS:  # the head has not paid lately
            return False
        self._started = self.clock()
        return True

    def charge(self, seconds: float) -> None:
        """Head time spent outside ``open``..``propose`` that belongs to this step (catching up)."""
        self.head_seconds += seconds
        if self._ran is not None:
            self._ran += seconds

    def propose(self, tree: RankedTree) -> Proposal:
        """The head ranked ``tree`` (best first); the clock stops and the sizer picks a prefix."""
        self._ran = self.clock() - self._started
        self.head_seconds += self._ran
        n = self.sizer.choose(tree.probs, context=self._context_len) if self.adaptive else len(tree.tokens)
        if n == 0:
            self._ledger.add(self._context_len, tree.proposal(len(tree.tokens)), float(tree.probs.sum()))
            return EMPTY_PROPOSAL
        self._predicted = float(tree.probs[:n].sum())
        return tree.proposal(n, self.sizer.calibration())

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        costs = self.sizer.costs
        costs.observe(verdict.drafted, self._context_len, out.seconds)
        if verdict.drafted:
            self.sizer.update(self._predicted, verdict.accepted)
        if self._ran is not None:  # score the head: what this step won, over its verify and the head's time
            one = costs.seconds(0, self._context_len)
            cost = cost_at(costs.relative(self._context_len), verdict.drafted) + (self._ran / one if one > 0 else 0.0)
            self.gate.update(HEADS, verdict.accepted + 1, cost)


def chain_tokens(agreement: Sequence[float], depth: int) -> float:
    """Tokens a step emits on average when it verifies a chain of the head's top guesses ``depth``
    deep: the bonus token plus each guess whose guesses before it were all right. ``agreement``
    is the head's held-out top-1 agreement per guess, each given the ones before it were right
    (what ``specdeck train`` records). Example: [0.5, 0.4] at depth 2: 1 + 0.5 + 0.2 = 1.7."""
    return 1.0 + sum(chain_path_probs(agreement, min(depth, len(agreement))))


def could_pay(agreement: Sequence[float], costs: CostModel, head_forwards: Callable[[int], float], *,
              min_gain: float = MIN_GAIN) -> bool:
    """Whether a head with this agreement could beat plain decoding on this machine: at the best
    chain depth, the tokens it emits over the verify's measured cost plus the head's own time
    (``head_forwards(depth)``, in target forwards), at the shortest measured context (where
    verifying is cheapest). A tree does better than its chain, which is why auto still measures
    a head that passes; one that fails here would only cost the answers it is tried on.

    Example: SmolLM2 F16 on 2 AMD cores, verifying 2 rows costs 1.86 forwards: EAGLE's
    agreement 0.35 gives 1.35 tokens for 1.86 + 0.25, far below 1."""
    relative = costs.relative(costs.contexts[0])
    chances = chain_path_probs(agreement, len(agreement))
    speeds = [expected_speeds(chances[:k], relative, fixed_cost=head_forwards(k))[k] for k in range(1, len(chances) + 1)]
    return bool(speeds) and max(speeds) > min_gain


def median_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    """The median time of ``run`` (its first call, which warms caches, not counted)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
