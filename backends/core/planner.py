"""How much to verify: one rule for every drafter, chains and trees alike.

A drafter proposes nodes and states, per node, its chance that the target accepts the node and
every node above it (``Proposal.chances``, calibrated by the drafter on its own history). On this
machine, verifying ``n`` nodes costs ``cost[n]`` plain forwards (the measured curve,
``CostModel.relative``; ``cost[0] == 1``), and drafting may cost too: a one-off ``fixed_cost``
(a draft model catching up with the text) and ``per_node`` (each draft-model token). A verify of
the ``n`` likeliest nodes then emits on average the bonus token plus each node's chance,

    speed(n) = (1 + chance[0] + ... + chance[n - 1]) / (cost[n] + fixed_cost + n * per_node),

relative to plain decoding (``speed(0) == 1``). ``plan_nodes`` ranks the nodes by chance (a child never
outranks its parent: its chance is at most its parent's), keeps what the target can take in one
forward (``Budget``: nodes, depth, root-to-leaf paths) and verifies the best ``n``, or nothing
when no ``n`` beats plain decoding by ``MIN_GAIN`` (the estimates are noisy; a step that drafts
for a promised 2% mostly loses).

Worked example, SmolLM2 F16 on 2 AMD EPYC cores: verifying 1 node (2 rows) costs 1.86 forwards
and 4 nodes 1.98 (measured); say 1.90 and 1.95 for 2 and 3. Prompt lookup found a 3-token chain
after a long quoted span, chances 0.9, 0.81, 0.73: speeds 1.0, 1.9 / 1.86 = 1.02, 2.71 / 1.90 =
1.43, 3.44 / 1.95 = 1.76, so all three are verified. The same chain after a one-token match,
chances 0.3, 0.09, 0.03: at best 1.39 / 1.90 = 0.73, so nothing is, and the guess goes to the
drafter's ``Ledger`` to be scored against what the target writes next. On an Intel Xeon, where
1 node (2 rows) costs 1.24, the first chain's first node alone is worth 1.9 / 1.24 = 1.53.

Drafters differ only in where chances come from (prompt lookup and the draft model: per-position
acceptance counted per bucket; REST and the trained heads: shares or head probabilities times a
calibration learned per bucket) and in what drafting costs; the rule that sizes what they
propose is this one.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from backends.core.tree import fit_paths, tree_depths
from backends.core.types import Budget, Proposal

MIN_GAIN = 1.05  # the speed over plain decoding a verify must promise


def cost_at(relative: Sequence[float], n: int) -> float:
    """Relative cost of verifying ``n`` nodes; past the measured curve, grown linearly from its end."""
    k_max = len(relative) - 1
    return relative[n] if n <= k_max else relative[k_max] * n / max(k_max, 1)


def expected_speeds(chances: Sequence[float], relative: Sequence[float], *, fixed_cost: float = 0.0,
                    per_node: float = 0.0) -> list[float]:
    """``speed(n)`` above for n = 0..len(chances), the nodes taken in the order given.

    Example: chances ``[0.9, 0.81]``, cost ``[1, 1.8, 2.0]``: 1.0, 1.9 / 1.8 = 1.06, 2.71 / 2.0 = 1.36."""
    out, expected = [1.0], 1.0
    for n, chance in enumerate(chances, start=1):
        expected += chance
        out.append(expected / (cost_at(relative, n) + fixed_cost + n * per_node))
    return out


def best_size(chances: Sequence[float], relative: Sequence[float], *, fixed_cost: float = 0.0,
              per_node: float = 0.0, min_gain: float = MIN_GAIN) -> int:
    """How many of the ranked nodes to verify: the fastest count, or 0 unless it beats plain
    decoding by ``min_gain``."""
    speeds = expected_speeds(chances, relative, fixed_cost=fixed_cost, per_node=per_node)
    best = max(range(len(speeds)), key=speeds.__getitem__)
    return best if speeds[best] > min_gain else 0


def could_pay(chances: Sequence[float], relative: Sequence[float], drafting: Callable[[int], float] = lambda n: 0.0,
              *, min_gain: float = MIN_GAIN) -> bool:
    """Whether a drafter could beat plain decoding here at all: verifying the first ``n`` of
    ``chances`` (the best case it can hope for: perfect acceptance, or a head's held-out
    agreement) while drafting them costs ``drafting(n)`` forwards, for the best ``n``. What keeps
    a draft model nearly as slow as its target, or a head that agrees too rarely, off the arms a
    session tries. Example: chances ``[1, 1]``, cost ``[1, 1.8, 2.0]``, a draft token at 0.8: at
    best 3 / (2.0 + 1.6) = 0.83, so no."""
    speeds = [expected_speeds(chances[:n], relative, fixed_cost=drafting(n))[n] for n in range(1, len(chances) + 1)]
    return max(speeds, default=0.0) > min_gain


def ranked(proposal: Proposal, budget: Budget) -> list[int]:
    """The proposal's nodes likeliest first (ties in index order, so parents before children),
    less what does not fit one forward: nodes deeper than ``budget.max_depth`` or opening more
    than ``budget.max_paths`` paths (with their subtrees), then all but the first ``max_nodes``."""
    chances = np.asarray(proposal.chances if proposal.chances is not None else [1.0] * proposal.size)
    order = np.argsort(-chances, kind="stable").tolist()
    allowed = None if proposal.is_chain and proposal.size <= budget.max_depth else \
        tree_depths(proposal.parents) <= budget.max_depth
    return fit_paths(proposal.parents, budget.max_paths, order=order, allowed=allowed)[: max(budget.max_nodes, 0)]


def plan_nodes(proposal: Proposal, relative: Sequence[float], budget: Budget, *, fixed_cost: float = 0.0,
               per_node: float = 0.0, min_gain: float = MIN_GAIN) -> list[int]:
    """The nodes of ``proposal`` worth verifying, ascending (none when nothing is): its best
    ``best_size`` nodes by chance, within the budget."""
    if proposal.size == 0:
        return []
    order = ranked(proposal, budget)
    chances = proposal.chances if proposal.chances is not None else (1.0,) * proposal.size
    n = best_size([chances[i] for i in order], relative, fixed_cost=fixed_cost, per_node=per_node, min_gain=min_gain)
    return sorted(order[:n])
