"""``specdeck chat``: an interactive terminal chat that streams answers and measures every one.

Each answer is followed by a stats line: method, decode tokens/s (time to first token excluded),
acceptance rate, tau, time to first token. Ctrl+C stops the current answer within one engine
step and keeps the conversation; Ctrl+D (or /quit) leaves. The conversation is re-rendered
through the model's chat template every turn; the target reuses the KV cache of the common
prefix, so earlier turns are not computed again. A conversation that outgrows the context leaves
its oldest turns out of the prompt, as the desktop chat does (``Session.fitting_prompt``), and
says so.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import TextIO

from backends.core.errors import SpecDeckError
from backends.core.types import Finished, GenerationSettings, RunStats, Step
from backends.hardware.observed import ObservedStore
from backends.drafters import REGISTRY
from backends.factory import Session
from backends.models.chat import Message
from backends.remote.client import RemoteError
from backends.remote.session import RemoteSession

HELP = """commands:
  /new            start a new conversation
  /method NAME    switch method ({methods})
  /system TEXT    set the system prompt (starts a new conversation)
  /quit           leave (Ctrl+D works too); Ctrl+C stops an answer"""


def format_stats(stats: RunStats) -> str:
    """One line a person can read at a glance."""
    parts = [(stats.method or "?") + (f" → {stats.played}" if stats.played else "")]
    if stats.decode_tok_s == stats.decode_tok_s:  # not NaN
        parts.append(f"{stats.decode_tok_s:.1f} tok/s decode")
    if stats.prompt_tokens and stats.prompt_tok_s == stats.prompt_tok_s:  # a server may not say how long the prompt was
        parts.append(f"prompt {stats.prompt_tok_s:.0f} tok/s")
    if stats.drafted:
        parts.append(f"acceptance {stats.acceptance_rate:.0%}")
    else:
        parts.append(stats.declined or "acceptance n/a (nothing drafted)")
    if stats.forwards:  # an answer stopped before its first token has no tau and no TTFT
        parts.append(f"tau {stats.tau:.2f}")
        parts.append(f"TTFT {stats.ttft_s * 1000:.0f} ms")
    parts.append(f"{stats.new_tokens} tokens")
    if stats.finish_reason not in ("eos", "stop"):
        parts.append(f"stopped: {stats.finish_reason}")
    return "[" + " · ".join(parts) + "]"


@dataclass
class ChatState:
    method: str
    system: str | None = None
    messages: list[Message] = field(default_factory=list)

    def conversation(self) -> list[Message]:
        head: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages


def answer(session: Session, state: ChatState, settings: GenerationSettings, out: TextIO) -> RunStats | None:
    """Stream one answer to ``out``; Ctrl+C cancels it. Returns its stats (None on error)."""
    fmt = session.model.chat_format
    fitted = session.fitting_prompt(state.conversation(), max_new_tokens=settings.max_new_tokens)
    if fitted.dropped:
        out.write(f"(the {fitted.dropped} oldest message(s) no longer fit the {session.target.n_ctx}-token context "
                  "and were left out of this answer)\n")
    prompt = fitted.tokens
    settings = GenerationSettings(
        max_new_tokens=settings.max_new_tokens, stop=settings.stop + fmt.stop, sampling=settings.sampling
    )
    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    printed = 0
    try:
        for event in session.generate(state.method, prompt, settings, cancel=cancel):
            if isinstance(event, Step) and event.text:
                out.write(event.text)
                out.flush()
                printed += len(event.text)
            elif isinstance(event, Finished):
                out.write(event.text[printed:] + "\n")
                state.messages.append({"role": "assistant", "content": event.text})
                return event.stats
    finally:
        signal.signal(signal.SIGINT, previous)
    return None


def answer_remote(session: RemoteSession, state: ChatState, settings: GenerationSettings, out: TextIO) -> RunStats | None:
    """Stream one answer from a server to ``out``; Ctrl+C cancels it (the connection closes, so
    the server stops generating). A failure raises ``RemoteError`` after the text it got is shown."""
    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        for event in session.generate(state.conversation(), settings, cancel=cancel):
            if isinstance(event, Step) and event.text:
                out.write(event.text)
                out.flush()
            elif isinstance(event, Finished):
                out.write("\n")
                state.messages.append({"role": "assistant", "content": event.text})
                return event.stats
    finally:
        signal.signal(signal.SIGINT, previous)
    return None


def _command(line: str, state: ChatState, out: TextIO) -> bool:
    """Handle a /command; returns False when the user wants to leave."""
    name, _, arg = line[1:].partition(" ")
    if name in ("quit", "exit", "q"):
        return False
    if name == "new":
        state.messages.clear()
        out.write("(new conversation)\n")
    elif name == "method" and arg.strip() in REGISTRY:
        state.method = arg.strip()
        out.write(f"(method: {state.method})\n")
    elif name == "system":
        state.system = arg.strip() or None
        state.messages.clear()
        out.write("(system prompt set; new conversation)\n")
    else:
        out.write(HELP.format(methods=", ".join(REGISTRY)) + "\n")
    return True


def chat_loop(session: Session | RemoteSession, state: ChatState, settings: GenerationSettings,
              inp: TextIO | None = None, out: TextIO | None = None) -> None:
    """Read messages and /commands until Ctrl+D; answer each on ``session`` (a local model, or a
    server: then the server's own method answers and /method does not apply). ``inp``/``out``
    default to the streams at call time (not at import), so a redirected stdin is read."""
    inp = inp if inp is not None else sys.stdin
    out = out if out is not None else sys.stdout
    remote = isinstance(session, RemoteSession)
    interactive = inp.isatty()
    while True:
        if interactive:
            out.write("\nyou> ")
            out.flush()
        line = inp.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            out.write("(empty message: nothing sent)\n")
            continue
        if line.startswith("/"):
            if remote and line.startswith("/method"):
                out.write("(the server decides how it drafts; restart it with another method to change it)\n")
            elif not _command(line, state, out):
                break
            continue
        state.messages.append({"role": "user", "content": line})
        if not interactive:
            out.write(f"you> {line}\n")
        out.write("assistant> ")
        out.flush()
        try:
            stats = answer_remote(session, state, settings, out) if remote else answer(session, state, settings, out)
        except RemoteError as exc:
            if exc.partial:  # what was shown stays in the conversation, and the error says so
                state.messages.append({"role": "assistant", "content": exc.partial})
            else:
                state.messages.pop()  # the message that could not be answered
            out.write(f"\n(error: {exc})\n")
            continue
        except SpecDeckError as exc:
            state.messages.pop()  # the message that could not be answered
            out.write(f"\n(error: {exc})\n")
            continue
        if stats is not None:
            out.write(format_stats(stats) + "\n")
            if stats.finish_reason != "cancelled" and not remote:  # what the recommender learns about this model here
                ObservedStore().record_run(session.model.path, "chat", stats)
        out.flush()
