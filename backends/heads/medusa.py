"""Medusa-1 heads in numpy: K small residual blocks on the target's last hidden state.

Head ``k`` (1-based) guesses the token ``k`` places after the one the target's own output layer
predicts from the same state: with the state of position ``t`` the target gives token ``t + 1``
(the next root), head 1 token ``t + 2``, head K token ``t + 1 + K``. Each head is one residual
block, ``h_k = x + silu(W_k x + b_k)``, followed by an output layer shared by all heads over a
draft vocabulary: the ``V'`` tokens the model used most in its own answers, initialized from the
target's output rows and trained with the heads. The full vocabulary would make the head as
costly as the target's own output layer (49k x 576 for SmolLM2, a quarter of its forward); 4096
tokens cover nearly all of what a chat model writes, and a token outside it is simply never
guessed (the target's bonus token still produces it).

Tensors (float16 in the file, float32 here): ``blocks.w`` [K, d, d], ``blocks.b`` [K, d],
``lm.weight`` [V', d] (the target's output rows, frozen: read from the model, ``HeadFile.attach``),
``vocab`` [V'] (target token ids).
"""

from __future__ import annotations

import numpy as np

from backends.core.errors import ModelFileError
from backends.heads.files import HeadFile

KIND = "medusa"


class MedusaHeads:
    """The heads of one ``HeadFile``, ready to run."""

    def __init__(self, head: HeadFile) -> None:
        if head.kind != KIND:
            raise ModelFileError(f"{head.path} is a {head.kind} head, not a Medusa head")
        c = head.config
        try:
            self.n_heads, self.d, self.n_draft_vocab = int(c["n_heads"]), int(c["d_model"]), int(c["draft_vocab"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError(f"{head.path}: the Medusa config lacks {exc}") from None
        k, d, v = self.n_heads, self.d, self.n_draft_vocab
        self.w = head.tensor("blocks.w", (k, d, d))
        self.b = head.tensor("blocks.b", (k, d))
        self.lm_t = np.ascontiguousarray(head.tensor("lm.weight", (v, d)).T)  # [d, V']: 1.6x faster to multiply
        self.w_flat = self.w.reshape(k * d, d)  # one matrix-vector product for every block
        vocab = np.asarray(head.tensors.get("vocab", np.zeros(0)), dtype=np.int64)
        if vocab.shape != (v,) or (v and (vocab.min() < 0 or vocab.max() >= head.target.n_vocab)):
            raise ModelFileError(f"{head.path}: the draft vocabulary is not {v} ids of the target's vocabulary")
        self.vocab = vocab
        self.head = head

    def logits(self, x: np.ndarray) -> np.ndarray:
        """[K, V'] logits over the draft vocabulary from one hidden state ``x`` [d]."""
        x = np.asarray(x, dtype=np.float32)
        z = (self.w_flat @ x).reshape(self.n_heads, self.d) + self.b  # [K, d]
        h = x[None, :] + z / (1.0 + np.exp(-z))  # residual + silu
        return h @ self.lm_t  # [K, V']

    def top(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each head's ``k`` likeliest target tokens and their probabilities: [K, k] ids, [K, k]."""
        logits = self.logits(x)
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        k = min(k, self.n_draft_vocab)
        best = np.argpartition(-probs, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(probs, best, axis=1), axis=1)
        best = np.take_along_axis(best, order, axis=1)
        return self.vocab[best], np.take_along_axis(probs, best, axis=1)
