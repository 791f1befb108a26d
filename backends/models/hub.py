"""Find models on the Hugging Face Hub and download them into the library folder, resumably.

Search, file listing and file metadata go through ``huggingface_hub`` (``HfApi``,
``get_hf_file_metadata``), and the bytes through its HTTP session (proxies, token, user agent).
The transfer loop itself is SpecDeck's rather than ``hf_hub_download``, because
``hf_hub_download`` throws a partial file away when it is interrupted, and a 5 GB model cut off
at 80% by a closed laptop lid or a Cancel click should continue where it stopped. It also moves
the progress bar and checks Cancel every megabyte, where the library reads 10 MB at a time.

How a download keeps the library clean:

- Bytes go to ``<name>.<etag>.part`` next to the destination. The library only lists ``*.gguf``
  files and folders with ``config.json``, so a partial file never shows up as a model.
- The etag (the file's sha256 for large files) is in the partial's name, so a file changed on the
  Hub since the partial was written starts over instead of splicing two versions together.
- When all bytes are there, the sha256 is checked against the Hub's, a GGUF file's header is
  checked, and only then the partial is renamed to its final name, in one step.
- A failed check deletes the partial (its bytes are wrong, resuming would keep them); a cancel or
  a network failure keeps it for the next attempt.

``endpoint`` is the Hub's address; None means huggingface.co (or ``HF_ENDPOINT``). Tests point it
at a local server that speaks the same HTTP API.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

import httpx
from huggingface_hub import HfApi, constants, get_hf_file_metadata, get_session, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

from backends.core.errors import Cancelled, ModelFileError, SpecDeckError
from backends.models.gguf_info import check_gguf_file

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HASH_CHUNK = 8 << 20
_CHUNK = 1 << 20  # progress and cancel granularity: a slow link still moves the bar every second
_RETRIES = 5

# (stage, bytes done, bytes in all or None when unknown); stage is "download" or "verify" (sha256)
Progress = Callable[[str, int, int | None], None]


class HubError(SpecDeckError):
    """The Hub could not be reached, or refused or does not have what was asked for."""


@dataclass(frozen=True)
class HubModel:
    """One search result."""

    id: str
    downloads: int
    likes: int
    has_gguf: bool


@dataclass(frozen=True)
class HubFile:
    """One file of a repository, as the Hub lists it."""

    path: str
    size: int
    sha256: str | None  # LFS files only; small text files have a git blob id instead

    @property
    def kind(self) -> str:
        """What SpecDeck can do with it: 'gguf', 'safetensors', 'config' (json, tokenizer files),
        'pickle' (refused: SpecDeck never loads pickled weights) or 'other'."""
        name = self.path.lower()
        if name.endswith(".gguf"):
            return "gguf"
        if name.endswith(".safetensors"):
            return "safetensors"
        if name.endswith(PICKLE_SUFFIXES):
            return "pickle"
        if name.endswith((".json", ".model", ".txt", ".jinja")):
            return "config"
        return "other"


def local_path(root: Path, repo_id: str, filename: str) -> Path:
    """``root/owner/name/filename``: one folder per repository, keeping a repository's own subfolders
    (a Hugging Face model folder must stay together for its ``config.json`` to find its weights)."""
    parts = PurePosixPath(filename).parts
    if not parts or any(p in ("..", "") or p.startswith("/") for p in parts):
        raise HubError(f"refusing the file name {filename!r}: it would land outside the library folder")
    return root.joinpath(*repo_id.split("/"), *parts)


def search_models(query: str, *, gguf_only: bool = True, limit: int = 30,
                  endpoint: str | None = None) -> list[HubModel]:
    """Models whose id matches ``query``, most downloaded first."""
    api = HfApi(endpoint=endpoint)
    with _hub_errors(f"search for {query!r}"):
        found = api.list_models(search=query or None, filter="gguf" if gguf_only else None,
                                sort="downloads", limit=limit)
        return [HubModel(m.id, m.downloads or 0, m.likes or 0, "gguf" in (m.tags or ()) or gguf_only)
                for m in found]


def list_files(repo_id: str, *, revision: str | None = None, endpoint: str | None = None) -> list[HubFile]:
    """Every file of a repository with its size, in path order."""
    api = HfApi(endpoint=endpoint)
    with _hub_errors(repo_id):
        tree = api.list_repo_tree(repo_id, recursive=True, revision=revision)
        files = [HubFile(f.path, f.size, f.lfs.sha256 if f.lfs else None) for f in tree if hasattr(f, "size")]
    return sorted(files, key=lambda f: f.path)


def expand_selection(files: list[HubFile], chosen: list[str]) -> list[HubFile]:
    """The files to download for ``chosen``: a split GGUF model (``-00001-of-00003``) needs all of
    its parts, and llama.cpp loads it from the first; pickled weights are refused."""
    wanted: dict[str, HubFile] = {}
    by_path = {f.path: f for f in files}
    for path in chosen:
        if path not in by_path:
            raise HubError(f"{path} is not in this repository")
        if by_path[path].kind == "pickle":
            raise HubError(f"{path} holds pickled weights, which can run code when loaded; "
                           "SpecDeck loads GGUF or safetensors only")
        split = _SPLIT.match(PurePosixPath(path).name)
        siblings = [f for f in files if split and _same_split(f.path, path)] or [by_path[path]]
        wanted.update((f.path, f) for f in siblings)
    return sorted(wanted.values(), key=lambda f: f.path)


def _same_split(candidate: str, path: str) -> bool:
    a, b = _SPLIT.match(PurePosixPath(candidate).name), _SPLIT.match(PurePosixPath(path).name)
    return bool(a and b and PurePosixPath(candidate).parent == PurePosixPath(path).parent
                and a["stem"] == b["stem"] and a["count"] == b["count"])


def partial_files(root: Path) -> list[Path]:
    """Interrupted downloads waiting to be resumed (they are never listed as models)."""
    return sorted(root.rglob("*.part")) if root.is_dir() else []


def download_file(repo_id: str, filename: str, root: Path, *, revision: str | None = None,
                  endpoint: str | None = None, progress: Progress | None = None,
                  cancel: threading.Event | None = None) -> Path:
    """Download one file to ``local_path(root, repo_id, filename)``, resuming a partial one.

    Returns the final path. Raises ``Cancelled`` when ``cancel`` is set (the partial file stays, so
    the next call resumes), ``HubError`` for network and Hub failures, ``ModelFileError`` when the
    bytes do not match the Hub's checksum or are not a GGUF file (the partial file is deleted).
    """
    dest = local_path(root, repo_id, filename)
    url = hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint)
    with _hub_errors(f"{repo_id}/{filename}"):
        meta = get_hf_file_metadata(url, endpoint=endpoint)
    etag = (meta.etag or "noetag").strip('"')
    if dest.exists() and dest.stat().st_size == meta.size:
        return dest  # already in the library
    part = dest.with_name(f"{dest.name}.{re.sub(r'[^0-9A-Za-z]', '', etag)[:16]}.part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _drop_stale_partials(dest, keep=part)
    done = part.stat().st_size if part.exists() else 0
    _check_disk_space(dest.parent, (meta.size or 0) - done)
    if meta.size is None or done < meta.size:
        _fetch(meta.location, part, meta.size, progress, cancel)
    _verify(part, dest, meta.size, etag, progress)
    part.replace(dest)
    return dest


def _fetch(url: str, part: Path, size: int | None, progress: Progress | None,
           cancel: threading.Event | None) -> None:
    """Append the missing bytes of ``url`` to ``part``; a dropped connection resumes from what is
    on disk (a few times, waiting longer each time) instead of failing the whole download."""
    failures = 0
    while True:
        before = part.stat().st_size if part.exists() else 0
        try:
            _stream(url, part, before, size, progress, cancel)
            return
        except httpx.TransportError as exc:
            grew = (part.stat().st_size if part.exists() else 0) > before
            failures = 0 if grew else failures + 1
            if failures > _RETRIES:
                raise HubError(f"the connection to the Hub keeps failing ({network_reason(exc)}); "
                               "the part downloaded so far is kept, try again later") from exc
            time.sleep(min(8.0, 0.5 * 2**failures))


def _stream(url: str, part: Path, done: int, size: int | None, progress: Progress | None,
            cancel: threading.Event | None) -> None:
    """One GET from byte ``done`` on (a Range request), written chunk by chunk.

    Cancel is checked after every chunk is on disk, so a cancelled download keeps all it received
    and a resumed one asks for exactly the rest.
    """
    headers = build_hf_headers()
    headers["Accept-Encoding"] = "identity"  # sizes and ranges are in bytes of the file itself
    if done:
        headers["Range"] = f"bytes={done}-"
    with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
        with _hub_errors(part.name):
            hf_raise_for_status(response)
        mode = "ab" if done and response.status_code == 206 else "wb"  # a server may ignore Range
        done = done if mode == "ab" else 0
        with part.open(mode) as out:
            for chunk in response.iter_bytes(_CHUNK):
                out.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress("download", done, size)
                if cancel is not None and cancel.is_set():
                    raise Cancelled("download cancelled; it resumes where it stopped next time")


def _verify(part: Path, dest: Path, size: int | None, etag: str, progress: Progress | None) -> None:
    """Check size, sha256 (when the Hub gave one) and the GGUF header; delete the partial if wrong."""
    try:
        if size is not None and part.stat().st_size != size:
            raise ModelFileError(f"{dest.name}: got {part.stat().st_size:,} bytes, the Hub lists {size:,}")
        if _SHA256.match(etag):
            digest = _sha256(part, progress)
            if digest != etag:
                raise ModelFileError(f"{dest.name} is corrupt: its sha256 is {digest[:12]}..., "
                                     f"the Hub's is {etag[:12]}...; it was deleted, download it again")
        if dest.suffix == ".gguf":
            check_gguf_file(part)
    except ModelFileError:
        part.unlink(missing_ok=True)
        raise


def _sha256(path: Path, progress: Progress | None) -> str:
    digest, size, done = hashlib.sha256(), path.stat().st_size, 0
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress("verify", done, size)
    return digest.hexdigest()


def _drop_stale_partials(dest: Path, keep: Path) -> None:
    """Partials of an older version of the same file (another etag) can never be resumed."""
    for old in dest.parent.glob(f"{dest.name}.*.part"):
        if old != keep:
            old.unlink(missing_ok=True)


def _check_disk_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise HubError(f"not enough disk space in {folder}: {needed / 2**30:.1f} GiB needed, "
                       f"{free / 2**30:.1f} GiB free")


@contextmanager
def _hub_errors(what: str) -> Iterator[None]:
    """Turn huggingface_hub and network exceptions into one ``HubError`` with a readable reason."""
    try:
        yield
    except SpecDeckError:
        raise
    except Exception as exc:
        message = _explain(what, exc)
        if message is None:
            raise
        raise HubError(message) from exc


def _explain(what: str, exc: BaseException) -> str | None:
    if isinstance(exc, GatedRepoError):
        return (f"{what} is gated: accept its licence on huggingface.co, then log in with "
                "`hf auth login` so SpecDeck can use your token")
    if isinstance(exc, RepositoryNotFoundError):
        return f"{what}: no such repository on the Hub (or it is private and you are not logged in)"
    if isinstance(exc, RevisionNotFoundError):
        return f"{what}: no such branch or revision"
    if isinstance(exc, EntryNotFoundError):
        return f"{what}: no such file in the repository"
    if isinstance(exc, HfHubHTTPError):
        return f"{what}: the Hub answered with an error ({exc})"
    if isinstance(exc, httpx.HTTPError):
        return f"cannot reach the Hugging Face Hub for {what}: {network_reason(exc)}"
    return None


def network_reason(exc: BaseException) -> str:
    """Why a request got no answer, in words a person can act on (not ``[Errno -2] ...``).

    Example: a lookup of huggingface.co that fails gives "no network: the Hub's address could not
    be looked up (check the connection, or a proxy)"."""
    text = str(exc).lower()
    if isinstance(exc, httpx.TimeoutException):
        return "the Hub did not answer in time; the network may be slow or down, try again later"
    if any(words in text for words in ("name or service not known", "name resolution", "nodename nor servname",
                                       "no address associated", "getaddrinfo")):
        return "no network: the Hub's address could not be looked up (check the connection, or a proxy)"
    if "refused" in text:
        return "the connection was refused (nothing answers at that address; check a proxy or the endpoint)"
    if "network is unreachable" in text or "no route to host" in text:
        return "no network: the Hub cannot be reached from this computer (check the connection)"
    if isinstance(exc, httpx.ProxyError):
        return "the proxy refused the connection (check its settings)"
    return f"the connection failed ({type(exc).__name__}); check the network and try again"


