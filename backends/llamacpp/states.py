"""Which hidden states a llama.cpp context hands out per row, and reading them after a forward.

Two kinds, chosen by ``layers`` (``Drafter.state_layers``):

* the final state, after the last layer and its norm (the vector the output layer multiplies):
  ``llama_set_embeddings`` with pooling none, one row per output row. Every graph makes it.
* the inputs of chosen layers (``LAYER_STATES``), as an EAGLE-3 head reads a low, a middle and a
  high one: ``llama_set_embeddings_layer_inp(ctx, il, on)`` / ``llama_get_embeddings_layer_inp``,
  one row per token of the forward. These two have C++ linkage in libllama.so and no binding in
  llama_cpp.py; only graphs that record their layer inputs (``LAYER_INPUT_GRAPHS``, read from the
  vendored llama.cpp's src/models: ``res->t_layer_inp[il] = ...``) can give them, and asking any
  other graph aborts the process, so the architecture is checked first.

Several layers come side by side in one row, [len(layers) * n_embd], in the order asked
(``FINAL_STATE`` stands for the final state among them).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from backends.core.errors import BackendError
from backends.core.types import FINAL_STATE
from backends.models.llama_lib import llama

# architectures (general.architecture) whose llama.cpp graph records every layer's input
LAYER_INPUT_GRAPHS = frozenset({
    "llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen4exp", "gpt-oss", "gemma4", "mimo2",
    "minimax-01", "minimax-m2", "deepseek4", "bailingmoe3", "nanbeige", "hunyuan_vl", "muse-glimmer", "lfm2",
    "nemotron_h",
})

# the exported names: C++ linkage (Itanium ABI, then MSVC)
_SET = ("_Z30llama_set_embeddings_layer_inpP13llama_contextjb", "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z")
_GET = ("_Z30llama_get_embeddings_layer_inpP13llama_contextj", "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z")


def _symbol(names: tuple[str, ...], argtypes: list, restype):
    from llama_cpp import llama_cpp

    for name in names:
        fn = getattr(llama_cpp._lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
            return fn
    raise BackendError("this llama.cpp build does not export llama_*_embeddings_layer_inp: it cannot hand out "
                       "layer inputs (a head that reads them, as EAGLE-3's, cannot run on it)")


@functools.cache
def _layer_inp_api():
    """(set, get) for layer inputs, bound once."""
    ctx = ctypes.c_void_p
    return (_symbol(_SET, [ctx, ctypes.c_uint32, ctypes.c_bool], None),
            _symbol(_GET, [ctx, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)))


def check_layers(layers: tuple[int, ...], *, n_layer: int, architecture: str, name: str) -> None:
    """A clear error for layers this model cannot hand out (instead of llama.cpp's abort)."""
    inner = [il for il in layers if il != FINAL_STATE]
    if inner and architecture not in LAYER_INPUT_GRAPHS:
        raise BackendError(f"{name} ({architecture}) cannot hand out the inputs of its layers: llama.cpp's graph "
                           f"for it does not record them (those that do: {', '.join(sorted(LAYER_INPUT_GRAPHS))})")
    bad = [il for il in inner if not 0 <= il < n_layer]
    if bad or len(set(layers)) != len(layers):
        raise BackendError(f"{name} has layers 0..{n_layer - 1}; cannot hand out the states of layers {list(layers)}")


class StateReader:
    """The states of one choice of ``layers`` on one context (``()``: the final state)."""

    def __init__(self, ctx, n_embd: int, layers: tuple[int, ...] = ()) -> None:
        self.ctx, self.n_embd, self.layers = ctx, n_embd, tuple(layers)
        self.inner = tuple(il for il in self.layers if il != FINAL_STATE)
        self.width = n_embd * max(1, len(self.layers))
        self.final = not self.layers or FINAL_STATE in self.layers  # needs llama_set_embeddings

    def switch(self, on: bool) -> None:
        """Turn the layer inputs this reader reads on or off (the final state goes with embeddings)."""
        if self.inner:
            set_inp, _ = _layer_inp_api()
            for il in self.inner:
                set_inp(self.ctx, il, on)

    def read(self, n: int) -> np.ndarray:
        """[n, width] float32 for the last forward's ``n`` rows (views where one layer is read)."""
        parts = []
        for il in self.layers or (FINAL_STATE,):
            if il == FINAL_STATE:
                ptr = llama().llama_get_embeddings(self.ctx)
            else:
                ptr = _layer_inp_api()[1](self.ctx, il)
            if not ptr:
                raise BackendError("llama.cpp returned no hidden states for this forward")
            parts.append(np.ctypeslib.as_array(ptr, shape=(n, self.n_embd)))
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
