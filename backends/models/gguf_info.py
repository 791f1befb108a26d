"""GGUF metadata without loading the model, read with the ``gguf`` package.

``GGUFReader`` builds a Python object per array element, so a 262k-token vocabulary takes about
10 s to parse on a small CPU. The summary SpecDeck needs is therefore cached as JSON in the user
cache directory, keyed by the file's absolute path, size and modification time: the second read
of a model is instant, and a changed file is parsed again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from backends.core.errors import ModelFileError
from backends.models.paths import cache_dir

GGUF_MAGIC = b"GGUF"
_CACHE_VERSION = 3


@dataclass(frozen=True)
class VocabInfo:
    """What decides whether two models can share tokens (see ``backends.models.compat``)."""

    kind: str  # tokenizer.ggml.model: gpt2 (BPE), llama (SentencePiece), ...
    n_vocab: int
    bos: int | None
    eos: int | None
    add_bos: bool
    add_eos: bool
    tokens: tuple[str, ...]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFInfo:
    """A GGUF file's header: architecture, sizes, tokenizer and the exact tensor table."""

    path: str
    file_size: int
    name: str
    architecture: str
    file_type: str
    n_params: int
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_head_kv: int  # the largest over layers
    key_length: int | None
    value_length: int | None
    sliding_window: int | None
    chat_template: str | None
    vocab: VocabInfo
    tensors: tuple[TensorInfo, ...]
    n_ff: int | None = None
    n_head_kv_layers: tuple[int, ...] = ()  # per layer, when the file gives a list (else empty)
    swa_layers: tuple[bool, ...] = ()  # per layer, when the file gives sliding_window_pattern

    @property
    def weights_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


def check_gguf_file(path: str | os.PathLike) -> Path:
    """Raise ``ModelFileError`` with a readable reason unless ``path`` looks like a GGUF file."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelFileError(f"{p} is a folder; pick a .gguf file inside it")
    with p.open("rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ModelFileError(f"{p} is not a GGUF model (it starts with {head!r}, a GGUF file starts with b'GGUF')")
    return p


def read_gguf_info(path: str | os.PathLike, *, use_cache: bool = True) -> GGUFInfo:
    """The metadata summary of a GGUF file; raises ``ModelFileError`` for bad files."""
    p = check_gguf_file(path).resolve()
    stat = p.stat()
    cache_file = _cache_path(p, stat.st_size, stat.st_mtime_ns)
    if use_cache and cache_file.exists():
        try:
            return _from_json(json.loads(cache_file.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # unreadable cache entry: parse the file again
    info = _parse(p, stat.st_size)
    if use_cache:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(info)))
        os.replace(tmp, cache_file)
    return info


def _cache_path(path: Path, size: int, mtime_ns: int) -> Path:
    key = hashlib.sha256(f"{_CACHE_VERSION}|{path}|{size}|{mtime_ns}".encode()).hexdigest()[:24]
    return cache_dir() / "gguf-info" / f"{key}.json"


def _parse(path: Path, file_size: int) -> GGUFInfo:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OSError, KeyError) as exc:
        raise ModelFileError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    fields = {name: _field_value(field) for name, field in reader.fields.items() if not _is_big_array(name)}
    tensors = tuple(
        TensorInfo(
            name=t.name,
            ggml_type=t.tensor_type.name,
            shape=tuple(int(x) for x in t.shape),
            n_elements=int(t.n_elements),
            n_bytes=int(t.n_bytes),
        )
        for t in reader.tensors
    )
    data_end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if data_end > file_size:
        raise ModelFileError(
            f"{path} is truncated: its tensors need {data_end:,} bytes but the file has {file_size:,}"
        )
    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    tokens = tuple(tokens_field.contents()) if tokens_field is not None else ()
    return _summarize(path, file_size, fields, tensors, tokens)


def _is_big_array(name: str) -> bool:
    return name.startswith("tokenizer.ggml.") and name.split(".")[-1] in {"tokens", "scores", "token_type", "merges"}


def _field_value(field) -> object:
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


def _summarize(path: Path, file_size: int, f: dict, tensors: tuple[TensorInfo, ...], tokens: tuple[str, ...]) -> GGUFInfo:
    arch = str(f.get("general.architecture") or "unknown")

    def arch_int(key: str) -> int | None:
        value = f.get(f"{arch}.{key}")
        if isinstance(value, list):  # per-layer values (e.g. head_count_kv): report the largest
            value = max(value) if value else None
        return int(value) if value is not None else None

    vocab = VocabInfo(
        kind=str(f.get("tokenizer.ggml.model") or "unknown"),
        n_vocab=int(f.get(f"{arch}.vocab_size") or len(tokens)),
        bos=_opt_int(f.get("tokenizer.ggml.bos_token_id")),
        eos=_opt_int(f.get("tokenizer.ggml.eos_token_id")),
        add_bos=bool(f.get("tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(f.get("tokenizer.ggml.add_eos_token", False)),
        tokens=tokens,
    )
    n_head = arch_int("attention.head_count") or 0
    return GGUFInfo(
        path=str(path),
        file_size=file_size,
        name=str(f.get("general.name") or path.stem),
        architecture=arch,
        file_type=_file_type_name(f.get("general.file_type")),
        n_params=sum(t.n_elements for t in tensors),
        n_layer=arch_int("block_count") or 0,
        n_ctx_train=arch_int("context_length") or 0,
        n_embd=arch_int("embedding_length") or 0,
        n_head=n_head,
        n_head_kv=arch_int("attention.head_count_kv") or n_head,
        key_length=arch_int("attention.key_length"),
        value_length=arch_int("attention.value_length"),
        sliding_window=arch_int("attention.sliding_window"),
        n_ff=arch_int("feed_forward_length"),
        n_head_kv_layers=_int_list(f.get(f"{arch}.attention.head_count_kv")),
        swa_layers=tuple(bool(x) for x in _int_list(f.get(f"{arch}.attention.sliding_window_pattern"))),
        chat_template=f.get("tokenizer.chat_template"),
        vocab=vocab,
        tensors=tensors,
    )


def _int_list(value: object) -> tuple[int, ...]:
    return tuple(int(x) for x in value) if isinstance(value, list) else ()


def _opt_int(value: object) -> int | None:
    return None if value is None else int(value)


def _file_type_name(value: object) -> str:
    from gguf import LlamaFileType

    if value is None:
        return "unknown"
    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"type {value}"


def _from_json(d: dict) -> GGUFInfo:
    vocab = d["vocab"]
    vocab = VocabInfo(**{**vocab, "tokens": tuple(vocab["tokens"])})
    tensors = tuple(TensorInfo(**{**t, "shape": tuple(t["shape"])}) for t in d["tensors"])
    lists = {k: tuple(d[k]) for k in ("n_head_kv_layers", "swa_layers")}
    return GGUFInfo(**{**d, **lists, "vocab": vocab, "tensors": tensors})
