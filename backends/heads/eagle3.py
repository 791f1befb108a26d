"""An EAGLE-3 head in numpy: the EAGLE layer reading a low, a middle and a high layer of the target.

EAGLE-1 (``backends.heads.eagle``) reads the target's final state and learns to regress the next
one. EAGLE-3 drops the regression: it fuses the inputs of three target layers ``u_t`` (low,
middle, high: ``state_layers``, e.g. {2, L/2, L-3}) into one vector ``g_t = W_fc u_t`` and learns
only the tokens, training on its own outputs (training-time test), so what it feeds itself at
the next draft level is its own layer output ``h_t``, whatever space that lives in.

Row ``t`` holds (``g_t`` or, in a draft row, the head's ``h`` of the row before; token
``x_{t+1}``) at position ``t``, as in llama.cpp's ``eagle3`` architecture
(src/models/eagle3.cpp), whose arithmetic this follows so a head exports to it unchanged:

    a = [rms(embed(x), embed_norm); rms(g, hidden_norm)]      # [2d]
    h = g + W_o attn(W_q a, W_k a, W_v a)                     # RoPE, GQA, the head's own cache
    h = h + W_down (silu(W_gate rms(h)) * W_up rms(h))        # -> the next row's g
    logits = W_lm rms(h, out_norm)                            # over the draft vocabulary

Tensors (float16 in the file): ``fc.weight`` [d, len(layers) d_t], ``embed_norm``,
``hidden_norm``, ``ffn_norm``, ``out_norm`` [d], ``q.weight`` [H hd, 2d], ``k.weight`` /
``v.weight`` [H_kv hd, 2d], ``o.weight`` [d, H hd], ``gate.weight`` / ``up.weight`` [d_ff, d],
``down.weight`` [d, d_ff], ``lm.weight`` [V', d] (trained, started from the target's rows),
``vocab`` [V'] (llama.cpp's ``d2t``, as target ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from backends.core.errors import ModelFileError
from backends.heads.eagle import EagleHead, EagleShape, draft_vocab, rms_norm
from backends.heads.files import HeadFile

KIND = "eagle3"
FUSED_LAYERS = 3  # a low, a middle and a high layer (``default_layers``)


def default_layers(n_layer: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layer inputs for a target of ``n_layer`` layers."""
    return min(2, n_layer - 1), n_layer // 2, max(0, n_layer - 3)


@dataclass(frozen=True)
class Eagle3Shape(EagleShape):
    layers: tuple[int, ...] = ()  # the target layers whose inputs are fused
    target_d: int = 0  # the target's width (the fused input is len(layers) * target_d)

    @classmethod
    def from_config(cls, c: dict, where: str = "the head") -> Eagle3Shape:
        base = EagleShape.from_config(c, where)
        try:
            layers, target_d = tuple(int(i) for i in c["layers"]), int(c["target_d"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError(f"{where}: the EAGLE-3 config lacks {exc}") from None
        if not layers or target_d <= 0:
            raise ModelFileError(f"{where}: the EAGLE-3 config names no target layers")
        return cls(**base.__dict__, layers=layers, target_d=target_d)

    def config(self) -> dict:
        return dict(super().config(), layers=list(self.layers), target_d=self.target_d)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        d, hd, a = self.d, self.head_dim, 2 * self.d
        return {"fc.weight": (d, len(self.layers) * self.target_d), "embed_norm": (d,), "hidden_norm": (d,),
                "q.weight": (self.n_head * hd, a), "k.weight": (self.n_kv_head * hd, a),
                "v.weight": (self.n_kv_head * hd, a), "o.weight": (d, self.n_head * hd), "ffn_norm": (d,),
                "gate.weight": (self.d_ff, d), "up.weight": (self.d_ff, d), "down.weight": (d, self.d_ff),
                "out_norm": (d,), "lm.weight": (self.draft_vocab, d)}


class Eagle3Head(EagleHead):
    """The layer of one EAGLE-3 ``HeadFile``; the EAGLE drafter runs it as it runs an EAGLE head.

    ``features`` fuses the target's states (``feature_width`` wide) into the ``d``-wide rows that
    ``forward`` takes, as it takes the head's own outputs in draft rows."""

    def __init__(self, head: HeadFile, embed: Callable[[np.ndarray], np.ndarray]) -> None:
        if head.kind != KIND:
            raise ModelFileError(f"{head.path} is a {head.kind} head, not an EAGLE-3 head")
        self.shape = s = Eagle3Shape.from_config(head.config, str(head.path))
        w = {name: head.tensor(name, shape) for name, shape in s.tensor_shapes().items()}
        self.fc_t = np.ascontiguousarray(w["fc.weight"].T)  # [len(layers) d_t, d]
        self.qkv_t = np.ascontiguousarray(np.concatenate([w["q.weight"], w["k.weight"], w["v.weight"]]).T)  # [2d, ...]
        self.o_t = np.ascontiguousarray(w["o.weight"].T)
        self.gate_up_t = np.ascontiguousarray(np.concatenate([w["gate.weight"], w["up.weight"]]).T)
        self.down_t = np.ascontiguousarray(w["down.weight"].T)
        self.embed_norm, self.hidden_norm = w["embed_norm"], w["hidden_norm"]
        self.ffn_norm, self.out_norm = w["ffn_norm"], w["out_norm"]
        self.lm_t = np.ascontiguousarray(w["lm.weight"].T)  # [d, V']
        self.vocab = draft_vocab(head, s.draft_vocab)
        self.embed, self.head = embed, head
        self.d = s.d
        self.feature_width = len(s.layers) * s.target_d
        self.state_layers = s.layers

    def features(self, states: np.ndarray) -> np.ndarray:
        """[n, d] fused features ``g`` of the target's states [n, len(layers) d_t]."""
        return np.asarray(states, np.float32) @ self.fc_t

    def _inputs(self, feats: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g, eps = np.asarray(feats, np.float32), self.shape.eps
        return g, np.concatenate([rms_norm(self.embed(tokens), self.embed_norm, eps), rms_norm(g, self.hidden_norm, eps)], 1)

    def log_probs(self, feats: np.ndarray) -> np.ndarray:
        return super().log_probs(rms_norm(np.asarray(feats, np.float32), self.out_norm, self.shape.eps))
