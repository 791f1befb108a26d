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
re-decodes the same logits afterwards. Every rollback is checked (``seq_rm``'s result, then the
positions sequence 0 still holds, which also catches a sliding-window cache that no longer has
the window a position needs) and a failed one raises: it would otherwise make speculative output
differ from plain decoding without a word. Recurrent and hybrid models (Mamba, RWKV, LFM2,
Granite-H, Qwen3-Next) fold every token into a state that cannot be taken back, so they offer
neither trees nor rollback, and the registry offers them plain decoding only.

Logits. ``verify`` hands out llama.cpp's own logits buffer, read-only, instead of copying
[n_nodes, vocab] float32 every step; it stays valid until this context's next decode, and the
``TargetOutput`` says when it no longer is (see ``backends.core.types.TargetOutput``).

Hidden states (``HIDDEN_STATES``, for trained draft heads). A prefill asked for them turns on
llama.cpp's per-token embeddings (``llama_set_embeddings``, pooling none): each forward then also
returns the final hidden state after the output norm (the vector the output layer multiplies),
for every row. That is the one state every architecture's graph produces; a drafter may ask for
the inputs of chosen layers instead or beside it (``layers``, ``LAYER_STATES``: only where the
architecture's graph records them, see ``backends.llamacpp.states``). The context keeps the states of the cached positions (float16, a few MB;
the pages of positions never reached stay unallocated), so a prompt that reuses the cached prefix
of the previous turn still hands its drafter every state. Embeddings make every row an output, so
a prefill with them also computes logits for every row (the output layer: about a quarter of a
SmolLM2-135M forward, 6% of an 8B one) and runs in chunks of ``HIDDEN_CHUNK`` rows to bound the
[rows, vocab] buffer. Positions without a state are recomputed when a prefill asks for states.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Sequence

import numpy as np

from backends.core.errors import BackendError, Cancelled
from backends.core.kept_states import KeptStates
from backends.core.tree import compile_tree
from backends.core.types import (HIDDEN_STATES, LAYER_STATES, NATIVE_EAGLE3, NATIVE_MTP, ROLLBACK, SEQUENCES, TREE, Proposal, TargetLimits,
                                 TargetOutput, Verdict)
from backends.llamacpp.model import LlamaModel
from backends.llamacpp.sequences import LlamaSequences
from backends.llamacpp.states import LAYER_INPUT_GRAPHS, StateReader, check_layers
from backends.models.llama_lib import llama, recent_errors

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
POOLING_NONE = 0  # llama_pooling_type: one embedding per token
HIDDEN_CHUNK = 128  # prefill rows per forward while hidden states are kept (every row has logits then)


def default_threads() -> int:
    """Physical cores: on small CPUs an extra thread per hyper-thread slows llama.cpp down."""
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except ImportError:
        return max(1, os.cpu_count() or 1)


def offers_for(*, recurrent: bool, hybrid: bool) -> frozenset[str]:
    """What a context over such a model offers: trees and rollback need a cache that can forget
    positions, which a recurrent state (recurrent and hybrid models alike) cannot; hidden states
    serve only drafters, which all need rollback."""
    return frozenset() if recurrent or hybrid else frozenset({TREE, ROLLBACK, HIDDEN_STATES, SEQUENCES})


