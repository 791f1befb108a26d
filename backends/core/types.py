"""Small immutable types shared by drafters, targets, the engine and every front end.

See ``backends.core`` for the vocabulary (target p, draft q, root, accepted, bonus, tau).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Protocol, Sequence, Union

import numpy as np

from backends.core.tree import fit_paths, is_chain, tree_depths, validate_parents

# Capabilities: what a drafter requires and what a target offers. Shared code checks these,
# never a method's name.
TREE = "tree"  # the target verifies token trees (several branches in one forward)
HIDDEN_STATES = "hidden_states"  # the target returns hidden states with its logits
# The hidden states can be the inputs of chosen layers (``Drafter.state_layers``), several
# concatenated per row, as an EAGLE-3 head reads a low, a middle and a high layer of the target.
LAYER_STATES = "layer_states"
FINAL_STATE = -1  # in ``state_layers``: the state after the last layer and its norm (the output layer's input)
# The target's cache can forget the rejected tokens of a verify exactly. Every drafting method
# needs it: a recurrent or hybrid model (Mamba, RWKV, LFM2, Granite-H, Qwen3-Next) folds each
# token into a state it cannot take back, so its speculative output would differ from plain
# decoding.
ROLLBACK = "rollback"
# The target can decode several independent sequences in one forward (``target.sequences``):
# recording training data answers several prompts at once, for the price of little more than one.
SEQUENCES = "sequences"
# The model has a next-n (multi-token prediction) block of its own that the target can run as a
# draft head (``target.native_head()``), as DeepSeek-V3, GLM-4.5 and MiMo files do.
NATIVE_MTP = "native_mtp"
# The target's engine runs an EAGLE-3 head itself (``target.engine_head(path)``: llama.cpp's
# ``eagle3`` architecture, from a GGUF), with its kernels and on its GPU, beside the model.
NATIVE_EAGLE3 = "native_eagle3"
# The target can run a subset of its own layers as a draft model (``target.skipping(layers)``):
# self-speculative decoding, a draft for free beside any model (the PyTorch backend's forward
# takes the layers to run as an argument).
LAYER_SKIP = "layer_skip"

NO_LIMIT = 1 << 30  # a limit a target does not have


@dataclass(frozen=True)
class TargetLimits:
    """What one verify forward of a target can take.

    ``max_batch`` counts rows, the root included (llama.cpp: ``n_batch``); ``max_paths`` counts the
    root-to-leaf paths of a tree (llama.cpp gives each its own sequence id, at most ``n_seq_max``).
    Example: with ``TargetLimits(512, 32)`` a proposal may have 511 nodes and 32 leaves.
    """

    max_batch: int = NO_LIMIT
    max_paths: int = NO_LIMIT

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_paths < 1:
            raise ValueError(f"limits must be at least 1, got batch {self.max_batch}, paths {self.max_paths}")


@dataclass(frozen=True)
class Budget:
    """How much a proposal may hold this step: context room and the target's batch (``max_nodes``),
    tokens still wanted (``max_depth``), the target's sequence limit (``max_paths`` leaves)."""

    max_nodes: int
    max_depth: int
    max_paths: int = NO_LIMIT

    @classmethod
    def for_step(cls, limits: TargetLimits, *, room: int, wanted: int) -> Budget:
        """The budget of a step with ``room`` free cache slots after the root and ``wanted`` more
        tokens to emit (the bonus token is always one of them)."""
        return cls(max_nodes=min(room, limits.max_batch - 1), max_depth=wanted - 1, max_paths=limits.max_paths)


