"""Training an EAGLE head with torch on recorded samples: the recipe ``HeadTrainer`` runs.

Data. A head row is the pair (state ``f_t``, token ``x_{t+1}``) and learns ``f_{t+1}``. Rows come
as sequences, since the layer attends to the rows before it: each recorded answer gives the last
``chunk`` rows of its conversation (the answer and the context just before it). Conversations
are held out whole, as for Medusa (``held_out``).

Loss (EAGLE's): smooth-L1 between the predicted and the true next state, weight 1.0, plus 0.1
times the cross-entropy of the head's logits (through the target's frozen output rows over the
draft vocabulary) against what the target does next: on answer rows the token it wrote (its
greedy choice), elsewhere its own distribution at the next state. Uniform noise on
the input states (``noise`` times their RMS) teaches the head to go on from its own, slightly
wrong, predictions, which is what it reads beyond the first draft level.

Agreement is measured the way the head drafts: a chain. Depth 1 reads the true states; depth
``k`` reads the head's own prediction from depth ``k - 1``, attending to the true rows and to its
chain's earlier draft rows, exactly as ``EagleDrafter`` runs it. Agreement at depth ``k`` is the
share of held-out answer positions where the guess equals what the model wrote, among those
where depths ``1..k - 1`` did.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import numpy as np

from backends.core.errors import SpecDeckError
from backends.heads.eagle import KIND, EagleShape
from backends.heads.files import ModelFingerprint
from backends.heads.record import Sample
from backends.heads.training import HeadTrainer, OnDevice, held_out, torch_or_error

EVAL_DEPTH = 4  # chain depths whose agreement is measured


@dataclass(frozen=True)
class EagleTrainConfig:
    draft_vocab: int = 4096
    lr: float = 1e-3
    batch: int = 8  # sequences per step
    chunk: int = 384  # rows per sequence
    weight_decay: float = 0.0
    noise: float = 0.1  # input noise, times the states' RMS
    ce_weight: float = 0.1
    seed: int = 0
    precision: str = "auto"  # the training products' type (``training_precision``)
    eval_every: int = 50
    eval_sequences: int = 24  # held-out sequences agreement is measured on
    max_epochs: float = 30.0
    clip: float = 1.0  # gradient norm clip
    train_lm: bool = False  # also train the output rows (for toy targets whose states no fixed layer reads)


@dataclass
class Sequences:
    """Training sequences, padded to ``chunk`` rows; tokens index ``table`` (their embeddings)."""

    states: np.ndarray  # [N, L + 1, d] float16: f_t for the rows, then the last row's target
    tokens: np.ndarray  # [N, L] int64, rows of ``table``: x_{t+1}
    positions: np.ndarray  # [N, L] int64: t
    valid: np.ndarray  # [N, L] bool: the row has a next state to learn
    written: np.ndarray  # [N, L] int64: draft-vocabulary id of x_{t+2} on answer rows, else -1
    held_out: np.ndarray  # [N] bool
    table: np.ndarray  # [U, d] float32: the target's embeddings of the tokens used


def eagle_sequences(samples: Sequence[tuple[int, Sample]], vocab: np.ndarray, n_vocab: int, chunk: int,
                    embed: Callable[[np.ndarray], np.ndarray], group: Callable[[int], int] = lambda n: n) -> Sequences:
    """One sequence per sample: its last ``chunk`` rows (see the module docstring)."""
    test = held_out([n for n, _ in samples], group)
    index = np.full(n_vocab, -1, dtype=np.int64)
    index[vocab] = np.arange(len(vocab))
    kept = [(n, s) for n, s in samples if len(s.tokens) >= 3]
    if not kept:
        raise SpecDeckError("the recorded answers are empty: nothing to train on")
    d = kept[0][1].states.shape[1]
    states = np.zeros((len(kept), chunk + 1, d), np.float16)
    tokens = np.zeros((len(kept), chunk), np.int64)
    positions = np.zeros((len(kept), chunk), np.int64)
    valid = np.zeros((len(kept), chunk), bool)
    written = np.full((len(kept), chunk), -1, np.int64)
    for i, (number, s) in enumerate(kept):
        rows = len(s.tokens) - 2  # rows t = 0 .. T - 3 have a next state
        t0 = max(0, rows - chunk)
        n = rows - t0
        t = np.arange(t0, t0 + n)
        states[i, : n + 1] = s.states[t0 : t0 + n + 1]
        tokens[i, :n] = s.tokens[t + 1]
        positions[i, :n] = t
        valid[i, :n] = True
        answer = t + 2 >= s.n_prompt
        written[i, :n] = np.where(answer, index[s.tokens[t + 2]], -1)
    used, local = np.unique(tokens, return_inverse=True)
    table = np.asarray(embed(used), np.float32)
    return Sequences(states, local.reshape(tokens.shape), positions, valid, written,
                     np.array([n in test for n, _ in kept]), table)


def layer_base(torch, shape: EagleShape):
    """The torch side of the EAGLE layer both head kinds share (``backends.heads.eagle``'s
    arithmetic): attention over the rows before and the chain of draft levels. A subclass makes
    the weights and says how a row's (token embedding, feature) enter (``inputs``)."""
    nn, F = torch.nn, torch.nn.functional
    d, hd, H, Hkv, ff = shape.d, shape.head_dim, shape.n_head, shape.n_kv_head, shape.d_ff

    class Layer(nn.Module):
        def make_weights(self, attn_in: int, lm_init: np.ndarray, train_lm: bool) -> None:
            lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
            self.q, self.k, self.v, self.o = lin(attn_in, H * hd), lin(attn_in, Hkv * hd), lin(attn_in, Hkv * hd), lin(H * hd, d)
            self.gate, self.up, self.down = lin(d, ff), lin(d, ff), lin(ff, d)
            self.ffn_norm = nn.Parameter(torch.ones(d))
            lm = torch.from_numpy(np.asarray(lm_init, np.float32))
            if train_lm:
                self.lm = nn.Parameter(lm)
            else:
                self.register_buffer("lm", lm)

        def init_weights(self, fc) -> None:
            """Small random matrices, ``fc`` first (the order fixes what a seed gives)."""
            with torch.no_grad():
                for m in (fc, self.q, self.k, self.v, self.o, self.gate, self.up, self.down):
                    m.weight.normal_(0.0, 0.02)

        def inputs(self, emb, feat):
            """(the residual stream [B, n, d], the attention's input) of rows (token embedding, feature)."""
            raise NotImplementedError

        def features(self, states):
            """The first level's features from the target's states (as they are, for EAGLE-1)."""
            return states

        def logits(self, pred):
            """Draft-vocabulary logits of predicted states."""
            return pred @ self.lm.T

        def _rms(self, x, w):
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + shape.eps) * w

        def _rope(self, x, pos):  # x [B, n, h, hd], pos [B, n]
            half = hd // 2
            freqs = shape.rope_theta ** (-torch.arange(half, dtype=torch.float64, device=pos.device) * 2.0 / hd)
            ang = pos[..., None].double() * freqs  # [B, n, hd/2]
            cos, sin = ang.cos().float()[:, :, None, :], ang.sin().float()[:, :, None, :]
            a, b = x[..., :half], x[..., half:]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

        def project(self, emb, feat, pos):
            """Rows -> (x [B, n, d], q [B, n, Hkv, g, hd], k, v [B, n, Hkv, hd])."""
            x, h = self.inputs(emb, feat)
            B, n = x.shape[:2]
            q = self._rope(self.q(h).view(B, n, H, hd), pos).view(B, n, Hkv, H // Hkv, hd)
            k = self._rope(self.k(h).view(B, n, Hkv, hd), pos)
            return x, q, k, self.v(h).view(B, n, Hkv, hd)

        def finish(self, x, attn):  # attn [B, n, H * hd]
            h = x + self.o(attn)
            g = self._rms(h, self.ffn_norm)
            return h + self.down(F.silu(self.gate(g)) * self.up(g))

        def forward(self, emb, feat, pos):
            """Teacher-forced rows [B, L, d] with causal attention -> predicted states [B, L, d]."""
            x, q, k, v = self.project(emb, feat, pos)
            L = x.shape[1]
            scores = torch.einsum("bnkgd,btkd->bkgnt", q, k) / hd ** 0.5
            causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
            w = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            attn = torch.einsum("bkgnt,btkd->bnkgd", w, v).reshape(x.shape[0], L, H * hd)
            return self.finish(x, attn), (k, v)

        def chain(self, emb, feat, pos, depth: int):
            """Predicted states per chain depth 1..depth, each [B, L, d] (row t: the chain that
            starts from true rows 0..t; depth k reads depth k - 1's prediction and token t + k)."""
            out, (k_true, v_true) = self.forward(emb, feat, pos)
            preds, k_draft, v_draft = [out], [], []
            L = emb.shape[1]
            causal = torch.ones(L, L, dtype=torch.bool, device=emb.device).tril()
            for level in range(1, depth):
                tok = torch.roll(emb, -level, dims=1)  # token t + level + 1's embedding at row t
                x, q, k, v = self.project(tok, preds[-1], pos + level)
                k_draft.append(k)
                v_draft.append(v)
                s_true = torch.einsum("bnkgd,btkd->bkgnt", q, k_true).masked_fill(~causal, float("-inf"))
                s_draft = torch.stack([torch.einsum("bnkgd,bnkd->bkgn", q, kd) for kd in k_draft], -1)
                w = (torch.cat([s_true, s_draft], -1) / hd ** 0.5).softmax(-1)
                attn = (torch.einsum("bkgnt,btkd->bnkgd", w[..., :L], v_true)
                        + torch.einsum("bkgnm,mbnkd->bnkgd", w[..., L:], torch.stack(v_draft)))
                preds.append(self.finish(x, attn.reshape(x.shape[0], L, H * hd)))
            return preds

    return Layer


def eagle_module(torch, shape: EagleShape, lm_init: np.ndarray, train_lm: bool = False):
    """The torch twin of ``backends.heads.eagle.EagleHead`` (same tensors, same arithmetic)."""
    d = shape.d

    class Eagle(layer_base(torch, shape)):
        """Starts as "the next state is this state" (``fc`` passes the state through, the
        layer adds little), which is a fair first guess for a slowly changing stream."""

        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2 * d, d, bias=False)
            self.attn_norm = torch.nn.Parameter(torch.ones(d))
            self.make_weights(d, lm_init, train_lm)
            self.init_weights(self.fc)
            with torch.no_grad():
                self.fc.weight[:, d:] += torch.eye(d)

        def inputs(self, emb, feat):
            x = self.fc(torch.cat([emb, feat], dim=-1))
            return x, self._rms(x, self.attn_norm)

    return Eagle()


