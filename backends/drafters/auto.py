"""``auto``: per prompt, the method that has been fastest here on this kind of prompt.

Which method pays depends on the machine, the model and the prompt, so ``auto`` measures: each
answer plays one arm (the session's methods, simplest first, then plain decoding), chosen by a
``Bandit`` per kind of prompt, and scores its tokens over ``(verify + the arm's own seconds) / t1``,
``t1`` the cost model's current plain forward (a busy neighbour slows arm and yardstick alike). A
later arm must measure 3% faster than those before it: one answer's speed scatters by 10% or more.

An answer played to try an arm that is not the leader hands over to the leader mid-answer once
the tried arm has measured slower over ``probe_steps`` steps of it: trying a loser then costs a
stretch of an answer, not a whole one (on SmolLM2 F16 and 2 CPU cores, four head arms tried
three times per kind of prompt each took 24 of 60 answers at ~1.0x where prompt lookup ran 1.3x).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

from backends.core.controller import Bandit
from backends.core.costs import CostModel
from backends.core.protocols import Drafter, pick_states, states_of
from backends.core.types import EMPTY_PROPOSAL, HIDDEN_STATES, Budget, Proposal, TargetOutput, Verdict

PLAIN = "ar"  # the baseline arm: draft nothing
LONG_PROMPT = 256  # tokens; longer prompts are mostly documents to summarize, rework or answer from


def prompt_kind(prompt: Sequence[int]) -> str:
    """The kind of prompt a choice is remembered for: ``short`` (chat) or ``long`` (documents)."""
    return "long" if len(prompt) >= LONG_PROMPT else "short"


class MethodSelector:
    """A bandit per kind of prompt, kept in the session's memory, and the running answer's tally,
    booked when the next answer starts (a drafter is not told that an answer ended)."""

    def __init__(self, arms: Sequence[str], *, min_tries: int = 3, decay: float = 0.95, margin: float = 0.03,
                 explore_share: float = 0.02, min_gap: int = 4, max_gap: int = 64, probe_steps: int = 16) -> None:
        """An answer is a round, so losers get a larger share than a per-step bandit's 0.3% and
        shorter gaps: one 10% behind is played again after about 6 answers per losing arm, then 8 ... 64.
        ``probe_steps``: steps a tried arm plays before it may be judged within its answer (a head's
        own gate tries it for 16)."""
        self.arms, self.margin, self.probe_steps = list(arms), margin, probe_steps
        self._make = lambda: Bandit(self.arms, baseline=PLAIN, min_tries=min_tries, decay=decay, margin=margin,
                                    explore_share=explore_share, min_gap=min_gap, max_gap=max_gap)
        self.bandits: dict[Hashable, Bandit] = {}
        self.handed: dict[Hashable, dict[str, int]] = {}  # per kind and tried arm: answers handed over mid-way
        self._open: tuple[Hashable, str] | None = None
        self.leader: str | None = None  # the running answer's kind's best arm (fixed until the answer is booked)
        self._tokens = self._cost = 0.0
        self._steps = 0

    def choose(self, kind: Hashable) -> str:
        self.close()
        bandit = self.bandits.setdefault(kind, self._make())
        arm = bandit.choose()
        self._open, self.leader = (kind, arm), bandit.best()
        return arm

    def trying(self) -> bool:
        """Whether the running answer plays an arm other than the leader, to try it."""
        return self._open is not None and self._open[1] != self.leader

    def add(self, tokens: int, cost: float) -> None:
        """One step of the running answer: tokens emitted and their cost in plain forwards."""
        self._tokens, self._cost, self._steps = self._tokens + tokens, self._cost + cost, self._steps + 1

    def lagging(self) -> str | None:
        """The leader of the running answer's kind, where this answer plays another arm to try it
        and that arm has measured slower than the leader (by the margin) over at least
        ``probe_steps`` steps; None otherwise (and once the answer was handed over)."""
        if not self.trying() or self._steps < self.probe_steps or self._cost <= 0:
            return None
        if self._tokens / self._cost * (1.0 + self.margin) >= self.bandits[self._open[0]].speed(self.leader):
            return None
        return self.leader

    def hand_over(self) -> None:
        """The running answer leaves its arm: what the arm did so far is booked as its play, the
        rest of the answer is not booked (an answer's later stretch is not a whole answer: prompt
        lookup, for one, finds more to copy there)."""
        if self._open is not None:
            kind, arm = self._open
            counts = self.handed.setdefault(kind, {})
            counts[arm] = counts.get(arm, 0) + 1
        self.close()

    def close(self) -> None:
        """Book the running answer's tally with its bandit."""
        if self._open is not None and self._tokens > 0:
            self.bandits[self._open[0]].update(self._open[1], self._tokens, self._cost)
        self._open, self.leader, self._tokens, self._cost, self._steps = None, None, 0.0, 0.0, 0

    def report(self) -> dict[Hashable, dict[str, dict[str, float]]]:
        """Per kind of prompt and arm: answers played, how many of them were handed over to the
        leader mid-way, and measured speed relative to plain decoding (the running answer booked
        first)."""
        self.close()
        return {kind: {arm: {"played": b.chosen.get(arm, 0), "handed_over": self.handed.get(kind, {}).get(arm, 0),
                             "speed": b.speed(arm)} for arm in [PLAIN, *b.arms]}
                for kind, b in self.bandits.items()}


