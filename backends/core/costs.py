"""What verification costs on this machine, so draft lengths are chosen, not guessed.

A forward over the root plus ``k`` drafted tokens costs far more than one token on a CPU, by an
amount that depends on the weights, the build's kernels and the context (every drafted token
attends to all of it). SmolLM2 F16 on 2 cores, relative to one token: k = 1 1.7x; k = 4 2.0x at
64 tokens of context, 2.4 to 2.7x at 1024; k = 16 4.0x and 6.1 to 6.7x. So the curve is measured
(``backends.core.timing``) and kept current from the verify times seen while generating.
"""

from __future__ import annotations

import bisect
from typing import Mapping, Sequence


class CostModel:
    """Seconds of a verify forward with ``k`` drafted tokens at a given context length.

    ``curves`` maps a context length to measured seconds for k = 0..K, interpolated between
    lengths and extrapolated linearly beyond them (as attention's cost grows). ``observe`` folds
    real verify times in as correction factors (moving averages of measured over curve: the
    machine's ``level`` from single-token forwards, ``batched`` from batched ones; their ratio is
    the ``shape``), so a busier machine shifts the estimates within a few steps.

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
        self._curves = [[float(x) for x in curves[c][: self.k_max + 1]] for c in self.contexts]  # [contexts][k_max + 1]
        # Measured/predicted: ``level`` (the machine now) from single-token forwards, ``batched`` from
        # batched ones only (plain decoding once priced a node at 2.9 forwards, not 1.9); None until
        # one is seen: batches follow the machine.
        self._level, self._batched = 1.0, None
        self._seen = [0, 0]  # single-token and batched forwards observed: the first ones are averaged

    @property
    def _shape(self) -> float:
        """What a batch costs on top of the machine's level: the two running means' ratio, not a
        mean of batched times over the level *at the time*. Live forwards run slower than the
        curve's fastest-of-5 (SmolLM2 F16, 2 cores: 1.18x), and an answer's first steps, which
        draft, came before the level had learned it: the shape took the level's error (1.15),
        kept it while the gate drafted little, and priced one drafted token at 1.17-1.31 plain
        forwards where it cost 1.04-1.07."""
        return 1.0 if self._batched is None else self._batched / self._level

    @property
    def curves(self) -> dict[int, list[float]]:
        """The measured curves, context -> seconds for k = 0..k_max (what the cache file keeps)."""
        return {c: list(row) for c, row in zip(self.contexts, self._curves)}

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

    def _row(self, context: int, upto: int) -> list[float]:
        """Measured seconds for k = 0..``upto`` at ``context``, between (or past) the nearest two curves.
        Lists: right after a forward (cold caches) numpy's calls took 55 us here, 0.5% of an F16 token."""
        if len(self.contexts) == 1:
            return self._curves[0][: upto + 1]
        i = min(max(bisect.bisect_right(self.contexts, context) - 1, 0), len(self.contexts) - 2)
        (c0, c1), (r0, r1) = self.contexts[i : i + 2], self._curves[i : i + 2]
        w = (context - c0) / (c1 - c0)
        return [max(a + (b - a) * w, 1e-9) for a, b in zip(r0[: upto + 1], r1)]

    def seconds(self, k: int, context: int) -> float:
        k = min(k, self.k_max)
        return self._row(context, k)[k] * self._level * (self._shape if k else 1.0)

    def batch_seconds(self, n: int, context: int) -> float:
        """Seconds to decode ``n`` tokens together (a prefill or a draft model's catch-up): the
        curve up to its end, then at the rate of its longest measured batch."""
        if n - 1 <= self.k_max:
            return self.seconds(max(n - 1, 0), context)
        return self.seconds(self.k_max, context) * n / (self.k_max + 1)

    def relative(self, context: int, upto: int | None = None) -> list[float]:
        """Cost of k = 0..K (at most ``upto``) drafted tokens relative to plain decoding, never
        decreasing in k. A list: asked on every step, where numpy's overhead would dominate."""
        row = self._row(context, self.k_max if upto is None else min(upto, self.k_max))
        out, scale = [1.0], self._shape / row[0]
        for seconds in row[1:]:
            out.append(max(out[-1], seconds * scale))
        return out

    def observe(self, k: int, context: int, seconds: float) -> None:
        """Fold one measured verify time into the estimates (past the first few, one outlier moves
        them little)."""
        if k > self.k_max or seconds <= 0:
            return
        ratio = seconds / self._row(context, k)[k]
        now = self._batched if k and self._batched is not None else self._level
        self._seen[k > 0] += 1  # a plain mean at first, then a moving one: the prior is a guess
        now += max(self.smoothing, 1.0 / self._seen[k > 0]) * (min(max(ratio, 0.5 * now), 2.0 * now) - now)
        if k:
            self._batched = now
        else:
            self._level = now
