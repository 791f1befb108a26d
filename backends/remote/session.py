"""A connected server, answering as a local session does: ``generate`` yields the engine's own
events (``Prefilled``, ``Step``, ``Finished``), so the terminal chat, the bench and the window's
charts read a remote answer exactly as they read a local one.

What differs, and how it is filled in:

- **Tokens.** An OpenAI-compatible stream carries text, not token ids. A step's ``tokens`` holds
  one ``REMOTE_TOKEN`` (-1) per token the chunk carried: vLLM says how many through
  ``continuous_usage_stats``, llama-server through ``timings_per_token``; otherwise a chunk counts
  as one token and the total is corrected from the final ``usage``.
- **Drafting.** The server drafts and verifies by itself. Acceptance comes from its own counters:
  vLLM's ``/metrics`` are read before the answer, about every ``poll_s`` while it streams (the
  change since the last reading is put on that step) and after it; llama-server's ``timings``
  give ``draft_n``/``draft_n_accepted`` with the last chunk. A server that reports neither (the
  llama-cpp-python server) leaves ``drafted`` at 0 and says so in ``declined``. Other requests the
  server runs meanwhile count too: the figures are the server's, not this answer's alone.
- **Prefill.** Time to the first text is the prefill (queueing included).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass

from backends.core.types import Event, Finished, GenerationSettings, Prefilled, RunStats, Step
from backends.models.chat import ChatFormat, Message
from backends.remote.client import CHAT, COMPLETIONS, Piece, RemoteClient, RemoteError, ServerConfig
from backends.remote.gpu import find_gpu_metrics
from backends.remote.metrics import SpecCounters, SpecDelta, parse_timings

REMOTE_TOKEN = -1  # a token the server generated; its id is not sent over the API
METHOD = "server"  # the method name a remote answer's stats carry
PLAIN = ChatFormat(template=None)  # how a conversation is written for the completions endpoint


@dataclass(frozen=True)
class ServerInfo:
    """What connecting found: the engine, its models, the one used and whether it counts drafts."""

    base: str
    engine: str  # "vLLM 0.9.2", "llama-server", "OpenAI-compatible server"
    models: tuple[str, ...]
    model: str
    counters: bool  # it exports vLLM's speculative-decoding counters
    gpu_metrics: str = ""  # where its GPUs' power and temperature can be read (dcgm-exporter), if anywhere

    @property
    def label(self) -> str:
        return f"{self.model} on {self.engine} at {self.base}"


def engine_of(client: RemoteClient) -> tuple[str, bool, str]:
    """Which engine answers, from the side endpoints only it has: (engine, whether it counts
    drafts, where its GPU metrics are)."""
    metrics = client.optional_text("/metrics") or ""
    gpus = find_gpu_metrics(client.config.base, metrics, verify=client.config.verify)
    if "vllm:" in metrics:
        version = client.optional_text("/version") or ""
        number = version.split('"version"')[-1].strip(' :"}\n') if '"version"' in version else ""
        return f"vLLM {number}".strip(), "vllm:spec_decode" in metrics, gpus
    props = client.optional_text("/props") or ""
    if "default_generation_settings" in props or "llamacpp:" in metrics:
        return "llama-server", False, gpus
    return "OpenAI-compatible server", False, gpus


class RemoteSession:
    """One server and one of its models, ready to answer."""

    poll_s = 0.5

    def __init__(self, config: ServerConfig, *, client: RemoteClient | None = None) -> None:
        self.config = config
        self.client = client or RemoteClient(config)
        self.chat = config.api != "completions"  # whether answers come from the chat endpoint
        try:
            self.info = self._connect()
        except BaseException:
            self.client.close()
            raise

    def _connect(self) -> ServerInfo:
        models = self.client.ready_models()
        if not models:
            raise RemoteError("bad_request", f"{self.config.base} serves no model")
        model = self.config.model or models[0]
        if model not in models:
            raise RemoteError("bad_request", f"{self.config.base} does not serve {model!r}; it serves {', '.join(models)}")
        engine, counters, gpus = engine_of(self.client)
        return ServerInfo(base=self.config.base, engine=engine, models=tuple(models), model=model, counters=counters,
                          gpu_metrics=gpus)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _counters(self) -> SpecCounters | None:
        return self.client.counters(self.info.model) if self.info.counters else None

    def request_body(self, messages: Sequence[Message], generation: GenerationSettings, *, chat: bool = True) -> dict:
        """The (chat-)completion request; per-chunk token counts asked for in both servers'
        spellings (each ignores the other's). Without ``chat`` the conversation is sent as a plain
        transcript ("User: ...\nAssistant:"), the way SpecDeck prompts a local model without a
        template, and stops where the model would start the user's next turn."""
        s = generation.sampling
        stop = list(generation.stop) + ([] if chat else list(PLAIN.stop))
        asked = {"messages": list(messages)} if chat else {"prompt": PLAIN.render(messages)}
        body: dict = {
            "model": self.info.model, **asked, "max_tokens": generation.max_new_tokens,
            "temperature": s.temperature, "top_p": s.top_p,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "timings_per_token": True,
        }
        if s.temperature > 0:
            body.update(top_k=s.top_k, min_p=s.min_p)
        if s.seed is not None:
            body["seed"] = s.seed
        if s.penalized:
            body["repeat_penalty"] = s.repeat_penalty
        if stop:
            body["stop"] = stop
        return body

    def generate(self, messages: Sequence[Message], generation: GenerationSettings, *,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """Stream one answer as engine events; a failure raises ``RemoteError`` with the text
        received so far in ``partial``."""
        run = _RemoteRun(self._counters())
        for piece in self._stream(messages, generation, cancel):
            if run.first is None and (piece.text or piece.finish_reason):
                yield run.prefilled()
            if piece.text:
                yield run.step(piece, self._poll(run))
            run.finish_with(piece)
        reason = "cancelled" if cancel is not None and cancel.is_set() and run.reason is None else run.reason or "eos"
        yield run.finished(reason, self._counters() if reason != "cancelled" else None)

    def _stream(self, messages: Sequence[Message], generation: GenerationSettings,
                cancel: threading.Event | None) -> Iterator[Piece]:
        """The answer's chunks, from the chat endpoint or the plain one. With ``api="auto"`` a
        model the server has no chat template for (vLLM refuses such a chat request with a 400
        that says so) is asked through ``/v1/completions`` from then on; nothing had streamed."""
        if self.chat:
            try:
                yield from self.client.stream(CHAT, self.request_body(messages, generation), cancel=cancel)
                return
            except RemoteError as exc:
                if not (self.config.api == "auto" and exc.kind == "bad_request" and not exc.partial
                        and "template" in str(exc).lower()):
                    raise
                self.chat = False
        yield from self.client.stream(COMPLETIONS, self.request_body(messages, generation, chat=False), cancel=cancel)

    def _poll(self, run: _RemoteRun) -> SpecDelta | None:
        """The counters' change since the last reading, when ``poll_s`` has passed."""
        if not self.info.counters or time.monotonic() - run.polled < self.poll_s:
            return None
        run.polled = time.monotonic()
        return run.advance(self._counters())


def connect(config: ServerConfig, cancel: threading.Event) -> RemoteSession | None:
    """``RemoteSession(config)``, given up as soon as ``cancel`` is set (None then): a host that
    drops packets holds a connection attempt for the whole connect timeout, once per retry, and a
    Stop must not wait for that. A session made after it was given up is closed then."""
    future: Future[RemoteSession] = Future()

    def attempt() -> None:
        try:
            future.set_result(RemoteSession(config))
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            future.set_exception(exc)

    threading.Thread(target=attempt, daemon=True, name="specdeck-remote-connect").start()  # daemon: never holds up exit
    while not cancel.is_set():
        if wait([future], timeout=0.05).done:
            return future.result()
    future.add_done_callback(_close_if_made)
    return None


def _close_if_made(attempt: Future) -> None:
    if attempt.exception() is None:
        attempt.result().close()


class _RemoteRun:
    """One answer's tally, in the engine's terms."""

    def __init__(self, before: SpecCounters | None) -> None:
        self.t0 = time.perf_counter()
        self.start = self.last = before
        self.polled = time.monotonic()
        self.first: float | None = None
        self.end = 0.0
        self.text: list[str] = []
        self.tokens = 0
        self.steps = 0
        self.first_tokens = 0  # tokens of the first chunk (the decode rate leaves them out, as locally)
        self.seen_usage = 0  # completion tokens the server had reported so far
        self.seen_timings = 0
        self.drafted = self.accepted = 0
        self.usage: dict | None = None
        self.timings: dict | None = None
        self.reason: str | None = None

    def prefilled(self) -> Prefilled:
        self.first = time.perf_counter() - self.t0
        return Prefilled(prompt_tokens=0, reused_tokens=0, seconds=self.first)

    def _count(self, piece: Piece) -> int:
        """Tokens this chunk carried, from the server's running counts where it sends them."""
        reported = (piece.usage or {}).get("completion_tokens")
        if isinstance(reported, int) and reported >= self.seen_usage:
            n, self.seen_usage = reported - self.seen_usage, reported
            return n
        predicted = (piece.timings or {}).get("predicted_n")
        if isinstance(predicted, int) and predicted >= self.seen_timings:
            n, self.seen_timings = predicted - self.seen_timings, predicted
            return n
        return 1

    def advance(self, now: SpecCounters | None) -> SpecDelta | None:
        if now is None:
            return None
        delta = now.minus(self.last)
        self.last = now
        return delta

    def step(self, piece: Piece, delta: SpecDelta | None) -> Step:
        n = max(1, self._count(piece))
        drafted = int(delta.drafted) if delta is not None else 0
        accepted = min(int(delta.accepted) if delta is not None else 0, n)
        self.drafted += drafted
        self.accepted += accepted
        self.tokens += n
        self.text.append(piece.text)
        self.end = time.perf_counter() - self.t0
        self.first_tokens = self.first_tokens or n
        self.steps += 1
        return Step(index=self.steps - 1, tokens=(REMOTE_TOKEN,) * n, text=piece.text, drafted=drafted,
                    accepted=accepted, draft_depth=0, t_draft=0.0, t_verify=0.0, t_accept=0.0, elapsed=self.end)

    def finish_with(self, piece: Piece) -> None:
        if piece.usage:
            self.usage = piece.usage
        if piece.timings:
            self.timings = piece.timings
        if piece.finish_reason:
            self.reason = {"stop": "eos", "length": "length"}.get(piece.finish_reason, piece.finish_reason)

    def finished(self, reason: str, after: SpecCounters | None) -> Finished:
        text = "".join(self.text)
        total = (self.usage or {}).get("completion_tokens")
        tokens = total if isinstance(total, int) and total >= self.tokens else self.tokens
        drafted, accepted, declined = self._drafting(after)
        first = self.first if self.first is not None else 0.0
        prompt = (self.usage or {}).get("prompt_tokens")
        stats = RunStats(
            method=METHOD, prompt_tokens=prompt if isinstance(prompt, int) else 0, reused_tokens=0, new_tokens=tokens,
            forwards=max(1, tokens - accepted) if tokens else 0, drafted=drafted, accepted=accepted, prefill_s=first, ttft_s=first,
            decode_s=max(0.0, self.end - first), first_step_tokens=min(self.first_tokens, tokens), draft_s=0.0, verify_s=0.0,
            accept_s=0.0, drafted_at=(), accepted_at=(), finish_reason=reason, declined=declined)
        return Finished(reason=reason, tokens=(REMOTE_TOKEN,) * tokens, text=text, stats=stats)

    def _drafting(self, after: SpecCounters | None) -> tuple[int, int, str]:
        """(drafted, accepted, why none) over the whole answer, from the server. Every verify
        step emits its accepted tokens plus one, so the steps are the tokens less the accepted
        ones, and tau = tokens / steps as for a local answer."""
        timings = parse_timings(self.timings)
        if timings is not None and timings.draft is not None:
            return int(timings.draft.drafted), int(timings.draft.accepted), ""
        if after is not None:
            whole = after.minus(self.start)
            return int(whole.drafted), int(whole.accepted), ""
        if timings is not None:
            return 0, 0, "the server drafted nothing for this answer"
        return 0, 0, "the server does not report drafting (no counters or timings)"
