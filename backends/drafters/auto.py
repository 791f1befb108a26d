"""``auto``: per prompt, the method that has been fastest here on this kind of prompt.

Which method pays depends on the machine, the model and the prompt, so ``auto`` measures: each
answer plays one arm (the session's methods, simplest first, then plain decoding), chosen by a
``Bandit`` per kind of prompt, and scores its tokens over ``(verify + the arm's own seconds) / t1``,
``t1`` the cost model's current plain forward (a busy neighbour slows arm and yardstick alike). A
later arm must measure 3% faster than those before it: one answer's speed scatters by 10% or more.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

from backends.core.controller import Bandit
from backends.core.costs import CostModel
from backends.core.protocols import Drafter, pick_states, states_of
from backends.core.types import EMPTY_PROPOSAL, Budget, Proposal, TargetOutput, Verdict

PLAIN = "ar"  # the baseline arm: draft nothing
LONG_PROMPT = 256  # tokens; longer prompts are mostly documents to summarize, rework or answer from


def prompt_kind(prompt: Sequence[int]) -> str:
    """The kind of prompt a choice is remembered for: ``short`` (chat) or ``long`` (documents)."""
    return "long" if len(prompt) >= LONG_PROMPT else "short"


class MethodSelector:
    """A bandit per kind of prompt, kept in the session's memory, and the running answer's tally,
    booked when the next answer starts (a drafter is not told that an answer ended)."""

    def __init__(self, arms: Sequence[str], *, min_tries: int = 3, decay: float = 0.95, margin: float = 0.03,
                 explore_share: float = 0.02, min_gap: int = 4, max_gap: int = 64) -> None:
        """An answer is a round, so losers get a larger share than a per-step bandit's 0.3% and
        shorter gaps: one 10% behind is played again after about 6 answers per losing arm, then 8 ... 64."""
        self.arms = list(arms)
        self._make = lambda: Bandit(self.arms, baseline=PLAIN, min_tries=min_tries, decay=decay, margin=margin,
                                    explore_share=explore_share, min_gap=min_gap, max_gap=max_gap)
        self.bandits: dict[Hashable, Bandit] = {}
        self._open: tuple[Hashable, str] | None = None
        self._tokens = self._cost = 0.0

    def choose(self, kind: Hashable) -> str:
        self.close()
        arm = self.bandits.setdefault(kind, self._make()).choose()
        self._open = (kind, arm)
        return arm

    def add(self, tokens: int, cost: float) -> None:
        """One step of the running answer: tokens emitted and their cost in plain forwards."""
        self._tokens, self._cost = self._tokens + tokens, self._cost + cost

    def close(self) -> None:
        """Book the running answer's tally with its bandit."""
        if self._open is not None and self._tokens > 0:
            self.bandits[self._open[0]].update(self._open[1], self._tokens, self._cost)
        self._open, self._tokens, self._cost = None, 0.0, 0.0

    def report(self) -> dict[Hashable, dict[str, dict[str, float]]]:
        """Per kind of prompt and arm: answers played and measured speed relative to plain decoding
        (the running answer booked first)."""
        self.close()
        return {kind: {arm: {"played": b.chosen.get(arm, 0), "speed": b.speed(arm)} for arm in [PLAIN, *b.arms]}
                for kind, b in self.bandits.items()}


class AutoDrafter(Drafter):
    """Plays the arm the selector picks for this prompt and scores it."""

    def __init__(self, arms: Mapping[str, Drafter], *, costs: CostModel, selector: MethodSelector,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.arms = dict(arms)
        self.requires = frozenset().union(*(d.requires for d in self.arms.values()))
        # the arm is chosen after the prefill, so the prompt's states are every arm's
        self.prompt_states, self.state_layers, blocks = states_of(self.arms.values())
        self._blocks = dict(zip(self.arms, blocks))
        self.costs, self.selector, self.clock = costs, selector, clock
        self.playing = PLAIN  # this answer's arm
        self._drafter: Drafter | None = None
        self._context_len = 0
        self._own = 0.0  # seconds this step spent drafting and observing

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        self.playing = self.selector.choose(prompt_kind(prompt))
        self._drafter = self.arms.get(self.playing)
        if self._drafter is not None:
            self._drafter.begin(prompt, self._mine(hidden))

    def _mine(self, hidden: np.ndarray | None) -> np.ndarray | None:
        """The part of the states the playing arm reads."""
        return pick_states(hidden, self._blocks.get(self.playing), len(self.state_layers))

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        start = self.clock()
        self._context_len = len(context)
        proposal = EMPTY_PROPOSAL if self._drafter is None else self._drafter.propose(context, budget)
        self._own = self.clock() - start
        return proposal

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        start = self.clock()
        if self._drafter is None:
            self.costs.observe(0, self._context_len, out.seconds)  # plain decoding keeps the cost model current
        else:
            self._drafter.observe(replace(out, hidden=self._mine(out.hidden)), verdict)
        own = self._own + self.clock() - start
        one = self.costs.seconds(0, self._context_len)
        self.selector.add(len(verdict.tokens), (out.seconds + own) / one if one > 0 else 1.0)
