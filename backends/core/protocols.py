"""The two interfaces every method and every backend meet: ``Target`` and ``Drafter``.

A target owns its KV cache; nothing else touches it. A drafter that runs a model of its own (the
draft model, later EAGLE heads) receives it as another ``Target``, so drafters never depend on a
backend and backends never depend on a drafter.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from backends.core.types import Budget, Proposal, TargetOutput, Verdict


@runtime_checkable
class Target(Protocol):
    """A model that verifies proposals. ``n_past`` tokens are in its KV cache."""

    offers: frozenset[str]  # capabilities, e.g. {TREE}
    n_ctx: int
    n_vocab: int
    eog_ids: frozenset[int]

    @property
    def n_past(self) -> int: ...

    def reset(self) -> None:
        """Empty the KV cache."""

    def prefill(self, tokens: Sequence[int]) -> int:
        """Make the cache hold exactly ``tokens`` (reusing a common prefix); returns reused count."""

    def verify(self, root: int, proposal: Proposal) -> TargetOutput:
        """One forward over the root (at position ``n_past``) and every proposal node."""

    def commit(self, verdict: Verdict) -> None:
        """Keep the root and the accepted path of the last ``verify``, drop the rest."""

    def truncate(self, n: int) -> None:
        """Forget positions ``n`` and later."""

    def token_piece(self, token: int) -> bytes:
        """The bytes a token stands for (for streaming text and stop strings)."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens for the target to verify; sees every verdict.

    ``requires`` names the target capabilities the drafter needs (e.g. ``{TREE}``); the factory
    and the GUI compare it with ``Target.offers``.
    """

    requires: frozenset[str]

    def begin(self, prompt: Sequence[int]) -> None:
        """A new answer starts after ``prompt`` (the engine has prefilled the target)."""

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        """Tokens that may follow ``context`` (whose last token is the root)."""

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        """Feedback after each verify: adapt lengths, sync a draft model's cache, read hidden states."""
