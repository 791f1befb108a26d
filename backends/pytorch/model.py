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
    """RMS norm in float32; llama casts back before the weight, gemma after (as their references)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * weight.float()).to(x.dtype)
    return weight * h.to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves ("neox" order): x [heads, n, hd], cos/sin [n, hd / 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Transformer:
    """The forward pass over canonical weights (``backends.pytorch.weights``); holds no cache."""

    def __init__(self, shape: TorchShape, weights: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", attention_dtype: torch.dtype | None = None) -> None:
        """``attention_dtype``: the KV cache's and attention's (``dtype`` by default). A CPU without
        native bfloat16 attends in float32 much faster than in bfloat16 (``loader.attention_dtype``)."""
        self.shape = shape
        self.dtype = dtype
        self.attention_dtype = attention_dtype or dtype
        self.device = torch.device(device)
        norm_dtype = torch.float32 if shape.gemma else dtype  # gemma's norms multiply in float32
        self.w = {k: v.to(device=self.device, dtype=norm_dtype if k.endswith("norm") else dtype).contiguous()
                  for k, v in weights.items()}
        self.w.setdefault("output", self.w["embed"])
        for i in range(shape.n_layer):
            self._fuse(i)
        self._inv_freq = {theta: self._frequencies(theta) for theta in {shape.theta(i) for i in range(shape.n_layer)}}

    def _fuse(self, i: int) -> None:
        """Stack layer ``i``'s matrices that read the same input (q, k and v; gate and up) into one,
        so each takes one matrix product a forward instead of two or three (a bias missing beside
        present ones becomes zeros)."""
        w = self.w
        mats = [w.pop(f"{i}.w{x}") for x in "qkv"]
        biases = [w.pop(f"{i}.b{x}", None) for x in "qkv"]
        w[f"{i}.wqkv"] = torch.cat(mats)
        if any(b is not None for b in biases):
            w[f"{i}.bqkv"] = torch.cat([torch.zeros(len(m), dtype=m.dtype, device=m.device) if b is None else b
                                        for m, b in zip(mats, biases)])
        w[f"{i}.w_gate_up"] = torch.cat([w.pop(f"{i}.w_gate"), w.pop(f"{i}.w_up")])

    def _frequencies(self, theta: float) -> torch.Tensor:
        hd = self.shape.head_dim
        return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=self.device) / hd))  # [hd / 2]

    def new_cache(self, n_ctx: int, layers: Sequence[int] | None = None) -> KVCache:
        return KVCache.empty(self.shape, n_ctx, dtype=self.attention_dtype, device=self.device, layers=layers)

    @property
    def layer_share(self) -> float:
        """The blocks' share of a one-token forward's weights (the rest: embedding row, output layer);
        what skipping a layer saves is about this over ``n_layer``."""
        body = sum(v.numel() for k, v in self.w.items() if k[0].isdigit())
        return body / (body + self.w["output"].numel())

    def _angles(self, layer: int, positions: torch.Tensor, known: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos and sin [n, hd / 2] for a layer's frequencies, computed once per forward for
        all layers that share them (``known``)."""
        s = self.shape
        key = (s.theta(layer), s.rope_linear if not s.window(layer) else 1.0)
        if key not in known:
            freqs = positions.float()[:, None] / key[1] * self._inv_freq[key[0]][None, :]  # [n, hd / 2]
            known[key] = freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)
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
        x = F.embedding(tokens, w["embed"])  # [n, d]
        if s.gemma:
            x = x * torch.tensor(s.embed_scale, dtype=self.dtype)
        taken: dict[int, torch.Tensor] = {}
        masks: dict[int, torch.Tensor] = {}
        angles: dict = {}
        for i in range(s.n_layer) if layers is None else layers:
            if i in states:
                taken[i] = x.float()
            window = s.window(i)
            if window not in masks:
                masks[window] = mask if not window else mask & (positions[:, None] - keys[None, :] < window)
            x = self._block(i, x, self._angles(i, positions, angles), cache, start=start, mask=masks[window])
        x = rms_norm(x, w["norm"], s.norm_eps, gemma=s.gemma)
        if FINAL_STATE in states:
            taken[FINAL_STATE] = x.float()
        out = None
        if logits_rows is None or len(logits_rows):
            rows = x if logits_rows is None else x[logits_rows]
            out = (rows @ w["output"].T).float()  # [rows, vocab]
        hidden = torch.cat([taken[il] for il in states], dim=1) if states else None
        return out, hidden

    def _block(self, i: int, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor], cache: KVCache, *,
               start: int, mask: torch.Tensor) -> torch.Tensor:
        s, w = self.shape, self.w
        h = rms_norm(x, w[f"{i}.attn_norm"], s.norm_eps, gemma=s.gemma)
        h = self._attention(i, h, angles, cache, start=start, mask=mask)
        if s.gemma:
            h = rms_norm(h, w[f"{i}.post_attn_norm"], s.norm_eps, gemma=True)
        x = x + h
        h = rms_norm(x, w[f"{i}.ffn_norm"], s.norm_eps, gemma=s.gemma)
        gate, up = (h @ w[f"{i}.w_gate_up"].T).chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if s.gemma else F.silu(gate)
        h = (gate * up) @ w[f"{i}.w_down"].T
        if s.gemma:
            h = rms_norm(h, w[f"{i}.post_ffn_norm"], s.norm_eps, gemma=True)
        return x + h

    def _project(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [H, n, hd], k and v [Hkv, n, hd] of ``h`` [n, d], with the biases and per-head norms the
        file has."""
        s, w = self.shape, self.w
        y = h @ w[f"{i}.wqkv"].T  # [n, (H + 2 Hkv) hd]
        bias = w.get(f"{i}.bqkv")
        if bias is not None:
            y = y + bias
        n = len(h)
        q, k, v = y.split([s.n_head * s.head_dim, s.n_kv * s.head_dim, s.n_kv * s.head_dim], dim=-1)
        q, k, v = q.view(n, s.n_head, s.head_dim), k.view(n, s.n_kv, s.head_dim), v.view(n, s.n_kv, s.head_dim)
        if f"{i}.q_norm" in w:
            q = rms_norm(q, w[f"{i}.q_norm"], s.norm_eps, gemma=s.gemma)
        if f"{i}.k_norm" in w:
            k = rms_norm(k, w[f"{i}.k_norm"], s.norm_eps, gemma=s.gemma)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def _attention(self, i: int, h: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor], cache: KVCache, *,
                   start: int, mask: torch.Tensor) -> torch.Tensor:
        s = self.shape
        n = len(h)
        q, k, v = self._project(i, h)
        q, k = rotary(q, *angles), rotary(k, *angles)  # [H, n, hd], [Hkv, n, hd]
        r = cache.rows[i]
        cache.k[r, :, start : start + n] = k
        cache.v[r, :, start : start + n] = v
        keys, values = cache.k[r, :, : start + n], cache.v[r, :, : start + n]  # [Hkv, start + n, hd]
        out = F.scaled_dot_product_attention(q[None].to(keys.dtype), keys[None], values[None],
                                             attn_mask=mask[None, None], scale=s.scale,
                                             enable_gqa=s.n_kv != s.n_head)  # [1, H, n, hd]
        return out[0].transpose(0, 1).reshape(n, s.n_head * s.head_dim).to(self.dtype) @ self.w[f"{i}.wo"].T
