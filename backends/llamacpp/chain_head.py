"""A draft head that llama.cpp runs in a context of its own, drafting one chain per sequence.

Two kinds of head run this way: a model's own next-n block (``backends.llamacpp.mtp``) and an
EAGLE-3 head exported to llama.cpp's ``eagle3`` architecture (``backends.llamacpp.eagle3``). Both
take rows (state, token, position), return the head's next state per row and logits with it,
which is the interface of the numpy ``backends.heads.eagle.EagleHead`` (``d``, ``vocab``,
``feature_width``, ``state_layers``, ``new_cache``, ``features``, ``forward``, ``log_probs``), so
the EAGLE-2 drafter drafts with them unchanged.

llama.cpp masks attention by sequence and position, so a cache here holds one chain: the rows of
a call must follow the cache's rows (catch-up, and trees grown one node per depth); anything else
is refused. A subclass says where the head's context comes from (``ctx``), where a drafter's row
``t`` sits in it (``offset``: MTP pairs ``x_p`` with ``h_{p-1}``, EAGLE-3 ``x_{t+1}`` with
``g_t`` at ``t``) and which logits columns are its vocabulary (``columns``).
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from backends.core.errors import BackendError
from backends.models.llama_lib import llama, recent_errors

MAX_CACHES = 4  # sequences of a head's context: the drafter's cache and a scratch one for timing it


class ChainCache:
    """One chain of rows in a head context's KV: ``committed`` rows of true states, then scratch
    rows, at llama.cpp positions ``first ..`` (the shape of ``backends.heads.eagle.HeadCache``)."""

    def __init__(self, head: ChainHead, seq: int) -> None:
        self.head, self.seq = head, seq
        self.first = 0  # llama.cpp position of row 0
        self.committed = 0
        self.length = 0
        self.reset()

    def commit(self) -> None:
        self.committed = self.length

    def drop_scratch(self) -> None:
        if self.length > self.committed:
            self.head.forget(self.seq, self.first + self.committed)
        self.length = self.committed

    def reset(self) -> None:
        self.head.forget(self.seq, -1)
        self.committed = self.length = 0


class ChainHead:
    """What the two llama.cpp-run heads share; a subclass sets ``ctx``, ``d``, ``feature_width``,
    ``state_layers``, ``vocab``, ``columns``, ``offset`` and ``what`` (for messages)."""

    what = "the head"
    offset = 0  # llama.cpp position of a drafter's row t: t + offset
    columns: np.ndarray | None = None  # the logits columns of ``vocab`` (None: all of them)

    def _start(self, ctx) -> None:
        """Take ``ctx`` (a head context with next-n embeddings on) and make the batch it reads."""
        from llama_cpp import llama_cpp_ext

        lib = llama()
        self.ctx = ctx
        self._ext = llama_cpp_ext
        self.mem = lib.llama_get_memory(ctx)
        llama_cpp_ext.llama_set_embeddings_nextn(ctx, True, True)  # a state per output row
        self._batch = lib.llama_batch_ext_init(ctx)
        self._n_logits = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(lib.llama_get_model(ctx))))
        self._caches = 0
        self._last: tuple[np.ndarray, np.ndarray] | None = None  # the last forward's (states, logits)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            lib = llama()
            lib.llama_batch_ext_free(self._batch)
            lib.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        if not sys.is_finalizing():
            self.close()

    def features(self, states: np.ndarray) -> np.ndarray:
        """The rows ``forward`` takes for the target's states: the states as they are."""
        return np.asarray(states, np.float32)

    def new_cache(self) -> ChainCache:
        seq = self._caches % MAX_CACHES
        self._caches += 1
        return ChainCache(self, seq)

    def forget(self, seq: int, start: int) -> None:
        """Drop ``seq``'s rows from llama.cpp position ``start`` on (-1: all of them)."""
        if not llama().llama_memory_seq_rm(self.mem, seq, start, -1):
            raise BackendError(f"llama.cpp could not roll back {self.what}'s cache to position {start}")

    def _check_chain(self, positions: np.ndarray, cache: ChainCache, visible: np.ndarray) -> np.ndarray:
        """llama.cpp positions of the rows, which must continue ``cache``'s chain."""
        n = len(positions)
        scratch = cache.length - cache.committed
        if visible.shape != (n, scratch + n) or not np.array_equal(visible, np.tri(n, scratch + n, scratch, dtype=bool)):
            raise BackendError(f"{self.what} drafts chains: each row must follow the rows before it")
        where = np.asarray(positions, np.int64) + self.offset
        if 0 < cache.length == cache.committed and where[0] > cache.first + cache.length:
            # true states after a gap (a drafter whose gate was shut kept only the last few rows):
            # llama.cpp's chain cannot skip positions, so it starts over at the gap, as a head
            # that reads past a gap sees mostly the rows after it anyway
            cache.reset()
        if cache.length == 0:
            cache.first = int(where[0])
        if not np.array_equal(where, cache.first + cache.length + np.arange(n)):
            raise BackendError(f"{self.what}'s rows must continue the cache at position {cache.first + cache.length}")
        return where

    def _process(self, kind: int, n: int) -> None:
        recent_errors.clear()
        rc = llama().llama_process(self.ctx, kind, self._batch)
        if rc != 0:
            raise BackendError(f"{self.what}'s forward failed with code {rc} {'; '.join(recent_errors)}".strip())

    def forward(self, feats: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cache: ChainCache,
                visible: np.ndarray, outputs: int | None = None) -> np.ndarray:
        """Run rows (state [n, d], next token [n], position [n]) after ``cache``'s rows; returns
        the head's states [n, d], or the last ``outputs`` rows' [outputs, d]. ``visible`` [n,
        scratch rows after appending] must make each row see every scratch row before it and
        itself: a chain. Every row is an output row all the same: this llama.cpp's eagle3 graph
        runs its output layer on every row whatever the batch asks, and with fewer output rows
        its state extraction hands out the first rows' states, not the ones asked for (measured:
        the last of 7 rows came back as the first). Only the rows returned are copied out (their
        logits are a vocabulary wide)."""
        n = len(tokens)
        kept = n if outputs is None else min(outputs, n)
        where = self._check_chain(positions, cache, visible)
        lib = llama()
        feats = np.ascontiguousarray(feats, np.float32)
        lib.llama_batch_ext_clear(self._batch)
        for j in range(n):
            idx = lib.llama_batch_ext_add_token(self._batch, cache.seq, int(tokens[j]))
            pos = (lib.llama_pos * 1)(int(where[j]))
            row = lib.llama_embd(feats[j].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.d)
            if idx < 0 or not (lib.llama_batch_ext_set_pos(self._batch, idx, pos)
                               and lib.llama_batch_ext_set_embd_token(self._batch, idx, row)
                               and lib.llama_batch_ext_set_output_logits(self._batch, idx, True)):
                raise BackendError(f"llama.cpp refused {self.what}'s row {j} (batch index {idx})")
        self._process(lib.LLAMA_PROCESS_TYPE_DECODE, n)
        cache.length += n
        states = np.empty((kept, self.d), np.float32)
        logits = np.empty((kept, len(self.vocab)), np.float32)
        for j, i in enumerate(range(n - kept, n)):  # i: the row's index in the batch and among its outputs
            states[j] = np.ctypeslib.as_array(self._ext.llama_get_embeddings_nextn_ith(self.ctx, i), shape=(self.d,))
            row = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i), shape=(self._n_logits,))
            logits[j] = row if self.columns is None else row[self.columns]
        self._last = (states, logits)
        return states

    def log_probs(self, feats: np.ndarray) -> np.ndarray:
        """[n, V] log-probabilities for rows of the last ``forward``'s states (views of them: the
        head's logits came with them; its output layer does not run twice)."""
        if self._last is None or not np.shares_memory(feats, self._last[0]):
            raise BackendError(f"{self.what} gives log-probabilities only for the states of its last forward")
        states, logits = self._last
        first = (feats.__array_interface__["data"][0] - states.__array_interface__["data"][0]) // states.strides[0]
        rows = logits[first : first + len(feats)]
        rows = rows - rows.max(-1, keepdims=True)
        return rows - np.log(np.exp(rows).sum(-1, keepdims=True))
