"""A trained multi-token-prediction (MTP) module in numpy, DeepSeek-V3 style, for models without one.

DeepSeek-V3's next-n module reads the model's hidden state ``h_t`` and the embedding of the token
that followed, normalizes each, concatenates them, projects back to the model's width and runs
one transformer block; the model's own output layer turns the result into the next token's
logits, and the result itself is what the next step reads (the module is applied recursively for
k steps). It is the recurrence an EAGLE head learns, arranged as DeepSeek arranged it, so it
drafts through the same EAGLE-2 drafter; ``specdeck train mtp`` trains one for a model whose GGUF
has no next-n block (``backends.heads.mtp_training``: k unrolled steps, later ones weighted less).

    x = W_proj [rms(h, hidden_norm); rms(embed(x_{t+1}), embed_norm)]    # [d]
    h' = x + W_o attn(rms(x, attn_norm))                                 # RoPE, the head's own cache
    h' = h' + W_down (silu(W_gate rms(h')) * W_up rms(h'))               # -> the next step's h
    logits = W_out rms(h', out_norm)                                     # the model's output rows

Tensors (float16 in the file): ``fc.weight`` [d, 2d] (``W_proj``), ``hidden_norm``, ``embed_norm``,
``attn_norm``, ``ffn_norm``, ``out_norm`` [d], ``q.weight`` .. ``down.weight`` as an EAGLE head's,
``lm.weight`` [V', d] (the model's own output rows over the draft vocabulary, frozen: read from the
model, ``HeadFile.attach``), ``vocab``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from backends.core.errors import ModelFileError
from backends.heads.eagle import EagleHead, EagleShape, draft_vocab, rms_norm
from backends.heads.files import HeadFile

KIND = "mtp"


class MTPShape(EagleShape):
    """An EAGLE layer's sizes; the tensors differ (``tensor_shapes``)."""

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        d = self.d
        return dict(super().tensor_shapes(), hidden_norm=(d,), embed_norm=(d,), out_norm=(d,))


class MTPModuleHead(EagleHead):
    """The module of one MTP ``HeadFile``; the EAGLE drafter runs it as it runs an EAGLE head."""

    def __init__(self, head: HeadFile, embed: Callable[[np.ndarray], np.ndarray]) -> None:
        if head.kind != KIND:
            raise ModelFileError(f"{head.path} is a {head.kind} head, not an MTP module")
        self.shape = s = MTPShape.from_config(head.config, str(head.path))
        w = {name: head.tensor(name, shape) for name, shape in s.tensor_shapes().items()}
        self.fc_t = np.ascontiguousarray(w["fc.weight"].T)  # [2d, d]
        self.qkv_t = np.ascontiguousarray(np.concatenate([w["q.weight"], w["k.weight"], w["v.weight"]]).T)
        self.o_t = np.ascontiguousarray(w["o.weight"].T)
        self.gate_up_t = np.ascontiguousarray(np.concatenate([w["gate.weight"], w["up.weight"]]).T)
        self.down_t = np.ascontiguousarray(w["down.weight"].T)
        self.attn_norm, self.ffn_norm, self.out_norm = w["attn_norm"], w["ffn_norm"], w["out_norm"]
        self.hidden_norm, self.embed_norm = w["hidden_norm"], w["embed_norm"]
        self.lm_t = np.ascontiguousarray(w["lm.weight"].T)  # [d, V']
        self.vocab = draft_vocab(head, s.draft_vocab)
        self.embed, self.head = embed, head
        self.d = self.feature_width = s.d
        self.state_layers: tuple[int, ...] = ()

    def _inputs(self, feats: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        eps = self.shape.eps
        both = np.concatenate([rms_norm(np.asarray(feats, np.float32), self.hidden_norm, eps),
                               rms_norm(self.embed(tokens), self.embed_norm, eps)], axis=1)
        x = both @ self.fc_t
        return x, rms_norm(x, self.attn_norm, eps)

    def log_probs(self, feats: np.ndarray) -> np.ndarray:
        return super().log_probs(rms_norm(np.asarray(feats, np.float32), self.out_norm, self.shape.eps))
