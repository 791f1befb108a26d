"""``eagle2``: an EAGLE head trained for this model drafts a dynamic tree (EAGLE-2) from its states.

The head (``backends.heads.eagle``) reads the target's hidden state and the token that followed,
and predicts the next state; fed its own predictions it walks ahead one tree level per forward.
``eagle3`` and ``mtp`` draft with this drafter too: an EAGLE-3 head (``backends.heads.eagle3``)
reads the inputs of three target layers (``state_layers``, which the engine asks the target for)
through ``features``, a model's own next-n block is run by the backend; the tree is the same.
Each step:

1. Catch up: the rows whose true states the last verify returned (the root's and the accepted
   nodes') go into the head's cache; the last one's output is the root's predicted state.
2. Grow (EAGLE-2): the root's ``top_k`` likeliest tokens are depth 1. At each further depth the
   ``expand`` nodes of the last level with the highest chance (the product of the head's
   probabilities along the path) run through the head in one batch, each attending to the cache
   and its own ancestors, and each offers its ``top_k`` tokens as children. Growth stops early
   once no path is likelier than ``min_chance``, or (adaptive) than what a level costs: every
   level is a head forward, and what it adds is about the chance of the likeliest node it
   expands times the probability that node's best child had at that depth lately, so a level
   whose best child is expected to be accepted less often than the level's cost in target
   forwards cannot repay it (both measured live; on SmolLM2 F16 with SpecDeck's small-batch
   kernel, 2 CPU cores, a numpy EAGLE level took 0.2-0.28 of a target forward, the whole grown
   tree 0.8 of one while verifying 1-3 nodes cost 1.02-1.18). Nor deeper than the most nodes a
   step may verify: a node at depth ``d`` needs its ``d - 1`` ancestors verified too.
3. Rerank: all grown nodes by chance, best first (a child is never likelier than its parent, so
   parents come first); how many to verify is ``TreeSteps``' call from the measured cost curve.

Besides such trees the gate has an arm of one guess a step (``ONE``): the catch-up's likeliest
token, verified alone, no level grown; the gate plays whichever arm measures fastest. What a
level cost and offered is kept across a session's answers (``LevelStats``), and reading a
backlog of states (the prompt's) is not charged to the step that reads it (``_catch_up``).

The tree's scratch rows are dropped after every step: only states the target computed stay in
the head's cache, for the accepted prefix only. Steps the gate left undrafted still bring the
accepted rows' true states, which the next drafting step catches up on; while drafting loses, only
the last ``IDLE_ROWS`` of them: a re-try then costs a few rows, not the prompt's (``CONTEXT_ROWS``;
on SmolLM2 F16's rag prompts eagle2 spent 0.75 ms a step drafting yet verified nothing), and
the head reads past a gap. While the gate stays shut longer than that, the steps ask for no states
(``QUIET_PROPOSAL``: llama.cpp's cost about 1% of an F16 forward).

Lossless: every node is a deterministic proposal (one-hot ``q``) checked by SpecDeck's acceptance
rules: greedy output is plain decoding's, and sampling keeps the target's distribution (a
deterministic candidate is accepted with the target's own probability, and rejected into the
target's distribution with that token removed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from backends.core.controller import ONE, RUN, Bandit, Sizer, TreeSteps
from backends.core.costs import CostModel
from backends.core.errors import SpecDeckError
from backends.core.protocols import Drafter
from backends.core.settings import Settings, bounded
from backends.core.timing import median_seconds
from backends.core.types import (EMPTY_PROPOSAL, HIDDEN_STATES, LAYER_STATES, QUIET_PROPOSAL, ROLLBACK, TREE, Budget,
                                 Proposal, RankedTree, TargetOutput, Verdict)
from backends.heads.eagle import EagleHead

CATCH_UP_CHUNK = 128  # rows the head takes in one forward while catching up
LEVEL_MEMORY = 0.9  # weight of the past in the running means of a level's seconds and odds
IDLE_ROWS = 32  # rows kept waiting while the gate finds drafting loses: all a re-try catches up on
# The prompt's last rows a head reads at the start of an answer. Each costs the target's prefill a
# logits row and the head a forward row (llama.cpp's EAGLE-3 graph runs its output layer on every
# row); a one-layer head guesses from the last few dozen as well as from 512. SmolLM2 F16, rag and
# summarization, 8 answers: acceptance 0.266 (64 rows) against 0.272 (512) for the EAGLE-3 head in
# llama.cpp, 0.258 against 0.253 for the numpy EAGLE head; time to first token 11.12 s against
# 12.45 s in all (plain decoding: 10.54 s).
CONTEXT_ROWS = 64


@dataclass(frozen=True)
class EagleSettings(Settings):
    head: str = ""  # a head file (.json) from `specdeck train eagle`; empty: the one found for the model
    top_k: int = bounded(4, 1, 16)  # children each expanded node offers
    expand: int = bounded(4, 1, 16)  # nodes expanded per depth
    depth: int = bounded(5, 1, 16)  # deepest draft level
    max_nodes: int = bounded(24, 1, 64)  # most tree nodes verified in one step
    context_rows: int = bounded(CONTEXT_ROWS, 1, 1 << 20)  # prompt rows the head reads at the start of an answer
    min_chance: float = bounded(0.05, 0.0, 1.0)  # grow no deeper once the best path's chance falls below this
    adaptive: bool = True  # False: always verify max_nodes nodes, run the head every step


@dataclass
class LevelStats:
    """What a tree level has lately cost (one head forward, seconds) and offered (by depth, the
    probability of the likeliest parent's best child): running means, kept across a session's
    answers beside the sizer and gate. Learned afresh for each answer, every answer's first step
    grew all its levels as if they were free (1.3 target forwards for SmolLM2's numpy head)."""

    seconds: float | None = None
    odds: dict[int, float] = field(default_factory=dict)

    def took(self, seconds: float) -> None:
        self.seconds = _running(self.seconds, seconds)

    def offered(self, depth: int, odds: float) -> None:
        self.odds[depth] = _running(self.odds.get(depth), odds)


def _running(last: float | None, value: float) -> float:
    return value if last is None else LEVEL_MEMORY * last + (1 - LEVEL_MEMORY) * value


@dataclass
class _Grown:
    """The nodes grown so far (list per field, by node index)."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]  # log chance of the path
    depths: list[int]
    rows: dict[int, int]  # node -> its scratch row in the head's cache (nodes that ran)
    outs: dict[int, np.ndarray]  # node -> the state it predicted [d]

    def add_children(self, parent: int, log_probs: np.ndarray, vocab: np.ndarray, k: int) -> list[int]:
        """``parent``'s ``k`` likeliest children under ``log_probs`` [V'] (-1: the root)."""
        k = min(k, len(log_probs))
        best = np.argpartition(-log_probs, k - 1)[:k]
        best = best[np.argsort(-log_probs[best], kind="stable")]
        base = self.scores[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        made = []
        for j in best:
            made.append(len(self.tokens))
            self.tokens.append(int(vocab[j]))
            self.parents.append(parent)
            self.scores.append(base + float(log_probs[j]))
            self.depths.append(depth)
        return made

    def ancestors(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out

    def ranked(self, max_nodes: int, max_depth: int) -> RankedTree:
        """The ``max_nodes`` likeliest nodes no deeper than ``max_depth``, best first, parents first."""
        keep = [i for i in range(len(self.tokens)) if self.depths[i] <= max_depth]
        keep.sort(key=lambda i: (-self.scores[i], self.depths[i], i))
        keep = keep[:max_nodes]
        new = {old: n for n, old in enumerate(keep)}
        # a child's chance never exceeds its parent's and ties go to the shallower node, so every
        # kept node's parent is kept, and ranked before it
        parents = [new[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep]
        return RankedTree(np.array([self.tokens[i] for i in keep], np.int32), np.array(parents, np.int32),
                          np.exp(np.array([self.scores[i] for i in keep], np.float64)))


class EagleDrafter(Drafter):
    """Drafts EAGLE-2 trees from one head; keeps the head's cache of true states across steps."""

    def __init__(self, head: EagleHead, settings: EagleSettings | None = None, *,
                 costs: CostModel | None = None, sizer: Sizer | None = None, gate: Bandit | None = None,
                 levels: LevelStats | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.head = head
        self.settings = settings or EagleSettings()
        self.state_layers = tuple(head.state_layers)  # the final state, or the layers an EAGLE-3 head fuses
        self.requires = frozenset({HIDDEN_STATES, ROLLBACK, TREE} | ({LAYER_STATES} if self.state_layers else set()))
        costs = costs or CostModel.from_relative([1.0] * (self.settings.max_nodes + 1))
        self.steps = TreeSteps(costs, max_nodes=self.settings.max_nodes, adaptive=self.settings.adaptive, prior=0.8,
                               sizer=sizer, gate=gate, arms=(ONE, RUN), clock=clock)
        self.sizer, self.gate = self.steps.sizer, self.steps.gate
        self.cache = head.new_cache()
        self.clock = clock
        self.levels = levels or LevelStats()
        self.begin([])

    @property
    def prompt_states(self) -> int:
        """Prompt rows the head reads at ``begin``: while drafting loses, only those a re-try reads
        (the prefill hands out logits for every row it gives states for)."""
        return IDLE_ROWS if self._losing() else self.settings.context_rows

    def _losing(self) -> bool:
        """The gate finds drafting loses here: only the last ``IDLE_ROWS`` rows are worth keeping."""
        return self.steps.adaptive and self.steps.losing

    def head_forwards(self, seconds_per_forward: float) -> Callable[[int], float]:
        """The head's time per step in target forwards, by chain depth: the catch-up forward and one
        more per depth past the first, each with its draft-vocabulary logits (timed on a scratch
        cache, one row: a chain)."""
        cache, head = self.head.new_cache(), self.head
        feats, tokens, where = np.zeros((1, head.d), np.float32), head.vocab[:1], np.zeros(1, np.int64)

        def forward() -> None:
            head.log_probs(head.forward(feats, tokens, where, cache, np.ones((1, 1), bool)))
            cache.reset()

        once = median_seconds(forward)
        return lambda depth: depth * once / seconds_per_forward

    @property
    def declined(self) -> str:  # type: ignore[override]
        return self.steps.declined

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        width = self.head.feature_width
        if hidden is not None and hidden.ndim == 2 and len(hidden) and hidden.shape[1] != width:
            raise SpecDeckError(f"the EAGLE head reads {width}-wide hidden states, the model gives {hidden.shape[1]}")
        self.cache.reset()
        self.steps.begin()
        # (position, the state its row predicted, that state's log-probabilities [V'])
        self._frontier: tuple[int, np.ndarray, np.ndarray] | None = None
        self._root = len(prompt) - 1
        # pending rows: (feature [d], next token, position); the prompt's last rows, row t = (f_t, x_{t+1})
        n = 0 if hidden is None else min(len(hidden), len(prompt) - 1, self.settings.context_rows)
        start = len(prompt) - 1 - n  # hidden's last n rows are positions start .. len(prompt) - 2
        rows = hidden[len(hidden) - n :] if n else ()
        self._pending = [(row, int(prompt[start + i + 1]), start + i) for i, row in enumerate(rows)]
        self._fresh = 0  # pending rows the last verify brought (the rest: a backlog, ``_catch_up``)

    def _catch_up(self) -> None:
        """Run the pending rows (true states) into the cache; the last one's output is the frontier.

        Rows older than the last verify's (the prompt's, or those kept while the gate was shut)
        are a backlog: reading them is paid once for a whole run of drafting steps, so its time is
        set aside from this step's score (``TreeSteps.aside``). Charged to one step, an answer's
        first step read its prompt for 1-2.4 target forwards and the gate shut on a head that,
        drafting a chain of one, ran 1.10-1.19x plain decoding (SmolLM2 F16, 2 CPU cores)."""
        if not self._pending:
            return
        backlog, last = max(0, len(self._pending) - self._fresh), None
        if backlog:
            start = self.clock()
            last = self._run_rows(self._pending[:backlog])
            self.steps.aside(self.clock() - start)
        out, position = self._run_rows(self._pending[backlog:]) or last
        self._pending, self._fresh = [], 0
        # the log-probabilities now, from the forward that made the state: a head run by the
        # backend (a model's own MTP block) hands them out with its states
        self._frontier = (position, out, self.head.log_probs(out[None])[0])

    def _run_rows(self, pending: list) -> tuple[np.ndarray, int] | None:
        """Run rows (feature, next token, position) into the cache as committed rows, in chunks;
        the last one's output [d] and position (None: no rows). Only that output is computed: the
        others' keys and values are all the cache keeps."""
        last = None
        for i in range(0, len(pending), CATCH_UP_CHUNK):
            rows = pending[i : i + CATCH_UP_CHUNK]
            feats = self.head.features(np.stack([r[0] for r in rows]))  # [n, feature_width] -> [n, d]
            tokens = np.array([r[1] for r in rows], np.int64)
            positions = np.array([r[2] for r in rows], np.int64)
            out = self.head.forward(feats, tokens, positions, self.cache, np.tril(np.ones((len(rows),) * 2, bool)),
                                    outputs=1)
            self.cache.commit()
            last = (out[-1], int(positions[-1]))
        return last

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        self._root = len(context) - 1
        if len(self._pending) > IDLE_ROWS and self._losing():
            del self._pending[:-IDLE_ROWS]
            self._fresh = min(self._fresh, IDLE_ROWS)
        known = bool(self._pending) and self._pending[-1][2] == self._root - 1
        ready = known or (self._frontier is not None and self._frontier[0] == self._root - 1)
        if not self.steps.open(context, budget, ready=ready or self.steps.quiet, lead=IDLE_ROWS):
            return QUIET_PROPOSAL if self.steps.quiet else EMPTY_PROPOSAL
        self._catch_up()
        try:
            tree = self._grow(budget)
        finally:
            self.cache.drop_scratch()  # only the model's own states may stay
        return self.steps.propose(tree)

    def _grow(self, budget: Budget) -> RankedTree:
        """The EAGLE-2 tree after the root (see the module docstring), ranked."""
        s, head = self.settings, self.head
        base, state, log_probs = self._frontier
        grown = _Grown([], [], [], [], {}, {})
        level = grown.add_children(-1, log_probs, head.vocab, s.top_k)
        limit = min(s.max_nodes, budget.max_nodes, self.steps.limit or s.max_nodes)
        max_depth = min(s.depth, budget.max_depth, limit)
        cost = self._level_cost()
        for depth in range(2, max_depth + 1):
            # a parent is worth expanding where its likeliest child (at the odds its best child had
            # at this depth lately) is likelier than the level costs; or than min_chance
            least = max(s.min_chance, cost / self.levels.odds.get(depth, 1.0))
            floor = np.log(least) if least > 0 else -np.inf
            chosen = [i for i in sorted(level, key=lambda i: -grown.scores[i])[: s.expand] if grown.scores[i] >= floor]
            if not chosen:  # nothing this unlikely would be verified, or repay the level: save the head's forwards
                break
            start = self.clock()
            feats = np.stack([grown.outs[grown.parents[i]] if grown.parents[i] >= 0 else state for i in chosen])
            first = self.cache.length - self.cache.committed  # scratch row of the first chosen node
            for j, node in enumerate(chosen):
                grown.rows[node] = first + j
            visible = np.zeros((len(chosen), first + len(chosen)), bool)
            for j, node in enumerate(chosen):
                visible[j, [grown.rows[a] for a in grown.ancestors(node)]] = True
            tokens = np.array([grown.tokens[i] for i in chosen], np.int64)
            out = head.forward(feats, tokens, np.full(len(chosen), base + depth - 1, np.int64), self.cache, visible)
            log_probs = head.log_probs(out)  # [len(chosen), V']
            self.levels.took(self.clock() - start)
            self.levels.offered(depth, float(np.exp(log_probs[0].max())))  # row 0: the likeliest parent
            level = []
            for j, node in enumerate(chosen):
                grown.outs[node] = out[j]
                level += grown.add_children(node, log_probs[j], head.vocab, s.top_k)
        return grown.ranked(limit, max_depth).within_paths(budget.max_paths)

    def _level_cost(self) -> float:
        """One tree level's head forward in target forwards at this context (0 until both are
        measured, and when not adaptive: a fixed tree is grown whole)."""
        if not self.steps.adaptive or self.levels.seconds is None:
            return 0.0
        one = self.steps.costs.seconds(0, self._root + 1)
        return self.levels.seconds / one if one > 0 else 0.0

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        self.steps.observe(out, verdict)
        if out.hidden is None:
            if self.steps.quiet:  # none asked for: the rows before the next re-try will have them
                return
            raise SpecDeckError("the target returned no hidden states: an EAGLE head cannot draft without them")
        rows = verdict.state_rows  # the root's and each accepted node's state
        for k, (row, token) in enumerate(zip(rows, verdict.tokens)):
            self._pending.append((out.hidden[row], int(token), self._root + k))
        self._fresh = len(rows)
