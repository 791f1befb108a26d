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
chain. ``threshold`` is ``SAFETY`` times the largest shift seen, since a sample's maximum
understates the tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from backends.core.protocols import Target
from backends.core.types import EMPTY_PROPOSAL, Proposal, Verdict

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
    """Compare each prompt's greedy continuation row by row, one token at a time against one chain.

    Leaves the target's cache empty. Prompts must leave room for ``depth + 1`` more tokens."""
    gap = logit = 0.0
    rows = 0
    for prompt in prompts:
        singles, continuation = _one_at_a_time(target, prompt, depth)
        target.reset()
        target.prefill(prompt[:-1])
        out = target.verify(prompt[-1], Proposal.chain(continuation))  # [1 + depth, vocab]
        for i, single in enumerate(singles):
            batched = out.row(i)
            a, b = np.argsort(single)[-2:][::-1]
            gap = max(gap, abs(float((single[a] - single[b]) - (batched[a] - batched[b]))))
            logit = max(logit, float(np.abs(single - batched).max()))
            rows += 1
        target.reset()
    return BatchNoise(gap_shift=gap, logit_shift=logit, rows=rows)


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
