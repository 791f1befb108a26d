"""REST datastores: text a user chose, tokenized with the model's tokenizer and indexed for lookup.

REST (retrieval-based speculative decoding) drafts what followed the current context's suffix in
a corpus. The corpus here is a token array with one suffix array over it: every occurrence of a
pattern is one contiguous range of the suffix array, found by binary search, and since that range
is sorted, the continuations after it come out sorted too, which makes counting how often each
continuation prefix occurs a single vectorized pass (see ``continuations``).

Example: corpus ``a b c a b d`` (one document); the suffix ``a b`` occurs twice, followed by
``c a b d`` and ``d``: the trie has ``c`` (1) and ``d`` (1) under the root.

File format: safetensors (two int32 arrays, ``tokens`` and ``suffix_array``) with metadata naming
the tokenizer (kind, size, special ids, a fingerprint of every token's text) and the sources.
Loading reads the header and memory-maps both arrays, so a datastore of hundreds of MB costs no
load time and only the pages a lookup touches. Documents are separated by negative sentinels
(``-1 - document index``), unique values that never match anything, so no match and no
continuation runs from one file into the next.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np
from safetensors.numpy import save_file

from backends.core.errors import SpecDeckError
from backends.core.tree import tree_depths
from backends.core.types import RankedTree
from backends.models.gguf_info import VocabInfo

# Field metadata for settings that name a datastore file (front ends offer a file chooser).
DATASTORE_FILE = MappingProxyType({"file": "SpecDeck datastores (*.sdstore);;All files (*)"})
FORMAT = "specdeck-rest-datastore"
FORMAT_VERSION = "1"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".c", ".cpp", ".h", ".js", ".ts",
                 ".java", ".go", ".rs", ".html", ".css", ".sh", ".toml", ".yaml", ".yml", ".tex")


class DatastoreError(SpecDeckError):
    """A datastore cannot be built or used (empty source, corrupt file, another vocabulary)."""


def vocab_fingerprint(vocab: VocabInfo) -> str:
    """Same tokenizer <=> same fingerprint: kind, size, special ids and every token's text."""
    digest = hashlib.sha256(f"{vocab.kind}|{vocab.n_vocab}|{vocab.bos}|{vocab.eos}".encode())
    for token in vocab.tokens:
        digest.update(token.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()


# --- building ---------------------------------------------------------------------------------


def source_texts(source: Path) -> list[Path]:
    """The text files under ``source`` (or ``source`` itself), in a stable order."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise DatastoreError(f"{source} does not exist")
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise DatastoreError(f"{source} holds no text files ({', '.join(TEXT_SUFFIXES[:4])} ...); nothing to index")
    return files


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of all suffixes of ``tokens`` in lexicographic order. [n] int32.

    Prefix doubling: sort by the first 1, 2, 4, ... tokens, each round ranking by (rank of the
    first half, rank of the second half) with one numpy lexsort; stops once every rank is unique,
    after log2 of the longest repeated run rounds. A suffix that ends is smaller than any
    extension of it (rank -1 past the end).
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64)
    k = 1
    while True:
        second = np.full(n, -1, dtype=np.int64)
        second[: n - k] = rank[k:] if k < n else second[:0]
        order = np.lexsort((second, rank))
        first_s, second_s = rank[order], second[order]
        new = np.empty(n, dtype=np.int64)
        new[0] = 0
        new[1:] = np.cumsum((first_s[1:] != first_s[:-1]) | (second_s[1:] != second_s[:-1]))
        rank = np.empty(n, dtype=np.int64)
        rank[order] = new
        if new[-1] == n - 1 or k >= n:
            return order.astype(np.int32)
        k *= 2


def read_sources(files: Sequence[Path]) -> Iterable[tuple[str, str]]:
    """``(name, text)`` documents: a text file is one document, a ``.jsonl`` file one per line.

    A JSONL line may be a string or an object with ``text``, ``content`` or ``answer``, or a
    list of ``turns`` or chat ``messages`` (exported chats, benchmark answers).
    """
    for path in files:
        if path.suffix.lower() != ".jsonl":
            yield str(path), path.read_text(encoding="utf-8", errors="replace")
            continue
        with path.open(encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{line_no}", _jsonl_text(path, line_no, line)


def _jsonl_text(path: Path, line_no: int, line: str) -> str:
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise DatastoreError(f"{path}:{line_no} is not JSON ({exc})") from None
    if isinstance(row, str):
        return row
    if isinstance(row, dict):
        for key in ("text", "content", "answer"):
            if isinstance(row.get(key), str):
                return row[key]
        parts = row.get("turns") or row.get("messages") or row.get("answers") or []
        texts = [p if isinstance(p, str) else p.get("content", "") for p in parts if isinstance(p, (str, dict))]
        if texts:
            return "\n\n".join(texts)
    raise DatastoreError(f"{path}:{line_no} has no text (expected a string or text/content/answer/turns/messages)")


@dataclass(frozen=True)
class BuildReport:
    path: Path
    documents: int
    tokens: int
    bytes: int


def build_datastore(texts: Iterable[tuple[str, str]], out: Path, *, tokenize: Callable[[str], list[int]],
                    vocab: VocabInfo, model_name: str, progress: Callable[[int, int], None] | None = None,
                    total: int | None = None) -> BuildReport:
    """Tokenize ``(name, text)`` documents with the model's tokenizer and write the datastore."""
    def documents() -> Iterable[tuple[str, Sequence[int]]]:
        for i, (name, text) in enumerate(texts):
            yield name, tokenize(text)
            if progress is not None:
                progress(i + 1, total or 0)

    return write_datastore(documents(), out, vocab=vocab, model_name=model_name)


def write_datastore(documents: Iterable[tuple[str, Sequence[int]]], out: Path, *, vocab: VocabInfo,
                    model_name: str) -> BuildReport:
    """Index already tokenized ``(name, token ids)`` documents into ``out``.

    Written to a temporary name and renamed, so an interrupted build leaves no half file.
    """
    pieces: list[np.ndarray] = []
    names: list[str] = []
    for name, ids in documents:
        if len(ids):
            pieces.append(np.asarray(ids, dtype=np.int32))
            pieces.append(np.asarray([-1 - len(names)], dtype=np.int32))
            names.append(name)
    if not pieces:
        raise DatastoreError("the source texts produced no tokens; nothing to index")
    tokens = np.concatenate(pieces)
    sa = suffix_array(tokens)
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "vocab_fingerprint": vocab_fingerprint(vocab),
            "vocab_kind": vocab.kind, "n_vocab": str(vocab.n_vocab), "model": model_name,
            "documents": str(len(names)), "sources": json.dumps(names[:1000])}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        save_file({"tokens": tokens, "suffix_array": sa}, str(tmp), metadata=meta)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return BuildReport(out, len(names), int(len(tokens) - len(names)), out.stat().st_size)


