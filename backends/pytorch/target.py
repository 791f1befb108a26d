"""The PyTorch target: the engine's ``Target`` over SpecDeck's own torch model.

KV layout. A static cache of ``n_ctx`` slots (``backends.pytorch.model.KVCache``). Committed tokens
fill slots ``0 .. n_past - 1``; a verify writes the root and the proposal into the slots after
them, every node at position ``n_past + depth``, and attends through an explicit mask: the whole
prefix, then the tree's ancestor mask (``compile_tree``). Commit moves the accepted path's slots
down to follow the root (``compact``) and forgets the rest by counting: a later forward overwrites
them. Rollback is exact by construction, nothing is ever recomputed.

Logits. A forward's logits are a fresh float32 tensor; on the CPU ``.numpy()`` shares its memory,
so the output owns its array and nothing is copied ([n_nodes, vocab]).

Hidden states. torch hands out the input of any layer and the final normed state for free (they
are intermediate tensors of the forward), so the target offers ``LAYER_STATES`` for every family
it runs, and keeps the states of cached positions as the llama.cpp target does.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch

from backends.core.errors import BackendError, Cancelled
from backends.core.kept_states import KeptStates
from backends.core.tree import compile_tree
from backends.core.types import (FINAL_STATE, HIDDEN_STATES, LAYER_SKIP, LAYER_STATES, NO_LIMIT, ROLLBACK, TREE,
                                 Proposal, TargetLimits, TargetOutput, Verdict)
from backends.pytorch.model import Transformer

NONE = torch.zeros(0, dtype=torch.long)  # logits_rows asking for no logits


class TorchLogits:
    """A verify's logits left on the GPU (``DeviceLogits``): the acceptance rule's top tokens come
    over as a few integers, a row only where sampling reads it; never [n_nodes, vocab] a step."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.tensor = logits  # [1 + n_nodes, vocab] float32 on the device

    def __len__(self) -> int:
        return len(self.tensor)

    def row(self, i: int) -> np.ndarray:
        return self.tensor[i].cpu().numpy()

    def argmax(self, rows: list[int] | None) -> np.ndarray:
        picked = self.tensor if rows is None else self.tensor[rows]
        return picked.argmax(dim=-1).cpu().numpy().astype(np.int64)


def host_or_device(logits: torch.Tensor) -> np.ndarray | TorchLogits:
    """CPU logits as a numpy view of the same memory (no copy); a GPU's stay there."""
    return logits.numpy() if logits.device.type == "cpu" else TorchLogits(logits)


