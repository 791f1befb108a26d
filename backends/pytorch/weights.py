"""Weights for the torch model, from a Hugging Face folder or a GGUF, under one set of names.

Names (``CanonicalWeights``): ``embed`` [V, d], ``norm`` [d], ``output`` [V, d] (absent when
tied), and per layer ``i``: ``i.attn_norm``, ``i.wq`` [H hd, d], ``i.wk``/``i.wv`` [Hkv hd, d],
``i.wo`` [d, H hd], optional ``i.bq``/``i.bk``/``i.bv``, ``i.q_norm``/``i.k_norm`` [hd],
``i.ffn_norm``, ``i.w_gate``/``i.w_up`` [ffn, d], ``i.w_down`` [d, ffn], and for gemma3
``i.post_attn_norm``/``i.post_ffn_norm``. Norm weights are the factors actually multiplied:
gemma's files store ``w`` for a norm that multiplies by ``1 + w`` (its GGUFs already store
``1 + w``, as llama.cpp multiplies plainly). Rotary dimensions are in the Hugging Face order
(halves, "neox"): llama GGUFs interleave q and k rows pairwise for llama.cpp's rotary kernel, so
those rows are put back.

Only safetensors and GGUF are read (never a pickle). A GGUF is dequantized once, with the
``gguf`` package, and kept as safetensors in the cache (``cached_gguf_weights``): SmolLM2-135M
takes about 5 s to dequantize and 0.2 s to read back.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from backends.core.errors import ModelFileError
from backends.models.paths import cache_dir, keep_recent, mark_used
from backends.pytorch.shape import TorchShape, shape_from_gguf, shape_from_hf

Progress = Callable[[float], bool] | None
CACHE_VERSION = 1  # bump when the cached layout changes
KEPT_DEQUANTIZED = 3  # dequantized models the cache keeps (each 4 bytes a weight), the most recently used

# Hugging Face parameter names -> canonical ones (after the "model." / "language_model." prefix)
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo", "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm", "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down", "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffn_norm",
}
_GGUF_LAYER = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm", "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up", "ffn_down.weight": "w_down", "ffn_norm.weight": "ffn_norm",
    "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_ffn_norm",
}
_GGUF_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "output"}
_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")


def hf_name(name: str, family: str) -> str | None:
    """The canonical name of a Hugging Face parameter, None for one the model does not use."""
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "output"
    for prefix in _HF_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            break
    if rest in ("embed_tokens.weight", "norm.weight"):
        return "embed" if rest.startswith("embed") else "norm"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
    if not m:
        return None
    part = m.group(2)
    if part == "post_attention_layernorm.weight":  # llama's norm before the MLP; gemma's after attention
        return f"{m.group(1)}.{'post_attn_norm' if family == 'gemma3' else 'ffn_norm'}"
    return f"{m.group(1)}.{_HF_LAYER[part]}" if part in _HF_LAYER else None


def gguf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    return f"{m.group(1)}.{_GGUF_LAYER[m.group(2)]}" if m and m.group(2) in _GGUF_LAYER else None


def expected_names(shape: TorchShape) -> set[str]:
    """What a complete set of weights for ``shape`` holds (biases are optional everywhere)."""
    per_layer = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    if shape.qk_norm:
        per_layer += ["q_norm", "k_norm"]
    if shape.gemma:
        per_layer += ["post_attn_norm", "post_ffn_norm"]
    names = {"embed", "norm"} | {f"{i}.{p}" for i in range(shape.n_layer) for p in per_layer}
    return names if shape.tied else names | {"output"}


def check_complete(weights: dict[str, Any], shape: TorchShape, source: str) -> None:
    """Refuse a file that lacks tensors the shape needs, or whose tables do not match it."""
    missing = sorted(expected_names(shape) - weights.keys())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFileError(f"{source} lacks {', '.join(missing[:3])}{more} for a {shape.family} model")
    if tuple(weights["embed"].shape) != (shape.n_vocab, shape.d):
        raise ModelFileError(f"{source}: the embedding table is {tuple(weights['embed'].shape)}, "
                             f"not ({shape.n_vocab}, {shape.d})")


# -- Hugging Face folders --------------------------------------------------------------------------
def read_hf_config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text())
    except OSError:
        raise ModelFileError(f"{folder} has no config.json: not a Hugging Face model folder") from None
    except ValueError as exc:
        raise ModelFileError(f"{folder}/config.json is not valid JSON ({exc})") from None


def load_hf_folder(folder: str | Path, *, progress: Progress = None):
    """(shape, canonical weights as torch tensors) from ``config.json`` and its safetensors files
    (one, or the shards its index names); pickled ``.bin`` weights are refused."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    folder = Path(folder)
    config = read_hf_config(folder)
    if config.get("auto_map"):
        raise ModelFileError(f"{folder.name} needs its own modeling code (auto_map); SpecDeck runs no remote code")
    shape = shape_from_hf(config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        why = f" (only {', '.join(pickles)}: pickled weights, which SpecDeck never loads)" if pickles else ""
        raise ModelFileError(f"{folder.name} has no .safetensors weights{why}")
    weights: dict[str, torch.Tensor] = {}
    for n, file in enumerate(files):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    canon = hf_name(name, shape.family)
                    if canon is not None:
                        weights[canon] = f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file.name} cannot be read as safetensors ({exc})") from None
        if progress is not None and progress((n + 1) / len(files)) is False:
            from backends.core.errors import Cancelled

            raise Cancelled("loading was cancelled")
    if shape.gemma:  # gemma's norms multiply by 1 + w
        for name in [k for k in weights if k.endswith("norm")]:
            weights[name] = weights[name].float() + 1.0
    check_complete(weights, shape, folder.name)
    return shape, weights


