"""The two interfaces every method and every backend meet: ``Target`` and ``Drafter``.

A target owns its KV cache; nothing else touches it. A drafter that runs a model of its own (the
draft model, later EAGLE heads) receives it as another ``Target``, so drafters never depend on a
backend and backends never depend on a drafter.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from backends.core.types import FINAL_STATE, HIDDEN_STATES, NO_LIMIT, Budget, Proposal, TargetLimits, TargetOutput, Verdict


@runtime_checkable
class Target(Protocol):
    """A model that verifies proposals. ``n_past`` tokens are in its KV cache.

    Every method that changes the cache either does what it says or raises (``BackendError``):
    a rollback that silently failed would make speculative output differ from plain decoding.
    """

    offers: frozenset[str]  # capabilities, e.g. {TREE, ROLLBACK}
    limits: TargetLimits  # rows and tree paths one verify may take
    n_ctx: int
    n_vocab: int
    eog_ids: frozenset[int]

    @property
    def n_past(self) -> int: ...

    def reset(self) -> None:
        """Empty the KV cache."""

    def prefill(self, tokens: Sequence[int], *, stop: Callable[[], bool] | None = None,
                hidden: bool = False, hidden_from: int = 0, layers: tuple[int, ...] = ()) -> int:
        """Make the cache hold exactly ``tokens`` (reusing a common prefix); returns reused count.

        ``stop`` is asked between chunks of the prompt; once it says yes the prefill raises
        ``Cancelled``, leaving a prefix of ``tokens`` in the cache (a later prefill reuses it).
        ``hidden`` (targets offering ``HIDDEN_STATES``): keep the hidden state of every position
        from ``hidden_from`` on for ``hidden_states``, and return states with every verify until a
        prefill without it. Positions before ``hidden_from`` may be computed without them (a
        prefill that returns states costs more: llama.cpp then computes every row's logits).
        ``layers`` (``LAYER_STATES`` targets): each state is the inputs of these layers side by
        side, [len(layers) * d] (``FINAL_STATE`` for the final one); empty: the final state."""

    def hidden_states(self, start: int, end: int) -> np.ndarray:
        """The kept hidden states of cached positions ``start .. end - 1``, [end - start, d] float32
        (``HIDDEN_STATES`` targets, after ``prefill(..., hidden=True, hidden_from <= start)``)."""

    def native_head(self) -> Any:
        """The model's own draft head, evaluated by the backend (``NATIVE_MTP`` targets only): an
        object with ``d``, ``feature_width``, ``state_layers``, ``vocab``, ``new_cache()``,
        ``features``, ``forward`` and ``log_probs`` as a numpy ``backends.heads.eagle.EagleHead``
        has, which the EAGLE drafter drafts with."""

    def engine_head(self, path: str) -> Any:
        """An EAGLE-3 head from the GGUF at ``path`` (llama.cpp's ``eagle3`` architecture),
        evaluated by the backend's engine beside the model (``NATIVE_EAGLE3`` targets only), with
        the interface ``native_head`` gives; refused, with the reason, for a head of another model."""

    def skipping(self, skip: Sequence[int], *, n_ctx: int | None = None) -> "Target":
        """The same model without layers ``skip``, as a target with a cache of its own (``LAYER_SKIP``
        targets only; ``n_layer`` and ``layer_share``, the blocks' share of a forward's weights, say
        what there is to skip)."""

    def verify(self, root: int, proposal: Proposal) -> TargetOutput:
        """One forward over the root (at position ``n_past``) and every proposal node."""

    def commit(self, verdict: Verdict) -> None:
        """Keep the root and the accepted path of the last ``verify``, drop the rest."""

    def extend(self, tokens: Sequence[int]) -> TargetOutput:
        """Append ``tokens`` to the cache (in as many forwards as ``limits.max_batch`` needs) and
        return the logits after the last one only: one row, owned by the caller. A draft model
        catching up with the text needs exactly that."""

    def truncate(self, n: int) -> None:
        """Forget positions ``n`` and later."""

    def token_piece(self, token: int) -> bytes:
        """The bytes a token stands for (for streaming text and stop strings)."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens for the target to verify; sees every verdict.

    ``requires`` names the target capabilities the drafter needs (e.g. ``{TREE}``); the factory
    and the GUI compare it with ``Target.offers``. The other fields have defaults here, which a
    drafter gets by naming this protocol as its base class.
    """

    requires: frozenset[str]
    # How many of the prompt's last positions' hidden states ``begin`` reads (``HIDDEN_STATES``
    # drafters): the target computes states for those only. An EAGLE head reads a window of
    # them, Medusa's the last one, a recording all.
    prompt_states: int = NO_LIMIT
    # Which states a ``HIDDEN_STATES`` drafter reads (``Target.prefill``'s ``layers``): empty for
    # the final state; layer numbers (``LAYER_STATES``) for those layers' inputs side by side.
    state_layers: tuple[int, ...] = ()
    playing: str = ""  # what runs this answer, where the drafter chooses (``auto``'s arm), for stats
    declined: str = ""  # why this answer drafted nothing, where the drafter chose so, for stats

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        """A new answer starts after ``prompt`` (the engine has prefilled the target). A drafter
        that requires ``HIDDEN_STATES`` gets the target's states of the last ``n =
        min(prompt_states, len(prompt) - 1)`` positions before the root as ``hidden`` ([n, d]:
        row ``i`` is position ``len(prompt) - 1 - n + i``); the root's comes as row 0 of the first
        verify."""

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        """Tokens that may follow ``context`` (whose last token is the root)."""

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        """Feedback after each verify that followed this drafter's ``propose``: adapt lengths, sync
        a draft model's cache, read hidden states (``out.hidden`` row 0 is the root's, row
        ``i + 1`` node ``i``'s; the accepted rows are the root and ``verdict.path``)."""


def states_of(drafters: Iterable[Drafter]) -> tuple[int, tuple[int, ...], list[tuple[int, ...] | None]]:
    """What a drafter combining ``drafters`` asks the target for, and how it hands each its part:
    (the most prompt states any reader reads, the layers to ask for, per drafter the blocks of
    the combined rows it reads or None for all of them).

    The target hands out one kind of state per answer, so drafters that read different ones get
    the union side by side: an EAGLE-3 head reading layers (2, 15, 27) beside an EAGLE head
    reading the final state makes the target hand out (2, 15, 27, FINAL_STATE), and the EAGLE head
    reads block 3 of each row (``pick_states``)."""
    drafters = list(drafters)
    readers = [d for d in drafters if HIDDEN_STATES in d.requires]
    most = max((d.prompt_states for d in readers), default=0)
    kinds = {d.state_layers for d in readers}
    if len(kinds) <= 1:
        return most, next(iter(kinds), ()), [None] * len(drafters)
    union: list[int] = []
    for d in readers:
        union += [il for il in d.state_layers or (FINAL_STATE,) if il not in union]
    blocks = [tuple(union.index(il) for il in d.state_layers or (FINAL_STATE,)) if HIDDEN_STATES in d.requires else None
              for d in drafters]
    return most, tuple(union), blocks


def pick_states(hidden: np.ndarray | None, blocks: tuple[int, ...] | None, n_blocks: int) -> np.ndarray | None:
    """The blocks ``blocks`` of rows holding ``n_blocks`` states side by side ([n, n_blocks d] ->
    [n, len(blocks) d]); everything for ``blocks`` None."""
    if hidden is None or blocks is None:
        return hidden
    d = hidden.shape[1] // n_blocks
    return np.concatenate([hidden[:, b * d : (b + 1) * d] for b in blocks], axis=1)
