"""A model's memory shape, from a GGUF tensor table or a Hugging Face folder, without loading it.

The fit estimator needs the same few numbers for both formats: bytes per transformer block (the
unit llama.cpp offloads), the token embedding and output projection, and what sizes the KV cache
(layers, KV heads per layer, key/value lengths, sliding-window layers). Everything comes from exact
tensor sizes in the file's header, so the weights term is exact, not a parameter-count guess.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from backends.core.errors import ModelFileError
from backends.models.gguf_info import GGUFInfo, read_gguf_info

# Sliding-window layouts llama.cpp hard-codes per architecture (its set_swa_pattern) when the file
# has no per-layer sliding_window_pattern: with pattern p, layer i uses the window iff i % p < p - 1.
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "llama4": 4, "gpt-oss": 2}

_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.")
_HF_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_HF_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                   "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class ModelShape:
    name: str
    path: str
    format: str  # "gguf" (llama.cpp) or "safetensors" (PyTorch)
    architecture: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_vocab: int
    n_ctx_train: int
    head_kv: tuple[int, ...]  # KV heads per layer
    key_length: int
    value_length: int
    swa_window: int | None
    swa: tuple[bool, ...]  # per layer: uses the sliding window
    block_bytes: tuple[int, ...]  # weights per transformer block
    embd_bytes: int  # token embedding table (llama.cpp keeps it on the CPU)
    output_bytes: int  # output projection; a copy of the embedding when tied
    other_bytes: int  # final norm and friends, placed with the output layer
    tied_output: bool
    weight_dtype_bytes: int = 2  # safetensors only: the dtype the KV cache and activations use
    kv_dtype_bytes: int = 0  # safetensors only: the KV cache's, where it is not the weights' (0)
    quantized: bool = False  # most block weights in a quantized type (dequantizing costs CPU time)

    @property
    def weights_bytes(self) -> int:
        return sum(self.block_bytes) + self.embd_bytes + self.other_bytes + (0 if self.tied_output else self.output_bytes)

    @property
    def total_layers(self) -> int:
        """Offloadable layers as llama.cpp counts them: every block plus the output layer."""
        return self.n_layer + 1


def load_shape(path: str | Path) -> ModelShape:
    """A .gguf file or a Hugging Face model folder (config.json + *.safetensors)."""
    p = Path(path)
    if p.is_dir():
        return shape_from_hf(p)
    if not p.exists():
        raise ModelFileError(f"{p} does not exist")
    if p.suffix == ".safetensors" or p.name == "config.json":
        return shape_from_hf(p.parent)
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{p} is neither a GGUF file nor a Hugging Face model folder (config.json + .safetensors)")
    return shape_from_gguf(read_gguf_info(p))


def shape_from_gguf(info: GGUFInfo) -> ModelShape:
    blocks = [0] * info.n_layer
    embd = output = other = float_bytes = 0
    for t in info.tensors:
        m = _GGUF_BLOCK.match(t.name)
        if m and int(m.group(1)) < info.n_layer:
            blocks[int(m.group(1))] += t.n_bytes
            float_bytes += t.n_bytes if t.ggml_type in ("F32", "F16", "BF16") else 0
        elif t.name == "token_embd.weight":
            embd = t.n_bytes
        elif t.name == "output.weight":
            output = t.n_bytes
        else:
            other += t.n_bytes
    _check_complete(info.path, info.n_layer, blocks, embd)
    head_dim = info.n_embd // info.n_head if info.n_head else 0
    return ModelShape(
        name=info.name,
        path=info.path,
        format="gguf",
        architecture=info.architecture,
        n_layer=info.n_layer,
        n_embd=info.n_embd,
        n_ff=info.n_ff or 4 * info.n_embd,
        n_head=info.n_head,
        n_vocab=info.vocab.n_vocab,
        n_ctx_train=info.n_ctx_train,
        head_kv=_per_layer(info.n_head_kv_layers, info.n_head_kv, info.n_layer),
        key_length=info.key_length or head_dim,
        value_length=info.value_length or head_dim,
        swa_window=info.sliding_window or None,
        swa=_swa_layers(info.architecture, info.n_layer, info.swa_layers, info.sliding_window),
        block_bytes=tuple(blocks),
        embd_bytes=embd,
        output_bytes=output or embd,
        other_bytes=other,
        tied_output=not output,
        quantized=float_bytes < sum(blocks) / 2,
    )


def shape_from_hf(folder: Path) -> ModelShape:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelFileError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{config_file} is not valid JSON: {exc}") from exc
    config = config.get("text_config", config)  # multimodal configs nest the language model
    n_layer = _cfg_int(config, config_file, "num_hidden_layers")
    n_embd = _cfg_int(config, config_file, "hidden_size")
    n_head = _cfg_int(config, config_file, "num_attention_heads")
    n_vocab = _cfg_int(config, config_file, "vocab_size")
    tensors = _safetensors_sizes(folder)
    blocks = [0] * n_layer
    embd = output = other = 0
    for name, nbytes in tensors.items():
        m = _HF_BLOCK.search(name)
        if m and int(m.group(1)) < n_layer:
            blocks[int(m.group(1))] += nbytes
        elif name.endswith("embed_tokens.weight"):
            embd = nbytes
        elif name.endswith("lm_head.weight"):
            output = nbytes
        else:
            other += nbytes
    _check_complete(str(folder), n_layer, blocks, embd)
    head_dim = int(config.get("head_dim") or n_embd // n_head)
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    layer_types = config.get("layer_types") or []
    swa = tuple(t == "sliding_attention" for t in layer_types) if len(layer_types) == n_layer else ()
    arch = str(config.get("model_type") or "unknown")
    return ModelShape(
        name=str(config.get("_name_or_path") or folder.name),
        path=str(folder),
        format="safetensors",
        architecture=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=int(config.get("intermediate_size") or 4 * n_embd),
        n_head=n_head,
        n_vocab=n_vocab,
        n_ctx_train=int(config.get("max_position_embeddings") or 0),
        head_kv=(int(config.get("num_key_value_heads") or n_head),) * n_layer,
        key_length=head_dim,
        value_length=head_dim,
        swa_window=int(window) if window else None,
        swa=swa or _swa_layers(arch, n_layer, (), window),
        block_bytes=tuple(blocks),
        embd_bytes=embd,
        output_bytes=output or embd,
        other_bytes=other,
        tied_output=not output,
        weight_dtype_bytes=_HF_DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "").upper()
                                               .replace("FLOAT", "F").replace("BFLOAT", "BF"), 2),
    )


def _safetensors_sizes(folder: Path) -> dict[str, int]:
    """Tensor name -> bytes, from the safetensors headers only (no weights are read)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder} has no .safetensors files (SpecDeck never loads pickled .bin weights)")
    sizes: dict[str, int] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    n = 1
                    for dim in sl.get_shape():
                        n *= int(dim)
                    sizes[name] = n * _HF_DTYPE_BYTES.get(sl.get_dtype(), 2)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelFileError(f"{file} is not a readable safetensors file: {exc}") from exc
    return sizes