class StateWindow:
    """The target's states of an answer's last ``limit`` positions (the prompt's, then each step's
    root and accepted rows), so an arm that reads states can take over mid-answer. Kept as chunks:
    a step adds a few rows, and re-copying 512 rows of them each step would cost a millisecond."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._chunks: list[np.ndarray] = []
        self._rows = 0

    def add(self, rows: np.ndarray | None) -> None:
        """Rows for the positions right after the last kept ones; None: a step without states, so
        the window starts over after it (it must hold positions without a gap)."""
        if rows is None:
            self._chunks, self._rows = [], 0
            return
        self._chunks.append(rows)
        self._rows += len(rows)
        if self._rows > 2 * self.limit:
            self._chunks, self._rows = [self.rows()], min(self._rows, self.limit)

    def rows(self) -> np.ndarray | None:
        """The kept rows, the last ``limit`` of them ([n, width]); None before any."""
        if not self._chunks:
            return None
        return np.concatenate(self._chunks)[-self.limit :]


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
        self.arm = PLAIN  # the arm playing now
        self.playing = PLAIN  # for stats: this answer's arm, "tried → leader" once handed over
        self._drafter: Drafter | None = None
        self._states: StateWindow | None = None  # a tried arm's answer: the states a reading leader would take over with
        self._context_len = 0
        self._own = 0.0  # seconds this step spent drafting and observing

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        self.arm = self.playing = self.selector.choose(prompt_kind(prompt))
        self._states = None
        if hidden is not None and self.selector.trying() and self._reads(self.selector.leader):
            self._states = StateWindow(self.prompt_states)  # only an answer that may hand over to a reader
            self._states.add(hidden)
        self._start(prompt, hidden)

    def _reads(self, arm: str | None) -> bool:
        """Whether ``arm`` reads the target's hidden states."""
        return arm in self.arms and HIDDEN_STATES in self.arms[arm].requires

    def _start(self, context: Sequence[int], hidden: np.ndarray | None) -> None:
        """The playing arm begins after ``context``, with the states of the positions before its root."""
        self._drafter = self.arms.get(self.arm)
        if self._drafter is not None:
            self._drafter.begin(context, self._mine(hidden))

    def _mine(self, hidden: np.ndarray | None) -> np.ndarray | None:
        """The part of the states the playing arm reads."""
        return pick_states(hidden, self._blocks.get(self.arm), len(self.state_layers))

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        start = self.clock()
        self._context_len = len(context)
        self._hand_over(context)
        proposal = EMPTY_PROPOSAL if self._drafter is None else self._drafter.propose(context, budget)
        self._own = self.clock() - start
        return proposal

    def _hand_over(self, context: Sequence[int]) -> None:
        """An arm tried this answer that measured slower than the leader gives the rest of the
        answer to the leader, which begins here as at a prompt (a reader of states with the kept
        window; where the target gave none, it waits for the next verify's)."""
        leader = self.selector.lagging()
        if leader is None:
            return
        reads = self._reads(leader)
        if reads and self._states is None:
            return  # the target hands out no states this answer: the leader could not draft
        self.selector.hand_over()
        self.arm, self.playing = leader, f"{self.arm} → {leader}"
        self._start(context, self._states.rows() if reads else None)

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        start = self.clock()
        if self._states is not None:  # the root's row and the accepted nodes': positions root .. root + accepted
            self._states.add(None if out.hidden is None else out.hidden[list(verdict.state_rows)])
        if self._drafter is None:
            self.costs.observe(0, self._context_len, out.seconds)  # plain decoding keeps the cost model current
        else:
            self._drafter.observe(replace(out, hidden=self._mine(out.hidden)), verdict)
        own = self._own + self.clock() - start
        one = self.costs.seconds(0, self._context_len)
        self.selector.add(len(verdict.tokens), (out.seconds + own) / one if one > 0 else 1.0)