# -- GGUF ----------------------------------------------------------------------------------------
def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's pairwise rotary row order -> Hugging Face halves, per head. [n_head hd, ...]"""
    rows = w.shape[0]
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(rows, *w.shape[1:])


def read_gguf(path: str | Path, *, progress: Progress = None) -> tuple[TorchShape, dict[str, np.ndarray]]:
    """(shape, canonical weights as float32 numpy arrays) dequantized from a GGUF.

    The header comes from SpecDeck's own reader (``read_gguf_info``: checked, cached per file) and
    each tensor is read from the file mapped at its offset, not through ``gguf.GGUFReader``, which
    parses every token string first (Gemma-3's 262k: 9.8 s of a first load here; 0.12 s)."""
    from backends.models.gguf_info import read_gguf_info
    from backends.models.weights import gguf_array

    path = Path(path)
    info = read_gguf_info(path)  # a bad file: ModelFileError, saying why
    tensors = {t.name: t for t in info.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelFileError(f"{path.name} has no token embeddings: not a language model GGUF")
    n_vocab = int(tensors["token_embd.weight"].shape[-1])
    fields = {"general.architecture": info.architecture, **info.metadata}
    shape = shape_from_gguf(fields, has_output="output.weight" in tensors, n_vocab=n_vocab)
    weights: dict[str, np.ndarray] = {}
    for n, (name, t) in enumerate(tensors.items()):
        canon = gguf_name(name)
        if canon is None:
            continue
        try:
            w = gguf_array(path, t)
        except (NotImplementedError, ValueError) as exc:
            raise ModelFileError(f"{path.name}: {name} is stored as {t.ggml_type}, which cannot be "
                                 f"dequantized here ({exc})") from None
        if shape.family == "llama" and canon.endswith((".wq", ".bq")):
            w = _unpermute(w, shape.n_head)
        elif shape.family == "llama" and canon.endswith((".wk", ".bk")):
            w = _unpermute(w, shape.n_kv)
        weights[canon] = np.array(w, dtype=np.float32)  # a copy: F32 tensors are views of the read-only map
        if progress is not None and n % 16 == 0 and progress(n / len(tensors)) is False:
            from backends.core.errors import Cancelled

            raise Cancelled("loading was cancelled")
    check_complete(weights, shape, path.name)
    return shape, weights


def _cache_file(path: Path) -> Path:
    stat = path.stat()
    key = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, CACHE_VERSION])
    return cache_dir() / "torch-weights" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".safetensors")


def cached_gguf_weights(path: str | Path, *, progress: Progress = None):
    """(shape, canonical weights as torch float32 tensors) of a GGUF: dequantized once, then read
    back from the cache (safetensors, with the shape in its metadata)."""
    import torch
    from safetensors.torch import load_file, save_file
    from dataclasses import asdict

    path = Path(path)
    file = _cache_file(path)
    if file.exists():
        try:
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                meta = json.loads(f.metadata()["shape"])
            meta["windows"] = tuple(meta["windows"])
            weights = load_file(str(file))
            mark_used(file)
            return TorchShape(**meta), weights
        except Exception:  # a damaged cache file: made again below
            file.unlink(missing_ok=True)
    shape, arrays = read_gguf(path, progress=progress)
    weights = {k: torch.from_numpy(v) for k, v in arrays.items()}
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".part")
    save_file(weights, str(tmp), metadata={"shape": json.dumps(asdict(shape))})
    tmp.replace(file)
    keep_recent(file.parent, KEPT_DEQUANTIZED, "*.safetensors", spare=file)
    return shape, weights


def load_weights(source: str | Path, *, progress: Progress = None):
    """(shape, canonical torch weights) of a GGUF file or a Hugging Face folder."""
    source = Path(source).expanduser()
    if source.is_dir():
        return load_hf_folder(source, progress=progress)
    if not source.exists():
        raise ModelFileError(f"{source} does not exist")
    return cached_gguf_weights(source, progress=progress)