@dataclass
class DownloadProgress:
    """What a download thread publishes for a window to poll: plain attributes, each written in
    one assignment, so a reader on another thread sees a consistent enough picture."""

    files: int
    total_bytes: int
    file_index: int = 0
    current: str = ""
    done_bytes: int = 0  # over all files
    stage: str = "download"  # or "verify"
    finished: bool = False
    error: str | None = None
    cancelled: bool = False
    paths: tuple[Path, ...] = ()
    result: Path | None = None  # what the job made of the files, when it makes something (a head)


def download_files(repo_id: str, files: list[HubFile], root: Path, state: DownloadProgress, *,
                   revision: str | None = None, endpoint: str | None = None,
                   cancel: threading.Event | None = None) -> None:
    """Download ``files`` one after another, publishing progress in ``state``; never raises.

    Meant to run on its own thread: whatever goes wrong ends up in ``state.error`` (a cancel in
    ``state.cancelled``) with the files finished so far kept in ``state.paths``.
    """
    with reporting(state, repo_id):
        fetch_files(repo_id, files, root, state, revision=revision, endpoint=endpoint, cancel=cancel)


@contextmanager
def reporting(state: DownloadProgress, what: str) -> Iterator[None]:
    """Run a download thread's work so that it ends in ``state`` (finished, with an error or a
    cancel), never in an exception nobody sees."""
    try:
        yield
    except Cancelled:
        state.cancelled = True
    except SpecDeckError as exc:
        state.error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a download thread must report, not die silently
        state.error = f"{what}: download failed: {exc or type(exc).__name__}"
    finally:
        state.finished = True


def fetch_files(repo_id: str, files: list[HubFile], root: Path, state: DownloadProgress, *,
                revision: str | None = None, endpoint: str | None = None,
                cancel: threading.Event | None = None) -> None:
    """Download ``files`` into ``root``, adding to ``state``'s counts (so that one job may fetch in
    several rounds, as a head does: its config first, then its weights); raises on failure."""
    for file in files:
        state.file_index, state.current = len(state.paths), file.path

        def report(stage: str, done: int, total: int | None, base: int = state.done_bytes,
                   size: int = file.size) -> None:
            state.stage, state.done_bytes = stage, base + min(done, size)

        base = state.done_bytes
        path = download_file(repo_id, file.path, root, revision=revision, endpoint=endpoint,
                             progress=report, cancel=cancel)
        state.done_bytes, state.paths = base + file.size, (*state.paths, path)
