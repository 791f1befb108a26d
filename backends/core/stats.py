"""Run statistics, filled from verdicts the same way for every method.

``StatsRecorder`` is the engine's private tally; ``RunStats`` (in ``types``) is the frozen result.
Timing conventions: TTFT runs from the start of ``generate`` to the end of the first step (prefill
included); the decode rate counts the tokens after the first step over the time after it, so a
long prompt does not flatter or hurt the decode figure.
"""

from __future__ import annotations

from backends.core.types import RunStats, Verdict


class StatsRecorder:
    def __init__(self, method: str, prompt_tokens: int) -> None:
        self.method = method
        self.played = ""
        self.declined = ""
        self.prompt_tokens = prompt_tokens
        self.reused_tokens = 0
        self.prefill_s = 0.0
        self.new_tokens = 0
        self.forwards = 0
        self.drafted = 0
        self.accepted = 0
        self.draft_s = self.verify_s = self.accept_s = 0.0
        self.first_step_end: float | None = None
        self.first_step_tokens = 0
        self.last_step_end = 0.0
        self.drafted_at: list[int] = []
        self.accepted_at: list[int] = []

    def prefilled(self, reused: int, seconds: float) -> None:
        self.reused_tokens = reused
        self.prefill_s = seconds

    def step(self, verdict: Verdict, emitted: int, *, t_draft: float, t_verify: float, t_accept: float, end: float) -> None:
        """One step that emitted the first ``emitted`` of ``verdict.tokens``: accepted tokens cut
        after an EOS token or a stop string were never part of the answer and do not count."""
        accepted = min(verdict.accepted, emitted)
        self.forwards += 1
        self.new_tokens += emitted
        self.drafted += verdict.drafted
        self.accepted += accepted
        self.draft_s += t_draft
        self.verify_s += t_verify
        self.accept_s += t_accept
        depth = verdict.draft_depth
        if depth > len(self.drafted_at):
            grow = depth - len(self.drafted_at)
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for d in range(depth):
            self.drafted_at[d] += 1
        for d in range(accepted):
            self.accepted_at[d] += 1
        if self.first_step_end is None:
            self.first_step_end = end
            self.first_step_tokens = emitted
        self.last_step_end = end

    def result(self, reason: str) -> RunStats:
        first = self.first_step_end if self.first_step_end is not None else 0.0
        return RunStats(
            method=self.method,
            prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused_tokens,
            new_tokens=self.new_tokens,
            forwards=self.forwards,
            drafted=self.drafted,
            accepted=self.accepted,
            prefill_s=self.prefill_s,
            ttft_s=first,
            decode_s=max(0.0, self.last_step_end - first),
            first_step_tokens=self.first_step_tokens,
            draft_s=self.draft_s,
            verify_s=self.verify_s,
            accept_s=self.accept_s,
            drafted_at=tuple(self.drafted_at),
            accepted_at=tuple(self.accepted_at),
            finish_reason=reason,
            played=self.played,
            declined=self.declined,
        )
