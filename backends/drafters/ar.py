"""``ar``: plain autoregressive decoding, through the same engine as every other method.

It proposes nothing, so each step is one target forward over the root and emits the bonus token
alone: exactly plain decoding, and the baseline every speedup is measured against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from backends.core.protocols import Drafter
from backends.core.types import EMPTY_PROPOSAL, Budget, Proposal, TargetOutput, Verdict


@dataclass(frozen=True)
class ARSettings:
    """Plain decoding has nothing to tune."""


class ARDrafter(Drafter):
    requires: frozenset[str] = frozenset()

    def __init__(self, settings: ARSettings | None = None) -> None:
        self.settings = settings or ARSettings()

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        pass

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        return EMPTY_PROPOSAL

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        pass
