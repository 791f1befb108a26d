"""The exact oracle for engine-tier tests: a tiny model whose logits do not depend on batching.

Its logits are a pure function of the token history: a random order-2 table plus an "induction"
bonus for the token that followed the previous occurrence of the last token (so its text repeats
itself the way real text does, and prompt lookup has something to find). Whether a position is
computed alone, in a chain or in a tree, the numbers are bit-identical, so speculative output
must equal plain greedy output exactly. Real models are tested separately, where divergences
must sit at numerical near-ties.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from backends.core.tree import compile_tree
from backends.core.types import TREE, Proposal, TargetOutput, Verdict


class OracleTarget:
    offers = frozenset({TREE})

    def __init__(self, vocab: int = 32, *, seed: int = 0, n_ctx: int = 512, sharpness: float = 2.5,
                 induction: float = 3.0, perturb: float = 0.0, perturb_seed: int = 1, eos: int | None = None,
                 eos_bias: float = -4.0) -> None:
        rng = np.random.default_rng(seed)
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
        self.tokens: list[int] = []
        self.verify_calls = 0
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

    # -- target protocol -----------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []

    def prefill(self, tokens: Sequence[int]) -> int:
        common = 0
        while common < min(len(tokens), len(self.tokens)) and tokens[common] == self.tokens[common]:
            common += 1
        self.tokens = list(tokens)
        return common

    def verify(self, root: int, proposal: Proposal) -> TargetOutput:
        self.verify_calls += 1
        if self.n_past + 1 + proposal.size > self.n_ctx:
            raise RuntimeError("oracle context overflow: the engine must respect the budget")
        base = self.tokens + [root]
        rows = [self.logits_for(base)]
        if proposal.size:
            tree = compile_tree(proposal.parents)
            for i in range(proposal.size):
                path = [proposal.tokens[j] for j in np.flatnonzero(tree.mask[i])]
                rows.append(self.logits_for(base + path))
        self._pending = (root, proposal.tokens)
        return TargetOutput(logits=np.stack(rows))

    def commit(self, verdict: Verdict) -> None:
        root, tokens = self._pending
        self._pending = None
        self.tokens.append(root)
        self.tokens.extend(tokens[i] for i in verdict.path)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def token_piece(self, token: int) -> bytes:
        return f"<{token}>".encode()