class LlamaTarget:
    """One llama.cpp context over a loaded model; implements the engine's target protocol."""

    offers = offers_for(recurrent=False, hybrid=False)  # a transformer's; an instance says its own

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
        ctx = model.new_context(f"a context of {n_ctx} tokens", n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                n_seq_max=max_tree_paths, n_threads=threads, n_threads_batch=n_threads_batch or threads,
                                flash_attn_type=FLASH_ATTN[flash_attn], kv_unified=True)
        self.ctx = ctx
        self.mem = lib.llama_get_memory(ctx)
        self.n_ctx: int = lib.llama_n_ctx(ctx)
        self.n_batch = n_batch
        self.n_threads = threads
        self.max_tree_paths = max_tree_paths
        self.offers = offers_for(recurrent=model.is_recurrent, hybrid=model.is_hybrid)
        if lib.llama_pooling_type(ctx) != POOLING_NONE:  # an embedding model: states would come pooled
            self.offers -= {HIDDEN_STATES, SEQUENCES}
        if HIDDEN_STATES in self.offers and model.meta("general.architecture") in LAYER_INPUT_GRAPHS:
            self.offers |= {LAYER_STATES, NATIVE_EAGLE3}
        if model.has_mtp and HIDDEN_STATES in self.offers:
            self.offers |= {NATIVE_MTP}
        self._native_head = None  # the model's MTP block, in a context of its own once a drafter asks
        self._engine_heads: dict[str, object] = {}  # EAGLE-3 GGUFs run beside the model, by path
        self.n_threads_batch = n_threads_batch or threads
        self.limits = TargetLimits(max_batch=n_batch, max_paths=max_tree_paths)
        self._n_swa = model.n_swa  # sliding window of the SWA layers (0: none)
        self._decodes = 0  # counts forwards: a TargetOutput's logits are valid while it stands still
        self.n_vocab = model.n_vocab
        self.eog_ids = model.eog_ids
        self.token_piece = model.token_piece
        self._capacity = n_batch
        self._batch = lib.llama_batch_init(self._capacity, 0, max_tree_paths)
        self._tokens: list[int] = []  # what the KV cache holds, position by position
        self._pending: tuple[int, list[int], tuple[tuple[int, ...], ...] | None] | None = None
        self._reader = StateReader(ctx, model.n_embd)  # which states the forwards hand out
        self.hidden_size: int = self._reader.width
        self._keep_hidden = False  # the last prefill asked for hidden states: every forward returns them
        self._embeddings = False  # what llama_set_embeddings was last told
        self._kept = KeptStates(self.n_ctx, self.hidden_size)  # the cached positions' states (float16)
        self._last_hidden: np.ndarray | None = None  # [1 + n_nodes, hidden_size] of the last verify
        self._views()

    def native_head(self):
        """The model's next-n block as a draft head (``NATIVE_MTP``; ``backends.llamacpp.mtp``), in a
        context of its own made once and freed with this one."""
        if NATIVE_MTP not in self.offers:
            raise BackendError(f"{self.model.name} has no next-n (MTP) block to draft with")
        if self._native_head is None:
            from backends.llamacpp.mtp import MTPHead

            self._native_head = MTPHead(self.model, n_ctx=self.n_ctx, n_threads=self.n_threads,
                                        n_threads_batch=self.n_threads_batch)
        return self._native_head

    def engine_head(self, path: str):
        """An EAGLE-3 GGUF run by llama.cpp beside this context (``NATIVE_EAGLE3``;
        ``backends.llamacpp.eagle3``), loaded once per file and freed with this target; on the GPU
        when the whole model is."""
        if NATIVE_EAGLE3 not in self.offers:
            raise BackendError(f"{self.model.name} cannot run an EAGLE-3 head in llama.cpp (its graph hands out "
                               "no layer inputs)")
        if path not in self._engine_heads:
            from backends.llamacpp.eagle3 import GGUFEagle3Head

            on_gpu = self.model.n_gpu_layers > self.model.n_layer  # the output layer too: the head can follow
            self._engine_heads[path] = GGUFEagle3Head(path, self.ctx, self.model, n_ctx=self.n_ctx,
                                                      n_gpu_layers=self.model.n_gpu_layers if on_gpu else 0,
                                                      n_threads=self.n_threads, n_threads_batch=self.n_threads_batch)
        return self._engine_heads[path]

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        lib = llama()
        if getattr(self, "_native_head", None) is not None:
            self._native_head.close()
            self._native_head = None
        for head in getattr(self, "_engine_heads", {}).values():
            head.close()
        self._engine_heads = {}
        if getattr(self, "ctx", None):
            self._decodes += 1  # logits handed out point into the context being freed
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

    def sequences(self, n_seqs: int, n_ctx_seq: int, layers: tuple[int, ...] = ()) -> LlamaSequences:
        """``n_seqs`` independent sequences over this target's model, in a context of their own
        (``SEQUENCES``; recording training data answers several prompts at once with it)."""
        return LlamaSequences(self.model, n_seqs=n_seqs, n_ctx_seq=n_ctx_seq, n_threads=self.n_threads, layers=layers)

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
        self._kept.clear()

    def truncate(self, n: int) -> None:
        """Forget everything from position ``n`` on; raises ``BackendError`` when the cache cannot
        (a recurrent state, or a sliding window that no longer holds what position ``n`` needs),
        after emptying it, so that nothing runs on a cache that is not what it claims to be."""
        if n >= len(self._tokens):
            return
        if not self._forget(n):
            held = len(self._tokens)
            self.reset()
            raise BackendError(f"llama.cpp could not roll its cache back from {held} to {n} tokens "
                               "(the cache was emptied)")

    def _forget(self, n: int) -> bool:
        """Remove positions ``n`` and later; whether the cache now holds exactly what attention
        at position ``n`` needs."""
        if not llama().llama_memory_seq_rm(self.mem, 0, n, -1):
            return False
        del self._tokens[n:]
        self._kept.forget(n)
        return self._holds(n)

    def _holds(self, n: int) -> bool:
        """Sequence 0 holds positions ``n - 1`` back to the start (or, with a sliding window, to
        the window's start; a recurrent state holds only its last position): two O(1) queries."""
        lib = llama()
        if n == 0:
            return lib.llama_memory_seq_pos_max(self.mem, 0) < 0
        if lib.llama_memory_seq_pos_max(self.mem, 0) != n - 1:
            return False
        if ROLLBACK not in self.offers:
            return True
        need = max(0, n - self._n_swa) if self._n_swa > 0 else 0
        return 0 <= lib.llama_memory_seq_pos_min(self.mem, 0) <= need

    def prefill(self, tokens: Sequence[int], *, stop: Callable[[], bool] | None = None,
                hidden: bool = False, hidden_from: int = 0, layers: tuple[int, ...] = ()) -> int:
        """Bring the cache to exactly ``tokens``, reusing the common prefix; returns reused count.

        A prefix the cache cannot be cut back to (a sliding window that moved past it, a recurrent
        state) is computed again from the start. ``stop`` is asked before every chunk of
        ``n_batch`` tokens; a yes raises ``Cancelled`` with the chunks so far kept. ``hidden``:
        keep the hidden state of every position from ``hidden_from`` on (``hidden_states``), and
        return the states of every later forward, until a prefill without it; the positions
        before it are computed the fast way, without embeddings. ``layers``: which states
        (``backends.llamacpp.states``); other layers than the kept states' start them afresh."""
        tokens = list(tokens)
        if len(tokens) > self.n_ctx:
            raise BackendError(f"{len(tokens)} tokens do not fit the {self.n_ctx}-token context")
        if hidden and HIDDEN_STATES not in self.offers:
            raise BackendError(f"{self.model.name} does not give hidden states (a recurrent model)")
        if hidden:
            self._choose_layers(tuple(layers))
        self._keep_hidden = hidden
        common = 0
        limit = min(len(tokens), len(self._tokens), self._kept.reusable(hidden_from) if hidden else len(self._tokens))
        while common < limit and tokens[common] == self._tokens[common]:
            common += 1
        if common < len(self._tokens) and not self._forget(common):
            self.reset()
        reused = len(self._tokens)
        if hidden:
            self._kept.begin_at(max(reused, hidden_from))  # the first state this prefill computes
        self._decode_chunks(tokens[reused:], last_logits=False, stop=stop, hidden_from=hidden_from)
        return reused

    def extend(self, tokens: Sequence[int]) -> TargetOutput:
        """Append ``tokens`` in chunks of ``n_batch``; the logits after the last one (a copy, [1, vocab])."""
        start = time.perf_counter()
        if not tokens:
            raise ValueError("extend needs at least one token")
        if self.n_past + len(tokens) > self.n_ctx:
            raise BackendError(f"the context is full ({self.n_ctx} tokens)")
        last = self._decode_chunks(list(tokens), last_logits=True)
        row = np.ctypeslib.as_array(llama().llama_get_logits_ith(self.ctx, last), shape=(1, self.n_vocab))
        return TargetOutput(logits=row.copy(), seconds=time.perf_counter() - start)

    def hidden_states(self, start: int, end: int) -> np.ndarray:
        """The hidden states of cached positions ``start .. end - 1``, [end - start, hidden_size]
        float32 (a copy); only after a prefill that asked for them."""
        if not self._keep_hidden:
            raise BackendError(f"hidden states of positions {start}..{end - 1} were not kept (no prefill asked for them)")
        return self._kept.read(start, end)

    def _choose_layers(self, layers: tuple[int, ...]) -> None:
        """Hand out the states of ``layers`` from now on; the kept states of others are dropped."""
        if layers == self._reader.layers:
            return
        check_layers(layers, n_layer=self.model.n_layer, architecture=self.model.meta("general.architecture") or "?",
                     name=self.model.name)
        self._reader.switch(False)
        self._use_embeddings(False)
        self._reader = StateReader(self.ctx, self.model.n_embd, layers)
        self.hidden_size = self._reader.width
        self._kept = KeptStates(self.n_ctx, self.hidden_size)

    def _use_embeddings(self, on: bool) -> None:
        """States on or off for the next forwards: embeddings (every row an output) for the final
        state, the layer inputs for the rest."""
        if on != self._embeddings:
            if self._reader.final:
                llama().llama_set_embeddings(self.ctx, on)
            self._reader.switch(on)
            self._embeddings = on

    def _read_hidden(self, n: int) -> np.ndarray:
        """The [n, hidden_size] states of the last forward's rows (all rows are outputs then)."""
        return self._reader.read(n)

    def _decode_chunks(self, tokens: list[int], *, last_logits: bool, stop: Callable[[], bool] | None = None,
                       hidden_from: int = 0) -> int:
        """Decode ``tokens`` after the cache, ``n_batch`` at a time (while states are kept, from
        position ``hidden_from`` on, ``HIDDEN_CHUNK`` at a time with every row an output), logits
        for the very last one only when asked; returns that token's row in the last batch."""
        row, start = 0, 0
        while start < len(tokens):
            if stop is not None and stop():
                raise Cancelled(f"stopped after {start} of {len(tokens)} prompt tokens")
            keep = self._keep_hidden and self.n_past >= hidden_from
            size = min(self._capacity, HIDDEN_CHUNK) if keep else self._capacity
            if self._keep_hidden and not keep:
                size = min(size, hidden_from - self.n_past)  # the fast way up to the first kept state
            chunk = tokens[start : start + size]
            self._use_embeddings(keep)
            # the final state comes for output rows only: every row one then (layer inputs come for all rows)
            self._fill_chain(chunk, self.n_past, want_logits=keep and self._reader.final)
            row = len(chunk) - 1
            if last_logits and start + len(chunk) == len(tokens):
                self._out[row] = 1
            self._decode(len(chunk))
            if keep:
                self._kept.store(self.n_past, self._read_hidden(len(chunk)))
            self._tokens.extend(chunk)
            start += len(chunk)
        self._use_embeddings(self._keep_hidden)  # what every later forward returns
        return row

    # -- verify / commit -----------------------------------------------------------------------
    def verify(self, root: int, proposal: Proposal) -> TargetOutput:
        """Decode the root and the whole proposal in one ``llama_decode``; logits for every node,
        in llama.cpp's buffer (read-only, valid until the next decode)."""
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
        states = self._keep_hidden and proposal.states  # a drafter that reads none this step: skip them
        self._use_embeddings(states)
        try:
            self._decode(n)
        except BackendError:
            if paths is not None:  # undo the prefix copies so the cache is as before
                for s in range(1, len(paths)):
                    llama().llama_memory_seq_rm(self.mem, s, -1, -1)
            raise
        self._pending = (root, list(proposal.tokens), paths)
        logits = np.ctypeslib.as_array(llama().llama_get_logits(self.ctx), shape=(n, self.n_vocab))  # [1 + n, vocab]
        logits.flags.writeable = False
        hidden = self._read_hidden(n).copy() if states else None  # [1 + n, hidden_size], small
        self._last_hidden = hidden
        decodes = self._decodes
        return TargetOutput(logits=logits, hidden=hidden, seconds=time.perf_counter() - start,
                            fresh=lambda: self._decodes == decodes)

    def commit(self, verdict: Verdict) -> None:
        """Keep the root and the accepted path; drop every other node of the last verify."""
        if self._pending is None:
            raise BackendError("commit without a verify")
        root, tokens, paths = self._pending
        self._pending = None
        lib = llama()
        base = self.n_past
        keep = base + 1 + len(verdict.path)
        removed = True
        if paths is None:
            if keep < base + 1 + len(tokens):
                removed = lib.llama_memory_seq_rm(self.mem, 0, keep, -1)
        else:
            last = verdict.path[-1] if verdict.path else None
            seq = 0 if last is None else next(s for s, p in enumerate(paths) if last in p)
            lib.llama_memory_seq_keep(self.mem, seq)
            removed = lib.llama_memory_seq_rm(self.mem, seq, keep, -1)
            if seq != 0:
                lib.llama_memory_seq_cp(self.mem, seq, 0, -1, -1)
                removed = lib.llama_memory_seq_rm(self.mem, seq, -1, -1) and removed
        if self._last_hidden is not None:
            self._kept.store(base, self._last_hidden[[0, *(i + 1 for i in verdict.path)]])
            self._last_hidden = None
        elif self._keep_hidden:  # a step without states: the kept run starts over after it
            self._kept.begin_at(keep)
        self._tokens.append(root)
        self._tokens.extend(tokens[i] for i in verdict.path)
        if not (removed and self._holds(keep)):
            self.reset()
            raise BackendError(f"llama.cpp could not drop the {len(tokens) - len(verdict.path)} rejected tokens "
                               "of this step (the cache was emptied)")

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
            if self.n_past and lib.llama_memory_seq_pos_max(self.mem, s) != self.n_past - 1:
                for t in range(1, s + 1):
                    lib.llama_memory_seq_rm(self.mem, t, -1, -1)
                raise BackendError(f"llama.cpp could not share the cached prefix with tree path {s}")
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
        self._decodes += 1  # from here on the previous forward's logits buffer may be overwritten
        recent_errors.clear()
        rc = llama().llama_decode(self.ctx, self._batch)
        if rc != 0:
            reason = "; ".join(recent_errors)
            if rc == 1:
                raise BackendError(f"llama.cpp found no room in the KV cache for {n} tokens {reason}".strip())
            raise BackendError(f"llama_decode failed with code {rc} {reason}".strip())