class EagleRecipe(OnDevice):
    """EAGLE-1: one decoder layer over (state, token) rows; items are sequences."""

    kept = ("table",)

    def __init__(self, data: Sequences, vocab: np.ndarray, lm_init: np.ndarray, shape: EagleShape, config) -> None:
        torch = self.torch = torch_or_error()
        torch.manual_seed(config.seed)
        self.data, self.vocab, self.shape, self.config = data, vocab, shape, config
        self.model = self.make_module(torch, lm_init)
        self.train_rows = np.flatnonzero(~data.held_out)
        test = np.flatnonzero(data.held_out)
        self.test_rows = (test if len(test) else self.train_rows)[: config.eval_sequences]
        self.n_train = len(self.train_rows)
        self.identity = int(data.valid.sum())
        self.table = torch.from_numpy(data.table)

    @cached_property
    def rms(self) -> float:
        """The states' root mean square (the scale of the input noise)."""
        valid = self.data.states[self.data.valid.nonzero()].astype(np.float32)
        return float(np.sqrt((valid * valid).mean())) if len(valid) else 1.0

    def make_module(self, torch, lm_init: np.ndarray):
        """The torch module this recipe trains (its weights drawn from the seed already set)."""
        return eagle_module(torch, self.shape, lm_init, self.config.train_lm)

    def _inputs(self, rows: np.ndarray):
        """(token embeddings, first-level features, the next final states, positions) of sequences."""
        d = self.data
        states = self.tensor(d.states[rows].astype(np.float32))  # [B, L + 1, dim]
        emb = self.table[self.tensor(d.tokens[rows])]  # [B, L, dim]
        return emb, self.model.features(states[:, :-1]), states[:, 1:], self.tensor(d.positions[rows])

    def loss(self, items: np.ndarray, step: int):
        torch, F, c = self.torch, self.torch.nn.functional, self.config
        rows = self.train_rows[items]
        emb, feat, target, pos = self._inputs(rows)
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + step)
        noise = (torch.rand(feat.shape, generator=gen) * 2 - 1) * (c.noise * self.rms)  # on the host: the same on any device
        pred, _ = self.model(emb, feat + noise.to(self.device), pos)
        mask = self.tensor(self.data.valid[rows]).float()
        reg = F.smooth_l1_loss(pred, target, reduction="none").mean(-1)
        lm = self.model.lm
        log_q = (pred @ lm.T).log_softmax(-1)  # [B, L, V']
        written = self.tensor(self.data.written[rows])
        with torch.no_grad():
            p = (target @ lm.T).softmax(-1)
            p = torch.where((written >= 0)[..., None], F.one_hot(written.clamp(min=0), p.shape[-1]).float(), p)
        ce = -(p * log_q).sum(-1)
        return ((reg + c.ce_weight * ce) * mask).sum() / mask.sum().clamp(min=1)

    def agreement(self) -> list[float]:
        rows = self.test_rows
        emb, feat, _, pos = self._inputs(rows)
        preds = self.model.chain(emb, feat, pos, EVAL_DEPTH)
        written = self.data.written[rows]  # [B, L]: x_{t+2}
        alive = written >= 0
        out = []
        for level, pred in enumerate(preds):
            guess = self.model.logits(pred).argmax(-1).cpu().numpy()
            want = np.roll(written, -level, axis=1)  # depth level+1 at row t guesses x_{t+level+2}
            if level:
                want[:, -level:] = -1
            alive &= want >= 0
            hit = alive & (guess == want)
            out.append(float(hit.sum() / alive.sum()) if alive.any() else 0.0)
            alive = hit
        return out

    def export(self, state: dict) -> tuple[dict, dict[str, np.ndarray]]:
        names = {"lm": "lm.weight"}
        tensors = {names.get(k, k): v.detach().numpy().astype(np.float16) for k, v in state.items()}
        tensors["vocab"] = self.vocab.astype(np.int64)
        return self.shape.config(), tensors


class EagleTrainer(HeadTrainer):
    def __init__(self, data: Sequences, vocab: np.ndarray, lm_init: np.ndarray, shape: EagleShape,
                 target: ModelFingerprint, config: EagleTrainConfig, checkpoint, device: str = "auto") -> None:
        super().__init__(EagleRecipe(data, vocab, lm_init, shape, config), KIND, target, config, checkpoint, device)
