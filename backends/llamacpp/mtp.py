"""A model's own multi-token-prediction (MTP, "next-n") block, run by llama.cpp as a draft head.

DeepSeek-V3, GLM-4.5+, MiMo, Hunyuan and others ship one or more next-n blocks in their GGUF:
given the model's hidden state ``h_t`` (after its output norm) and the token ``x_{t+1}`` that
followed, the block predicts the state and logits one place further on. That is the recurrence an
EAGLE head learns (``backends.drafters.eagle``), so the EAGLE drafter drafts with it unchanged:
``MTPHead`` offers the same four things as the numpy ``EagleHead`` (``d``, ``vocab``,
``new_cache``, ``forward`` and ``log_probs``), evaluated by llama.cpp in a second context of the
same loaded weights (``LLAMA_CONTEXT_TYPE_MTP``, whose KV cache holds only the next-n layers).

llama.cpp's MTP batch pairs, at position ``p``, token ``x_p`` with the state ``h_{p-1}``
(``llama_batch_ext_set_embd_token``); the EAGLE drafter's row ``(f_t, x_{t+1})`` at position ``t``
is that pair at ``p = t + 1``. Each output row returns the block's own next state
(``llama_get_embeddings_nextn_ith``, the C++-linkage call llama-cpp-python binds in
``llama_cpp_ext``) and its logits over the full vocabulary. llama.cpp masks attention by sequence
and position, so a cache here holds one chain: the rows of a call must follow the cache's rows
(catch-up, and trees grown one node per depth); anything else is refused.

The target's hidden states (``HIDDEN_STATES``: ``llama_get_embeddings``, the rows after the output
norm) are the states the block reads: llama.cpp's MTP graphs take ``h_nextn``, the same tensor
(a test holds them equal on a model the tests write).
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from backends.core.errors import BackendError
from backends.llamacpp.model import LlamaModel
from backends.models.llama_lib import llama, recent_errors

MAX_CACHES = 4  # sequences of the MTP context: the drafter's cache and a scratch one for timing it


class MTPCache:
    """One chain of rows in the MTP context's KV: ``committed`` rows of true states, then scratch
    rows, at llama.cpp positions ``first ..`` (the shape of ``backends.heads.eagle.HeadCache``)."""

    def __init__(self, head: MTPHead, seq: int) -> None:
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


class MTPHead:
    """The model's first next-n block as an EAGLE-style head (see the module docstring)."""

    def __init__(self, model: LlamaModel, *, n_ctx: int, n_threads: int, n_threads_batch: int) -> None:
        if not model.has_mtp:
            raise BackendError(f"{model.name} has no next-n (MTP) block that llama.cpp can run")
        from llama_cpp import llama_cpp_ext

        lib = llama()
        self.model = model
        self._ext = llama_cpp_ext
        self.ctx = model.new_context("the MTP block's context", n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                                     n_seq_max=MAX_CACHES, n_threads=n_threads, n_threads_batch=n_threads_batch,
                                     ctx_type=lib.LLAMA_CONTEXT_TYPE_MTP, kv_unified=True)
        self.mem = lib.llama_get_memory(self.ctx)
        llama_cpp_ext.llama_set_embeddings_nextn(self.ctx, True, True)  # a state per output row
        self._batch = lib.llama_batch_ext_init(self.ctx)
        self.d = self.feature_width = int(lib.llama_model_n_embd_out(model.ptr))  # reads the target's final state
        self.state_layers: tuple[int, ...] = ()
        self.vocab = np.arange(model.n_vocab, dtype=np.int64)  # logits cover the whole vocabulary
        self._caches = 0
        self._last: tuple[np.ndarray, np.ndarray] | None = None  # the last forward's (states, logits)

    def close(self) -> None:
        lib = llama()
        if getattr(self, "ctx", None):
            lib.llama_batch_ext_free(self._batch)
            lib.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        if not sys.is_finalizing():
            self.close()

    def features(self, states: np.ndarray) -> np.ndarray:
        """The target's states are the block's input rows as they are."""
        return np.asarray(states, np.float32)

    def new_cache(self) -> MTPCache:
        seq = self._caches % MAX_CACHES
        self._caches += 1
        return MTPCache(self, seq)

    def forget(self, seq: int, start: int) -> None:
        """Drop ``seq``'s rows from llama.cpp position ``start`` on (-1: all of them)."""
        if not llama().llama_memory_seq_rm(self.mem, seq, start, -1):
            raise BackendError(f"llama.cpp could not roll back the MTP block's cache to position {start}")

    def forward(self, feats: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cache: MTPCache,
                visible: np.ndarray) -> np.ndarray:
        """Run rows (state [n, d], next token [n], position [n]) after ``cache``'s rows; returns
        the block's states [n, d]. ``visible`` [n, scratch rows after appending] must make each
        row see every scratch row before it and itself: a chain."""
        n = len(tokens)
        scratch = cache.length - cache.committed
        if visible.shape != (n, scratch + n) or not np.array_equal(visible, np.tri(n, scratch + n, scratch, dtype=bool)):
            raise BackendError("the MTP block drafts chains: each row must follow the rows before it")
        where = np.asarray(positions, np.int64) + 1  # llama.cpp pairs x_p with h_{p-1}
        if cache.length == 0:
            cache.first = int(where[0])
        if not np.array_equal(where, cache.first + cache.length + np.arange(n)):
            raise BackendError(f"MTP rows must continue the cache at position {cache.first + cache.length}")
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
                raise BackendError(f"llama.cpp refused MTP row {j} (batch index {idx})")
        recent_errors.clear()
        rc = lib.llama_process(self.ctx, lib.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        if rc != 0:
            raise BackendError(f"the MTP block's forward failed with code {rc} {'; '.join(recent_errors)}".strip())
        cache.length += n
        states = np.empty((n, self.d), np.float32)
        logits = np.empty((n, len(self.vocab)), np.float32)
        for j in range(n):
            states[j] = np.ctypeslib.as_array(self._ext.llama_get_embeddings_nextn_ith(self.ctx, j), shape=(self.d,))
            logits[j] = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, j), shape=(len(self.vocab),))
        self._last = (states, logits)
        return states

    def log_probs(self, feats: np.ndarray) -> np.ndarray:
        """[n, V] log-probabilities for rows of the last ``forward``'s states (views of them: the
        block's logits came with them; its output layer does not run twice)."""
        if self._last is None or not np.shares_memory(feats, self._last[0]):
            raise BackendError("the MTP block gives log-probabilities only for the states of its last forward")
        states, logits = self._last
        first = (feats.__array_interface__["data"][0] - states.__array_interface__["data"][0]) // states.strides[0]
        rows = logits[first : first + len(feats)]
        rows = rows - rows.max(-1, keepdims=True)
        return rows - np.log(np.exp(rows).sum(-1, keepdims=True))
