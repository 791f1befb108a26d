"""Training an EAGLE-3 head (``backends.heads.eagle3``) with torch on recorded samples.

Data. As for EAGLE-1 (``eagle_training.eagle_sequences``), one sequence per recorded answer,
but each recorded state is the target's chosen layer inputs and, last, its final state side by
side ([len(layers) d + d]): the layers are what the head reads, the final state is what says
the target's distribution over the draft vocabulary at every position (through the target's
frozen output rows), which is what the head learns; on answer rows, what the target wrote there
(its greedy choice over the whole vocabulary, which a distribution over the draft vocabulary
can rank lower), as the EAGLE-1 recipe does.

Training-time test. EAGLE-3 unrolls ``depth`` draft levels: level 1 reads the fused true
features, level ``k`` reads level ``k - 1``'s output for the same row and the true token that
followed, attending to the true rows and its own earlier levels, exactly as the drafter runs the
head (``layer_base.chain``). No feature is regressed, so the head's output may live in any space
that predicts well; the loss is the soft cross-entropy against the target's distribution at each
level, level ``k`` weighted ``decay ** (k - 1)``.

Draft vocabulary: the ``V'`` tokens the answers use most (``training.draft_vocabulary``); the
head's output rows start as the target's rows for them and are trained (EAGLE-3 has its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.heads.eagle3 import KIND, Eagle3Shape
from backends.heads.eagle_training import EagleRecipe, Sequences, layer_base
from backends.heads.files import ModelFingerprint
from backends.heads.training import HeadTrainer


@dataclass(frozen=True)
class Eagle3TrainConfig:
    draft_vocab: int = 4096
    lr: float = 1e-3
    batch: int = 8  # sequences per step
    chunk: int = 384  # rows per sequence
    depth: int = 4  # draft levels unrolled in training (training-time test)
    decay: float = 0.8  # loss weight of level k: decay ** (k - 1)
    weight_decay: float = 0.0
    seed: int = 0
    precision: str = "auto"  # the training products' type (``training_precision``)
    eval_every: int = 50
    eval_sequences: int = 24
    max_epochs: float = 30.0
    clip: float = 1.0


def eagle3_module(torch, shape: Eagle3Shape, lm_init: np.ndarray):
    """The torch twin of ``Eagle3Head``; ``target_lm`` (frozen) gives the target's distribution."""
    nn, d, fused = torch.nn, shape.d, len(shape.layers) * shape.target_d

    class Eagle3(layer_base(torch, shape)):
        """Starts as the logit lens of the highest layer read: ``fc`` passes that layer's input
        through and the output rows are the target's own."""

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(fused, d, bias=False)
            self.embed_norm, self.hidden_norm = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
            self.out_norm = nn.Parameter(torch.ones(d))
            self.make_weights(2 * d, lm_init, train_lm=True)
            self.register_buffer("target_lm", torch.tensor(np.asarray(lm_init, np.float32)), persistent=False)
            self.init_weights(self.fc)
            with torch.no_grad():
                if shape.target_d == d:
                    self.fc.weight[:, fused - d:] += torch.eye(d)

        def features(self, states):
            return self.fc(states)

        def inputs(self, emb, feat):
            return feat, torch.cat([self._rms(emb, self.embed_norm), self._rms(feat, self.hidden_norm)], dim=-1)

        def logits(self, pred):
            return self._rms(pred, self.out_norm) @ self.lm.T

    return Eagle3()


class UnrolledRecipe(EagleRecipe):
    """Training-time test over sequences whose states are what the head reads, then the final
    state side by side (``reads`` columns; 0: the head reads the final state itself): EAGLE-3's
    recipe, and the trained MTP module's (``backends.heads.mtp_training``)."""

    reads = 0

    def _inputs(self, rows: np.ndarray):
        d = self.data
        states = self.tensor(d.states[rows].astype(np.float32))  # [B, L + 1, reads + d]
        emb = self.table[self.tensor(d.tokens[rows])]
        final = states[..., self.reads :]
        read = states[..., : self.reads] if self.reads else final
        return emb, self.model.features(read[:, :-1]), final[:, 1:], self.tensor(d.positions[rows])

    def loss(self, items: np.ndarray, step: int):
        torch, c = self.torch, self.config
        rows = self.train_rows[items]
        emb, feat, final_next, pos = self._inputs(rows)
        preds = self.model.chain(emb, feat, pos, c.depth)
        with torch.no_grad():
            p_next = (final_next @ self.model.target_lm.T).softmax(-1)  # [B, L, V']: the target after row t
            written = self.tensor(self.data.written[rows])  # what it wrote there, on answer rows
            hard = torch.nn.functional.one_hot(written.clamp(min=0), p_next.shape[-1]).float()
            p_next = torch.where((written >= 0)[..., None], hard, p_next)
        valid = self.tensor(self.data.valid[rows])
        L = valid.shape[1]
        total, weights = 0.0, 0.0
        for level, pred in enumerate(preds):
            # level k at row t predicts what follows position t + k: the distribution k - 1 rows on
            p = torch.roll(p_next, -level, dims=1)
            mask = valid & torch.roll(valid, -level, dims=1)
            mask[:, L - level:] = False
            ce = -(p * self.model.logits(pred).log_softmax(-1)).sum(-1)
            m = mask.float()
            total = total + c.decay ** level * (ce * m).sum() / m.sum().clamp(min=1)
            weights += c.decay ** level
        return total / weights


class Eagle3Recipe(UnrolledRecipe):
    """EAGLE-3: the states are the chosen layers' inputs, then the final state."""

    def make_module(self, torch, lm_init: np.ndarray):
        self.reads = len(self.shape.layers) * self.shape.target_d
        return eagle3_module(torch, self.shape, lm_init)


class Eagle3Trainer(HeadTrainer):
    def __init__(self, data: Sequences, vocab: np.ndarray, lm_init: np.ndarray, shape: Eagle3Shape,
                 target: ModelFingerprint, config: Eagle3TrainConfig, checkpoint, device: str = "auto") -> None:
        super().__init__(Eagle3Recipe(data, vocab, lm_init, shape, config), KIND, target, config, checkpoint, device)
