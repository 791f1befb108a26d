"""``pld``: prompt lookup decoding. Free drafts copied from text the answer repeats.

Summaries, code edits and RAG answers quote their prompt. If the last ``n`` tokens already
appeared earlier (in the prompt or the answer so far), the tokens that followed them there are a
good guess for what comes next. No model runs to draft, so the only cost is verifying.

Example: context ``... the cat sat on the mat . the cat`` with ``max_ngram=2``: the suffix
``the cat`` occurred before, followed by ``sat on the mat``, which is proposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from backends.core.controller import LengthController, ShadowLedger
from backends.core.types import EMPTY_PROPOSAL, Budget, Proposal, TargetOutput, Verdict


@dataclass(frozen=True)
class PLDSettings:
    max_ngram: int = 3  # longest suffix looked up
    min_ngram: int = 1  # shortest suffix that may still match
    max_draft: int = 8  # most tokens proposed in one step
    adaptive: bool = True  # let the controller pick the length (False: always propose max_draft)

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram <= 16:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram <= 16, got {self.min_ngram}, {self.max_ngram}")
        if not 1 <= self.max_draft <= 64:
            raise ValueError(f"max_draft must be in 1..64, got {self.max_draft}")


class NgramIndex:
    """Positions of every n-gram (n = 1..max_ngram) in a growing token list.

    ``lookup`` finds the longest suffix of the list that occurred earlier and returns the tokens
    that followed its most recent earlier occurrence. Adding a token costs ``max_ngram`` dict
    updates, so lookups stay O(1) however long the context grows.
    """

    def __init__(self, max_ngram: int, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end index of its latest occurrence
        self._indexed = 0  # n-grams ending before this index are in _last

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def sync(self, context: Sequence[int]) -> None:
        """Follow an engine context that only ever grows."""
        if len(context) > len(self.tokens):
            self.tokens.extend(context[len(self.tokens) :])

    def _index_until(self, end: int) -> None:
        """Register n-grams ending at indices below ``end``."""
        toks = self.tokens
        for i in range(self._indexed, end):
            for n in range(1, min(self.max_ngram, i + 1) + 1):
                self._last[tuple(toks[i - n + 1 : i + 1])] = i
        self._indexed = max(self._indexed, end)

    def lookup(self, max_len: int) -> tuple[list[int], int]:
        """(continuation, matched n-gram size) for the current suffix; ([], 0) when none."""
        toks = self.tokens
        last = len(toks) - 1
        if last < 1 or max_len <= 0:
            return [], 0
        self._index_until(last)  # everything except the suffix's own end
        for n in range(min(self.max_ngram, last), self.min_ngram - 1, -1):
            end = self._last.get(tuple(toks[last - n + 1 :]))
            if end is not None:
                return toks[end + 1 : end + 1 + max_len], n
        return [], 0


class PLDDrafter:
    """Prompt lookup with a length controller: drafts only as long as it is expected to pay.

    Lookups are free, so every step makes one; when the controller withholds it, the guess goes to
    a ``ShadowLedger`` and is scored against what the target emits next. The controller thus
    learns this text's acceptance without paying for a single probe.
    """

    requires: frozenset[str] = frozenset()

    def __init__(self, settings: PLDSettings | None = None, *, costs: Sequence[float] | None = None) -> None:
        self.settings = settings or PLDSettings()
        self.controller = LengthController(costs or [1.0] * (self.settings.max_draft + 1), max_len=self.settings.max_draft)
        self._index = NgramIndex(self.settings.max_ngram, self.settings.min_ngram)
        self._shadow = ShadowLedger()
        self._bucket = 0

    def begin(self, prompt: Sequence[int]) -> None:
        self._index = NgramIndex(self.settings.max_ngram, self.settings.min_ngram)
        self._index.extend(prompt)
        self._shadow = ShadowLedger()

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        self._index.sync(context)
        for guessed, matched, bucket in self._shadow.resolve(context):
            self.controller.update(guessed, matched, bucket)
        tokens, n = self._index.lookup(self.settings.max_draft)
        self._bucket = n
        available = min(len(tokens), budget.max_depth, budget.max_nodes)
        k = available if not self.settings.adaptive else self.controller.choose(available, bucket=n)
        if k == 0:
            self._shadow.add(len(context), tokens, n)
            return EMPTY_PROPOSAL
        return Proposal.chain(tokens[:k])

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        if verdict.drafted:
            self.controller.update(verdict.drafted, verdict.accepted, bucket=self._bucket)
