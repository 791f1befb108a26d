"""How long to draft: the length that maximizes expected tokens per second, or nothing.

Verifying ``k`` drafted tokens costs ``cost[k]`` target forwards' worth of time (``cost[0] == 1``
is plain decoding; on a CPU ``cost[4]`` is 1.3x-2.5x depending on the weight type, so drafting is
not free). With per-position acceptance ``a_1, a_2, ...`` (position d accepted given d - 1 was),
drafting ``k`` tokens emits ``E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k`` tokens per step, so the
speed relative to plain decoding is ``E(k) / (cost[k] + k * draft_cost)``. ``choose`` returns the
best ``k``; when no ``k`` beats 1.0, it returns 0 (draft nothing) and probes again later so a
method that starts paying off is noticed.

Worked example: cost ``[1, 1.8, 2.0, 2.1]``, acceptance ``[0.9, 0.9, 0.9]``: E = 1.9, 2.71, 3.44,
speeds 1.06, 1.36, 1.64: draft 3. With acceptance ``[0.3, ...]`` every speed is below 1: draft 0.
"""

from __future__ import annotations

from typing import Sequence


class LengthController:
    """Online per-position acceptance estimates (one set per ``bucket``) and the length choice."""

    def __init__(
        self,
        costs: Sequence[float],
        *,
        max_len: int,
        prior: float = 0.6,
        prior_weight: float = 2.0,
        draft_cost: float = 0.0,
        probe_every: int = 8,
    ) -> None:
        if not costs or costs[0] <= 0:
            raise ValueError("costs must start with the cost of one-token decoding (> 0)")
        self.costs = [c / costs[0] for c in costs]
        self.max_len = min(max_len, len(self.costs) - 1)
        self.prior = prior
        self.prior_weight = prior_weight
        self.draft_cost = draft_cost
        self.probe_every = probe_every
        self._counts: dict[object, list[list[float]]] = {}  # bucket -> [[accepted, tried] per position]
        self._idle: dict[object, int] = {}

    def acceptance(self, bucket: object = None) -> list[float]:
        """Estimated conditional acceptance per draft position, smoothed toward the prior."""
        counts = self._counts.get(bucket, [])
        rates = []
        for d in range(self.max_len):
            acc, tried = counts[d] if d < len(counts) else (0.0, 0.0)
            rates.append((acc + self.prior * self.prior_weight) / (tried + self.prior_weight))
        return rates

    def speedup(self, k: int, bucket: object = None) -> float:
        """Expected speed of drafting ``k`` tokens relative to plain decoding."""
        expected, survive = 1.0, 1.0
        for a in self.acceptance(bucket)[:k]:
            survive *= a
            expected += survive
        return expected / (self.costs[k] + k * self.draft_cost)

    def choose(self, available: int, bucket: object = None) -> int:
        """How many of ``available`` candidate tokens to draft now (0: none)."""
        limit = min(available, self.max_len)
        if limit <= 0:
            return 0
        best_k, best = 0, 1.0
        for k in range(1, limit + 1):
            s = self.speedup(k, bucket)
            if s > best:
                best_k, best = k, s
        if best_k == 0:
            idle = self._idle.get(bucket, 0) + 1
            self._idle[bucket] = idle
            if idle >= self.probe_every:  # keep learning: a cheap probe of one token
                self._idle[bucket] = 0
                return 1
        return best_k

    def update(self, drafted: int, accepted: int, bucket: object = None) -> None:
        """Record one verdict: positions 1..accepted+1 were tried, 1..accepted accepted."""
        counts = self._counts.setdefault(bucket, [])
        while len(counts) < drafted:
            counts.append([0.0, 0.0])
        for d in range(min(drafted, accepted + 1)):
            counts[d][1] += 1.0
            if d < accepted:
                counts[d][0] += 1.0
