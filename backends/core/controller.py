"""How long to draft: the length that maximizes expected tokens per second, or nothing.

Verifying ``k`` drafted tokens costs ``cost[k]`` target forwards' worth of time (``cost[0] == 1``
is plain decoding; on a CPU ``cost[4]`` is 1.3x-2.5x depending on the weight type and build, so
drafting is not free). With per-position acceptance ``a_1, a_2, ...`` (position d accepted given
d - 1 was), drafting ``k`` tokens emits ``E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k`` tokens per
step, and with a draft model costing ``draft_cost`` forwards per token the speed relative to plain
decoding is ``E(k) / (cost[k] + k * draft_cost)``. ``choose`` returns the best ``k``, or 0 (draft
nothing) when no ``k`` beats 1.0.

Worked example: cost ``[1, 1.8, 2.0, 2.1]``, acceptance ``[0.9, 0.9, 0.9]``: E = 1.9, 2.71, 3.44,
speeds 1.06, 1.36, 1.64: draft 3. With acceptance ``[0.3, ...]`` every speed is below 1: draft 0.

Estimates are counts with exponential forgetting (``decay`` per update), so the controller follows
a text that changes character halfway. A drafter whose guesses are free to make (prompt lookup)
also learns from the steps where it did not draft: ``ShadowLedger`` compares each withheld guess
with the tokens the target went on to emit, which under greedy decoding is exactly the acceptance
the guess would have had, and under sampling has the same probability (a one-hot draft ``x`` is
accepted with probability ``p(x)``, the chance that the target samples ``x``). Drafters whose
guesses cost a forward instead probe now and then with ``probe_every``.
"""

from __future__ import annotations

from typing import Hashable, Sequence


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
        probe_every: int | None = None,
        decay: float = 0.97,
    ) -> None:
        if not costs or costs[0] <= 0:
            raise ValueError("costs must start with the cost of one-token decoding (> 0)")
        self.costs = [c / costs[0] for c in costs]
        self.max_len = min(max_len, len(self.costs) - 1)
        self.prior = prior
        self.prior_weight = prior_weight
        self.draft_cost = draft_cost
        self.probe_every = probe_every
        self.decay = decay
        self._counts: dict[Hashable, list[list[float]]] = {}  # bucket -> [[accepted, tried] per position]
        self._idle: dict[Hashable, int] = {}
        # Even perfect acceptance cannot pay when verification and drafting cost too much.
        self.can_pay = any((k + 1) / (self.costs[k] + k * draft_cost) > 1.0 for k in range(1, self.max_len + 1))

    def acceptance(self, bucket: Hashable = None) -> list[float]:
        """Estimated conditional acceptance per draft position, smoothed toward the prior."""
        counts = self._counts.get(bucket, [])
        rates = []
        for d in range(self.max_len):
            acc, tried = counts[d] if d < len(counts) else (0.0, 0.0)
            rates.append((acc + self.prior * self.prior_weight) / (tried + self.prior_weight))
        return rates

    def speedup(self, k: int, bucket: Hashable = None) -> float:
        """Expected speed of drafting ``k`` tokens relative to plain decoding."""
        expected, survive = 1.0, 1.0
        for a in self.acceptance(bucket)[:k]:
            survive *= a
            expected += survive
        return expected / (self.costs[k] + k * self.draft_cost)

    def choose(self, available: int, bucket: Hashable = None) -> int:
        """How many of ``available`` candidate tokens to draft now (0: none)."""
        limit = min(available, self.max_len)
        if limit <= 0 or not self.can_pay:
            return 0
        best_k, best = 0, 1.0
        for k in range(1, limit + 1):
            s = self.speedup(k, bucket)
            if s > best:
                best_k, best = k, s
        if best_k == 0 and self.probe_every:
            idle = self._idle.get(bucket, 0) + 1
            self._idle[bucket] = idle
            if idle >= self.probe_every:  # keep learning: try the full length once
                self._idle[bucket] = 0
                return limit
        return best_k

    def update(self, drafted: int, accepted: int, bucket: Hashable = None) -> None:
        """Record one verdict: positions 1..accepted+1 were tried, 1..accepted accepted."""
        counts = self._counts.setdefault(bucket, [])
        for row in counts:
            row[0] *= self.decay
            row[1] *= self.decay
        while len(counts) < drafted:
            counts.append([0.0, 0.0])
        for d in range(min(drafted, accepted + 1)):
            counts[d][1] += 1.0
            if d < accepted:
                counts[d][0] += 1.0


class ShadowLedger:
    """Guesses that were not drafted, scored against the text the target actually produced.

    ``add(start, tokens, bucket)`` records that ``tokens`` were the guess for ``context[start:]``;
    ``resolve(context)`` returns ``(guessed, matched, bucket)`` for every guess the context has
    now confirmed or refuted. Example: guess ``[5, 6, 7]`` at 10; once ``context[10:12] == [5, 9]``
    it resolves to ``(3, 1, bucket)``.
    """

    def __init__(self) -> None:
        self._open: list[tuple[int, list[int], Hashable]] = []

    def add(self, start: int, tokens: Sequence[int], bucket: Hashable = None) -> None:
        if tokens:
            self._open.append((start, list(tokens), bucket))

    def resolve(self, context: Sequence[int]) -> list[tuple[int, int, Hashable]]:
        done, still_open = [], []
        for start, tokens, bucket in self._open:
            seen = context[start : start + len(tokens)]
            matched = 0
            while matched < len(seen) and seen[matched] == tokens[matched]:
                matched += 1
            if matched < len(seen) or len(seen) == len(tokens):
                done.append((len(tokens), matched, bucket))
            else:
                still_open.append((start, tokens, bucket))
        self._open = still_open
        return done
