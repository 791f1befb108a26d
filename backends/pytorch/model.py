"""SpecDeck's own small decoder-only transformer in PyTorch (gpt-fast style): explicit positions, a
static KV cache owned by the caller, any attention mask (token trees), the inputs of any layer,
and a ``layers`` argument that runs a subset of the blocks (self-speculative decoding).

One forward takes ``n`` new tokens that go into cache slots ``start .. start + n - 1`` and attend
to slots ``0 .. start + n - 1`` through ``mask`` [n, start + n]. Slots are not positions: a tree's
siblings sit in consecutive slots at the same position, and after a verify the target moves the
accepted slots together (``KVCache.compact``). The rotary angle comes from ``positions``, and a
sliding-window layer also hides keys more than its window behind the query (``key_positions``).

Arithmetic follows the Hugging Face reference of each family (norms in float32, then the model's
dtype), so that fp32 logits match transformers' within rounding (tests/test_torch_backend.py).
Two liberties make a forward fewer operations (on a CPU a small model's token is mostly torch's
per-operation overhead: SmolLM2-135M runs about 1,800 of them a token): each head's q and k rows
are stored in rotary pairs, so both rotate as one complex product in float32, and a layer's
weights are looked up once, not by name per forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from backends.core.types import FINAL_STATE
from backends.pytorch.shape import TorchShape


@dataclass
class KVCache:
    """Keys and values of the layers a forward runs, for ``n_ctx`` slots: [len(layers), n_kv, n_ctx,
    head_dim] each; ``rows[i]`` is layer ``i``'s row (a layer-skipping draft keeps only its own)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor  # [n_ctx] int64, the position of the token in each slot
    rows: dict[int, int]

    @classmethod
    def empty(cls, shape: TorchShape, n_ctx: int, *, dtype: torch.dtype, device: torch.device,
              layers: Sequence[int] | None = None) -> KVCache:
        layers = list(range(shape.n_layer)) if layers is None else list(layers)
        size = (len(layers), shape.n_kv, n_ctx, shape.head_dim)
        return cls(torch.zeros(size, dtype=dtype, device=device), torch.zeros(size, dtype=dtype, device=device),
                   torch.zeros(n_ctx, dtype=torch.long, device=device), {il: r for r, il in enumerate(layers)})

    @property
    def n_ctx(self) -> int:
        return self.k.shape[2]

    def compact(self, start: int, kept: torch.Tensor) -> None:
        """Move slots ``kept`` (ascending, all >= ``start``) to ``start, start + 1, ...``: the accepted
        path of a tree. Slots after them keep stale values that the next forward overwrites."""
        n = len(kept)
        if n and not bool((kept == torch.arange(start, start + n, device=kept.device)).all()):
            self.k[:, :, start : start + n] = self.k[:, :, kept]
            self.v[:, :, start : start + n] = self.v[:, :, kept]
            self.positions[start : start + n] = self.positions[kept]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool) -> torch.Tensor:
    """RMS norm over the last dimension, computed in float32 (torch's kernel upcasts half precision);
    llama rounds to the model's dtype before the weight, gemma after (as their references), whose
    norm weights are float32. ``weight`` broadcasts (a per-head norm: [heads, hd])."""
    h = F.rms_norm(x.float() if gemma else x, x.shape[-1:], eps=eps)
    return (h * weight).to(x.dtype)


