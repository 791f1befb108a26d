"""How far a target's logits move between one-token and batched evaluation: the near-tie scale.

Plain decoding evaluates one token per forward; speculative decoding verifies a whole draft in
one batched forward. On real kernels the two round differently (summation order, activation
quantization, attention split into chunks), so the same position gets slightly different
logits. Where the target's top two logits are closer than that difference, a lossless method
may emit the runner-up and part from plain decoding: a numerical near-tie, not a bug. Where they
are further apart, a difference is a bug.

The difference depends on the weight type, the CPU code and the context length (measured on a
Zen 4 with the zen4 variant, top-2 gap shift over 16 drafted tokens: SmolLM2 F16 0.013 after 72
tokens and 0.024 after 618; Q4_1 exactly 0 after 72 and 0.18 after 618), so it is measured on the
machine, for the model, rather than assumed::

    noise = measure_batch_noise(target, [short_prompt, long_prompt])
    noise.threshold   # a first difference at a top-2 margin below this is a near-tie

What is measured is the shift of the top-2 gap (the quantity that decides a flip), row by row:
the greedy continuation of each prompt one token at a time, then the same tokens verified as one
chain and as the main path of a tree (tree drafters verify in that layout). ``threshold`` is ``SAFETY`` times the largest shift seen, since a sample's maximum
understates the tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from backends.core.protocols import Target
from backends.core.types import EMPTY_PROPOSAL, TREE, Proposal, Verdict

SAFETY = 3.0  # the threshold over the largest shift a few prompts show
FLOOR = 1e-3  # kernels that agree bit for bit still get a threshold above float rounding
DEPTH = 16  # drafted tokens per measured chain (the longest chain SpecDeck's drafters verify)


@dataclass(frozen=True)
class BatchNoise:
    """The largest top-2 gap shift and logit shift seen between one-token and batched rows."""

    gap_shift: float
    logit_shift: float
    rows: int

    @property
    def threshold(self) -> float:
        return max(SAFETY * self.gap_shift, FLOOR)

    def describe(self, margin: float) -> str:
        """'a numerical near-tie (margin 0.140, this model's batch noise 0.18)' or 'a real difference ...'."""
        kind = "a numerical near-tie" if margin <= self.threshold else "a real difference (beyond batch noise)"
        return f"{kind} (margin {margin:.3f}, this model's batch noise {self.gap_shift:.3f})"


def measure_batch_noise(target: Target, prompts: Sequence[Sequence[int]], *, depth: int = DEPTH) -> BatchNoise:
    """Compare each prompt's greedy continuation row by row, one token at a time against the same
    tokens verified as one chain and, where the target verifies trees, as the main path of a tree.

    The tree is measured because its rows sit in another batch layout (a runner-up leaf beside
    every chain node, each path its own sequence, a wider attention mask), which kernels may
    round differently; tree drafters' outputs are judged against it. On a Zen 4 with the zen4
    CPU code the two agree (SmolLM2 Q4_1: 0 and 0 after 55 tokens, 0.172 and 0.172 after 600).

    Leaves the target's cache empty. Prompts must leave room for ``depth + 1`` more tokens."""
    gap = logit = 0.0
    rows = 0
    for prompt in prompts:
        singles, continuation = _one_at_a_time(target, prompt, depth)
        for proposal, path_rows in _shapes(target, singles, continuation):
            target.reset()
            target.prefill(prompt[:-1])
            out = target.verify(prompt[-1], proposal)  # [1 + proposal.size, vocab]
            for single, i in zip(singles, path_rows):
                batched = out.row(i)
                a, b = np.argsort(single)[-2:][::-1]
                gap = max(gap, abs(float((single[a] - single[b]) - (batched[a] - batched[b]))))
                logit = max(logit, float(np.abs(single - batched).max()))
                rows += 1
        target.reset()
    return BatchNoise(gap_shift=gap, logit_shift=logit, rows=rows)


def _shapes(target: Target, singles: list[np.ndarray], continuation: list[int]) -> list[tuple[Proposal, list[int]]]:
    """The continuation as a chain and, where the target takes it, as a tree with each chain node's
    runner-up as a sibling leaf; each with the output rows of the root and the chain's nodes."""
    shapes = [(Proposal.chain(continuation), list(range(len(continuation) + 1)))]
    if TREE not in target.offers or len(continuation) + 1 > target.limits.max_paths:
        return shapes
    tokens: list[int] = []
    parents: list[int] = []
    path_rows = [0]
    parent = -1
    for token, single in zip(continuation, singles):  # singles[d] is the row that chose token d
        runner_up = int(np.argsort(single)[-2])
        tokens += [token, runner_up]
        parents += [parent, parent]
        parent = len(tokens) - 2
        path_rows.append(parent + 1)
    shapes.append((Proposal(tuple(tokens), tuple(parents)), path_rows))
    return shapes


def _one_at_a_time(target: Target, prompt: Sequence[int], depth: int) -> tuple[list[np.ndarray], list[int]]:
    """The rows of plain decoding at the root and ``depth`` greedy tokens after it, and those tokens."""
    target.reset()
    target.prefill(prompt[:-1])
    root, rows, tokens = prompt[-1], [], []
    for _ in range(depth + 1):
        out = target.verify(root, EMPTY_PROPOSAL)
        rows.append(out.row(0))
        root = int(np.argmax(rows[-1]))
        target.commit(Verdict(path=(), tokens=(root,), drafted=0, draft_depth=0))
        tokens.append(root)
    return rows, tokens[:depth]
