"""The engine loop: propose, verify in one target forward, accept, commit, feed back.

Every method (plain decoding included) runs through ``generate``; the CLI chat, the benchmark,
the GUI worker and the tests all consume the same events. Example::

    for event in generate(target, drafter, prompt, GenerationSettings(max_new_tokens=64)):
        if isinstance(event, Step):
            print(event.text, end="")
        elif isinstance(event, Finished):
            print(event.stats.decode_tok_s)
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator, Sequence

from backends.core.acceptance import accept
from backends.core.errors import PromptTooLongError
from backends.core.protocols import Drafter, Target
from backends.core.sampling import make_rng
from backends.core.stats import StatsRecorder
from backends.core.text import TextStream
from backends.core.types import Budget, Event, Finished, GenerationSettings, Prefilled, Step


def check_prompt(prompt: Sequence[int], n_ctx: int) -> None:
    """Refuse prompts that leave no room for one new token (before touching the model)."""
    if not prompt:
        raise PromptTooLongError("the prompt is empty: there is nothing to continue")
    if len(prompt) >= n_ctx:
        raise PromptTooLongError(
            f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}: "
            "shorten the prompt or load the model with a larger context"
        )


def _cut(tokens: tuple[int, ...], eog: frozenset[int], room: int) -> tuple[tuple[int, ...], str | None]:
    """Tokens this step may emit and the finish reason they cause (an EOG token is kept)."""
    for i, token in enumerate(tokens[:room]):
        if token in eog:
            return tokens[: i + 1], "eos"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None


def generate(
    target: Target,
    drafter: Drafter,
    prompt: Sequence[int],
    settings: GenerationSettings,
    *,
    cancel: threading.Event | None = None,
    method: str = "",
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Event]:
    """Generate one answer after ``prompt``; yields Prefilled, then Steps, then Finished.

    ``cancel`` is checked before every step, so setting it stops generation within one step.
    """
    prompt = list(prompt)
    check_prompt(prompt, target.n_ctx)
    t0 = clock()
    reused = target.prefill(prompt[:-1])
    drafter.begin(prompt)
    stats = StatsRecorder(method, len(prompt))
    stats.played = str(getattr(drafter, "playing", "") or "")  # e.g. the arm auto chose for this answer
    stats.prefilled(reused, clock() - t0)
    yield Prefilled(prompt_tokens=len(prompt), reused_tokens=reused, seconds=stats.prefill_s)

    context = list(prompt)  # the root is context[-1]
    rng = make_rng(settings.sampling.seed)
    stream = TextStream(target.token_piece, settings.stop)
    produced, index, reason = 0, 0, None
    while reason is None:
        if cancel is not None and cancel.is_set():
            reason = "cancelled"
            break
        if len(context) > target.n_ctx:
            reason = "context_full"
            break
        budget = Budget(max_nodes=target.n_ctx - len(context), max_depth=settings.max_new_tokens - produced - 1)
        ta = clock()
        proposal = drafter.propose(context, budget).pruned(budget)
        tb = clock()
        out = target.verify(context[-1], proposal)
        tc = clock()
        verdict = accept(out, proposal, settings=settings.sampling, history=context, rng=rng)
        target.commit(verdict)
        td = clock()
        drafter.observe(out, verdict)
        te = clock()
        tokens, reason = _cut(verdict.tokens, target.eog_ids, settings.max_new_tokens - produced)
        context.extend(tokens)
        produced += len(tokens)
        text, stopped = stream.push(tokens)
        if stopped:
            reason = "stop"
        t_draft, t_verify, t_accept = (tb - ta) + (te - td), tc - tb, td - tc
        stats.step(verdict, len(tokens), t_draft=t_draft, t_verify=t_verify, t_accept=t_accept, end=te - t0)
        if reason is not None and not stopped:
            text += stream.flush()
        yield Step(
            index=index,
            tokens=tokens,
            text=text,
            drafted=verdict.drafted,
            accepted=min(verdict.accepted, len(tokens)),
            draft_depth=verdict.draft_depth,
            t_draft=t_draft,
            t_verify=t_verify,
            t_accept=t_accept,
            elapsed=te - t0,
        )
        index += 1
    stream.flush()
    yield Finished(reason=reason, tokens=tuple(context[len(prompt) :]), text=stream.text, stats=stats.result(reason))
