"""What verification costs on this machine, so draft lengths are chosen, not guessed.

One forward over the root plus ``k`` drafted tokens costs far more than one token on a CPU, and
how much more depends on the weight type, the build's matrix kernels and the context length
(every drafted token attends to the whole context). Measured here for SmolLM2 F16 on 2 cores,
relative to one token: k = 1 costs 1.7x; k = 4 costs 2.0x at 64 tokens of context and 2.4 to
2.7x at 1024; k = 16 costs 4.0x and 6.1 to 6.7x; a 64-node tree 13x and 19x. A fixed draft length
loses on one machine or another; so the curve is measured, at lengths up to 16 and a 32-node
tree, and extended in a straight line to 64 nodes.

``time_forwards`` measures a curve after a short filler context, when a model is first loaded
(0.4 s on 2 cores for SmolLM2 F16, 0.5 s for Q4_1, where every extra node costs more).
``time_here`` measures one on top of what the cache holds: the session runs it once per model,
after the first long prompt's prefill, instead of prefilling a thousand tokens of filler at load
(that alone took 2 s). ``CostModel`` holds curves at one or more
context lengths, interpolates between them (beyond, it extrapolates: attention cost grows linearly
with context), and keeps learning from the verify times the target reports while generating
(``observe``): a machine that gets busier or a context past the measured range shifts the
estimates within a few steps.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Mapping, Sequence

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


class CostModel:
    """Seconds of a verify forward with ``k`` drafted tokens at a given context length.

    ``curves`` maps a context length to measured seconds for k = 0..K. Between measured lengths
    the seconds are interpolated linearly, beyond them extrapolated from the last two (attention
    cost grows linearly with context). ``observe`` folds real verify times in as correction
    factors (exponential moving averages, one for single-token forwards and one for batched ones),
    so the model tracks drift and errors of the first measurement.

    Example: ``CostModel({64: [0.010, 0.020], 1024: [0.013, 0.025]}).relative(544)`` is
    ``[1.0, 1.96]``: 0.0115 s and 0.0225 s at the midpoint.
    """

    def __init__(self, curves: Mapping[int, Sequence[float]], *, smoothing: float = 0.1) -> None:
        if not curves:
            raise ValueError("a cost model needs at least one measured curve")
        self.smoothing = smoothing
        self._set(curves)

    def _set(self, curves: Mapping[int, Sequence[float]]) -> None:
        self.contexts = sorted(curves)
        self.k_max = min(len(curves[c]) for c in self.contexts) - 1
        self._curves = np.array([list(curves[c][: self.k_max + 1]) for c in self.contexts])  # [contexts, k_max + 1]
        # Measured/predicted ratios learned while generating: one for single-token forwards, one
        # shared by all batched ones (their common level is what drifts; the shape holds).
        self._correction = [1.0, 1.0]
        self._last_row: tuple[int, np.ndarray] = (-1, self._curves[0])

    @property
    def curves(self) -> dict[int, list[float]]:
        """The measured curves, context -> seconds for k = 0..k_max (what the cache file keeps)."""
        return {c: row.tolist() for c, row in zip(self.contexts, self._curves)}

    def add_curve(self, context: int, seconds: Sequence[float]) -> None:
        """A curve measured at another context length. The corrections learned so far start over:
        they made up for the context the model could not see, which the new curve now shows."""
        if len(seconds) < self.k_max + 1:
            raise ValueError(f"a curve needs k = 0..{self.k_max}, got {len(seconds)} entries")
        self._set({**self.curves, context: list(seconds)})

    @classmethod
    def from_relative(cls, costs: Sequence[float]) -> CostModel:
        """A context-independent model from relative costs (tests, GPUs with flat curves)."""
        return cls({0: list(costs)})

    def _segment(self, context: int) -> tuple[int, float]:
        """The pair of measured contexts to interpolate between, and how far along ``context`` is."""
        i = min(max(bisect.bisect_right(self.contexts, context) - 1, 0), len(self.contexts) - 2)
        c0, c1 = self.contexts[i], self.contexts[i + 1]
        return i, (context - c0) / (c1 - c0)

    def _row(self, context: int) -> np.ndarray:
        """Measured seconds for k = 0..k_max at ``context``, inter- or extrapolated."""
        if len(self.contexts) == 1:
            return self._curves[0]
        if self._last_row[0] != context:  # asked several times per step
            i, frac = self._segment(context)
            t0, t1 = self._curves[i], self._curves[i + 1]
            self._last_row = (context, np.maximum(t0 + (t1 - t0) * frac, 1e-9))
        return self._last_row[1]

    def _measured(self, k: int, context: int) -> float:
        """One entry of ``_row`` without building the row (asked every step, at a new context)."""
        if len(self.contexts) == 1:
            return float(self._curves[0, k])
        i, frac = self._segment(context)
        t0, t1 = float(self._curves[i, k]), float(self._curves[i + 1, k])
        return max(t0 + (t1 - t0) * frac, 1e-9)

    def seconds(self, k: int, context: int) -> float:
        k = min(k, self.k_max)
        return self._measured(k, context) * self._correction[min(k, 1)]

    def batch_seconds(self, n: int, context: int) -> float:
        """Seconds to decode ``n`` tokens together (a prefill or a draft model's catch-up): the
        curve up to its end, then at the rate of its longest measured batch."""
        if n - 1 <= self.k_max:
            return self.seconds(max(n - 1, 0), context)
        return self.seconds(self.k_max, context) * n / (self.k_max + 1)

    def relative(self, context: int) -> list[float]:
        """Cost of k = 0..K drafted tokens relative to plain decoding, never decreasing in k."""
        row = self._row(context)
        one, batched = self._correction
        rel = row * (batched / (row[0] * one))
        rel[0] = 1.0
        return np.maximum.accumulate(np.maximum(rel, 1.0)).tolist()

    def observe(self, k: int, context: int, seconds: float) -> None:
        """Fold one measured verify time into the estimates (one outlier moves them little)."""
        if k > self.k_max or seconds <= 0:
            return
        i = min(k, 1)
        ratio = min(max(seconds / self._measured(k, context), 0.5 * self._correction[i]), 2.0 * self._correction[i])
        self._correction[i] += self.smoothing * (ratio - self._correction[i])


def widest_paying_batch(costs: CostModel, context: int, cap: int) -> int:
    """How many rows one forward should take to decode the most rows per second, from the
    measured curve: the smallest count within 5% of the best (more rows cost memory for little).

    Example: rows costing [1, 1.86, 1.9, 1.95, 1.98] x one row give 5 (2.5 rows per unit of time)."""
    rates = [n / costs.batch_seconds(n, context) for n in range(1, max(1, cap) + 1)]
    best = max(rates)
    return next(n for n, rate in enumerate(rates, 1) if rate >= 0.95 * best)


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
