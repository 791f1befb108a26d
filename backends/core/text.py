"""Streaming detokenization with stop strings.

Tokens are byte pieces: a UTF-8 character can be split across two tokens, and a stop string can
be split across steps. ``TextStream`` decodes bytes incrementally and holds back any tail of the
text that could still become a stop string, so the user never sees half a stop string.

Example with stop ``"\\nUser:"``: pushing ``"Hi\\nUs"`` releases ``"Hi"`` and holds ``"\\nUs"``;
pushing ``"er:"`` then reports the stop and releases nothing more.
"""

from __future__ import annotations

import codecs
from typing import Callable, Sequence


class TextStream:
    """Incremental text for one answer; ``push`` returns (newly released text, stop found)."""

    def __init__(self, piece: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        self._piece = piece
        self._stop = tuple(stop)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._released = 0
        self.stopped = False

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stop

    @property
    def text(self) -> str:
        """Everything released so far (the final answer once finished)."""
        return self._text[: self._released]

    def push(self, tokens: Sequence[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._text += self._decoder.decode(b"".join(self._piece(t) for t in tokens))
        start = self._released
        if self._stop:
            cut = self._find_stop(start)
            if cut is not None:
                self._text = self._text[:cut]
                self._released = cut
                self.stopped = True
                return self._text[start:cut], True
            self._released = max(start, len(self._text) - self._held_back())
        else:
            self._released = len(self._text)
        return self._text[start : self._released], False

    def flush(self) -> str:
        """Release what was held back (the answer ended without completing a stop string)."""
        if not self.stopped:
            self._text += self._decoder.decode(b"", final=True)
        start, self._released = self._released, len(self._text)
        return self._text[start:]

    def _find_stop(self, start: int) -> int | None:
        # Released text never ends in a stop-string prefix, so a stop can only begin at ``start``
        # or later.
        hits = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:n]):
                    best = n
                    break
        return best
