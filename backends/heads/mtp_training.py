"""Training a DeepSeek-V3-style MTP module (``backends.heads.mtp``) with torch on recorded samples.

Data: EAGLE's sequences of the model's final states (``eagle_training.eagle_sequences``). The
module is applied recursively for ``depth`` steps (step ``k`` reads step ``k - 1``'s output and the
true token that followed, attending to the true rows and its own earlier steps), which is how it
drafts; the loss is the soft cross-entropy against the model's own distribution at each step (the
token it wrote, on answer rows) through the model's frozen output rows, step ``k`` weighted
``decay ** (k - 1)``: DeepSeek-V3 weights its MTP losses down for the same reason, a far guess
only counts when the nearer ones were right. The shared recipe is ``UnrolledRecipe``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.heads.eagle_training import Sequences, layer_base
from backends.heads.eagle3_training import UnrolledRecipe
from backends.heads.files import ModelFingerprint
from backends.heads.mtp import KIND, MTPShape
from backends.heads.training import HeadTrainer


@dataclass(frozen=True)
class MTPTrainConfig:
    draft_vocab: int = 4096
    lr: float = 1e-3
    batch: int = 8  # sequences per step
    chunk: int = 384  # rows per sequence
    depth: int = 3  # recursive steps unrolled in training
    decay: float = 0.8  # loss weight of step k: decay ** (k - 1)
    weight_decay: float = 0.0
    seed: int = 0
    precision: str = "auto"  # the training products' type (``training_precision``)
    eval_every: int = 50
    eval_sequences: int = 24
    max_epochs: float = 30.0
    clip: float = 1.0


def mtp_module(torch, shape: MTPShape, lm_init: np.ndarray):
    """The torch twin of ``MTPModuleHead``; its output rows are the model's, frozen."""
    nn, d = torch.nn, shape.d

    class MTP(layer_base(torch, shape)):
        """Starts as "the next state is this state, normalized": ``fc`` passes the normed state
        through, the block adds little, and the output norm is the model's scale."""

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2 * d, d, bias=False)
            self.attn_norm = nn.Parameter(torch.ones(d))
            self.hidden_norm, self.embed_norm = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
            self.out_norm = nn.Parameter(torch.ones(d))
            self.make_weights(d, lm_init, train_lm=False)
            self.register_buffer("target_lm", self.lm, persistent=False)
            self.init_weights(self.fc)
            with torch.no_grad():
                self.fc.weight[:, :d] += torch.eye(d)

        def inputs(self, emb, feat):
            x = self.fc(torch.cat([self._rms(feat, self.hidden_norm), self._rms(emb, self.embed_norm)], dim=-1))
            return x, self._rms(x, self.attn_norm)

        def logits(self, pred):
            return self._rms(pred, self.out_norm) @ self.lm.T

    return MTP()


class MTPRecipe(UnrolledRecipe):
    """The module reads the final state; its loss is the unrolled one."""

    def make_module(self, torch, lm_init: np.ndarray):
        return mtp_module(torch, self.shape, lm_init)


class MTPTrainer(HeadTrainer):
    def __init__(self, data: Sequences, vocab: np.ndarray, lm_init: np.ndarray, shape: MTPShape,
                 target: ModelFingerprint, config: MTPTrainConfig, checkpoint, device: str = "auto") -> None:
        super().__init__(MTPRecipe(data, vocab, lm_init, shape, config), KIND, target, config, checkpoint, device)
