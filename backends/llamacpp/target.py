"""The llama.cpp target: prefill, verify a token tree in ONE ``llama_decode``, commit.

KV layout. The cache holds the committed tokens under sequence id 0. The root (last emitted
token) and the proposal are decoded together with explicit positions ``n_past + depth``. A chain
stays in sequence 0. A tree gets one sequence id per root-to-leaf path: every node carries the
ids of all paths through it, the root carries all of them, and the committed prefix is copied
into each path's sequence (``seq_cp``, metadata only). llama.cpp masks attention by the query's
sequence and position, so each node sees exactly the prefix, its ancestors and itself: a tree
mask without an explicit mask. This needs a unified KV cache (``kv_unified``): with per-sequence
caches a token cannot belong to several sequences.

Commit keeps the accepted path. For a chain that is ``seq_rm(0, n_past + 1 + accepted, -1)``;
for a tree, ``seq_keep(b)`` for a path ``b`` through the last accepted node, ``seq_rm`` of its
rejected tail, then the survivors move back to sequence 0. Rollback this way is exact: llama.cpp
re-decodes the same logits afterwards.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence

import numpy as np

from backends.core.errors import BackendError
from backends.core.tree import compile_tree
from backends.core.types import TREE, Proposal, TargetOutput, Verdict
from backends.llamacpp.model import LlamaModel
from backends.models.llama_lib import llama, recent_errors

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


def default_threads() -> int:
    """Physical cores: on small CPUs an extra thread per hyper-thread slows llama.cpp down."""
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except ImportError:
        return max(1, os.cpu_count() or 1)


class LlamaTarget:
    """One llama.cpp context over a loaded model; implements the engine's target protocol."""

    offers = frozenset({TREE})

    def __init__(
        self,
        model: LlamaModel,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_batch: int = 512,
        max_tree_paths: int = 32,
        flash_attn: str = "auto",
    ) -> None:
        lib = llama()
        if flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {sorted(FLASH_ATTN)}, got {flash_attn!r}")
        if n_ctx < 16:
            raise ValueError(f"n_ctx must be at least 16, got {n_ctx}")
        self.model = model
        threads = n_threads or default_threads()
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = max_tree_paths
        params.n_threads = threads
        params.n_threads_batch = n_threads_batch or threads
        params.flash_attn_type = FLASH_ATTN[flash_attn]
        params.kv_unified = True
        params.no_perf = True
        recent_errors.clear()
        ctx = lib.llama_init_from_model(model.ptr, params)
        if not ctx:
            reason = "; ".join(recent_errors) or "out of memory?"
            raise BackendError(f"llama.cpp could not create a context of {n_ctx} tokens: {reason}")
        self.ctx = ctx
        self.mem = lib.llama_get_memory(ctx)
        self.n_ctx: int = lib.llama_n_ctx(ctx)
        self.n_batch = n_batch
        self.n_threads = threads
        self.max_tree_paths = max_tree_paths
        self.n_vocab = model.n_vocab
        self.eog_ids = model.eog_ids
        self.token_piece = model.token_piece
        self._capacity = n_batch
        self._batch = lib.llama_batch_init(self._capacity, 0, max_tree_paths)
        self._tokens: list[int] = []  # what the KV cache holds, position by position
        self._pending: tuple[int, list[int], tuple[tuple[int, ...], ...] | None] | None = None
        self._views()

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        lib = llama()
        if getattr(self, "ctx", None):
            lib.llama_batch_free(self._batch)
            lib.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        if not sys.is_finalizing():
            self.close()

    def _views(self) -> None:
        cap, b = self._capacity, self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(cap,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(cap,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(cap,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(cap,))
        self._seq = [np.ctypeslib.as_array(b.seq_id[i], shape=(self.max_tree_paths,)) for i in range(cap)]
        for row in self._seq:
            row[0] = 0
        self._nseq[:] = 1
        self._tree_rows = 0  # rows whose sequence ids a tree batch changed

    # -- KV cache ------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return len(self._tokens)

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def reset(self) -> None:
        llama().llama_memory_clear(self.mem, True)
        self._tokens = []

    def truncate(self, n: int) -> None:
        """Forget everything from position ``n`` on."""
        if n >= len(self._tokens):
            return
        if not llama().llama_memory_seq_rm(self.mem, 0, n, -1):
            self.reset()  # a sliding-window cache cannot cut deep into its past: start over
            return
        del self._tokens[n:]

    def prefill(self, tokens: Sequence[int]) -> int:
        """Bring the cache to exactly ``tokens``, reusing the common prefix; returns reused count."""
        tokens = list(tokens)
        common = 0
        limit = min(len(tokens), len(self._tokens))
        while common < limit and tokens[common] == self._tokens[common]:
            common += 1
        self.truncate(common)
        reused = len(self._tokens)
        if len(tokens) > self.n_ctx:
            raise BackendError(f"{len(tokens)} tokens do not fit the {self.n_ctx}-token context")
        for start in range(reused, len(tokens), self._capacity):
            chunk = tokens[start : start + self._capacity]
            self._fill_chain(chunk, start, want_logits=False)
            self._decode(len(chunk))
            self._tokens.extend(chunk)
        return reused

    # -- verify / commit -----------------------------------------------------------------------
    def verify(self, root: int, proposal: Proposal) -> TargetOutput:
        """Decode the root and the whole proposal in one ``llama_decode``; logits for every node."""
        start = time.perf_counter()
        n = 1 + proposal.size
        if n > self._capacity:
            raise BackendError(f"a proposal of {proposal.size} nodes exceeds the batch size {self._capacity}")
        if self.n_past + n > self.n_ctx:
            raise BackendError(f"the context is full ({self.n_ctx} tokens)")
        if proposal.is_chain:
            self._fill_chain([root, *proposal.tokens], self.n_past, want_logits=True)
            paths = None
        else:
            paths = self._fill_tree(root, proposal)
        try:
            self._decode(n)
        except BackendError:
            if paths is not None:  # undo the prefix copies so the cache is as before
                for s in range(1, len(paths)):
                    llama().llama_memory_seq_rm(self.mem, s, -1, -1)
            raise
        self._pending = (root, list(proposal.tokens), paths)
        logits = np.ctypeslib.as_array(llama().llama_get_logits(self.ctx), shape=(n, self.n_vocab))
        return TargetOutput(logits=logits.copy(), seconds=time.perf_counter() - start)  # [1 + n_nodes, vocab]

    def commit(self, verdict: Verdict) -> None:
        """Keep the root and the accepted path; drop every other node of the last verify."""
        if self._pending is None:
            raise BackendError("commit without a verify")
        root, tokens, paths = self._pending
        self._pending = None
        lib = llama()
        base = self.n_past
        keep = base + 1 + len(verdict.path)
        if paths is None:
            lib.llama_memory_seq_rm(self.mem, 0, keep, -1)
        else:
            last = verdict.path[-1] if verdict.path else None
            seq = 0 if last is None else next(s for s, p in enumerate(paths) if last in p)
            lib.llama_memory_seq_keep(self.mem, seq)
            lib.llama_memory_seq_rm(self.mem, seq, keep, -1)
            if seq != 0:
                lib.llama_memory_seq_cp(self.mem, seq, 0, -1, -1)
                lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self._tokens.append(root)
        self._tokens.extend(tokens[i] for i in verdict.path)

    # -- batch filling -------------------------------------------------------------------------
    def _restore_seq_rows(self) -> None:
        for i in range(self._tree_rows):
            self._seq[i][0] = 0
        self._nseq[: self._tree_rows] = 1
        self._tree_rows = 0

    def _fill_chain(self, tokens: Sequence[int], start: int, *, want_logits: bool) -> None:
        n = len(tokens)
        if self._tree_rows:
            self._restore_seq_rows()
        self._tok[:n] = tokens
        self._pos[:n] = np.arange(start, start + n)
        self._out[:n] = 1 if want_logits else 0
        self._batch.n_tokens = n

    def _fill_tree(self, root: int, proposal: Proposal) -> tuple[tuple[int, ...], ...]:
        tree = compile_tree(proposal.parents)
        paths = tree.paths
        if len(paths) > self.max_tree_paths:
            raise BackendError(f"a tree with {len(paths)} leaves exceeds {self.max_tree_paths} sequences")
        lib = llama()
        for s in range(1, len(paths)):
            lib.llama_memory_seq_cp(self.mem, 0, s, -1, -1)
        n = 1 + proposal.size
        self._tok[0] = root
        self._tok[1:n] = proposal.tokens
        self._pos[0] = self.n_past
        self._pos[1:n] = self.n_past + tree.depths
        self._out[:n] = 1
        seqs: list[list[int]] = [list(range(len(paths)))] + [[] for _ in range(proposal.size)]
        for s, path in enumerate(paths):
            for node in path:
                seqs[node + 1].append(s)
        for row, ids in enumerate(seqs):
            self._nseq[row] = len(ids)
            self._seq[row][: len(ids)] = ids
        self._tree_rows = max(self._tree_rows, n)
        self._batch.n_tokens = n
        return paths

    def _decode(self, n: int) -> None:
        recent_errors.clear()
        rc = llama().llama_decode(self.ctx, self._batch)
        if rc != 0:
            reason = "; ".join(recent_errors)
            if rc == 1:
                raise BackendError(f"llama.cpp found no room in the KV cache for {n} tokens {reason}".strip())
            raise BackendError(f"llama_decode failed with code {rc} {reason}".strip())
