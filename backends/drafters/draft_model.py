"""``draft``: a smaller model with the same vocabulary guesses ahead; the target verifies.

The draft model runs in its own context (any ``Target``: a llama.cpp context, or the oracle in
tests). Its KV cache follows the committed text lazily: tokens the draft has not seen yet wait in
``_pending`` and are decoded together at the start of the next proposal (``Target.extend``: in
chunks the draft's batch holds, with logits for the last token only). The invariant, checked at
every proposal: the draft's cache followed by ``_pending`` is exactly the context.

Per step: catch up, then draft a chain token by token (each one a draft forward), stopping at the
length the sizer expects to pay off or as soon as the draft's confidence (its top
probability) falls below ``min_confidence``. With ``tree_width > 1`` the runner-up tokens at each
depth hang as extra leaves beside the chain, so a near miss of the draft still gets verified in
the same target forward (useful on GPUs, where wide verification is nearly free).

After the verdict, the draft keeps the accepted prefix of what it decoded and queues the rest
(the accepted tokens it never decoded, and the bonus token) for the next catch-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from backends.core.controller import Bandit, Sizer, TreeSteps, chain_tree
from backends.core.costs import CostModel
from backends.core.planner import could_pay
from backends.core.protocols import Drafter, Target
from backends.core.settings import Settings, bounded
from backends.core.sampling import make_rng, sample_token, target_distribution
from backends.core.tree import tree_depths
from backends.core.types import (EMPTY_PROPOSAL, ROLLBACK, TREE, Budget, Proposal, RankedTree, SamplingSettings,
                                 TargetOutput, Verdict)

# A backlog of text the draft has not seen (after steps it did not draft) is
# decoded once; the steps after it only catch up on what one step leaves behind (its last drafted
# token and the bonus). So the backlog is priced as a one-off, spread over the steps it enables,
# at most this many (the sizer's answer is revisited at about that pace anyway).
ONE_OFF_STEPS = 16
STEADY_CATCH_UP = 2  # tokens a drafting step leaves for the next catch-up
PRIOR = 0.8  # each draft token's chance before anything is learned: a draft of the same family mostly agrees


@dataclass(frozen=True)
class DraftSettings(Settings):
    max_draft: int = bounded(8, 1, 32)  # longest chain drafted in one step
    min_confidence: float = bounded(0.5, 0.0, 1.0, high_open=True)  # stop drafting when the draft's top probability is lower
    tree_width: int = bounded(1, 1, 8)  # 1: a chain; k > 1: k - 1 runner-up tokens beside each chain token
    adaptive: bool = True  # let the sizer pick the length (False: always up to max_draft)


class DraftModelDrafter(Drafter):
    """Drafts chains (with runner-up leaves) with the draft model, whenever its gate (``TreeSteps``)
    measured that drafting pays here and the sizer finds a length that does."""

    def __init__(
        self,
        draft: Target,
        settings: DraftSettings | None = None,
        *,
        sampling: SamplingSettings,
        target_vocab: int,
        costs: CostModel | None = None,
        draft_costs: CostModel | None = None,
        sizer: Sizer | None = None,
        gate: Bandit | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """``stop`` is asked between the chunks of the draft's own prompt prefill (Stop pressed);
        pass a ``sizer`` to keep what it learned across answers."""
        self.draft = draft
        self._stop = stop
        self.settings = settings or DraftSettings()
        self.requires = frozenset({TREE, ROLLBACK} if self.settings.tree_width > 1 else {ROLLBACK})
        self.sampling = sampling
        self.target_vocab = target_vocab
        self._rng = make_rng(None if sampling.seed is None else sampling.seed + 1)
        n = self.settings.max_draft
        # Without measurements: verification is flat and a draft forward costs half a target one.
        costs = costs or CostModel.from_relative([1.0] * (n + 1))
        self.draft_costs = draft_costs or CostModel.from_relative([0.5 * c for c in costs.relative(0)])
        # Draft-model guesses cost forwards, so unlike prompt lookup this drafter probes now and then.
        sizer = sizer or Sizer(costs, max_nodes=n, decay=0.97, probe_every=16)
        self.steps = TreeSteps(costs, max_nodes=n, adaptive=self.settings.adaptive, sizer=sizer, gate=gate)
        self.sizer, self.gate = self.steps.sizer, self.steps.gate
        self._context_len = 0
        self._pending: list[int] = []
        self._decoded: list[int] = []  # chain tokens decoded into the draft during the last proposal
        self._base = 0  # draft n_past before those
        self._off = False  # this answer's prompt does not fit the draft's context: no drafting

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        self.declined = ""  # why this answer was not drafted, for its stats (see _choose_length)
        self._decoded = []
        self._off = len(prompt) >= self.draft.n_ctx
        if self._off:  # a draft context shorter than the target's: this answer goes undrafted
            self._pending = []
            self.declined = f"the prompt does not fit the draft model's {self.draft.n_ctx}-token context"
            return
        self.draft.prefill(prompt[:-1], stop=self._stop)
        self._pending = [prompt[-1]]
        self._base = self.draft.n_past

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        self._context_len = len(context)
        self._decoded = []
        if self._off:
            return EMPTY_PROPOSAL
        self._check_in_step(context)
        self._base = self.draft.n_past
        length = min(self.settings.max_draft, budget.max_depth, budget.max_nodes, self.draft.n_ctx - len(context))
        if not self.steps.open(context, budget, ready=length > 0):
            if length > 0 and not self.declined:
                self.declined = self.steps.declined
            return EMPTY_PROPOSAL
        if self.settings.adaptive:
            length = self._choose_length(length, len(context), steps_left=budget.max_depth)
        proposal = self._draft_tree(self._catch_up(), list(context), length, budget.max_nodes) if length else EMPTY_PROPOSAL
        self.steps.drafted()
        return proposal

    @staticmethod
    def _chain(n: int) -> RankedTree:
        """``n`` chain positions as the sizer sees them (sized before drafting: placeholder tokens)."""
        return chain_tree(np.zeros(n, dtype=np.int32), PRIOR)

    def _check_in_step(self, context: Sequence[int]) -> None:
        """The draft's cache and the tokens waiting for it must be exactly the context (O(1))."""
        if self.draft.n_past + len(self._pending) != len(context):
            raise RuntimeError(f"the draft model is out of step with the text: its cache holds {self.draft.n_past} "
                               f"tokens and {len(self._pending)} wait, but the context has {len(context)}")

    def _choose_length(self, available: int, context: int, *, steps_left: int = ONE_OFF_STEPS) -> int:
        """The sizer's choice, priced with this draft's costs: one forward per drafted token
        after the first, the catch-up every drafting step needs (``STEADY_CATCH_UP`` tokens), and
        a backlog beyond that as a one-off spread over the steps it enables (at most
        ``ONE_OFF_STEPS``, and no more than ``steps_left``: an answer about to end cannot pay
        back a long catch-up).

        Example: a 30-token backlog costing 3 forwards is charged 3 forwards to a step that ends
        the answer but 0.175 per step over 16 steps, on top of the 0.1 of a steady catch-up.
        """
        target_s = self.sizer.costs.seconds(0, context)
        per_token = self.draft_costs.seconds(0, context) / target_s
        n = len(self._pending)
        steady = self.draft_costs.batch_seconds(min(n, STEADY_CATCH_UP), context) / target_s
        one_off = self.draft_costs.batch_seconds(n, context) / target_s - steady
        horizon = max(1, min(ONE_OFF_STEPS, steps_left))
        fixed = steady - per_token + one_off / horizon
        length = self.sizer.plan(self._chain(available), context=context, fixed_cost=fixed, per_node=per_token)[0]
        if length == 0 and not could_pay([1.0] * available, self.sizer.costs.relative(context),
                                         lambda k: fixed + k * per_token):
            self.declined = f"drafting would not pay here: a draft token costs {per_token:.2f}x a target forward"
        elif length == 0 and not self.declined:  # could pay, but not at the acceptance expected so far
            self.declined = (f"drafting would not pay here: a draft token costs {per_token:.2f}x a target forward, too much "
                             "for the acceptance expected so far")
        return length

    def _draft_tree(self, row: np.ndarray, history: list[int], length: int, max_nodes: int) -> Proposal:
        """A chain of up to ``length`` draft tokens (plus runner-up leaves when tree_width > 1)."""
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
            for sibling in self._runners_up(row, token, max_nodes - len(tokens)):
                tokens.append(sibling)
                parents.append(parent)
                probs.append(None)
            parent = node
            history.append(token)
            if depth + 1 >= length or confidence < self.settings.min_confidence:
                break
            row = self._advance(token, len(history))
        has_q = any(q is not None for q in probs)
        return Proposal(tuple(tokens), tuple(parents), tuple(probs) if has_q else None, self._chances(parents))

    def _chances(self, parents: Sequence[int]) -> tuple[float, ...]:
        """Estimated chance the target accepts each node's path: chain nodes the sizer's
        calibrated chances; a runner-up leaf gets a share of what its chain sibling leaves over (a
        guess, kept low)."""
        if not parents:
            return ()
        depths = tree_depths(parents)
        path = [1.0, *self.sizer.chances(self._chain(int(depths.max())))]  # the chain's chance per depth
        chances: list[float] = []
        chain_child: set[int] = set()  # parents whose first (chain) child has been seen
        for i, parent in enumerate(parents):
            reach = 1.0 if parent < 0 else chances[parent]
            d = int(depths[i])
            a = path[d] / path[d - 1] if path[d - 1] > 0 else 0.0  # the chain token's chance given its parent
            chances.append(reach * a if parent not in chain_child else reach * (1.0 - a) * 0.3)
            chain_child.add(parent)
        return tuple(chances)

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        if self._off:
            return
        self.steps.observe(out, verdict)  # the verify's time, and what drafting paid (the gate)
        if verdict.drafted:  # sized before drafting, so the sizer learns here
            self.sizer.update(self._chain(verdict.draft_depth), verdict.draft_depth, verdict.accepted)
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
        """Decode every pending token; the draft's logits for the next token ([vocab])."""
        n = len(self._pending)
        out = self.draft.extend(self._pending)
        if n <= self.draft.limits.max_batch:  # one forward: a point on the draft's cost curve
            self.draft_costs.observe(n - 1, self._context_len, out.seconds)
        self._pending = []
        self._base = self.draft.n_past
        return out.logits[0]

    def _advance(self, token: int, context: int) -> np.ndarray:
        out = self.draft.extend([token])
        self.draft_costs.observe(0, context, out.seconds)
        self._decoded.append(token)
        return out.logits[0]

    def _pick(self, row: np.ndarray, history: list[int]) -> tuple[int, np.ndarray | None, float]:
        """The draft's token, the distribution it came from (None: greedy) and its confidence."""
        if self.sampling.greedy:
            token = int(np.argmax(row))
            confidence = 1.0 / float(np.exp(row.astype(np.float64) - row[token]).sum())
            return token, None, confidence
        q = target_distribution(row, history, self.sampling)
        # q must live on the target's vocabulary: drop draft-only ids, pad ids only the target has
        q = np.pad(q, (0, max(0, self.target_vocab - len(q))))[: self.target_vocab]
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

