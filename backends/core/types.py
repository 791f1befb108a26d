"""Small immutable types shared by drafters, targets, the engine and every front end.

See ``backends.core`` for the vocabulary (target p, draft q, root, accepted, bonus, tau).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np

from backends.core.tree import is_chain, tree_depths, validate_parents

# Capabilities: what a drafter requires and what a target offers. Shared code checks these,
# never a method's name.
TREE = "tree"  # the target verifies token trees (several branches in one forward)
HIDDEN_STATES = "hidden_states"  # the target returns hidden states with its logits


@dataclass(frozen=True)
class Budget:
    """How much a proposal may hold this step (context room, tokens still wanted)."""

    max_nodes: int
    max_depth: int


@dataclass(frozen=True, eq=False)
class Proposal:
    """A token tree under the root; a chain has ``parents == (-1, 0, 1, ...)``.

    ``draft_probs[i]`` is the distribution ``q`` that ``tokens[i]`` was drawn from (a [vocab]
    array), or ``None`` when the drafter chose the token deterministically (one-hot ``q``).
    ``draft_probs`` itself may be ``None`` when every node is deterministic.
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    draft_probs: tuple[np.ndarray | None, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        if self.draft_probs is not None and len(self.draft_probs) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.draft_probs)} draft distributions")
        validate_parents(self.parents)

    @classmethod
    def chain(cls, tokens: Sequence[int], draft_probs: Sequence[np.ndarray | None] | None = None) -> Proposal:
        """A straight line of drafted tokens, the common case."""
        probs = None if draft_probs is None else tuple(draft_probs)
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)), probs)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return is_chain(self.parents)

    def q(self, node: int) -> np.ndarray | None:
        """The draft distribution of ``node`` (``None``: one-hot on its token)."""
        return None if self.draft_probs is None else self.draft_probs[node]

    def pruned(self, budget: Budget) -> Proposal:
        """The first nodes that fit the budget; parents precede children, so this stays a tree."""
        if self.size <= budget.max_nodes and (self.size == 0 or self.is_chain and self.size <= budget.max_depth):
            return self
        keep = [i for i, d in enumerate(tree_depths(self.parents)) if d <= budget.max_depth]
        keep = keep[: max(budget.max_nodes, 0)]
        if len(keep) == self.size:
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        parents = tuple(-1 if self.parents[i] < 0 else new_index[self.parents[i]] for i in keep)
        probs = None if self.draft_probs is None else tuple(self.draft_probs[i] for i in keep)
        return Proposal(tuple(self.tokens[i] for i in keep), parents, probs)


EMPTY_PROPOSAL = Proposal()


@dataclass(frozen=True, eq=False)
class TargetOutput:
    """What one verify forward returns. Row 0 is the root, row ``i + 1`` is proposal node ``i``."""

    logits: np.ndarray  # [1 + n_nodes, vocab] float32
    hidden: np.ndarray | None = None  # [1 + n_nodes, d_model], only from targets offering HIDDEN_STATES
    seconds: float = 0.0  # wall time of the forward as the target measured it (feeds the cost model)


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
