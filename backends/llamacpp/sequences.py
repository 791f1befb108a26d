"""Several independent sequences decoded together in one llama.cpp context.

Recording training data for a head means the model answering hundreds of prompts itself. One
answer at a time, every step is a one-row forward that reads all the weights for one token; on a
CPU a forward of a few rows costs little more than one (the measured cost curve: on an AMD EPYC,
5 rows about 2x one), so answering several prompts at once gives several times the tokens per
second. This is llama-server's continuous batching, small: each sequence has its own id and its
own KV stream (``kv_unified`` off, so attention of one sequence never scans another's cells), and
one ``llama_decode`` takes, per sequence, either the next chunk of its prompt or its last token.

Every row is an output (embeddings on, pooling none), so each forward returns every row's final
hidden state, which is what the recording keeps, and the logits of each sequence's last row;
with ``layers`` the states are those layers' inputs side by side (``backends.llamacpp.states``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from backends.core.errors import BackendError
from backends.llamacpp.model import LlamaModel
from backends.llamacpp.states import StateReader, check_layers
from backends.models.llama_lib import llama, recent_errors


@dataclass(frozen=True)
class SequenceStep:
    """What one forward gave one sequence."""

    logits: np.ndarray  # [vocab] float32, after its last row (a copy)
    hidden: np.ndarray  # [rows, d] float16, the states of the rows it fed (d: the states' width)


class LlamaSequences:
    """``n_seqs`` sequences of up to ``n_ctx_seq`` tokens each, in one context."""

    def __init__(self, model: LlamaModel, *, n_seqs: int, n_ctx_seq: int, n_threads: int,
                 n_batch: int = 256, layers: tuple[int, ...] = ()) -> None:
        lib = llama()
        check_layers(tuple(layers), n_layer=model.n_layer, architecture=model.meta("general.architecture") or "?",
                     name=model.name)
        if n_seqs < 1 or n_ctx_seq < 16:
            raise ValueError(f"need at least one sequence of 16 tokens, got {n_seqs} of {n_ctx_seq}")
        self.ctx = model.new_context(
            f"{n_seqs} sequences of {n_ctx_seq} tokens", n_ctx=n_seqs * n_ctx_seq, n_batch=n_batch, n_ubatch=n_batch,
            n_seq_max=n_seqs, kv_unified=False,  # a stream per sequence: attention reads only its own cells
            n_threads=n_threads, n_threads_batch=n_threads, embeddings=True)
        self.mem = lib.llama_get_memory(self.ctx)
        self._reader = StateReader(self.ctx, model.n_embd, tuple(layers))
        self._reader.switch(True)
        self.n_seqs, self.n_ctx_seq, self.n_batch = n_seqs, n_ctx_seq, n_batch
        self.n_vocab, self.d = model.n_vocab, self._reader.width
        self.n_past = [0] * n_seqs
        self._batch = lib.llama_batch_init(n_batch, 0, 1)
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(n_batch,))
        self._nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n_batch,))
        self._out = np.ctypeslib.as_array(self._batch.logits, shape=(n_batch,))
        self._seq_rows = [np.ctypeslib.as_array(self._batch.seq_id[i], shape=(1,)) for i in range(n_batch)]
        self._nseq[:] = 1
        self._out[:] = 1
        self.seconds = 0.0  # spent in llama_decode, for throughput reports

    def close(self) -> None:
        if getattr(self, "ctx", None):
            lib = llama()
            lib.llama_batch_free(self._batch)
            lib.llama_free(self.ctx)
            self.ctx = None

    def __enter__(self) -> LlamaSequences:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def truncate(self, seq: int, n: int) -> None:
        """Keep the first ``n`` positions of sequence ``seq`` (a next prompt that shares them)."""
        if n < self.n_past[seq]:
            if not llama().llama_memory_seq_rm(self.mem, seq, n, -1):
                llama().llama_memory_seq_rm(self.mem, seq, -1, -1)
                n = 0
            self.n_past[seq] = n

    def room(self, seq: int) -> int:
        return self.n_ctx_seq - self.n_past[seq]

    def decode(self, feeds: Sequence[tuple[int, Sequence[int]]]) -> list[SequenceStep]:
        """Append each feed's tokens to its sequence in one forward; at most ``n_batch`` rows in all.

        ``feeds``: (sequence id, tokens), each sequence at most once."""
        rows = sum(len(t) for _, t in feeds)
        if not 0 < rows <= self.n_batch:
            raise ValueError(f"a forward takes 1 to {self.n_batch} rows, got {rows}")
        row = 0
        for seq, tokens in feeds:
            n = len(tokens)
            if n > self.room(seq):
                raise BackendError(f"sequence {seq} is full ({self.n_ctx_seq} tokens)")
            self._tok[row : row + n] = tokens
            self._pos[row : row + n] = np.arange(self.n_past[seq], self.n_past[seq] + n)
            for r in range(row, row + n):
                self._seq_rows[r][0] = seq
            row += n
        self._batch.n_tokens = rows
        start = time.perf_counter()
        recent_errors.clear()
        rc = llama().llama_decode(self.ctx, self._batch)
        self.seconds += time.perf_counter() - start
        if rc != 0:
            raise BackendError(f"llama_decode of {len(feeds)} sequences failed with code {rc} "
                               f"{'; '.join(recent_errors)}".strip())
        lib = llama()
        hidden = self._reader.read(rows)  # [rows, d]
        logits = np.ctypeslib.as_array(lib.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))  # [rows, V]
        out, row = [], 0
        for seq, tokens in feeds:
            n = len(tokens)
            self.n_past[seq] += n
            out.append(SequenceStep(logits[row + n - 1].copy(), hidden[row : row + n].astype(np.float16)))
            row += n
        return out
