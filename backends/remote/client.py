"""A client for OpenAI-compatible servers (vLLM, llama-server, llama-cpp-python's server).

What a desktop user needs from it, beyond sending a request:

- **Clear failures.** Every way a server can fail becomes a ``RemoteError`` whose message says
  what happened and what to do: unreachable, wrong key (401/403), rate-limited (429), failed
  (5xx), stalled (no data for ``stall_timeout`` seconds), dropped mid-answer. A failure during an
  answer carries the text received so far (``partial``), so nothing the user saw is lost.
- **Retries only where they cannot duplicate anything.** Connection failures, 429 and 502-504 are
  retried with exponential backoff (a 429's ``Retry-After`` is honoured up to ``max_wait``)
  before the first byte of an answer; once text has streamed, a retry would repeat it, so a
  dropped stream is reported instead.
- **Cancel and stall detection while blocked.** The HTTP read runs on a reader thread that feeds a
  queue; the caller's thread waits on the queue in short slices, so a stop request is honoured
  within ~50 ms even when the server sends nothing, and closing the stream tells the server to
  stop generating.
- **The key stays secret.** It is sent as a bearer token and kept out of ``repr`` and messages.
"""

from __future__ import annotations

import email.utils
import json
import queue
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx

from backends.core.errors import SpecDeckError
from backends.remote.metrics import SpecCounters, parse_vllm

_RETRY_STATUS = {429, 502, 503, 504}
APIS = ("auto", "chat", "completions")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_DONE = object()


class RemoteError(SpecDeckError):
    """A server could not give (all of) an answer. ``kind`` is one of unreachable, auth,
    rate_limited, server, bad_request, stalled, dropped, protocol, tls, loading; ``partial`` is the answer text
    received before the failure."""

    def __init__(self, kind: str, message: str, *, partial: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.partial = partial
        self.status = status


@dataclass(frozen=True)
class ServerConfig:
    """Where a server is and how patient to be with it. ``url`` is its base address, with or
    without ``/v1`` (``http://gpu-box:8000``); ``verify`` is False or a CA bundle path for
    self-signed TLS."""

    url: str
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None  # the served model to ask (None: the first one it lists)
    verify: bool | str = True
    connect_timeout: float = 5.0
    stall_timeout: float = 120.0  # the longest silence accepted, time to the first token included
    retries: int = 3
    backoff: float = 0.5  # seconds before the first retry; doubles each time
    max_wait: float = 30.0  # the longest Retry-After honoured
    api: str = "auto"  # "chat", "completions" (a plain transcript), or "auto": chat unless the model has no template

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"a server address starts with http:// or https://, got {self.url!r}")
        if self.api not in APIS:
            raise ValueError(f"the API is one of {', '.join(APIS)}, got {self.api!r}")

    @property
    def name(self) -> str:
        """A short label for tables and panes: ``host:port`` (the scheme and path left out)."""
        return httpx.URL(self.base).netloc.decode() or self.base

    @property
    def base(self) -> str:
        """The address without a trailing ``/`` or ``/v1`` (metrics and health live beside it)."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class Piece:
    """One streamed chunk: its text, and what the server said about it."""

    text: str
    finish_reason: str | None = None
    usage: dict | None = None  # {"prompt_tokens", "completion_tokens"} when the server sends it
    timings: dict | None = None  # llama-server's per-request timings


def tls_verify(verify: bool | str) -> bool | ssl.SSLContext:
    """httpx's ``verify`` for ServerConfig's: a CA file becomes a context trusting it."""
    return ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify


def retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    current = datetime.fromtimestamp(now if now is not None else time.time(), tz=timezone.utc)
    return max(0.0, (when - current).total_seconds())


def _detail(response: httpx.Response) -> str:
    """The server's own words about an error response, short."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:200]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:200]
    return str(body)[:200]


