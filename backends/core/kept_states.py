"""The hidden states a target keeps for the positions in its KV cache, for every backend.

A drafter that reads hidden states (EAGLE, Medusa, MTP heads, a training recording) asks the
target for the states of positions already cached (``Target.hidden_states``): the prompt's at
``begin``, the accepted rows after each verify. A target keeps them in one [n_ctx, width] array,
valid for one contiguous run of positions ``start .. end - 1``: each forward that hands out states
continues the run, a rollback shortens it, and a forward that does not continue it (states asked
for in the middle of the cache) starts a new run there.

Example: a prefill of 10 tokens asking for states from position 4 keeps 4..9; a verify of the
root (position 10) and 3 nodes of which 1 is accepted adds 10..11; ``truncate(8)`` leaves 4..7.
"""

from __future__ import annotations

import numpy as np

from backends.core.errors import BackendError


class KeptStates:
    """The states of a run of cached positions (see the module docstring)."""

    def __init__(self, n_ctx: int, width: int, dtype: type = np.float16) -> None:
        self.n_ctx, self.width, self.dtype = n_ctx, width, dtype
        self.rows: np.ndarray | None = None  # [n_ctx, width], made at the first store (pages fill as used)
        self.start = self.end = 0

    def clear(self) -> None:
        self.start = self.end = 0

    def forget(self, n: int) -> None:
        """Positions ``n`` and later left the cache."""
        self.end = min(self.end, n)
        self.start = min(self.start, self.end)

    def reusable(self, hidden_from: int) -> int:
        """How much of the cache a prefill wanting states from ``hidden_from`` on can keep: up to
        the last kept state when the run reaches back to ``hidden_from``, else up to it."""
        return self.end if self.start <= hidden_from <= self.end else hidden_from

    def begin_at(self, first: int) -> None:
        """The next state stored is position ``first``'s: a run that does not end there starts over."""
        if not self.start <= first == self.end:
            self.start = self.end = first

    def store(self, position: int, rows: np.ndarray) -> None:
        """States for positions from ``position`` on ([n, width]), where they continue the run."""
        if self.rows is None:
            self.rows = np.empty((self.n_ctx, self.width), dtype=self.dtype)
        if self.start <= position <= self.end:
            self.rows[position : position + len(rows)] = rows
            self.end = position + len(rows)

    def read(self, start: int, end: int) -> np.ndarray:
        """The states of positions ``start .. end - 1``, [end - start, width] float32 (a copy)."""
        if start == end:
            return np.zeros((0, self.width), np.float32)
        if self.rows is None or end > self.end or not self.start <= start <= end:
            raise BackendError(f"hidden states of positions {start}..{end - 1} were not kept "
                               f"(positions {self.start}..{self.end - 1} have one)")
        return self.rows[start:end].astype(np.float32)