def rotary(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, hd] (float32, each head's dimensions in rotary pairs: ``pair_rows``) by
    ``turns`` [n, hd / 2] complex: the pair (a, b) becomes (a cos - b sin, a sin + b cos)."""
    n, heads, hd = x.shape
    pairs = torch.view_as_complex(x.view(n, heads, hd // 2, 2))
    return torch.view_as_real(pairs * turns[:, None]).view(n, heads, hd)


def pair_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q or k projection [heads hd, ...] from halves order (Hugging Face: dimension ``j``
    turns with ``j + hd / 2``) into pairs (``2j`` with ``2j + 1``), per head. Applied to q and k
    alike it leaves every q.k product, so attention, unchanged."""
    half = head_dim // 2
    order = torch.arange(head_dim).view(2, half).T.reshape(-1)  # 0, half, 1, half + 1, ...
    return w.view(-1, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


@dataclass
class Layer:
    """One block's weights, looked up once; q and k rows in rotary pairs (``pair_rows``)."""

    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [(H + 2 Hkv) hd, d]: q, k and v stacked (one matrix product)
    bqkv: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [H + Hkv, hd]: q's per-head norm for each query head, then k's
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 ff, d]: gate and up stacked
    w_down: torch.Tensor
    post_attn_norm: torch.Tensor | None  # gemma's norms after attention and the MLP
    post_ffn_norm: torch.Tensor | None


class Transformer:
    """The forward pass over canonical weights (``backends.pytorch.weights``); holds no cache."""

    def __init__(self, shape: TorchShape, weights: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", attention_dtype: torch.dtype | None = None,
                 activation_dtype: torch.dtype | None = None) -> None:
        """``dtype``: the weights'. ``attention_dtype``: the KV cache's and attention's; on a CPU
        float32 attends faster than half precision (``loader.attention_dtype``). ``activation_dtype``:
        the residual stream's and the norms' (both ``dtype`` by default); float32 beside float16
        weights, whose range (65504) the largest activations of a model can pass (Gemma-3-270M's
        residual reaches 1e5, SmolLM2's 2.5e4): each matrix product then rounds its input to the
        weights' dtype and its output back, as llama.cpp multiplies F16 weights."""
        self.shape = shape
        self.dtype = dtype
        self.attention_dtype = attention_dtype or dtype
        self.activation_dtype = activation_dtype or dtype
        self.device = torch.device(device)
        norm_dtype = torch.float32 if shape.gemma else self.activation_dtype  # gemma's norms multiply in float32
        self.w = {k: v.to(device=self.device, dtype=norm_dtype if k.endswith("norm") else dtype).contiguous()
                  for k, v in weights.items()}
        self.w.setdefault("output", self.w["embed"])
        self.layers = [self._layer(i) for i in range(shape.n_layer)]
        self._inv_freq = {theta: self._frequencies(theta) for theta in {shape.theta(i) for i in range(shape.n_layer)}}

    def _layer(self, i: int) -> Layer:
        """Layer ``i``'s weights, taken out of ``self.w``: matrices that read the same input (q, k
        and v; gate and up) stacked into one, so each takes one matrix product a forward instead of
        two or three (a bias missing beside present ones becomes zeros); q's and k's rows, biases
        and norms in rotary pairs."""
        s, w, hd = self.shape, self.w, self.shape.head_dim
        mats = [w.pop(f"{i}.w{x}") for x in "qkv"]
        biases = [w.pop(f"{i}.b{x}", None) for x in "qkv"]
        bias = None
        if any(b is not None for b in biases):
            bias = [torch.zeros(len(m), dtype=m.dtype, device=m.device) if b is None else b for m, b in zip(mats, biases)]
            bias = torch.cat([pair_rows(bias[0], hd), pair_rows(bias[1], hd), bias[2]])
        qk_norm = None
        if f"{i}.q_norm" in w:
            q_norm, k_norm = pair_rows(w.pop(f"{i}.q_norm"), hd), pair_rows(w.pop(f"{i}.k_norm"), hd)
            qk_norm = torch.cat([q_norm.expand(s.n_head, hd), k_norm.expand(s.n_kv, hd)])
        return Layer(w.pop(f"{i}.attn_norm"), torch.cat([pair_rows(mats[0], hd), pair_rows(mats[1], hd), mats[2]]),
                     bias, qk_norm, w.pop(f"{i}.wo"), w.pop(f"{i}.ffn_norm"),
                     torch.cat([w.pop(f"{i}.w_gate"), w.pop(f"{i}.w_up")]), w.pop(f"{i}.w_down"),
                     w.pop(f"{i}.post_attn_norm", None), w.pop(f"{i}.post_ffn_norm", None))

    def _frequencies(self, theta: float) -> torch.Tensor:
        hd = self.shape.head_dim
        return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=self.device) / hd))  # [hd / 2]

    def new_cache(self, n_ctx: int, layers: Sequence[int] | None = None) -> KVCache:
        return KVCache.empty(self.shape, n_ctx, dtype=self.attention_dtype, device=self.device, layers=layers)

    @property
    def layer_share(self) -> float:
        """The blocks' share of a one-token forward's weights (the rest: embedding row, output layer);
        what skipping a layer saves is about this over ``n_layer``."""
        body = sum(t.numel() for layer in self.layers for t in vars(layer).values() if t is not None)
        return body / (body + self.w["output"].numel())

    def _turns(self, layer: int, positions: torch.Tensor, known: dict) -> torch.Tensor:
        """Rotary turns cos + i sin [n, hd / 2] for a layer's frequencies, computed once per
        forward for all layers that share them (``known``)."""
        s = self.shape
        key = (s.theta(layer), s.rope_linear if not s.window(layer) else 1.0)
        if key not in known:
            angles = positions.float()[:, None] / key[1] * self._inv_freq[key[0]][None, :]  # [n, hd / 2]
            known[key] = torch.polar(torch.ones_like(angles), angles)
        return known[key]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, *, start: int,
                mask: torch.Tensor, layers: Sequence[int] | None = None, logits_rows: torch.Tensor | None = None,
                states: Sequence[int] = ()) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run ``tokens`` [n] at ``positions`` [n] into cache slots ``start ..``; returns (logits of
        ``logits_rows`` (all rows when None; an empty tensor: none) [rows, vocab] float32, the states
        ``states`` side by side [n, len(states) d] float32 or None). ``layers``: the blocks to run
        (all by default); a skipped block leaves its cache slots as they were. ``mask`` [n, start + n]
        bool: True where a row may attend to a slot."""
        s, w = self.shape, self.w
        n = len(tokens)
        cache.positions[start : start + n] = positions
        keys = cache.positions[: start + n]
        x = F.embedding(tokens, w["embed"]).to(self.activation_dtype)  # [n, d]
        if s.gemma:
            x = x * torch.tensor(s.embed_scale, dtype=self.activation_dtype)
        taken: dict[int, torch.Tensor] = {}
        masks: dict[int, torch.Tensor] = {}
        turns: dict = {}
        for i in range(s.n_layer) if layers is None else layers:
            if i in states:
                taken[i] = x.float()
            window = s.window(i)
            if window not in masks:
                allowed = mask if not window else mask & (positions[:, None] - keys[None, :] < window)
                # additive, made once: attention would turn a boolean mask into this in every layer
                masks[window] = torch.zeros(allowed.shape, dtype=self.attention_dtype, device=self.device).masked_fill_(
                    ~allowed, float("-inf"))[None, None]
            x = self._block(i, x, self._turns(i, positions, turns), cache, start=start, mask=masks[window])
        x = rms_norm(x, w["norm"], s.norm_eps, gemma=s.gemma)
        if FINAL_STATE in states:
            taken[FINAL_STATE] = x.float()
        out = None
        if logits_rows is None or len(logits_rows):
            rows = x if logits_rows is None else x[logits_rows]
            out = self._linear(rows, w["output"]).float()  # [rows, vocab]
        hidden = torch.cat([taken[il] for il in states], dim=1) if states else None
        return out, hidden

    def _block(self, i: int, x: torch.Tensor, turns: torch.Tensor, cache: KVCache, *, start: int,
               mask: torch.Tensor) -> torch.Tensor:
        s, w = self.shape, self.layers[i]
        h = rms_norm(x, w.attn_norm, s.norm_eps, gemma=s.gemma)
        h = self._attention(i, h, turns, cache, start=start, mask=mask)
        if w.post_attn_norm is not None:
            h = rms_norm(h, w.post_attn_norm, s.norm_eps, gemma=True)
        x = x + h
        h = rms_norm(x, w.ffn_norm, s.norm_eps, gemma=s.gemma)
        gate, up = self._linear(h, w.w_gate_up).chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if s.gemma else F.silu(gate)
        h = self._linear(gate * up, w.w_down)
        if w.post_ffn_norm is not None:
            h = rms_norm(h, w.post_ffn_norm, s.norm_eps, gemma=True)
        return x + h

    def _attention(self, i: int, h: torch.Tensor, turns: torch.Tensor, cache: KVCache, *, start: int,
                   mask: torch.Tensor) -> torch.Tensor:
        """Attention of ``h`` [n, d] over the cache's slots ``0 .. start + n - 1``, writing its own
        keys and values into ``start ..``. q and k take the biases and per-head norms the file has
        and rotate together, in float32 (on a CPU the cache and attention are float32 too)."""
        s, w = self.shape, self.layers[i]
        n, heads = len(h), s.n_head + s.n_kv
        y = self._linear(h, w.wqkv, w.bqkv)  # [n, (H + 2 Hkv) hd]
        qk, v = y.split([heads * s.head_dim, s.n_kv * s.head_dim], dim=-1)
        qk = qk.reshape(n, heads, s.head_dim)
        if w.qk_norm is not None:
            qk = rms_norm(qk, w.qk_norm, s.norm_eps, gemma=s.gemma)
        qk = rotary(qk.float(), turns).transpose(0, 1)  # [H + Hkv, n, hd]
        r = cache.rows[i]
        cache.k[r, :, start : start + n] = qk[s.n_head :]
        cache.v[r, :, start : start + n] = v.view(n, s.n_kv, s.head_dim).transpose(0, 1)
        keys, values = cache.k[r, :, : start + n], cache.v[r, :, : start + n]  # [Hkv, start + n, hd]
        out = F.scaled_dot_product_attention(qk[None, : s.n_head].to(keys.dtype), keys[None], values[None],
                                             attn_mask=mask, scale=s.scale,
                                             enable_gqa=s.n_kv != s.n_head)  # [1, H, n, hd]
        return self._linear(out[0].transpose(0, 1).reshape(n, s.n_head * s.head_dim).to(self.activation_dtype), w.wo)

    @staticmethod
    def _linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``h @ weight.T (+ bias)`` in the weights' dtype, returned in ``h``'s."""
        if h.dtype == weight.dtype:
            return F.linear(h, weight, bias)
        return F.linear(h.to(weight.dtype), weight, bias).to(h.dtype)
