"""How much to verify: one rule for every drafter, chains and trees alike (README: "How SpecDeck
decides how much to verify", with a worked example). Verifying the ``n`` likeliest nodes costs
``cost[n]`` plain forwards (measured) plus drafting's own cost, and emits on average the bonus
token plus each node's chance (``Proposal.chances``):

    speed(n) = (1 + chance[0] + ... + chance[n - 1]) / (cost[n] + fixed_cost + n * per_node)

The best ``n`` goes, or nothing unless it beats plain decoding by ``MIN_GAIN`` (the estimates are
noisy; a step drafted for a promised 2% mostly loses).
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
    """Whether a drafter could beat plain decoding here at all, at its best-case ``chances``
    (perfect acceptance, a head's held-out agreement) with ``drafting(n)`` forwards to draft ``n``.
    Example: chances ``[1, 1]``, cost ``[1, 1.8, 2.0]``, a draft token at 0.8: at best 3 / (2.0 +
    1.6) = 0.83, so no: such a draft model is not among the arms a session tries."""
    speeds = [expected_speeds(chances[:n], relative, fixed_cost=drafting(n))[n] for n in range(1, len(chances) + 1)]
    return max(speeds, default=0.0) > min_gain


def plan_nodes(proposal: Proposal, relative: Sequence[float], budget: Budget) -> list[int]:
    """The nodes of ``proposal`` worth verifying, ascending (none when nothing is): of its nodes
    that fit one forward, likeliest first (ties in index order, so parents before children; none
    deeper than ``budget.max_depth``, within ``max_paths`` paths and ``max_nodes`` nodes), the
    ``best_size`` first."""
    chances = np.asarray(proposal.chances if proposal.chances is not None else [1.0] * proposal.size)
    fits = fit_paths(proposal.parents, budget.max_paths, order=np.argsort(-chances, kind="stable").tolist(),
                     allowed=tree_depths(proposal.parents) <= budget.max_depth)[: max(budget.max_nodes, 0)]
    return sorted(fits[: best_size(chances[fits].tolist(), relative)])
