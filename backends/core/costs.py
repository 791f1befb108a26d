"""Measuring what verification costs on this machine, so drafting lengths are chosen, not guessed.

``measure_verify_costs(target, 8)`` times one forward of the root plus ``k`` drafted tokens for
k = 0..8 and returns the cost relative to k = 0 (plain decoding). On a CPU it is far from flat:
a quantized SmolLM2 verifying 4 extra tokens can cost 2-3 plain forwards, an F16 one 1.3-2.3x,
depending on the build's matrix kernels. Repetitions are interleaved across k so a burst of load
from another process spreads over all lengths instead of bending one of them, and the curve is
made non-decreasing (a longer batch never really costs less).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from backends.core.protocols import Target
from backends.core.types import Proposal, Verdict

_KEEP_ROOT = Verdict(path=(), tokens=(0,), drafted=0, draft_depth=0)


def time_forwards(target: Target, k_max: int, *, reps: int = 5, context: int = 64,
                  clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median seconds of one verify with k = 0..k_max drafted tokens. Leaves the cache empty."""
    token = min(100, target.n_vocab - 1)
    target.reset()
    target.prefill([token] * context)
    samples: list[list[float]] = [[] for _ in range(k_max + 1)]
    for _ in range(reps + 1):  # the first round warms caches and thread pools up
        for k in range(k_max + 1):
            start = clock()
            target.verify(token, Proposal.chain([token] * k))
            samples[k].append(clock() - start)
            target.commit(_KEEP_ROOT)
            target.truncate(context)
    target.reset()
    return [statistics.median(s[1:]) for s in samples]


def measure_verify_costs(target: Target, k_max: int, *, reps: int = 5) -> tuple[float, ...]:
    """Relative cost of verifying 0..k_max drafted tokens (1.0 = one plain decoding step)."""
    seconds = time_forwards(target, k_max, reps=reps)
    costs, highest = [], 0.0
    for s in seconds:
        highest = max(highest, s / seconds[0])
        costs.append(highest)
    return tuple(costs)