def status_error(response: httpx.Response, *, what: str) -> RemoteError:
    """A readable error for an HTTP error status (the body is already read)."""
    code, detail = response.status_code, _detail(response)
    said = f": {detail}" if detail else ""
    if code in (401, 403):
        return RemoteError("auth", f"the server refused the API key ({code}{said}); check the key in the connection settings",
                           status=code)
    if code == 429:
        wait = retry_after(response.headers.get("retry-after"))
        later = f" and asks to retry after {wait:.0f} s" if wait is not None else ""
        return RemoteError("rate_limited", f"the server is rate-limiting requests (429){later}; try again later", status=code)
    if code == 404:
        return RemoteError("bad_request", f"the server has no {what} (404{said}); is this an OpenAI-compatible address?", status=code)
    if 400 <= code < 500:
        return RemoteError("bad_request", f"the server rejected the {what} ({code}{said})", status=code)
    return RemoteError("server", f"the server failed on the {what} ({code}{said})", status=code)


class RemoteClient:
    """One server: its models, health, counters, and streamed (chat) completions."""

    def __init__(self, config: ServerConfig, *, transport: httpx.BaseTransport | None = None) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        timeout = httpx.Timeout(config.stall_timeout, connect=config.connect_timeout)
        self.http = httpx.Client(base_url=config.base, headers=headers, timeout=timeout, verify=tls_verify(config.verify),
                                 transport=transport, follow_redirects=True)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RemoteClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plain requests ------------------------------------------------------------------------
    def _send(self, request: httpx.Request, *, what: str, stream: bool = False) -> httpx.Response:
        """Send with retries for what cannot have produced anything yet (no connection, 429,
        502-504). A returned response has a success status; a streamed one is still open."""
        delay = self.config.backoff
        for attempt in range(self.config.retries + 1):
            last = attempt == self.config.retries
            try:
                response = self.http.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if _tls_failure(exc):  # retrying cannot make a certificate trusted
                    raise RemoteError("tls", f"the TLS certificate of {self.config.base} is not trusted "
                                      f"({_reason(exc)}); for a self-signed one, give its CA certificate file") from exc
                if last:
                    raise RemoteError("unreachable", f"cannot reach {self.config.base} ({_reason(exc)}); "
                                      "is the server running and the address right?") from exc
                time.sleep(delay)
                delay *= 2
                continue
            except httpx.TimeoutException as exc:
                raise RemoteError("stalled", f"the server did not answer the {what} within "
                                  f"{self.config.stall_timeout:.0f} s") from exc
            except httpx.TransportError as exc:
                raise RemoteError("unreachable", f"the connection to {self.config.base} failed ({_reason(exc)})") from exc
            if response.is_success:
                return response
            response.read()
            response.close()
            if response.status_code not in _RETRY_STATUS or last:
                raise status_error(response, what=what)
            wait = retry_after(response.headers.get("retry-after"))
            if wait is not None and wait > self.config.max_wait:
                raise status_error(response, what=what)
            time.sleep(wait if wait is not None else delay)
            delay *= 2
        raise AssertionError("unreachable")  # the loop returns or raises

    def _get_json(self, path: str, *, what: str) -> object:
        response = self._send(self.http.build_request("GET", path), what=what)
        try:
            return response.json()
        except ValueError as exc:
            raise RemoteError("protocol", f"the server's {what} is not JSON; is this an OpenAI-compatible address?") from exc

    def models(self) -> list[str]:
        """The model ids the server serves (``/v1/models``)."""
        body = self._get_json("/v1/models", what="model list")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise RemoteError("protocol", "the server's model list has no 'data'; is this an OpenAI-compatible address?")
        return [str(item["id"]) for item in data if isinstance(item, dict) and "id" in item]

    def health(self) -> str | None:
        """``/health`` as vLLM and llama-server answer it: "ok", or "loading" for the 503 that
        llama-server sends while it reads its model; None where there is no such endpoint (404)
        or it could not be asked (the model list is what proves a server usable)."""
        try:
            response = self.http.get("/health", timeout=min(5.0, self.config.stall_timeout))
        except httpx.HTTPError:
            return None
        if response.is_success:
            return "ok"
        return "loading" if response.status_code == 503 else None

    def ready_models(self) -> list[str]:
        """The model list of a server ready to answer; one still loading its model is said to be."""
        if self.health() == "loading":
            raise RemoteError("loading", f"{self.config.base} is still loading its model (/health answers 503); "
                              "try again when it is ready", status=503)
        return self.models()

    def optional_text(self, path: str) -> str | None:
        """A side endpoint (``/metrics``, ``/props``, ``/version``) or None where the server has
        none; never retried for long, never fatal."""
        try:
            response = self.http.get(path, timeout=min(5.0, self.config.stall_timeout))
        except httpx.HTTPError:
            return None
        return response.text if response.is_success else None

    def counters(self, model: str | None = None) -> SpecCounters | None:
        """The server's speculative-decoding counters (vLLM's ``/metrics``), None without them."""
        text = self.optional_text("/metrics")
        if not text:
            return None
        try:
            return parse_vllm(text, model=model)
        except ValueError:  # not Prometheus text
            return None

    # -- streaming -----------------------------------------------------------------------------
    def stream(self, endpoint: str, body: dict, *, cancel: threading.Event | None = None) -> Iterator[Piece]:
        """Stream ``endpoint`` (CHAT or COMPLETIONS; ``body`` without ``stream``); stops quietly
        when ``cancel`` is set and raises ``RemoteError`` (with the text so far) on any failure."""
        request = self.http.build_request("POST", endpoint, json={**body, "stream": True})
        pieces: queue.Queue = queue.Queue()
        stop = threading.Event()
        reader = threading.Thread(target=self._read_stream, args=(request, pieces, stop), daemon=True,
                                  name="specdeck-remote-reader")
        reader.start()
        received: list[str] = []
        last = time.monotonic()
        try:
            while True:
                try:
                    item = pieces.get(timeout=0.05)
                except queue.Empty:
                    if cancel is not None and cancel.is_set():
                        return
                    if time.monotonic() - last > self.config.stall_timeout:
                        raise RemoteError("stalled", f"the server sent nothing for {self.config.stall_timeout:.0f} s; "
                                          "it may be overloaded or stuck", partial="".join(received)) from None
                    continue
                last = time.monotonic()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise self._stream_failure(item, "".join(received)) from item
                piece = _piece(item, "".join(received))
                received.append(piece.text)
                yield piece
                if cancel is not None and cancel.is_set():
                    return
        finally:
            stop.set()

    def _read_stream(self, request: httpx.Request, pieces: queue.Queue, stop: threading.Event) -> None:
        """The reader thread: server-sent events, one JSON object per ``data:`` line."""
        try:
            response = self._send(request, what="chat request", stream=True)
            try:
                for line in response.iter_lines():
                    if stop.is_set():
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        pieces.put(_DONE)
                        return
                    pieces.put(json.loads(data))
            finally:
                response.close()  # closing the connection tells the server to stop generating
            pieces.put(RemoteError("dropped", "the server closed the answer without finishing it"))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            pieces.put(exc)

    def _stream_failure(self, exc: BaseException, partial: str) -> RemoteError:
        kept = f"; the {len(partial)} characters received are kept" if partial else ""
        if isinstance(exc, RemoteError):
            exc.partial = partial
            if exc.kind == "dropped" and kept:
                exc.args = (str(exc) + kept,)
            return exc
        if isinstance(exc, json.JSONDecodeError):
            return RemoteError("protocol", "the server streamed something that is not JSON", partial=partial)
        if isinstance(exc, httpx.TimeoutException):
            return RemoteError("stalled", f"the server sent nothing for {self.config.stall_timeout:.0f} s{kept}",
                               partial=partial)
        if isinstance(exc, httpx.HTTPError):
            return RemoteError("dropped", f"the connection to the server was lost mid-answer ({_reason(exc)}){kept}",
                               partial=partial)
        return RemoteError("protocol", f"reading the server's answer failed: {exc}", partial=partial)


def _piece(item: object, partial: str) -> Piece:
    """A chat-completion chunk as a Piece; an ``error`` object in the stream becomes a RemoteError."""
    if not isinstance(item, dict):
        raise RemoteError("protocol", "the server streamed a chunk that is not an object", partial=partial)
    if "error" in item:
        error = item["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise RemoteError("server", f"the server failed mid-answer: {message}", partial=partial)
    choices = item.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    delta = choice.get("delta") or {}  # a chat chunk; a completion chunk has its text beside it
    text = (delta.get("content") or "") if isinstance(delta, dict) else ""
    text = text or str(choice.get("text") or "")
    return Piece(text=text, finish_reason=choice.get("finish_reason"), usage=item.get("usage") or None,
                 timings=item.get("timings") or None)


def _tls_failure(exc: BaseException) -> bool:
    """Whether a connection failed in the TLS handshake (an untrusted or mismatched certificate)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text or type(exc).__name__
