"""``draft``: a smaller model with the same vocabulary guesses ahead; the target verifies.

The draft model runs in its own context (any ``Target``: a llama.cpp context, or the oracle in
tests). Its KV cache follows the committed text lazily: tokens the draft has not seen yet wait in
``_pending`` and are decoded together, in one forward, at the start of the next proposal.

Per step: catch up, then draft a chain token by token (each one a draft forward), stopping at the
length the controller expects to pay off or as soon as the draft's confidence (its top
probability) falls below ``min_confidence``. With ``tree_width > 1`` the runner-up tokens at each
depth hang as extra leaves beside the chain, so a near miss of the draft still gets verified in
the same target forward (useful on GPUs, where wide verification is nearly free).

After the verdict, the draft keeps the accepted prefix of what it decoded and queues the rest
(the accepted tokens it never decoded, and the bonus token) for the next catch-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from backends.core.controller import AcceptanceStats, LengthController
from backends.core.costs import CostModel
from backends.core.protocols import Target
from backends.core.sampling import make_rng, sample_token, target_distribution
from backends.core.types import TREE, Budget, Proposal, SamplingSettings, TargetOutput, Verdict

_TAKE_ALL = Verdict(path=(), tokens=(0,), drafted=0, draft_depth=0)


@dataclass(frozen=True)
class DraftSettings:
    max_draft: int = 8  # longest chain drafted in one step
    min_confidence: float = 0.5  # stop drafting when the draft's top probability is lower
    tree_width: int = 1  # 1: a chain; k > 1: k - 1 runner-up tokens beside each chain token
    adaptive: bool = True  # let the controller pick the length (False: always up to max_draft)

    def __post_init__(self) -> None:
        if not 1 <= self.max_draft <= 32:
            raise ValueError(f"max_draft must be in 1..32, got {self.max_draft}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {self.min_confidence}")
        if not 1 <= self.tree_width <= 8:
            raise ValueError(f"tree_width must be in 1..8, got {self.tree_width}")


def _chain_verdict(n: int) -> Verdict:
    """Commit every node of an ``n``-token chain (the draft's own catch-up)."""
    return Verdict(path=tuple(range(n)), tokens=(0,) * (n + 1), drafted=n, draft_depth=n)


class DraftModelDrafter:
    def __init__(
        self,
        draft: Target,
        settings: DraftSettings | None = None,
        *,
        sampling: SamplingSettings,
        target_vocab: int,
        costs: CostModel | None = None,
        draft_seconds: float | None = None,
        stats: AcceptanceStats | None = None,
    ) -> None:
        self.draft = draft
        self.settings = settings or DraftSettings()
        self.requires = frozenset({TREE}) if self.settings.tree_width > 1 else frozenset()
        self.sampling = sampling
        self.target_vocab = target_vocab
        self._rng = make_rng(None if sampling.seed is None else sampling.seed + 1)
        n = self.settings.max_draft
        costs = costs or CostModel.from_relative([1.0] * (n + 1))
        # Draft-model guesses cost forwards, so unlike prompt lookup this drafter probes now and then.
        self.controller = LengthController(costs, max_len=n, stats=stats or self.new_stats(), probe_every=16)
        # One draft forward in seconds (moving average of measured ones); None: assume half a target forward.
        self._draft_seconds = draft_seconds
        self._context_len = 0
        self._pending: list[int] = []
        self._decoded: list[int] = []  # chain tokens decoded into the draft during the last proposal
        self._base = 0  # draft n_past before those

    @staticmethod
    def new_stats() -> AcceptanceStats:
        """A draft model of the same family usually agrees with its target: start at 0.8."""
        return AcceptanceStats(prior=0.8)

    def begin(self, prompt: Sequence[int]) -> None:
        self.draft.prefill(prompt[:-1])
        self._pending = [prompt[-1]]
        self._decoded = []
        self._base = self.draft.n_past

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        room = self.draft.n_ctx - self.draft.n_past - len(self._pending)
        length = min(self.settings.max_draft, budget.max_depth, budget.max_nodes, room)
        self._context_len = len(context)
        if self.settings.adaptive:
            length = self.controller.choose(length, context=len(context), draft_cost=self._draft_cost(len(context)))
        self._decoded = []
        self._base = self.draft.n_past
        if length <= 0:
            return Proposal()
        row = self._catch_up()
        history = list(context)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[np.ndarray | None] = []
        parent = -1
        for depth in range(length):
            token, q, confidence = self._pick(row, history)
            if token >= self.target_vocab or (depth > 0 and confidence < self.settings.min_confidence):
                break
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            probs.append(q)
            for sibling in self._runners_up(row, token, budget.max_nodes - len(tokens)):
                tokens.append(sibling)
                parents.append(parent)
                probs.append(None)
            parent = node
            history.append(token)
            if depth + 1 < length and confidence >= self.settings.min_confidence:
                row = self._advance(token)
            else:
                break
        has_q = any(q is not None for q in probs)
        return Proposal(tuple(tokens), tuple(parents), tuple(probs) if has_q else None)

    def _draft_cost(self, context: int) -> float:
        """One draft forward relative to one target forward at this context length."""
        target_s = self.controller.costs.seconds(0, context)
        return 0.5 if self._draft_seconds is None else self._draft_seconds / target_s

    def _timed(self, out: TargetOutput) -> TargetOutput:
        if out.seconds > 0:
            prev = self._draft_seconds if self._draft_seconds is not None else out.seconds
            self._draft_seconds = 0.9 * prev + 0.1 * out.seconds
        return out

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        self.controller.costs.observe(verdict.drafted, self._context_len, out.seconds)
        if verdict.drafted:
            self.controller.update(verdict.draft_depth, verdict.accepted)
        accepted = list(verdict.tokens[:-1])
        keep = 0
        while keep < min(len(accepted), len(self._decoded)) and accepted[keep] == self._decoded[keep]:
            keep += 1
        self.draft.truncate(self._base + keep)
        self._pending.extend(accepted[keep:])
        self._pending.append(verdict.bonus)
        self._decoded = []

    # -- draft model steps ---------------------------------------------------------------------
    def _catch_up(self) -> np.ndarray:
        """Decode every pending token in one forward; the draft's logits for the next token."""
        root, rest = self._pending[0], self._pending[1:]
        out = self.draft.verify(root, Proposal.chain(rest))
        self.draft.commit(_chain_verdict(len(rest)))
        self._pending = []
        self._base = self.draft.n_past
        return out.logits[-1]

    def _advance(self, token: int) -> np.ndarray:
        out = self._timed(self.draft.verify(token, Proposal()))
        self.draft.commit(_TAKE_ALL)
        self._decoded.append(token)
        return out.logits[0]

    def _pick(self, row: np.ndarray, history: list[int]) -> tuple[int, np.ndarray | None, float]:
        """The draft's token, the distribution it came from (None: greedy) and its confidence."""
        if self.sampling.greedy:
            token = int(np.argmax(row))
            confidence = 1.0 / float(np.exp(row.astype(np.float64) - row[token]).sum())
            return token, None, confidence
        q = target_distribution(row, history, self.sampling)[: self.target_vocab]
        total = q.sum()
        if total <= 0.0:
            return self.target_vocab, None, 0.0  # nothing inside the target's vocabulary
        q = q / total
        return sample_token(q, self._rng), q, float(q.max())

    def _runners_up(self, row: np.ndarray, chosen: int, room: int) -> list[int]:
        want = min(self.settings.tree_width - 1, room - 1)
        if want <= 0:
            return []
        top = np.argpartition(row, -(want + 1))[-(want + 1) :]
        top = top[np.argsort(-row[top])]
        return [int(t) for t in top if t != chosen and t < self.target_vocab][:want]
