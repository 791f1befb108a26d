"""``medusa``: Medusa-1 heads trained for this model guess the next few tokens from its last state.

After each verify the target's hidden state of the last accepted token is known (``HIDDEN_STATES``).
The target's own output layer turned it into the bonus token, the new root; head ``k`` reads the
same state and ranks the tokens ``k`` places further on (``backends.heads.medusa``). The heads do
not see each other's guesses, so a path's chance is estimated as the product of its tokens'
head probabilities, and the candidate tree is built best first: a node at depth ``k`` may take
any of head ``k + 1``'s top ``width`` tokens as a child. How many of the ranked nodes to verify is
the ``Sizer``'s call (measured verify costs against the predicted gain, calibrated by what
the target accepted); with ``width = 1`` the tree is a chain and needs no tree verify.

Running the heads costs about a tenth of a SmolLM2-135M forward on a CPU (1.3 ms: the four heads'
rows of the draft vocabulary), which is all loss where drafting does not pay; whether to run them
at all, and how many nodes to verify, is ``TreeSteps``' call (a gate and a sizer, shared with
``eagle2`` and ``rest``). Heads that do not pay on this machine then run only within the gate's
exploration share; heads that pay run every step.

Lossless: every guess is a deterministic proposal (one-hot ``q``), checked by SpecDeck's
acceptance rules; greedy output is plain decoding's, sampling keeps the target's distribution.
Medusa's "typical acceptance" would accept guesses the target only finds plausible and change
the output, so it is not offered.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from backends.core.controller import Bandit, Sizer, TreeSteps
from backends.core.costs import CostModel
from backends.core.errors import SpecDeckError
from backends.core.protocols import Drafter
from backends.core.settings import Settings, bounded
from backends.core.timing import median_seconds
from backends.core.types import (EMPTY_PROPOSAL, HIDDEN_STATES, QUIET_PROPOSAL, ROLLBACK, TREE, Budget, Proposal,
                                 RankedTree, TargetOutput, Verdict)
from backends.heads.medusa import MedusaHeads

@dataclass(frozen=True)
class MedusaSettings(Settings):
    head: str = ""  # a head file (.json) from `specdeck train medusa`; empty: the one found for the model
    width: int = bounded(3, 1, 16)  # candidates per head (1: a chain)
    max_nodes: int = bounded(24, 1, 64)  # most tree nodes verified in one step
    adaptive: bool = True  # False: always verify max_nodes nodes


def rank_medusa(ids: np.ndarray, probs: np.ndarray, *, max_nodes: int, max_depth: int) -> RankedTree:
    """The ``max_nodes`` likeliest nodes of the tree whose depth-``k`` nodes take head ``k``'s
    candidates (``ids``/``probs`` [K, width]), best first; a child's chance is its parent's times
    its own, so best-first order puts every parent before its children.

    Example: head 1 offers ``a`` (0.6) and ``b`` (0.3), head 2 ``c`` (0.5): ``a`` 0.6, ``a c``
    0.3, ``b`` 0.3, ``b c`` 0.15.
    """
    depth_limit = min(max_depth, len(ids))
    tokens: list[int] = []
    parents: list[int] = []
    chances: list[float] = []
    heap = [(-float(p), 0, j, -1) for j, p in enumerate(probs[0])] if depth_limit > 0 else []
    heapq.heapify(heap)
    while heap and len(tokens) < max_nodes:
        neg, depth, j, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(ids[depth, j]))
        parents.append(parent)
        chances.append(-neg)
        if depth + 1 < depth_limit:
            for c, p in enumerate(probs[depth + 1]):
                heapq.heappush(heap, (neg * float(p), depth + 1, c, node))
    return RankedTree(np.array(tokens, dtype=np.int32), np.array(parents, dtype=np.int32),
                      np.array(chances, dtype=np.float64))


class MedusaDrafter(Drafter):
    """Drafts from the heads; keeps the last accepted state between steps."""

    def __init__(self, heads: MedusaHeads, settings: MedusaSettings | None = None, *,
                 costs: CostModel | None = None, sizer: Sizer | None = None, gate: Bandit | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.heads = heads
        self.settings = settings or MedusaSettings()
        self.requires = frozenset({HIDDEN_STATES, ROLLBACK} | ({TREE} if self.settings.width > 1 else set()))
        self.prompt_states = 1  # the heads read the last state only
        costs = costs or CostModel.from_relative([1.0] * (self.settings.max_nodes + 1))
        self.steps = TreeSteps(costs, max_nodes=self.settings.max_nodes, adaptive=self.settings.adaptive, prior=0.8,
                               sizer=sizer, gate=gate, clock=clock)
        self.sizer, self.gate = self.steps.sizer, self.steps.gate
        self.begin([])

    def head_forwards(self, seconds_per_forward: float) -> Callable[[int], float]:
        """The heads' time per step in target forwards, by chain depth (one run gives every depth)."""
        state = np.zeros(self.heads.d, np.float32)
        once = median_seconds(lambda: self.heads.top(state, self.settings.width))
        return lambda depth: once / seconds_per_forward

    @property
    def declined(self) -> str:  # type: ignore[override]
        return self.steps.declined

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        if hidden is not None and hidden.ndim == 2 and hidden.shape[1] != self.heads.d:
            raise SpecDeckError(f"the head reads {self.heads.d}-wide hidden states, the model gives {hidden.shape[1]}")
        self._state = hidden[-1] if hidden is not None and len(hidden) else None  # [d]: the root's parent's
        self.steps.begin()

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        if not self.steps.open(context, budget, ready=self._state is not None or self.steps.quiet, lead=1):
            return QUIET_PROPOSAL if self.steps.quiet else EMPTY_PROPOSAL  # no state is read before a re-try
        s = self.settings
        ids, probs = self.heads.top(self._state, s.width)
        limit = min(s.max_nodes, budget.max_nodes)
        tree = rank_medusa(ids, probs, max_nodes=limit, max_depth=budget.max_depth).within_paths(budget.max_paths)
        return self.steps.propose(tree)

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        self.steps.observe(out, verdict)
        if out.hidden is None and not self.steps.quiet:
            raise SpecDeckError("the target returned no hidden states: Medusa heads cannot draft without them")
        self._state = None if out.hidden is None else out.hidden[verdict.state_rows[-1]]
