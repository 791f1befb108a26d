"""An EAGLE-3 head run by llama.cpp: a GGUF of its ``eagle3`` architecture, linked to the target.

SpecDeck's EAGLE-3 heads export to that architecture (``backends.heads.eagle3_gguf``), and heads
published as ``eagle3`` GGUFs load the same way. llama.cpp runs the head in a context of its own
(``ctx_other`` is the target's context, whose token embeddings and, for heads without their own,
output rows it reads), with the target's GPU layers where the target has them:

- the encoder (``LLAMA_PROCESS_TYPE_ENCODE``) fuses the target's three layer inputs into the
  head's feature ``g_t = W_fc u_t`` (``features``);
- the decoder (``LLAMA_PROCESS_TYPE_DECODE``) takes, at position ``t``, token ``x_{t+1}`` with
  ``g_t`` (or the head's own output of the row before, in a draft row) and returns its next
  pre-norm state (``llama_get_embeddings_nextn_ith``) and its logits, full-vocabulary rows that
  are ``-inf`` outside the head's draft vocabulary (``d2t``).

So the EAGLE-2 drafter drafts with it unchanged, one chain per sequence
(``backends.llamacpp.chain_head``).
"""

from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

import numpy as np

from backends.core.errors import BackendError, HeadMismatchError, ModelFileError
from backends.llamacpp.chain_head import MAX_CACHES, ChainHead
from backends.llamacpp.model import LlamaModel
from backends.models.llama_lib import llama

ARCH = "eagle3"
ENCODER_SEQ = MAX_CACHES  # the sequence id the encoder's rows go under (the caches use 0 .. MAX_CACHES - 1)


class HeadHeader(NamedTuple):
    layers: tuple[int, ...]  # the target layers whose inputs it fuses
    target_d: int  # the target width it was made for
    d2t: np.ndarray | None  # its draft vocabulary as target ids (None: the whole vocabulary)


def read_head(path: str | os.PathLike) -> HeadHeader:
    """What an ``eagle3`` GGUF says of the target it reads, from the file (llama.cpp's
    ``llama_model_target_layer_ids`` has C++ linkage and no binding; the file says the same).
    Through SpecDeck's cached header reader: ``gguf.GGUFReader`` spent 2.1 s on the tokenizer a
    SmolLM2 head's GGUF carries (49,152 tokens and 48,900 merges) at every session's first use."""
    from backends.models.gguf_info import read_gguf_info

    info = read_gguf_info(path)
    layers, width = info.metadata.get(f"{ARCH}.target_layers"), info.metadata.get(f"{ARCH}.target_hidden_size")
    d2t = None
    table = next((t for t in info.tensors if t.name == "d2t"), None)
    if table is not None:
        dtype = {"I64": np.int64, "I32": np.int32}.get(table.ggml_type)
        if dtype is None:
            raise ModelFileError(f"{path}: its d2t map is {table.ggml_type}, not integer target token ids")
        d2t = np.fromfile(path, dtype, count=table.n_elements, offset=table.offset).astype(np.int64)
    return HeadHeader(tuple(int(i) for i in layers) if isinstance(layers, (list, tuple)) else (),
                      int(width) if isinstance(width, (int, float)) else 0, d2t)


class GGUFEagle3Head(ChainHead):
    """An ``eagle3`` GGUF run by llama.cpp beside ``target_ctx`` (see the module docstring)."""

    what = "the EAGLE-3 head"

    def __init__(self, path: str | os.PathLike, target_ctx, target: LlamaModel, *, n_ctx: int, n_gpu_layers: int,
                 n_threads: int, n_threads_batch: int) -> None:
        from llama_cpp import llama_cpp_ext

        lib = llama()
        header = read_head(path)
        self.model = LlamaModel(path, n_gpu_layers=n_gpu_layers)
        try:
            if self.model.meta("general.architecture") != ARCH:
                raise ModelFileError(f"{path} is not an EAGLE-3 head of llama.cpp's eagle3 architecture")
            wrong = [f"{what} {mine} vs {theirs}" for what, mine, theirs in (
                ("vocabulary", self.model.n_vocab, target.n_vocab), ("width", header.target_d, target.n_embd))
                if mine != theirs]
            if any(il >= target.n_layer for il in header.layers):
                wrong.append(f"layers {list(header.layers)} of a {target.n_layer}-layer model")
            if wrong:
                raise HeadMismatchError(f"{path} is an EAGLE-3 head for another model than {target.name} "
                                        f"({'; '.join(wrong)})")
            self.state_layers = header.layers
            self._start(self.model.new_context("the EAGLE-3 head's context", n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                                               n_seq_max=ENCODER_SEQ + 1, n_threads=n_threads,
                                               n_threads_batch=n_threads_batch, kv_unified=True, ctx_other=target_ctx))
        except Exception:
            self.model.close()
            raise
        self._ext = llama_cpp_ext
        self.d = int(lib.llama_model_n_embd(self.model.ptr))
        self.feature_width = len(self.state_layers) * int(target.n_embd)
        self.vocab = np.arange(target.n_vocab, dtype=np.int64) if header.d2t is None else header.d2t
        self.columns = header.d2t

    def close(self) -> None:
        super().close()
        if getattr(self, "model", None) is not None:
            self.model.close()

    def features(self, states: np.ndarray) -> np.ndarray:
        """[n, d] fused features ``g`` of the target's layer inputs [n, feature_width] (the encoder)."""
        lib = llama()
        states = np.ascontiguousarray(states, np.float32)
        if states.ndim != 2 or states.shape[1] != self.feature_width:
            raise BackendError(f"{self.what} reads {self.feature_width}-wide states, got {states.shape}")
        out = np.empty((len(states), self.d), np.float32)
        step = int(lib.llama_n_ubatch(self.ctx))
        for first in range(0, len(states), step):
            rows = states[first : first + step]
            lib.llama_batch_ext_clear(self._batch)
            # the encoder reads no positions, but a batch's must continue its sequence's
            start = lib.llama_memory_seq_pos_max(self.mem, ENCODER_SEQ) + 1
            for j, row in enumerate(rows):
                embd = lib.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.feature_width)
                idx = lib.llama_batch_ext_add_embd(self._batch, ENCODER_SEQ, embd)
                pos = (lib.llama_pos * 1)(start + j)
                if idx < 0 or not (lib.llama_batch_ext_set_pos(self._batch, idx, pos)
                                   and lib.llama_batch_ext_set_output_embd(self._batch, idx, True)):
                    raise BackendError(f"llama.cpp refused {self.what}'s encoder row {j} (batch index {idx})")
            self._process(lib.LLAMA_PROCESS_TYPE_ENCODE, len(rows))
            fused = self._ext.llama_get_embeddings_nextn(self.ctx)
            out[first : first + len(rows)] = np.ctypeslib.as_array(fused, shape=(len(rows), self.d))
        return out
