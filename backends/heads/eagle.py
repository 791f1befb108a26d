"""An EAGLE head in numpy: one decoder layer that runs the target one step ahead in feature space.

The target's hidden state ``f_t`` (after tokens ``0..t``) is what its output layer turns into
token ``t + 1``. EAGLE's observation is that the *next* state is easy to guess once the token that
was actually sampled is known: the head reads the pair ``(f_t, x_{t + 1})`` and predicts
``f_{t + 1}``, whose logits (through the target's own, frozen output rows over a draft vocabulary)
guess token ``t + 2``. Fed its own prediction and a guessed token it goes on, one level of a draft
tree per forward. Head row ``t`` therefore holds the pair ``(f_t, x_{t + 1})`` at position ``t``.

Layer (llama style, sizes from the target): ``x = W_fc [embed(x_{t+1}); f_t]``, then
``h = x + attn(rms(x))`` with RoPE and grouped-query attention over the head's own KV cache,
``f^ = h + W_down (silu(W_gate rms(h)) * W_up rms(h))``. Token embeddings are the target's
(``embed``: token ids [n] -> rows [n, d], e.g. ``backends.models.weights.TokenEmbeddings``), so the
head file stays a few MB.

Tensors (float16 in the file): ``fc.weight`` [d, 2d], ``attn_norm`` [d], ``q.weight`` [H hd, d],
``k.weight`` / ``v.weight`` [H_kv hd, d], ``o.weight`` [d, H hd], ``ffn_norm`` [d], ``gate.weight`` /
``up.weight`` [d_ff, d], ``down.weight`` [d, d_ff], ``lm.weight`` [V', d] (the target's output rows
unless trained: then read from the model, ``HeadFile.attach``), ``vocab`` [V'].

The cache keeps committed rows (pairs whose feature is the target's own) and, above them, the
scratch rows of the draft tree being built; ``HeadCache.drop_scratch`` forgets the latter after
every step, so only the accepted prefix stays, recomputed from the target's true states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from backends.core.errors import ModelFileError
from backends.heads.files import HeadFile

KIND = "eagle"


@dataclass(frozen=True)
class EagleShape:
    d: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    draft_vocab: int
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @classmethod
    def from_config(cls, c: dict, where: str = "the head") -> EagleShape:
        try:
            return cls(int(c["d_model"]), int(c["n_head"]), int(c["n_kv_head"]), int(c["head_dim"]),
                       int(c["d_ff"]), int(c["draft_vocab"]), float(c.get("rope_theta", 10000.0)),
                       float(c.get("eps", 1e-5)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError(f"{where}: the EAGLE config lacks {exc}") from None

    def config(self) -> dict:
        return {"d_model": self.d, "n_head": self.n_head, "n_kv_head": self.n_kv_head, "head_dim": self.head_dim,
                "d_ff": self.d_ff, "draft_vocab": self.draft_vocab, "rope_theta": self.rope_theta, "eps": self.eps}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        d, hd = self.d, self.head_dim
        return {"fc.weight": (d, 2 * d), "attn_norm": (d,), "q.weight": (self.n_head * hd, d),
                "k.weight": (self.n_kv_head * hd, d), "v.weight": (self.n_kv_head * hd, d),
                "o.weight": (d, self.n_head * hd), "ffn_norm": (d,), "gate.weight": (self.d_ff, d),
                "up.weight": (self.d_ff, d), "down.weight": (d, self.d_ff), "lm.weight": (self.draft_vocab, d)}


class HeadCache:
    """The head's keys and values: ``committed`` rows of true features, then scratch rows.

    Stored per KV head ([H_kv, rows, hd]) so a query block multiplies one contiguous matrix."""

    def __init__(self, n_kv_head: int, head_dim: int, capacity: int = 256) -> None:
        self.k = np.zeros((n_kv_head, capacity, head_dim), np.float32)
        self.v = np.zeros_like(self.k)
        self.committed = 0
        self.length = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Add rows (k, v [n, H_kv, hd]) after the last one."""
        n = len(k)
        if self.length + n > self.k.shape[1]:
            grow = max(self.k.shape[1] * 2, self.length + n)
            pad = ((0, 0), (0, grow - self.k.shape[1]), (0, 0))
            self.k, self.v = np.pad(self.k, pad), np.pad(self.v, pad)
        self.k[:, self.length:self.length + n] = k.transpose(1, 0, 2)
        self.v[:, self.length:self.length + n] = v.transpose(1, 0, 2)
        self.length += n

    def commit(self) -> None:
        """Every row so far holds a true feature (rows are committed before any scratch is added)."""
        self.committed = self.length

    def drop_scratch(self) -> None:
        self.length = self.committed

    def reset(self) -> None:
        self.committed = self.length = 0


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding, halves layout (x [n, H, hd], positions [n])."""
    half = x.shape[-1] // 2
    freqs = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / x.shape[-1])
    angles = positions[:, None].astype(np.float64) * freqs[None, :]  # [n, hd/2]
    cos, sin = np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def draft_vocab(head: HeadFile, size: int) -> np.ndarray:
    """The head's draft vocabulary ([V'] target token ids), checked against its target."""
    vocab = np.asarray(head.tensors.get("vocab", np.zeros(0)), dtype=np.int64)
    if vocab.shape != (size,) or (len(vocab) and (vocab.min() < 0 or vocab.max() >= head.target.n_vocab)):
        raise ModelFileError(f"{head.path}: the draft vocabulary is not {size} ids of the target's vocabulary")
    return vocab


class EagleHead:
    """The layer of one ``HeadFile``, ready to run with the target's embeddings."""

    def __init__(self, head: HeadFile, embed: Callable[[np.ndarray], np.ndarray]) -> None:
        if head.kind != KIND:
            raise ModelFileError(f"{head.path} is a {head.kind} head, not an EAGLE head")
        self.shape = s = EagleShape.from_config(head.config, str(head.path))
        w = {name: head.tensor(name, shape) for name, shape in s.tensor_shapes().items()}
        self.fc_t = np.ascontiguousarray(w["fc.weight"].T)  # [2d, d]
        self.qkv_t = np.ascontiguousarray(np.concatenate([w["q.weight"], w["k.weight"], w["v.weight"]]).T)
        self.o_t = np.ascontiguousarray(w["o.weight"].T)
        self.gate_up_t = np.ascontiguousarray(np.concatenate([w["gate.weight"], w["up.weight"]]).T)  # [d, 2 d_ff]
        self.down_t = np.ascontiguousarray(w["down.weight"].T)
        self.attn_norm, self.ffn_norm = w["attn_norm"], w["ffn_norm"]
        self.lm_t = np.ascontiguousarray(w["lm.weight"].T)  # [d, V']
        self.vocab = draft_vocab(head, s.draft_vocab)
        self.embed = embed
        self.head = head
        self.d = s.d  # the width of the states it predicts (and reads in draft rows)
        self.feature_width = s.d  # the width of the target's states it reads
        self.state_layers: tuple[int, ...] = ()  # which target states: the final one

    def new_cache(self) -> HeadCache:
        return HeadCache(self.shape.n_kv_head, self.shape.head_dim)

    def features(self, states: np.ndarray) -> np.ndarray:
        """The rows ``forward`` takes for the target's states [n, feature_width]: the states themselves."""
        return np.asarray(states, np.float32)

    def _inputs(self, feats: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the residual stream [n, d], the attention's input [n, d]) of rows (feature, token)."""
        x = np.concatenate([self.embed(tokens), np.asarray(feats, np.float32)], axis=1) @ self.fc_t  # [n, d]
        return x, rms_norm(x, self.attn_norm, self.shape.eps)

    def forward(self, feats: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cache: HeadCache,
                visible: np.ndarray, outputs: int | None = None) -> np.ndarray:
        """Run rows (feature [n, d], token [n], position [n]); returns predicted features [n, d],
        or of the last ``outputs`` rows only [outputs, d].

        The rows' keys and values are appended to ``cache`` first; each row then attends to every
        committed row and to the scratch rows (these new ones included) that ``visible`` marks,
        [n, scratch rows after appending]: its tree ancestors and itself, or the rows before it.
        A row's keys and values are all the cache needs of it: catching up on a prompt, only the
        last row's attention and feed-forward run.
        """
        s = self.shape
        n = len(tokens)
        x, attn_in = self._inputs(feats, tokens)
        qkv = attn_in @ self.qkv_t
        hq, hk = s.n_head * s.head_dim, s.n_kv_head * s.head_dim
        q = rope(qkv[:, :hq].reshape(n, s.n_head, s.head_dim), positions, s.rope_theta)
        k = rope(qkv[:, hq:hq + hk].reshape(n, s.n_kv_head, s.head_dim), positions, s.rope_theta)
        v = qkv[:, hq + hk:].reshape(n, s.n_kv_head, s.head_dim)
        cache.append(k, v)
        group = s.n_head // s.n_kv_head
        keys, values = cache.k[:, :cache.length], cache.v[:, :cache.length]  # [H_kv, T, hd]
        kept = n if outputs is None else min(outputs, n)  # the rows whose predictions are wanted: the last ones
        q, x, visible = q[n - kept:], x[n - kept:], visible[n - kept:]
        # [H_kv, group * kept, hd]: the query heads that share a KV head, one block per KV head
        qg = q.reshape(kept, s.n_kv_head, group, s.head_dim).transpose(1, 2, 0, 3).reshape(s.n_kv_head, group * kept, -1)
        scores = qg @ keys.transpose(0, 2, 1) * s.head_dim ** -0.5  # [H_kv, group * kept, T]; a Python float keeps float32
        hidden = np.tile(~visible, (group, 1))  # [group * kept, scratch rows]: committed rows are all seen
        scores[:, :, cache.committed:][:, hidden] = -np.inf
        scores -= scores.max(-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(-1, keepdims=True)
        attn = (scores @ values).reshape(s.n_kv_head, group, kept, s.head_dim).transpose(2, 0, 1, 3).reshape(kept, hq)
        h = x + attn @ self.o_t
        gu = rms_norm(h, self.ffn_norm, s.eps) @ self.gate_up_t
        g, u = gu[:, :s.d_ff], gu[:, s.d_ff:]
        return h + (g / (1.0 + np.exp(-g)) * u) @ self.down_t

    def log_probs(self, feats: np.ndarray) -> np.ndarray:
        """[n, V'] log-probabilities over the draft vocabulary for predicted features [n, d]."""
        logits = feats @ self.lm_t
        logits -= logits.max(-1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(-1, keepdims=True))