# --- loading and lookup -----------------------------------------------------------------------


@dataclass(frozen=True)
class Continuations:
    """A trie of what followed a matched suffix, flattened: node ``i`` has ``tokens[i]``,
    ``parents[i]`` (-1: the root) and ``counts[i]`` occurrences out of ``total`` sampled ones.
    Parents precede children; nodes are in breadth-first order."""

    tokens: np.ndarray  # [n] int32
    parents: np.ndarray  # [n] int32
    counts: np.ndarray  # [n] int32
    total: int
    matched: int  # length of the context suffix that matched

    def ranked(self, max_depth: int, top: int | None = None, bucket: Hashable = None) -> RankedTree:
        """The nodes by share, at most ``max_depth`` deep, the ``top`` best (all by default). A
        child never outnumbers its parent and ties keep breadth-first order, so a stable sort puts
        parents first. A share is ``count / (total + 1)``: a continuation seen once is a coin flip."""
        keep = np.flatnonzero(tree_depths(self.parents) <= max_depth)
        order = keep[np.argsort(-self.counts[keep], kind="stable")][:top]
        return RankedTree(self.tokens, self.parents, self.counts / (self.total + 1), bucket).taking(order)


NO_CONTINUATIONS = Continuations(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), 0, 0)


class Datastore:
    """A memory-mapped datastore file; ``continuations(context)`` is the lookup REST needs."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        header, offset = _read_header(self.path)
        self.meta: dict[str, str] = header.get("__metadata__", {})
        if self.meta.get("format") != FORMAT:
            raise DatastoreError(f"{self.path} is not a SpecDeck datastore (build one with `specdeck datastore build`)")
        self.tokens = _map_array(self.path, header, offset, "tokens")
        self.sa = _map_array(self.path, header, offset, "suffix_array")
        if len(self.tokens) != len(self.sa):
            raise DatastoreError(f"{self.path} is corrupt: {len(self.tokens)} tokens but {len(self.sa)} suffixes")

    @property
    def documents(self) -> int:
        return int(self.meta.get("documents", 0))

    @property
    def n_tokens(self) -> int:
        """Text tokens (the document separators not counted)."""
        return len(self.tokens) - self.documents

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size

    def check_vocab(self, vocab: VocabInfo) -> None:
        """Refuse a datastore made with another tokenizer: its ids would mean other words."""
        if self.meta.get("vocab_fingerprint") != vocab_fingerprint(vocab):
            raise DatastoreError(
                f"{self.path.name} was built with the tokenizer of {self.meta.get('model', 'another model')} "
                f"({self.meta.get('vocab_kind')}, {self.meta.get('n_vocab')} tokens); the loaded model's is "
                f"{vocab.kind} with {vocab.n_vocab} tokens. Build a datastore for this model.")

    def _compare(self, start: int, pattern: Sequence[int]) -> int:
        """-1, 0 or 1: the corpus at ``start`` against ``pattern`` over ``len(pattern)`` tokens."""
        window = self.tokens[start:start + len(pattern)].tolist()
        for a, b in zip(window, pattern):
            if a != b:
                return -1 if a < b else 1
        return 0 if len(window) == len(pattern) else -1

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """The suffix-array range ``[lo, hi)`` of suffixes starting with ``pattern``."""
        sa, lo, hi = self.sa, 0, len(self.sa)
        while lo < hi:  # first suffix >= pattern
            mid = (lo + hi) // 2
            if self._compare(int(sa[mid]), pattern) < 0:
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, len(sa)
        while lo < hi:  # first suffix > pattern (not starting with it)
            mid = (lo + hi) // 2
            if self._compare(int(sa[mid]), pattern) <= 0:
                lo = mid + 1
            else:
                hi = mid
        return first, lo

    def longest_match(self, context: Sequence[int], *, max_len: int, min_len: int) -> tuple[int, int, int]:
        """(length, lo, hi) of the longest suffix of ``context`` (``min_len..max_len`` tokens) in
        the corpus, or (0, 0, 0). Occurrence is monotone in length, so lengths are bisected."""
        best = (0, 0, 0)
        lo_len, hi_len = min_len, min(max_len, len(context))
        while lo_len <= hi_len:
            m = (lo_len + hi_len) // 2
            lo, hi = self.find(context[len(context) - m:])
            if hi > lo:
                best, lo_len = (m, lo, hi), m + 1
            else:
                hi_len = m - 1
        return best

    def continuations(self, context: Sequence[int], *, max_len: int = 16, min_len: int = 2, depth: int = 8,
                      samples: int = 256, top: int | None = None) -> Continuations:
        """The trie of up to ``depth`` tokens that followed the longest matching suffix.

        At most ``samples`` occurrences are read, evenly spaced over the range (still in sorted
        order), so a very common suffix costs no more than a rare one. With ``top``, only nodes
        that may rank among the ``top`` most frequent are built (see ``_trie``).
        """
        m, lo, hi = self.longest_match(context, max_len=max_len, min_len=min_len)
        if m == 0:
            return NO_CONTINUATIONS
        rows = np.linspace(lo, hi - 1, num=min(samples, hi - lo)).round().astype(np.int64)
        starts = self.sa[rows].astype(np.int64) + m  # [S]
        idx = np.minimum(starts[:, None] + np.arange(depth)[None, :], len(self.tokens) - 1)
        cont = np.asarray(self.tokens[idx])  # [S, depth]
        ended = np.maximum.accumulate((cont < 0) | (starts[:, None] + np.arange(depth) >= len(self.tokens)), axis=1)
        cont = np.where(ended, -1, cont)
        return _trie(cont, m, top)


def _trie(cont: np.ndarray, matched: int, top: int | None = None) -> Continuations:
    """Count every prefix of the sorted continuation rows (one run of equal prefixes per node).

    ``top``: REST verifies at most 16 nodes, but 256 sampled rows of depth 8 make up to 2,048.
    A child never occurs more often than its parent, so once ``top`` nodes are known, a node
    rarer than the ``top``-th most frequent so far can never rank among the ``top`` (the
    threshold only rises), nor can anything below it: such runs are left out, level by level.
    Among equal counts the earlier node ranks first, so the ``top`` best of the result are
    exactly those of the full trie.
    """
    n_rows, depth = cont.shape
    tokens, parents, counts = [], [], []  # one array per level
    n_nodes, threshold = 0, 0
    prev_ids = np.full(n_rows, -1, dtype=np.int64)  # node id of each row's prefix at depth d - 1
    changed = np.zeros(max(n_rows - 1, 0), dtype=bool)
    for d in range(depth):
        changed = changed | (cont[1:, d] != cont[:-1, d])
        run_start = np.concatenate(([0], np.flatnonzero(changed) + 1))
        run_len = np.diff(np.concatenate((run_start, [n_rows])))
        run_of_row = np.repeat(np.arange(len(run_start)), run_len)
        parent = prev_ids[run_start]
        live = (cont[run_start, d] >= 0) & ((parent >= 0) | (d == 0)) & (run_len >= threshold)
        ids = np.full(len(run_start), -1, dtype=np.int64)
        ids[live] = n_nodes + np.arange(int(live.sum()))
        tokens.append(cont[run_start[live], d])
        parents.append(parent[live])
        counts.append(run_len[live])
        n_nodes += int(live.sum())
        if top is not None and 0 < top <= n_nodes:
            every = np.concatenate(counts)
            threshold = int(np.partition(every, n_nodes - top)[n_nodes - top])  # the top-th largest
        prev_ids = ids[run_of_row]
        if not live.any():
            break
    if not tokens:
        return Continuations(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), n_rows, matched)
    return Continuations(np.concatenate(tokens).astype(np.int32), np.concatenate(parents).astype(np.int32),
                         np.concatenate(counts).astype(np.int32), n_rows, matched)


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise DatastoreError(f"{path} is empty or truncated")
            (length,) = struct.unpack("<Q", raw)
            if length > 100 << 20 or length > path.stat().st_size - 8:
                raise DatastoreError(f"{path} is not a datastore (its header length is {length:,} bytes)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise DatastoreError(f"datastore not found: {path}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DatastoreError(f"{path} is corrupt: its header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise DatastoreError(f"{path} is corrupt: its header is not a table")
    return header, 8 + length


def _map_array(path: Path, header: dict, offset: int, name: str) -> np.ndarray:
    entry = header.get(name)
    if not isinstance(entry, dict) or entry.get("dtype") != "I32" or len(entry.get("shape", ())) != 1:
        raise DatastoreError(f"{path} is corrupt: no int32 array {name!r}")
    begin, end = entry["data_offsets"]
    count = entry["shape"][0]
    if end - begin != 4 * count or offset + end > path.stat().st_size:
        raise DatastoreError(f"{path} is corrupt or truncated: array {name!r} does not fit the file")
    if count == 0:
        return np.zeros(0, dtype=np.int32)
    mapped = np.memmap(path, dtype="<i4", mode="r", offset=offset + begin, shape=(count,))
    # A plain ndarray over the same mapping: slicing a memmap object costs 2.5 us of bookkeeping,
    # and a lookup slices some 60 times (every comparison of the binary search).
    return mapped.view(np.ndarray)
