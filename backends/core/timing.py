"""Timing verify forwards on this machine: the measurements ``CostModel`` is built from.

``time_forwards`` measures a curve after a short filler context, when a model is first loaded
(0.4 s on 2 cores for SmolLM2 F16, 0.5 s for Q4_1, where every extra node costs more).
``time_here`` measures one on top of what the cache holds: the session runs it once per model,
after the first long prompt's prefill, instead of prefilling a thousand tokens of filler at load
(that alone took 2 s). ``CpuWatch`` tells whether another process was busy meanwhile, when a
timing must not be trusted.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from backends.core.protocols import Target
from backends.core.types import Proposal, Verdict

_KEEP_ROOT = Verdict(path=(), tokens=(0,), drafted=0, draft_depth=0)


DENSE_SIZES = (0, 1, 2, 4, 8, 16)  # chains measured; straight lines between them
DENSE_UP_TO = DENSE_SIZES[-1]
TWICE_UP_TO = 4  # chains this short are timed twice (the fastest counts): every draft pays them
SPARSE_SIZES = (32,)  # trees measured; beyond the last, the line through the last two goes on
TREE_BRANCHES = 4  # the shape of the probes past DENSE_UP_TO: trees, as merged and retrieval drafts are
SHORT_CONTEXT = 16  # tokens of filler the load-time curve is measured after


def probe_sizes(k_max: int) -> list[int]:
    """Node counts whose verify time is measured for a curve up to ``k_max``.

    Not every length: on SmolLM2 (2 cores) the cost grows in straight lines between these, within
    the 5 to 10% that two measurements of one length scatter by, and linearly past 16 nodes
    (F16: 4.4x at 16, 7.6x at 32, 14.2x at 64; extrapolated from 16 and 32, 64 nodes come out 2.5%
    low; Q4_1 1.8%). Measuring 0, 1, 2, 3, 4, 6, 8, 12, 16, 32 and 64 took 1.0 s on F16, 1.45 s on
    Q4_1; these take 0.4 and 0.5 s, with the filler prefill, and fit the curve as closely.
    Example: ``probe_sizes(64)`` is ``0, 1, 2, 4, 8, 16, 32``; ``probe_sizes(10)`` is
    ``0, 1, 2, 4, 8, 10``.
    """
    top = min(k_max, SPARSE_SIZES[-1])
    return [k for k in DENSE_SIZES + SPARSE_SIZES if k < top] + [top]


def probe(token: int, k: int, *, tree: bool | None = None) -> Proposal:
    """A chain of ``k`` tokens up to DENSE_UP_TO, beyond it (or when ``tree``) a tree of
    TREE_BRANCHES equal branches.

    A tree batch costs what a chain of as many tokens costs (measured for SmolLM2 F16 at 512 tokens
    of context: 8 to 64 nodes, 1 to 16 branches, within 3%), but the probe takes the tree path
    through the backend so a backend where it does not is measured as it is.
    """
    if not (k > DENSE_UP_TO if tree is None else tree):
        return Proposal.chain([token] * k)
    parents: list[int] = []
    for branch in range(min(TREE_BRANCHES, k)):
        length = k // TREE_BRANCHES + (1 if branch < k % TREE_BRANCHES else 0)
        parents += [-1] + [len(parents) + i for i in range(length - 1)]
    return Proposal((token,) * k, tuple(parents))


def interpolate(sizes: Sequence[int], seconds: Sequence[float], k_max: int | None = None) -> list[float]:
    """Seconds for every k = 0..k_max from measurements at ``sizes``: straight lines between them,
    and past the last the line through the last two (``k_max`` defaults to the last size)."""
    ks = np.arange((sizes[-1] if k_max is None else k_max) + 1)
    curve = np.interp(ks, sizes, seconds)
    if len(sizes) > 1 and ks[-1] > sizes[-1]:
        slope = max(seconds[-1] - seconds[-2], 0.0) / (sizes[-1] - sizes[-2])
        curve = np.where(ks > sizes[-1], seconds[-1] + slope * (ks - sizes[-1]), curve)
    return [float(x) for x in curve]


def _filler(target: Target) -> int:
    """The token probes and filler contexts are made of (any id works: cost ignores content)."""
    return min(100, target.n_vocab - 1)


def time_here(target: Target, k_max: int, *, reps: int = 2, clock: Callable[[], float] = time.perf_counter,
              stop: Callable[[], bool] = lambda: False) -> list[float] | None:
    """Fastest seconds of one verify with k = 0..k_max drafted nodes on top of what the cache holds.

    Leaves the cache as it found it, so it can run between a prompt's prefill and its first step.
    ``stop`` is asked before every probe; once it says yes the result is None (a user who pressed
    Stop waits at most one probe, 0.15 s on 2 cores). One small tree forward warms thread pools,
    compute buffers and the backend's tree path up first. Repetitions are interleaved across k, so
    a burst of load from another process spreads over all lengths instead of bending one. Chains
    up to TWICE_UP_TO are timed ``reps`` times: every draft pays them, and their scatter would
    move the whole relative curve (it is divided by k = 0). Longer probes cost several forwards
    each (32 nodes: 15 on Q4_1) and are timed once, in the last round.
    """
    context = target.n_past
    if context + k_max + 2 > target.n_ctx:
        raise ValueError(f"no room for a {k_max}-node probe after {context} tokens in a {target.n_ctx}-token context")
    token = _filler(target)
    sizes = probe_sizes(k_max)
    samples: dict[int, list[float]] = {k: [] for k in sizes}

    def timed(proposal: Proposal) -> float:
        start = clock()
        target.verify(token, proposal)
        seconds = clock() - start
        target.commit(_KEEP_ROOT)
        target.truncate(context)
        return seconds

    timed(probe(token, min(k_max, 2 * TREE_BRANCHES), tree=True))  # first batches, and trees, cost extra
    for round_ in range(reps):
        for k in sizes if round_ == reps - 1 else [k for k in sizes if k <= TWICE_UP_TO]:
            if stop():
                return None
            samples[k].append(timed(probe(token, k)))
    # interference only ever adds time: the fastest repetition is the truest
    return interpolate(sizes, [min(samples[k]) for k in sizes], k_max)


def time_forwards(target: Target, k_max: int, *, reps: int = 2, context: int = SHORT_CONTEXT,
                  clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """``time_here`` after ``context`` tokens of filler; leaves the cache empty."""
    target.reset()
    target.prefill([_filler(target)] * context)
    try:
        seconds = time_here(target, k_max, reps=reps, clock=clock)
        assert seconds is not None  # nothing asked it to stop
        return seconds
    finally:
        target.reset()


class CpuWatch:
    """CPU used by *other* processes while a block runs, in cores (0.0 on a quiet machine).

    On a 2-core machine one busy neighbour slows llama.cpp several-fold, so a timing taken
    meanwhile must not be trusted (or cached).
    """

    def __enter__(self) -> CpuWatch:
        import psutil

        self._proc = psutil.Process()
        self._t = time.perf_counter()
        self._sys = psutil.cpu_times()
        self._mine = self._proc.cpu_times()
        return self

    def __exit__(self, *exc: object) -> None:
        import psutil

        wall = max(time.perf_counter() - self._t, 1e-9)
        sys_now, mine_now = psutil.cpu_times(), self._proc.cpu_times()
        busy = (sys_now.user + sys_now.system) - (self._sys.user + self._sys.system)
        mine = (mine_now.user + mine_now.system) - (self._mine.user + self._mine.system)
        self.other_cores = max(0.0, (busy - mine) / wall)


def median_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    """The median time of ``run`` (its first call, which warms caches, not counted)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
