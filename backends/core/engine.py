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
from backends.core.errors import BackendError, Cancelled, PromptTooLongError
from backends.core.protocols import Drafter, Target
from backends.core.sampling import make_rng
from backends.core.stats import StatsRecorder
from backends.core.text import TextStream
from backends.core.types import HIDDEN_STATES, Budget, Event, Finished, GenerationSettings, Prefilled, Step


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


def _push_text(stream: TextStream, tokens: tuple[int, ...]) -> tuple[tuple[int, ...], str, bool]:
    """The step's tokens up to the one that completes a stop string, the text they release, and
    whether a stop string was found. Tokens past the stop are not part of the answer."""
    if not stream.stops:
        return tokens, stream.push(tokens)[0], False
    released = []
    for i, token in enumerate(tokens):
        text, stopped = stream.push((token,))
        released.append(text)
        if stopped:
            return tokens[: i + 1], "".join(released), True
    return tokens, "".join(released), False


def _check_cache(target: Target, context: list[int]) -> None:
    """The target must hold the whole context but its last token (the root): O(1) per step, and a
    rollback that silently failed shows up here instead of as output that differs from plain
    decoding."""
    if target.n_past != len(context) - 1:
        raise BackendError(f"the model's cache holds {target.n_past} tokens where the answer so far has "
                           f"{len(context) - 1}: a rollback of rejected tokens failed")


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

    ``cancel`` is checked between the prompt's prefill chunks and before every step, so setting
    it stops generation within one chunk or step (a cancelled prefill yields Finished alone).
    """
    prompt = list(prompt)
    check_prompt(prompt, target.n_ctx)
    t0 = clock()
    stats = StatsRecorder(method, len(prompt))
    hidden = HIDDEN_STATES in drafter.requires
    first = max(0, len(prompt) - 1 - drafter.prompt_states)  # the first prompt position whose state it reads
    try:
        reused = target.prefill(prompt[:-1], stop=None if cancel is None else cancel.is_set, hidden=hidden,
                                hidden_from=first, layers=drafter.state_layers if hidden else ())
        drafter.begin(prompt, target.hidden_states(first, len(prompt) - 1) if hidden else None)
    except Cancelled:
        yield Finished(reason="cancelled", tokens=(), text="", stats=stats.result("cancelled"))
        return
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
        _check_cache(target, context)
        wanted = settings.max_new_tokens - produced
        budget = Budget.for_step(target.limits, room=target.n_ctx - len(context), wanted=wanted)
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
        tokens, text, stopped = _push_text(stream, tokens)
        if stopped:
            reason = "stop"
        context.extend(tokens)
        produced += len(tokens)
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
    stats.declined = drafter.declined  # why it drafted nothing, if it chose so
    stats.played = drafter.playing  # what ran, read at the end: auto may hand an answer over mid-way
    yield Finished(reason=reason, tokens=tuple(context[len(prompt) :]), text=stream.text, stats=stats.result(reason))