def _check_complete(where: str, n_layer: int, blocks: list[int], embd: int) -> None:
    missing = [i for i, b in enumerate(blocks) if b == 0]
    if n_layer <= 0:
        raise ModelFileError(f"{where} does not say how many layers it has")
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ModelFileError(f"{where} is missing the tensors of layer(s) {shown}")
    if not embd:
        raise ModelFileError(f"{where} has no token embedding tensor")


def _per_layer(values: tuple[int, ...], default: int, n_layer: int) -> tuple[int, ...]:
    return tuple(values) if len(values) == n_layer else (default,) * n_layer


def _swa_layers(arch: str, n_layer: int, explicit: tuple[bool, ...], window: int | None) -> tuple[bool, ...]:
    if len(explicit) == n_layer:
        return tuple(explicit)
    pattern = SWA_PATTERNS.get(arch)
    if not window or not pattern:
        return (False,) * n_layer
    return tuple(i % pattern < pattern - 1 for i in range(n_layer))


def _cfg_int(config: dict, where: Path, key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ModelFileError(f"{where} has no valid '{key}'")
    return value


def as_torch(shape: ModelShape, dtype_bytes: int, kv_bytes: int = 0) -> ModelShape:
    """The model as SpecDeck's PyTorch backend holds it: every weight in one dtype of
    ``dtype_bytes`` (a GGUF is dequantized), the KV cache in ``kv_bytes`` (0: the weights' dtype;
    float32 on a CPU), a tied output layer sharing the embedding table."""
    if shape.format == "safetensors" and shape.weight_dtype_bytes == dtype_bytes:
        return replace(shape, kv_dtype_bytes=kv_bytes)
    d = shape.n_embd
    attention = [d * shape.n_head * shape.key_length + d * kv * (shape.key_length + shape.value_length)
                 + shape.n_head * shape.value_length * d for kv in shape.head_kv]
    blocks = tuple(dtype_bytes * (a + 3 * d * shape.n_ff + 4 * d) for a in attention)
    table = dtype_bytes * shape.n_vocab * d
    return replace(shape, format="safetensors", block_bytes=blocks, embd_bytes=table, output_bytes=table,
                   other_bytes=dtype_bytes * d, weight_dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_bytes,
                   quantized=False)

