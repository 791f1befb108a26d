"""The exact oracle for engine-tier tests: a tiny model whose logits do not depend on batching.

Its logits are a pure function of the token history: a random order-2 table plus an "induction"
bonus for the token that followed the previous occurrence of the last token (so its text repeats
itself the way real text does, and prompt lookup has something to find). Whether a position is
computed alone, in a chain or in a tree, the numbers are bit-identical, so speculative output
must equal plain greedy output exactly. Real models are tested separately, where divergences
must sit at numerical near-ties.

With ``hidden_size`` it also offers ``HIDDEN_STATES``: the "hidden state" of a position is a fixed
random vector of its last two tokens, again a pure function of the history, so heads trained or
drawn at random can draft from it; "layer ``il``'s input" (``LAYER_STATES``) is that vector
rolled by ``il + 1``, so several layers side by side differ.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from backends.core.errors import BackendError, Cancelled
from backends.core.tree import compile_tree
from backends.core.types import (FINAL_STATE, HIDDEN_STATES, LAYER_STATES, ROLLBACK, TREE, Proposal, TargetLimits, TargetOutput,
                                 Verdict)


class OracleTarget:
    """``max_batch`` and ``max_paths`` are enforced the way llama.cpp enforces ``n_batch`` and
    ``n_seq_max``: a forward past them raises."""

    offers = frozenset({TREE, ROLLBACK})

    def __init__(self, vocab: int = 32, *, seed: int = 0, n_ctx: int = 512, sharpness: float = 2.5,
                 induction: float = 3.0, perturb: float = 0.0, perturb_seed: int = 1, eos: int | None = None,
                 eos_bias: float = -4.0, max_batch: int = 512, max_paths: int = 32, hidden_size: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.hidden_size = hidden_size
        self.states = rng.normal(size=(vocab, vocab, hidden_size)).astype(np.float32) if hidden_size else None
        if hidden_size:
            self.offers = frozenset({TREE, ROLLBACK, HIDDEN_STATES, LAYER_STATES})
        self._keep_hidden = False
        self._layers: tuple[int, ...] = ()
        self._hidden_from = 0
        self.table = rng.normal(size=(vocab, vocab, vocab)).astype(np.float32) * sharpness
        if perturb:
            noise = np.random.default_rng(perturb_seed).normal(size=self.table.shape).astype(np.float32)
            self.table = self.table + perturb * noise
        self.induction = induction
        self.n_vocab = vocab
        self.n_ctx = n_ctx
        self.eos = eos
        if eos is not None:
            self.table[..., eos] += eos_bias
        self.eog_ids = frozenset() if eos is None else frozenset({eos})
        self.limits = TargetLimits(max_batch=max_batch, max_paths=max_paths)
        self.tokens: list[int] = []
        self.verify_calls = 0
        self.forwards = 0  # every forward: prefill chunks, verifies, extends
        self._pending: tuple[int, tuple[int, ...]] | None = None

    # -- the model -----------------------------------------------------------------------------
    def logits_for(self, history: Sequence[int]) -> np.ndarray:
        """Logits for the token after ``history`` (pure function of the history)."""
        a = history[-2] if len(history) > 1 else 0
        b = history[-1]
        row = self.table[a, b].copy()
        for i in range(len(history) - 2, -1, -1):  # induction: what followed b last time?
            if history[i] == b:
                row[history[i + 1]] += self.induction
                break
        return row

    def state_for(self, history: Sequence[int]) -> np.ndarray:
        """The hidden state after ``history`` (pure function of its last two tokens), of the layers
        the last prefill asked for."""
        base = self.states[history[-2] if len(history) > 1 else 0, history[-1]]
        parts = [base if il == FINAL_STATE else np.roll(base, il + 1) for il in self._layers or (FINAL_STATE,)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    # -- target protocol -----------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []

    def prefill(self, tokens: Sequence[int], *, stop: Callable[[], bool] | None = None,
                hidden: bool = False, hidden_from: int = 0, layers: tuple[int, ...] = ()) -> int:
        if len(tokens) > self.n_ctx:
            raise BackendError(f"{len(tokens)} tokens do not fit the {self.n_ctx}-token context")
        common = 0
        while common < min(len(tokens), len(self.tokens)) and tokens[common] == self.tokens[common]:
            common += 1
        if hidden and self.states is None:
            raise BackendError("this oracle has no hidden states (hidden_size=0)")
        self._keep_hidden = hidden
        self._layers = tuple(layers) if hidden else ()
        self._hidden_from = hidden_from  # states before it are not handed out (as a real target keeps none)
        del self.tokens[common:]
        for start in range(common, len(tokens), self.limits.max_batch):
            if stop is not None and stop():
                raise Cancelled("prefill stopped")
            self.forwards += 1
            self.tokens.extend(tokens[start : start + self.limits.max_batch])
        return common

    def extend(self, tokens: Sequence[int]) -> TargetOutput:
        if self.n_past + len(tokens) > self.n_ctx:
            raise RuntimeError("oracle context overflow")
        self.forwards += -(-len(tokens) // self.limits.max_batch)
        self.tokens.extend(tokens)
        return TargetOutput(logits=self.logits_for(self.tokens)[None, :])

    def verify(self, root: int, proposal: Proposal) -> TargetOutput:
        self.verify_calls += 1
        self.forwards += 1
        if self.n_past + 1 + proposal.size > self.n_ctx:
            raise RuntimeError("oracle context overflow: the engine must respect the budget")
        if 1 + proposal.size > self.limits.max_batch:
            raise BackendError(f"a proposal of {proposal.size} nodes exceeds the batch size {self.limits.max_batch}")
        base = self.tokens + [root]
        rows = [self.logits_for(base)]
        if proposal.size:
            tree = compile_tree(proposal.parents)
            if len(tree.paths) > self.limits.max_paths:
                raise BackendError(f"a tree with {len(tree.paths)} leaves exceeds {self.limits.max_paths} sequences")
            for i in range(proposal.size):
                path = [proposal.tokens[j] for j in np.flatnonzero(tree.mask[i])]
                rows.append(self.logits_for(base + path))
        self._pending = (root, proposal.tokens)
        hidden = None
        if self._keep_hidden and proposal.states:  # as llama.cpp: no states where none are wanted
            mask = compile_tree(proposal.parents).mask if proposal.size else None
            hidden = np.stack([self.state_for(base)] + [
                self.state_for(base + [proposal.tokens[j] for j in np.flatnonzero(mask[i])]) for i in range(proposal.size)])
        return TargetOutput(logits=np.stack(rows), hidden=hidden)

    def hidden_states(self, start: int, end: int) -> np.ndarray:
        if not self._keep_hidden or end > len(self.tokens) or start < self._hidden_from:
            raise BackendError(f"no hidden states kept for positions {start}..{end - 1}")
        rows = [self.state_for(self.tokens[: i + 1]) for i in range(start, end)]
        width = self.hidden_size * max(1, len(self._layers))
        return np.stack(rows).reshape(-1, width) if rows else np.zeros((0, width), np.float32)

    def commit(self, verdict: Verdict) -> None:
        root, tokens = self._pending
        self._pending = None
        self.tokens.append(root)
        self.tokens.extend(tokens[i] for i in verdict.path)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def token_piece(self, token: int) -> bytes:
        return f"<{token}>".encode()