@dataclass(frozen=True, eq=False)
class Proposal:
    """A token tree under the root; a chain has ``parents == (-1, 0, 1, ...)``.

    ``draft_probs[i]`` is the distribution ``q`` that ``tokens[i]`` was drawn from (a [vocab]
    array), or ``None`` when the drafter chose the token deterministically (one-hot ``q``).
    ``draft_probs`` itself may be ``None`` when every node is deterministic.

    ``chances[i]`` is the drafter's estimate, calibrated on its own history, that the target
    accepts node ``i`` and every node above it (so a child never exceeds its parent); ``None``
    when the drafter has none. Whoever combines or cuts proposals (``specinfer``) reads them
    here instead of asking the drafter afterwards.

    ``states`` False: the drafter does not read this step's hidden states (a head whose gate stays
    closed for a while), so the target may skip them: llama.cpp's cost about 1% of an F16 forward.
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    draft_probs: tuple[np.ndarray | None, ...] | None = None
    chances: tuple[float, ...] | None = None
    states: bool = True

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        if self.draft_probs is not None and len(self.draft_probs) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.draft_probs)} draft distributions")
        if self.chances is not None and len(self.chances) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.chances)} chances")
        validate_parents(self.parents)

    @classmethod
    def chain(cls, tokens: Sequence[int], draft_probs: Sequence[np.ndarray | None] | None = None,
              chances: Sequence[float] | None = None) -> Proposal:
        """A straight line of drafted tokens, the common case."""
        probs = None if draft_probs is None else tuple(draft_probs)
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)), probs,
                   None if chances is None else tuple(float(c) for c in chances))

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return is_chain(self.parents)

    def q(self, node: int) -> np.ndarray | None:
        """The draft distribution of ``node`` (``None``: one-hot on its token)."""
        return None if self.draft_probs is None else self.draft_probs[node]

    def kept(self, budget: Budget) -> list[int]:
        """The nodes that fit ``budget``, in index order: none deeper than ``max_depth``, at most
        ``max_paths`` leaves (a node that would open one more path is left out with its subtree,
        while one that extends a path is kept: a draft model's chain survives, its runner-up leaves
        go), then the first ``max_nodes``. Each step keeps parents with their children, and a
        parent-closed part of a tree never has more leaves than the tree, so the result fits.

        Example: parents ``[-1, -1, -1, 0]`` with ``max_paths=2`` keep nodes 0, 1 and 3.
        """
        if self.size <= budget.max_nodes and (self.size == 0 or self.is_chain and self.size <= budget.max_depth):
            return list(range(self.size))
        allowed = tree_depths(self.parents) <= budget.max_depth
        return fit_paths(self.parents, budget.max_paths, allowed=allowed)[: max(budget.max_nodes, 0)]

    def pruned(self, budget: Budget) -> Proposal:
        """The tree cut to ``kept(budget)``; parents precede children, so this stays a tree."""
        return self.subset(self.kept(budget))

    def subset(self, keep: Sequence[int]) -> Proposal:
        """The nodes ``keep`` (ascending, parents included) as a proposal of their own."""
        if len(keep) == self.size:
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        parents = tuple(-1 if self.parents[i] < 0 else new_index[self.parents[i]] for i in keep)
        probs = None if self.draft_probs is None else tuple(self.draft_probs[i] for i in keep)
        chances = None if self.chances is None else tuple(self.chances[i] for i in keep)
        return Proposal(tuple(self.tokens[i] for i in keep), parents, probs, chances, self.states)


EMPTY_PROPOSAL = Proposal()
QUIET_PROPOSAL = Proposal(states=False)  # nothing drafted, and no hidden states wanted this step


@dataclass(frozen=True)
class RankedTree:
    """Candidate nodes ranked best first, parents before children, so that every prefix is a tree:
    what a drafter that scores many candidates (a datastore's continuations, trained heads) hands
    to the sizer, which verifies a prefix."""

    tokens: np.ndarray  # [n] int32
    parents: np.ndarray  # [n] int32, indices into this ranking (-1: root)
    probs: np.ndarray  # [n] float64, the drafter's estimate that each node's path is accepted
    bucket: Hashable = None  # which calibration applies (REST keeps one per length of the matched suffix)

    def proposal(self, n: int, chances: Sequence[float] | None = None) -> Proposal:
        """The first ``n`` nodes, with ``chances`` (default: the raw estimates)."""
        chances = self.probs if chances is None else chances
        return Proposal(tuple(self.tokens[:n].tolist()), tuple(self.parents[:n].tolist()),
                        chances=tuple(map(float, chances[:n])))

    def within_paths(self, max_paths: int) -> RankedTree:
        """The ranking less the nodes that would open more than ``max_paths`` root-to-leaf paths
        (the target's sequence limit), still best first with parents before children."""
        keep = fit_paths(self.parents.tolist(), max_paths)
        return self if len(keep) == len(self.tokens) else self.taking(keep)

    def taking(self, keep: Sequence[int]) -> RankedTree:
        """The nodes ``keep`` in that order (each parent kept before its children), renumbered."""
        keep = np.asarray(keep, dtype=np.int64)
        new_index = np.full(len(self.tokens) + 1, -1, dtype=np.int32)  # [-1] stays -1: the root
        new_index[keep] = np.arange(len(keep), dtype=np.int32)
        parents = np.where(self.parents[keep] < 0, -1, new_index[self.parents[keep]]).astype(np.int32)
        return RankedTree(self.tokens[keep], parents, self.probs[keep], self.bucket)


class DeviceLogits(Protocol):
    """Logits that stay on the device that computed them (a GPU): [1 + n_nodes, vocab] there, and
    only what the acceptance rule reads crosses to the host: the top token of the rows on the
    accepted path (a few integers), a row's floats where sampling needs them."""

    def row(self, i: int) -> np.ndarray:
        """Row ``i`` as a host [vocab] float32 array."""

    def argmax(self, rows: list[int] | None) -> np.ndarray:
        """The top token of each of ``rows`` (all when None), host int64."""


class StaleLogitsError(RuntimeError):
    """Logits read after the target's next forward overwrote them (a programming error)."""


@dataclass(frozen=True, eq=False)
class TargetOutput:
    """What one verify forward returns. Row 0 is the root, row ``i + 1`` is proposal node ``i``.

    Ownership: a backend may hand out its own logits buffer instead of a copy (llama.cpp's is
    [n_nodes, vocab] float32, 39 MB for 64 nodes of a 152k vocabulary, and copying it every step
    costs more than the acceptance rule that reads a few rows of it). Such a ``logits`` array is
    read-only and valid only until the target's next forward; ``fresh`` then says False. Read it
    through ``row`` and ``argmax``, which check that and raise ``StaleLogitsError`` instead of
    returning another forward's numbers; ``row`` returns a copy that stays valid. An output whose
    ``fresh`` is None owns its array (the oracle, tests).
    """

    # [1 + n_nodes, vocab] float32, possibly a read-only view (see above); or ``DeviceLogits`` that
    # stay where a GPU computed them and hand over only the rows and top tokens that are read
    logits: np.ndarray | DeviceLogits
    hidden: np.ndarray | None = None  # [1 + n_nodes, d_model], only from targets offering HIDDEN_STATES
    seconds: float = 0.0  # wall time of the forward as the target measured it (feeds the cost model)
    fresh: Callable[[], bool] | None = None  # None: the array is owned; else False once overwritten

    def _check(self) -> None:
        if self.fresh is not None and not self.fresh():
            raise StaleLogitsError("these logits were overwritten by a later forward of the target; copy rows "
                                   "you keep past the step with TargetOutput.row")

    def row(self, i: int) -> np.ndarray:
        """A copy of row ``i`` ([vocab] float32): the root's for 0, node ``i - 1``'s otherwise."""
        self._check()
        if not isinstance(self.logits, np.ndarray):
            return self.logits.row(i)
        return np.array(self.logits[i])

    def top(self, i: int) -> int:
        """The top token of row ``i``, read in place."""
        self._check()
        if not isinstance(self.logits, np.ndarray):
            return int(self.logits.argmax([i])[0])
        return int(np.argmax(self.logits[i]))

    def argmax(self, rows: Sequence[int] | None = None) -> np.ndarray:
        """The top token of each of ``rows`` (all by default), [len(rows)] int64, read in place."""
        self._check()
        if not isinstance(self.logits, np.ndarray):
            return self.logits.argmax(None if rows is None else list(rows))
        if rows is None:
            return np.argmax(self.logits, axis=1)
        return np.array([np.argmax(self.logits[r]) for r in rows], dtype=np.int64)


@dataclass(frozen=True)
class Verdict:
    """The acceptance rule's decision for one step.

    ``path`` lists the accepted proposal nodes from the root down; ``tokens`` is what the step
    emits: the accepted nodes' tokens followed by the bonus token.
    """

    path: tuple[int, ...]
    tokens: tuple[int, ...]
    drafted: int
    draft_depth: int
    # Where the verify's output rows are, for a drafter whose proposal was merged with others into
    # the tree verified (``merge.project``); None: its proposal was the tree (node i at row i + 1).
    merged_path_rows: tuple[int, ...] | None = None  # see ``state_rows``
    merged_node_rows: tuple[int, ...] | None = None  # per own node; -1: not verified

    @property
    def state_rows(self) -> tuple[int, ...]:
        """The rows of ``TargetOutput`` (its ``hidden``) whose states made ``tokens``, one per token:
        the root's (row 0) and each accepted node's. A drafter whose proposal was merged with
        others sees only its own nodes in ``path``, yet the text may have gone on through the
        others': these rows are the whole accepted path's, so a head reads the state of every
        token written, whoever guessed it."""
        if self.merged_path_rows is not None:
            return self.merged_path_rows
        return (0, *(i + 1 for i in self.path))

    def row_of(self, node: int) -> int:
        """The row of ``TargetOutput`` with the verify's output at this drafter's proposal node
        (what the target predicts after it); -1 where the node was not verified."""
        if self.merged_node_rows is not None:
            return self.merged_node_rows[node] if node < len(self.merged_node_rows) else -1
        return node + 1 if node < self.drafted else -1

    @property
    def accepted(self) -> int:
        return len(self.path)

    @property
    def bonus(self) -> int:
        return self.tokens[-1]


@dataclass(frozen=True)
class SamplingSettings:
    """The processing plain decoding applies to the target's logits, in llama.cpp's order:
    repetition penalty, top-k, top-p, min-p, temperature. ``temperature == 0`` means greedy.
    Verification applies exactly the same processing, which is what makes it lossless."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise ValueError(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1.0 and self.repeat_last_n > 0


@dataclass(frozen=True)
class GenerationSettings:
    """What one answer may do: how long, where to stop, how to sample."""

    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    sampling: SamplingSettings = field(default_factory=SamplingSettings)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass(frozen=True)
class Prefilled:
    """The prompt is in the KV cache (``reused`` of its tokens were already there)."""

    prompt_tokens: int
    reused_tokens: int
    seconds: float


@dataclass(frozen=True)
class Step:
    """One propose-verify-accept-commit round.

    ``tokens[:accepted]`` came from accepted drafts, the rest from the target itself (the bonus),
    which is what a GUI colours. ``text`` is the text released to the user by this step (text
    that might still turn into a stop string is held back until it cannot).
    """

    index: int
    tokens: tuple[int, ...]
    text: str
    drafted: int
    accepted: int
    draft_depth: int
    t_draft: float
    t_verify: float
    t_accept: float
    elapsed: float  # seconds since generation started


@dataclass(frozen=True)
class RunStats:
    """Measured the same way for every method, from verdicts (see ``backends.core.stats``)."""

    method: str
    prompt_tokens: int
    reused_tokens: int
    new_tokens: int
    forwards: int  # target verify forwards (prefill excluded)
    drafted: int
    accepted: int
    prefill_s: float
    ttft_s: float
    decode_s: float  # from the first emitted token to the last
    first_step_tokens: int
    draft_s: float
    verify_s: float
    accept_s: float
    drafted_at: tuple[int, ...]  # steps that drafted position d + 1
    accepted_at: tuple[int, ...]  # steps that accepted position d + 1
    finish_reason: str
    played: str = ""  # what a method that chooses per answer (auto) played, e.g. "pld"
    # Why the drafter drafted nothing when it chose not to, in words (a drafter's ``declined``),
    # e.g. "drafting would not pay here: a draft token costs 0.78x a target forward".
    declined: str = ""

    @property
    def prompt_tok_s(self) -> float:
        computed = self.prompt_tokens - self.reused_tokens
        return computed / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first step (TTFT excluded)."""
        later = self.new_tokens - self.first_step_tokens
        return later / self.decode_s if self.decode_s > 0 and later > 0 else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tau(self) -> float:
        return self.new_tokens / self.forwards if self.forwards else float("nan")

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        return tuple(a / d if d else float("nan") for a, d in zip(self.accepted_at, self.drafted_at))

    @classmethod
    def from_dict(cls, d: dict) -> RunStats:
        """The inverse of ``to_dict`` (derived rates are recomputed, JSON lists become tuples)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in cls.__dataclass_fields__})

    def to_dict(self) -> dict:
        """A JSON-ready dict with the derived rates included."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for name in ("prompt_tok_s", "decode_tok_s", "acceptance_rate", "tau", "acceptance_by_position"):
            out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class Finished:
    """The answer is complete; ``reason`` is eos, stop, length, context_full or cancelled."""

    reason: str
    tokens: tuple[int, ...]
    text: str
    stats: RunStats


Event = Union[Prefilled, Step, Finished]
