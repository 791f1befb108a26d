"""A model's own multi-token-prediction (MTP, "next-n") block, run by llama.cpp as a draft head.

DeepSeek-V3, GLM-4.5+, MiMo, Hunyuan and others ship one or more next-n blocks in their GGUF:
given the model's hidden state ``h_t`` (after its output norm) and the token ``x_{t+1}`` that
followed, the block predicts the state and logits one place further on. That is the recurrence an
EAGLE head learns (``backends.drafters.eagle``), so the EAGLE drafter drafts with it unchanged:
``MTPHead`` offers the interface of the numpy ``EagleHead``, evaluated by llama.cpp in a second
context of the same loaded weights (``LLAMA_CONTEXT_TYPE_MTP``, whose KV cache holds only the
next-n layers).

llama.cpp's MTP batch pairs, at position ``p``, token ``x_p`` with the state ``h_{p-1}``
(``llama_batch_ext_set_embd_token``); the EAGLE drafter's row ``(f_t, x_{t+1})`` at position ``t``
is that pair at ``p = t + 1``. Each output row returns the block's own next state
(``llama_get_embeddings_nextn_ith``, the C++-linkage call llama-cpp-python binds in
``llama_cpp_ext``) and its logits over the full vocabulary. Like every head llama.cpp runs, it
drafts one chain per sequence (``backends.llamacpp.chain_head``).

The target's hidden states (``HIDDEN_STATES``: ``llama_get_embeddings``, the rows after the output
norm) are the states the block reads: llama.cpp's MTP graphs take ``h_nextn``, the same tensor
(a test holds them equal on a model the tests write).
"""

from __future__ import annotations

import numpy as np

from backends.core.errors import BackendError
from backends.llamacpp.chain_head import MAX_CACHES, ChainHead
from backends.llamacpp.model import LlamaModel
from backends.models.llama_lib import llama


class MTPHead(ChainHead):
    """The model's first next-n block as an EAGLE-style head (see the module docstring)."""

    what = "the MTP block"
    offset = 1  # llama.cpp pairs x_p with h_{p-1}

    def __init__(self, model: LlamaModel, *, n_ctx: int, n_threads: int, n_threads_batch: int) -> None:
        if not model.has_mtp:
            raise BackendError(f"{model.name} has no next-n (MTP) block that llama.cpp can run")
        lib = llama()
        self.model = model
        self._start(model.new_context("the MTP block's context", n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                                      n_seq_max=MAX_CACHES, n_threads=n_threads, n_threads_batch=n_threads_batch,
                                      ctx_type=lib.LLAMA_CONTEXT_TYPE_MTP, kv_unified=True))
        self.d = self.feature_width = int(lib.llama_model_n_embd_out(model.ptr))  # reads the target's final state
        self.state_layers: tuple[int, ...] = ()
        self.vocab = np.arange(model.n_vocab, dtype=np.int64)  # logits cover the whole vocabulary
