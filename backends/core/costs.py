"""What verification costs on this machine, so draft lengths are chosen, not guessed.

One forward over the root plus ``k`` drafted tokens costs far more than one token on a CPU, and
how much more depends on the weight type, the build's matrix kernels and the context length
(every drafted token attends to the whole context). Measured here for SmolLM2 F16 on 2 cores,
relative to one token: k = 1 costs 1.7x; k = 4 costs 2.0x at 64 tokens of context and 2.4 to
2.7x at 1024; k = 16 costs 4.0x and 6.1 to 6.7x; a 64-node tree 13x and 19x. A fixed draft length
loses on one machine or another; so the curve is measured, at lengths up to 16 and a few tree
sizes up to 64.

``time_forwards`` measures a curve after a short filler context, when a model is first loaded (a
second on 2 cores for SmolLM2 F16). ``time_here`` measures one on top of what the cache holds:
the session runs it once per model, after the first long prompt's prefill, instead of prefilling a
thousand tokens of filler at load (that alone took 2 s). ``CostModel`` holds curves at one or more
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


DENSE_SIZES = (0, 1, 2, 3, 4, 6, 8, 12, 16)  # chains measured; straight lines between them
DENSE_UP_TO = DENSE_SIZES[-1]
SPARSE_SIZES = (32, 64)
TREE_BRANCHES = 4  # the shape of the probes past DENSE_UP_TO: trees, as merged and retrieval drafts are
SHORT_CONTEXT = 64  # tokens of filler the load-time curve is measured after


def probe_sizes(k_max: int) -> list[int]:
    """Node counts whose verify time is measured for a curve up to ``k_max`` (always 0 and k_max).

    Not every length: straight lines between these stay within 6% of measuring every length up to
    16 (SmolLM2 F16, 2 cores), less than two measurements of one length scatter, at half the time.
    Example: ``probe_sizes(40)`` is ``0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 40``.
    """
    sizes = [k for k in DENSE_SIZES if k < k_max] + [k for k in SPARSE_SIZES if k < k_max]
    return sizes + [k_max]


def probe(token: int, k: int) -> Proposal:
    """A chain of ``k`` tokens up to DENSE_UP_TO, beyond it a tree of TREE_BRANCHES equal branches.

    A tree batch costs what a chain of as many tokens costs (measured for SmolLM2 F16 at 512 tokens
    of context: 8 to 64 nodes, 1 to 16 branches, within 3%), but the probe takes the tree path
    through the backend so a backend where it does not is measured as it is.
    """
    if k <= DENSE_UP_TO:
        return Proposal.chain([token] * k)
    parents: list[int] = []
    for branch in range(TREE_BRANCHES):
        length = k // TREE_BRANCHES + (1 if branch < k % TREE_BRANCHES else 0)
        parents += [-1] + [len(parents) + i for i in range(length - 1)]
    return Proposal((token,) * k, tuple(parents))


def interpolate(sizes: Sequence[int], seconds: Sequence[float]) -> list[float]:
    """Seconds for every k = 0..sizes[-1] from measurements at ``sizes`` (straight lines between)."""
    return [float(x) for x in np.interp(np.arange(sizes[-1] + 1), sizes, seconds)]


def _filler(target: Target) -> int:
    """The token probes and filler contexts are made of (any id works: cost ignores content)."""
    return min(100, target.n_vocab - 1)


def time_here(target: Target, k_max: int, *, reps: int = 2, clock: Callable[[], float] = time.perf_counter,
              stop: Callable[[], bool] = lambda: False) -> list[float] | None:
    """Fastest seconds of one verify with k = 0..k_max drafted nodes on top of what the cache holds.

    Leaves the cache as it found it, so it can run between a prompt's prefill and its first step.
    ``stop`` is asked before every probe; once it says yes the result is None (a user who pressed
    Stop waits at most one probe, a quarter second on 2 cores). One forward of the largest probe
    warms thread pools and compute buffers up first. Repetitions are interleaved across k, so a
    burst of load from another process spreads over all lengths instead of bending one. Past
    DENSE_UP_TO a probe costs up to 30 forwards (Q4_1 on 2 cores) and the curve is a straight
    line, so those sizes are timed once, in the last round.
    """
    context = target.n_past
    if context + k_max + 2 > target.n_ctx:
        raise ValueError(f"no room for a {k_max}-node probe after {context} tokens in a {target.n_ctx}-token context")
    token = _filler(target)
    sizes = probe_sizes(k_max)
    samples: dict[int, list[float]] = {k: [] for k in sizes}

    def timed(k: int) -> float:
        proposal = probe(token, k)
        start = clock()
        target.verify(token, proposal)
        seconds = clock() - start
        target.commit(_KEEP_ROOT)
        target.truncate(context)
        return seconds

    timed(k_max)  # the largest probe: the first batch of a size, or through the tree path, costs extra
    for round_ in range(reps):
        for k in sizes if round_ == reps - 1 else [k for k in sizes if k <= DENSE_UP_TO]:
            if stop():
                return None
            samples[k].append(timed(k))
    # interference only ever adds time: the fastest repetition is the truest
    return interpolate(sizes, [min(samples[k]) for k in sizes])


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
