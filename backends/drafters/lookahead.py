"""``lookahead``: Lookahead decoding (Fu et al.): Jacobi iteration plus an n-gram pool, no draft model.

Two branches hang under the root in ONE target forward:

- The lookahead branch: a window of ``W`` guesses for the next positions, laid out as a chain, so
  guess ``k`` sees the guesses before it. The target's outputs at the chain nodes are its
  predictions for the following positions given those guesses: one Jacobi iteration. The
  predictions become the next step's window (shifted by what the step emitted), and the guesses
  improve from iteration to iteration the way Jacobi decoding converges.
- The verification branch: up to ``G`` candidates from the n-gram pool that start with the root
  token, each ``N - 1`` tokens long, merged into one trie with the lookahead chain.

Both branches are ordinary tree nodes, so the acceptance rule and therefore losslessness are the
same as for every other method: the target keeps the longest path it agrees with.

The pool. An n-gram is collected along a Jacobi trajectory: the prediction for position ``q`` was
made with guess ``x`` at ``q - 1``, which was itself predicted with guess ``w`` at ``q - 2`` one
iteration earlier, and so on; ``(w, x, prediction)`` is a 3-gram the model itself finds likely.
The pool also takes every n-gram of the prompt and of the text generated so far (the paper's
trick, and what makes lookahead good at repeating).

How wide. Wide verification costs more on a CPU than on a GPU (SmolLM2 F16 on 2 cores: 8 tokens
cost 1.9 forwards), so a fixed (W, G) loses somewhere. ``ShapeBandit`` tries a few shapes and
keeps the one with the best measured tokens per unit of verify cost, including plain decoding
(no tree at all), and re-probes the others now and then as the pool grows or the machine's load
changes.

Example: W = 3, N = 3, G = 2, root ``the``, window ``[cat, on, mat]``, pool for ``the``:
``(cat, sat)``, ``(dog, ran)``. The tree: ``the -> cat -> (on -> mat, sat)`` and ``the -> dog -> ran``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from backends.core.controller import Bandit
from backends.core.planner import cost_at
from backends.core.costs import CostModel
from backends.core.protocols import Drafter
from backends.core.settings import Settings, bounded
from backends.core.types import EMPTY_PROPOSAL, ROLLBACK, TREE, Budget, Proposal, TargetOutput, Verdict
from backends.drafters.merge import merge


@dataclass(frozen=True)
class LookaheadSettings(Settings):
    window: int = bounded(4, 0, 16)  # W: Jacobi guesses verified per step (the lookahead branch)
    ngram: int = bounded(3, 2, 8)  # N: n-gram length; a candidate drafts N - 1 tokens
    guesses: int = bounded(3, 0, 16)  # G: most pool candidates verified per step
    pool_per_token: int = bounded(8, 1, 64)  # most continuations kept per starting token (newest win)
    adaptive: bool = True  # let the bandit pick W and G (up to the values above) by measured speed

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window == 0 and self.guesses == 0:
            raise ValueError("window and guesses are both 0: lookahead would never draft")


class NgramPool:
    """Continuations of ``n - 1`` tokens keyed by the token before them, newest first."""

    def __init__(self, n: int, per_token: int) -> None:
        self.n, self.per_token = n, per_token
        self._by_first: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, gram: Sequence[int]) -> None:
        if len(gram) != self.n:
            return
        bucket = self._by_first.setdefault(int(gram[0]), OrderedDict())
        key = tuple(int(t) for t in gram[1:])
        bucket[key] = None
        bucket.move_to_end(key, last=False)
        while len(bucket) > self.per_token:
            bucket.popitem(last=True)

    def add_text(self, tokens: Sequence[int], start: int) -> None:
        """Every n-gram of ``tokens`` that ends at index ``start`` or later."""
        for end in range(max(start, self.n - 1), len(tokens)):
            self.add(tokens[end - self.n + 1 : end + 1])

    def candidates(self, token: int, k: int) -> list[tuple[int, ...]]:
        bucket = self._by_first.get(int(token))
        return list(bucket)[:k] if bucket else []

    def __len__(self) -> int:
        return sum(len(b) for b in self._by_first.values())


class ShapeBandit(Bandit):
    """Which (W, G) to verify: the shape with the best measured tokens per unit of verify cost.

    Each shape's record is emitted tokens and relative verify cost (from the cost model, so a
    noisy wall clock does not decide). Plain decoding, (0, 0), is the baseline worth exactly 1.
    """

    def __init__(self, shapes: Sequence[tuple[int, int]], *, min_tries: int = 2,
                 decay: float = 0.97, **options: float) -> None:
        """Re-probing the losing shapes costs the bandit's default 0.3% of the rounds: where no
        shape pays (every CPU measured so far) the probes are pure loss, and each costs a wide
        forward for about one token. On SmolLM2 Q4_1 (60 Spec-Bench prompts, cost-model units)
        lookahead ran at 0.995 of plain decoding with it, 0.990 with a 1% share. With the 5
        default shapes, one 10% short of paying is re-checked every 185 rounds (an answer or two),
        one at half speed every 1,700.
        """
        super().__init__(shapes, baseline=(0, 0), min_tries=min_tries, decay=decay, **options)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return self.arms

    def settled(self) -> tuple[int, int]:
        """The shape chosen most often so far (what this machine settled on)."""
        return max(self.chosen, key=self.chosen.__getitem__) if self.chosen else self.baseline


def default_shapes(settings: LookaheadSettings) -> list[tuple[int, int]]:
    """Full, half and zero window, with and without pool candidates."""
    w, g = settings.window, settings.guesses
    return [(a, b) for a in sorted({w, w // 2, 0}) for b in sorted({g, 0}) if (a, b) != (0, 0)]


class LookaheadDrafter(Drafter):
    requires: frozenset[str] = frozenset({TREE, ROLLBACK})

    def __init__(self, settings: LookaheadSettings | None = None, *, costs: CostModel | None = None,
                 bandit: ShapeBandit | None = None) -> None:
        self.settings = settings or LookaheadSettings()
        s = self.settings
        self.costs = costs or CostModel.from_relative([1.0] * 17)
        self.bandit = bandit or ShapeBandit(default_shapes(s))
        self.begin([])

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        s = self.settings
        self._pool = NgramPool(s.ngram, s.pool_per_token)
        self._pool.add_text(prompt, 0)
        self._seen = len(prompt)
        self._base = len(prompt)  # context index the first window slot guesses
        self._window = self._fill({}, prompt, len(prompt))
        self._inputs: deque[dict[int, int]] = deque(maxlen=s.ngram - 1)
        self._shape = (0, 0)
        self._look_nodes: tuple[int, ...] = ()
        self._context_len = len(prompt)

    # -- propose ---------------------------------------------------------------------------
    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        if self._base != len(context):  # the text moved on without this drafter: a new window
            self._base = len(context)
            self._window = self._fill({}, context, len(context))
        self._context_len = len(context)
        self._pool.add_text(context, self._seen)
        self._seen = len(context)
        s = self.settings
        shape = self.bandit.choose() if s.adaptive else (s.window, s.guesses)
        w, g = shape
        self._shape = shape
        if w == 0 and g == 0:  # plain decoding, the shape a CPU mostly settles on: nothing to build
            self._inputs.append({len(context) - 1: int(context[-1])})
            self._look_nodes = ()
            return EMPTY_PROPOSAL
        window = list(self._window[: min(w, budget.max_depth)])
        g = min(g, budget.max_paths - (1 if window else 0))  # one sequence per branch
        cands = [c[: budget.max_depth] for c in self._pool.candidates(context[-1], g)] if budget.max_depth else []
        self._inputs.append({len(context) - 1: int(context[-1]), **{self._base + i: t for i, t in enumerate(window)}})
        tree = merge([Proposal.chain(window)] + [Proposal.chain(c) for c in cands])
        n = min(tree.proposal.size, budget.max_nodes)
        self._look_nodes = tuple(node for node in tree.maps[0] if node < n)
        if n == 0:
            return EMPTY_PROPOSAL
        p = tree.proposal
        return Proposal(p.tokens[:n], p.parents[:n])

    # -- observe ---------------------------------------------------------------------------
    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        self.costs.observe(verdict.drafted, self._context_len, out.seconds)
        if self._shape != self.bandit.baseline:  # plain decoding is worth 1 by definition
            cost = cost_at(self.costs.relative(self._context_len), verdict.drafted)
            self.bandit.update(self._shape, len(verdict.tokens), cost)
        predictions = self._predictions(out, verdict)
        if predictions:
            self._collect(predictions)
        new_len = self._context_len + len(verdict.tokens)
        history = list(verdict.tokens)
        self._base = new_len
        self._window = self._fill(predictions, history, new_len)

    def _predictions(self, out: TargetOutput, verdict: Verdict) -> dict[int, int]:
        """Jacobi: the target's next token after each lookahead node verified, by context index
        (merged with other drafters' trees, the verify may have kept only the window's start)."""
        rows = [verdict.row_of(node) for node in self._look_nodes]
        rows = rows[: rows.index(-1)] if -1 in rows else rows
        if not rows:
            return {}
        best = out.argmax(rows)  # [w]
        return {self._base + i + 1: int(t) for i, t in enumerate(best)}

    def _collect(self, predictions: dict[int, int]) -> None:
        """Diagonal n-grams: guesses at q - N + 1 .. q - 1 from successive iterations, then q."""
        n = self.settings.ngram
        levels = list(self._inputs)
        if len(levels) < n - 1:
            return
        for q, token in predictions.items():
            gram = [levels[-1 - j].get(q - 1 - j) for j in range(n - 1)][::-1]
            if all(t is not None for t in gram):
                self._pool.add([*gram, token])

    def _fill(self, predictions: dict[int, int], history: Sequence[int], base: int) -> list[int]:
        """The next window: predictions for ``base`` onwards, gaps filled from recent text (the
        paper starts from random tokens; recent ones converge sooner and keep runs reproducible)."""
        w = self.settings.window
        tail = list(history[-w:]) or [0]
        return [predictions.get(base + i, tail[i % len(tail)]) for i in range(w)]