class TorchTarget:
    """One KV cache over a loaded ``Transformer``; implements the engine's target protocol."""

    offers = frozenset({TREE, ROLLBACK, HIDDEN_STATES, LAYER_STATES, LAYER_SKIP})

    def __init__(self, model: Transformer, *, token_piece: Callable[[int], bytes], eog_ids: frozenset[int],
                 n_ctx: int = 4096, n_batch: int = 512, name: str = "model", skip: tuple[int, ...] = ()) -> None:
        """``skip``: layers this target leaves out (a self-speculative draft, see ``skipping``)."""
        if n_ctx < 16:
            raise ValueError(f"n_ctx must be at least 16, got {n_ctx}")
        self.model = model
        self.name = name
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_vocab = model.shape.n_vocab
        self.eog_ids = eog_ids
        self.token_piece = token_piece
        self.limits = TargetLimits(max_batch=n_batch, max_paths=NO_LIMIT)
        self.skip = tuple(sorted(set(skip)))
        self.layers = [i for i in range(model.shape.n_layer) if i not in self.skip]
        self.cache = model.new_cache(n_ctx, self.layers)
        self.n_threads = torch.get_num_threads()
        self._tokens: list[int] = []  # what the cache holds, slot by slot
        self._pending: tuple[int, list[int]] | None = None  # the last verify's root and nodes
        self._layers: tuple[int, ...] = (FINAL_STATE,)  # which states the forwards hand out
        self._keep_hidden = False
        self._kept = KeptStates(n_ctx, self.hidden_size, np.float32)  # the cached positions' states
        self._last_hidden: np.ndarray | None = None  # [1 + n_nodes, hidden_size] of the last verify

    @property
    def n_layer(self) -> int:
        return self.model.shape.n_layer

    @property
    def layer_share(self) -> float:
        return self.model.layer_share

    def skipping(self, skip: Sequence[int], *, n_ctx: int | None = None) -> TorchTarget:
        """The same weights without layers ``skip``, with a cache of their own (``LAYER_SKIP``): a
        draft model for self-speculative decoding that costs no memory but its cache."""
        bad = [il for il in skip if not 0 <= il < self.n_layer]
        if bad:
            raise BackendError(f"{self.name} has {self.n_layer} layers; it cannot skip layer {bad[0]}")
        return TorchTarget(self.model, token_piece=self.token_piece, eog_ids=self.eog_ids, n_ctx=n_ctx or self.n_ctx,
                           n_batch=self.n_batch, name=f"{self.name} without {len(set(skip))} layers", skip=tuple(skip))

    @property
    def placement(self) -> str:
        """Where it runs, in words (the status bar, the CLI): "CPU (PyTorch, float32)"."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        if self.model.device.type == "cuda":
            return f"GPU (PyTorch CUDA, {torch.cuda.get_device_name(self.model.device)}, {dtype})"
        return f"CPU (PyTorch, {dtype})"

    @property
    def runtime(self) -> tuple[str, ...]:
        """What changes its speed and rounding besides the weights: cost curves are kept per runtime."""
        m = self.model
        return (str(m.dtype), str(m.attention_dtype), str(m.activation_dtype), str(m.device), torch.__version__)

    @property
    def hidden_size(self) -> int:
        return len(self._layers) * self.model.shape.d

    # -- KV cache ------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return len(self._tokens)

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def reset(self) -> None:
        self._tokens = []
        self._pending = None
        self._kept.clear()

    def truncate(self, n: int) -> None:
        """Forget positions ``n`` and later (their slots are overwritten by the next forward)."""
        if n < len(self._tokens):
            del self._tokens[n:]
            self._kept.forget(n)

    # -- forwards ------------------------------------------------------------------------------
    def _forward(self, tokens: Sequence[int], depths: np.ndarray, tree_mask: np.ndarray, *,
                 logits_rows: torch.Tensor | None) -> tuple[torch.Tensor | None, np.ndarray | None]:
        """Tokens into the slots after the cache at positions ``n_past + depths``, attending to the
        whole cache and, among themselves, through ``tree_mask`` [n, n]."""
        start, n = self.n_past, len(tokens)
        mask = torch.ones((n, start + n), dtype=torch.bool)
        mask[:, start:] = torch.from_numpy(tree_mask)
        states = self._layers if self._keep_hidden else ()
        device = self.model.device
        logits, hidden = self.model.forward(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.from_numpy(start + depths.astype(np.int64)).to(device), self.cache,
            start=start, mask=mask.to(device), logits_rows=None if logits_rows is None else logits_rows.to(device),
            states=states, layers=self.layers if self.skip else None)
        return logits, None if hidden is None else hidden.cpu().numpy()

    def _chain(self, tokens: Sequence[int], *, last_logits: bool) -> torch.Tensor | None:
        """Append a straight run of tokens; the last one's logits when asked."""
        n = len(tokens)
        rows = torch.tensor([n - 1]) if last_logits else NONE
        logits, hidden = self._forward(tokens, np.arange(n), np.tril(np.ones((n, n), dtype=bool)), logits_rows=rows)
        if hidden is not None:
            self._kept.store(self.n_past, hidden)
        self._tokens.extend(int(t) for t in tokens)
        return logits

    def _run(self, tokens: list[int], *, last_logits: bool, stop: Callable[[], bool] | None = None,
             hidden_from: int = 0) -> torch.Tensor | None:
        """Append ``tokens`` ``n_batch`` at a time (split where kept states begin)."""
        logits, done = None, 0
        while done < len(tokens):
            if stop is not None and stop():
                raise Cancelled(f"stopped after {done} of {len(tokens)} prompt tokens")
            size = min(self.n_batch, len(tokens) - done)
            if self._keep_hidden and self.n_past < hidden_from:
                size = min(size, hidden_from - self.n_past)
            keep, self._keep_hidden = self._keep_hidden, self._keep_hidden and self.n_past >= hidden_from
            try:
                logits = self._chain(tokens[done : done + size], last_logits=last_logits and done + size == len(tokens))
            finally:
                self._keep_hidden = keep
            done += size
        return logits

    def prefill(self, tokens: Sequence[int], *, stop: Callable[[], bool] | None = None,
                hidden: bool = False, hidden_from: int = 0, layers: tuple[int, ...] = ()) -> int:
        """Bring the cache to exactly ``tokens``, reusing the common prefix; returns the reused count
        (see ``Target.prefill``)."""
        tokens = [int(t) for t in tokens]
        if len(tokens) > self.n_ctx:
            raise BackendError(f"{len(tokens)} tokens do not fit the {self.n_ctx}-token context")
        if hidden:
            self._choose_layers(tuple(layers) or (FINAL_STATE,))
        self._keep_hidden = hidden
        self._pending = None
        limit = min(len(tokens), len(self._tokens))
        if hidden:  # states must run from hidden_from (or the kept ones) up to the reused prefix
            limit = min(limit, self._kept.reusable(hidden_from))
        common = 0
        while common < limit and tokens[common] == self._tokens[common]:
            common += 1
        self.truncate(common)
        if hidden:
            self._kept.begin_at(max(common, hidden_from))
        self._run(tokens[common:], last_logits=False, stop=stop, hidden_from=hidden_from)
        return common

    def _choose_layers(self, layers: tuple[int, ...]) -> None:
        bad = [il for il in layers if il != FINAL_STATE and il not in self.layers]
        if bad:
            raise BackendError(f"{self.name} has {self.model.shape.n_layer} layers; no layer {bad[0]}")
        if layers != self._layers:
            self._layers = layers
            self._kept = KeptStates(self.n_ctx, self.hidden_size, np.float32)

    def hidden_states(self, start: int, end: int) -> np.ndarray:
        """The kept states of cached positions ``start .. end - 1``, [end - start, hidden_size] float32."""
        if not self._keep_hidden:
            raise BackendError(f"hidden states of positions {start}..{end - 1} were not kept (no prefill asked for them)")
        return self._kept.read(start, end)

    def extend(self, tokens: Sequence[int]) -> TargetOutput:
        """Append ``tokens``; the logits after the last one ([1, vocab], owned)."""
        start = time.perf_counter()
        if not tokens:
            raise ValueError("extend needs at least one token")
        if self.n_past + len(tokens) > self.n_ctx:
            raise BackendError(f"the context is full ({self.n_ctx} tokens)")
        self._pending = None
        logits = self._run([int(t) for t in tokens], last_logits=True)
        return TargetOutput(logits=logits.cpu().numpy(), seconds=time.perf_counter() - start)

    # -- verify / commit -----------------------------------------------------------------------
    def verify(self, root: int, proposal: Proposal) -> TargetOutput:
        """The root and the whole proposal in one forward; logits for every node ([1 + n, vocab])."""
        start = time.perf_counter()
        n = 1 + proposal.size
        if n > self.n_batch:
            raise BackendError(f"a proposal of {proposal.size} nodes exceeds the batch size {self.n_batch}")
        if self.n_past + n > self.n_ctx:
            raise BackendError(f"the context is full ({self.n_ctx} tokens)")
        tree = compile_tree(proposal.parents)
        mask = np.zeros((n, n), dtype=bool)
        mask[:, 0] = True
        mask[1:, 1:] = tree.mask
        depths = np.concatenate([[0], tree.depths])
        logits, hidden = self._forward([root, *proposal.tokens], depths, mask, logits_rows=None)
        self._pending = (int(root), list(proposal.tokens))
        self._last_hidden = hidden
        out = host_or_device(logits)
        if not isinstance(out, np.ndarray):
            torch.cuda.synchronize(self.model.device)  # the forward's time, not its launch
        return TargetOutput(logits=out, hidden=hidden, seconds=time.perf_counter() - start)

    def commit(self, verdict: Verdict) -> None:
        """Keep the root and the accepted path of the last verify, in consecutive slots."""
        if self._pending is None:
            raise BackendError("commit without a verify")
        root, tokens = self._pending
        self._pending = None
        base = self.n_past
        kept = torch.tensor([base, *(base + 1 + i for i in verdict.path)], device=self.model.device)
        self.cache.compact(base, kept)
        if self._last_hidden is not None:
            self._kept.store(base, self._last_hidden[[0, *(i + 1 for i in verdict.path)]])
            self._last_hidden = None
        self._tokens.append(root)
        self._tokens.extend(tokens[i] for i in verdict.path)

    def close(self) -> None:
        """Nothing to free by hand: the cache goes with the object."""
        self._kept = KeptStates(self.n_ctx, self.hidden_size, np.float32)
