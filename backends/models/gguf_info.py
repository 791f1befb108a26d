"""GGUF metadata without loading the model: a header reader that checks every length it reads.

A GGUF file is a header (magic, version, tensor count, key count), the key-value metadata, one
record per tensor (name, shape, ggml type, data offset) and then the aligned tensor data. The
header is untrusted input: one flipped byte turns a string length or an array count into 2**64.
So the reader here walks it itself, using the ``gguf`` package only for its tables of types, and
checks every count and length against the bytes the file has left *before* it reads or
allocates anything. Each check says what it found where, in one line::

    model.gguf: corrupt GGUF header: key 'general.name' claims a string of 4,294,967,295 bytes
    at byte 138, but only 98,362,294 bytes are left in the file

It makes the checks llama.cpp's own reader makes (``ggml/src/gguf.cpp``): versions 2 and 3, no
empty or duplicate keys, no nested arrays, tensor names under 64 bytes, at most 4 dimensions,
known ggml types, rows a whole number of blocks, each tensor's data right after the previous
one's. A file it accepts is one llama.cpp can at least parse; which architectures llama.cpp
implements only llama.cpp knows (``specdeck models info`` asks it).

Walking the metadata by hand is also fast: ``gguf.GGUFReader`` builds a numpy view per array
element (Gemma-3-270M's 262k-token vocabulary: 28 s with it, 0.6 s here, on a busy 2-core VM;
the bundled SmolLM2: 2.2 s and 0.4 s). The summary SpecDeck needs is still cached as JSON in the user cache directory, keyed by the file's absolute path, size and
modification time: the second read of a model is instant, and a changed file is parsed again.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from backends.core.errors import ModelFileError
from backends.models.paths import cache_dir, keep_recent, mark_used, write_atomic

GGUF_MAGIC = b"GGUF"
_CACHE_VERSION = 7  # 5: n_layer_nextn; 6: tensor data offsets; 7: the architecture's own keys
_KEPT_INFOS = 64  # cached summaries (up to 1 MB each: the token texts), the most recently used


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
    shape: tuple[int, ...]  # ggml order: shape[0] is the length of a row
    n_elements: int
    n_bytes: int
    offset: int = 0  # where its data starts in the file (bytes): rows can be read without another parser


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
    n_layer_nextn: int = 0  # next-n (MTP) blocks among the n_layer (DeepSeek-V3, GLM-4.5: the last ones)
    # the keys "<architecture>.*" as the file holds them (rope, norms, windows): what a runtime
    # other than llama.cpp needs to rebuild the model (``backends.pytorch.shape.shape_from_gguf``)
    metadata: dict[str, object] = field(default_factory=dict)

    @property
    def weights_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


def check_gguf_file(path: str | os.PathLike) -> Path:
    """Raise ``ModelFileError`` with a readable reason unless ``path`` looks like a GGUF file."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if p.is_dir():
        if (p / "config.json").is_file():
            raise ModelFileError(f"{p} is a Hugging Face model folder: the PyTorch backend runs it (--backend torch)")
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
            info = _from_json(json.loads(cache_file.read_text()))
            mark_used(cache_file)
            return info
        except (OSError, ValueError, KeyError, TypeError):
            pass  # an unreadable entry, or one another thread's pruning just took: parse the file again
    info = _parse(p, stat.st_size)
    if use_cache:
        try:
            write_atomic(cache_file, json.dumps(asdict(info)))
        except OSError:
            pass  # an unwritable cache only means parsing the header again next time
        keep_recent(cache_file.parent, _KEPT_INFOS, "*.json", spare=cache_file)
    return info


def _cache_path(path: Path, size: int, mtime_ns: int) -> Path:
    key = hashlib.sha256(f"{_CACHE_VERSION}|{path}|{size}|{mtime_ns}".encode()).hexdigest()[:24]
    return cache_dir() / "gguf-info" / f"{key}.json"


def _parse(path: Path, file_size: int) -> GGUFInfo:
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            fields, tensors = _Header(buf, path).read()
    except OSError as exc:
        raise ModelFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return _summarize(path, file_size, _Fields(path, fields), tensors)


# -- the header ----------------------------------------------------------------------------------
# GGUF value types (gguf.GGUFValueType): twelve fixed-size scalars, a string, an array.
_SCALARS = {0: struct.Struct("<B"), 1: struct.Struct("<b"), 2: struct.Struct("<H"), 3: struct.Struct("<h"),
            4: struct.Struct("<I"), 5: struct.Struct("<i"), 6: struct.Struct("<f"), 7: struct.Struct("<?"),
            10: struct.Struct("<Q"), 11: struct.Struct("<q"), 12: struct.Struct("<d")}
_UINT32, _STRING, _ARRAY = 4, 8, 9
_U32, _U64 = _SCALARS[4], _SCALARS[10]
_MIN_KEY_BYTES = 8 + 1 + 4 + 1  # length, one character, value type, a one-byte value
_MIN_TENSOR_BYTES = 8 + 1 + 4 + 4 + 8  # name length, one character, dimension count, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NAME = 64  # GGML_MAX_NAME, the terminating NUL included
_INT64_MAX = 2**63 - 1
_DEFAULT_ALIGNMENT = 32
_KEPT_ITEMS = 1 << 16  # longer arrays are stepped over, not turned into lists (tokens excepted)
_SKIPPED = {"tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}  # large, unused
_TOKENS = "tokenizer.ggml.tokens"


class _Header:
    """A cursor over a GGUF file's header that trusts no number it reads.

    Every count and length is checked against the bytes left before it is used, so a corrupt
    header costs at most one pass over the file, never an allocation it describes. Failures are
    ``ModelFileError`` naming what was read and at which byte.
    """

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def read(self) -> tuple[dict[str, object], tuple[TensorInfo, ...]]:
        self.take(4, "the magic")  # check_gguf_file saw b"GGUF"
        self._version(self.u32("the GGUF version"))
        n_tensors = self.count("the tensor count", each=_MIN_TENSOR_BYTES)
        n_keys = self.count("the metadata key count", each=_MIN_KEY_BYTES)
        fields, types = self._fields(n_keys)
        return fields, self._tensors(n_tensors, self._alignment(fields, types))

    # -- primitives ------------------------------------------------------------------------------
    def corrupt(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: corrupt GGUF header: {what}")

    def take(self, n: int, what: str) -> int:
        """Claim ``n`` bytes at the cursor and return where they start."""
        start = self.pos
        if n > self.size - start:
            raise ModelFileError(f"{self.path}: truncated or corrupt GGUF header: {what} at byte {start:,} "
                                 f"needs {n:,} bytes, but the file ends at byte {self.size:,}")
        self.pos = start + n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, what))[0]

    def count(self, what: str, *, each: int) -> int:
        """A count of things that follow, each at least ``each`` bytes: no more than the file holds."""
        n = self.u64(what)
        left = self.size - self.pos
        if n > left // each:
            raise self.corrupt(f"{what} at byte {self.pos - 8:,} is {n:,}, more than the {left:,} bytes left "
                               f"in the file could hold at {each} bytes or more each (a corrupt count, or a file cut short)")
        return n

    def raw_string(self, what: str) -> bytes:
        length = self.u64(f"the length of {what}")
        left = self.size - self.pos
        if length > left:
            raise self.corrupt(f"{what} claims a string of {length:,} bytes at byte {self.pos:,}, "
                               f"but only {left:,} bytes are left in the file")
        start = self.pos
        self.pos += length
        return self.buf[start:self.pos]

    def name(self, what: str) -> str:
        """A key or tensor name: text llama.cpp matches exactly, so it must be valid UTF-8."""
        start = self.pos
        raw = self.raw_string(what)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.corrupt(f"{what} at byte {start:,} is not UTF-8 text: {_shown(raw)}") from None
        if "\0" in text:  # llama.cpp's C strings would end there: two names could become one
            raise self.corrupt(f"{what} at byte {start:,} contains a NUL byte: {_shown(text)}")
        return text

    # -- metadata --------------------------------------------------------------------------------
    def _version(self, version: int) -> None:
        if version in (2, 3):
            return
        if version == 1:
            raise self.corrupt("it is GGUF version 1, which llama.cpp no longer reads; convert the model again")
        if version and version & 0xFFFF == 0:
            raise self.corrupt(f"version field {version:#010x} reads as big-endian: the file was written for "
                               "machines of the other byte order")
        raise self.corrupt(f"GGUF version {version}; llama.cpp reads versions 2 and 3")

    def _fields(self, n_keys: int) -> tuple[dict[str, object], dict[str, int]]:
        fields: dict[str, object] = {}
        types: dict[str, int] = {}
        for i in range(n_keys):
            start = self.pos
            key = self.name(f"the name of key {i:,}")
            if not key:
                raise self.corrupt(f"the name of key {i:,} at byte {start:,} is empty")
            if key in fields:
                raise self.corrupt(f"key {_shown(key)} appears twice (again at byte {start:,})")
            types[key] = self.u32(f"the value type of key {_shown(key)}")
            limit = 0 if key in _SKIPPED else None if key == _TOKENS else _KEPT_ITEMS
            fields[key] = self._value(types[key], f"key {_shown(key)}", limit=limit)
        return fields, types

    def _value(self, vtype: int, what: str, *, limit: int | None) -> object:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return scalar.unpack_from(self.buf, self.take(scalar.size, f"the value of {what}"))[0]
        if vtype == _STRING:
            return self.raw_string(what).decode("utf-8", errors="replace")
        if vtype == _ARRAY:
            return self._array(what, limit=limit)
        raise self.corrupt(f"{what} has value type {vtype}, which GGUF does not define (0 to 12)")

    def _array(self, what: str, *, limit: int | None) -> list | None:
        """The items as a list, or None when there are more than ``limit`` (they are stepped over)."""
        item_type = self.u32(f"the item type of {what}")
        scalar = _SCALARS.get(item_type)
        if item_type == _ARRAY:
            raise self.corrupt(f"{what} is an array of arrays, which llama.cpp does not read")
        if scalar is None and item_type != _STRING:
            raise self.corrupt(f"{what} is an array of value type {item_type}, which GGUF does not define (0 to 12)")
        n = self.count(f"the item count of {what}", each=scalar.size if scalar else 8)
        keep = limit is None or n <= limit
        if scalar is None:
            return self._strings(n, what, keep=keep)
        start = self.take(n * scalar.size, f"the items of {what}")
        return list(struct.unpack_from(f"<{n}{scalar.format[-1]}", self.buf, start)) if keep else None

    def _strings(self, n: int, what: str, *, keep: bool) -> list[str] | None:
        """``n`` strings, each length checked (a hot loop: a vocabulary has 50k to 260k of them)."""
        items: list[str] | None = [] if keep else None
        buf, pos, size = self.buf, self.pos, self.size
        for i in range(n):
            if size - pos < 8:
                self.pos = pos
                self.take(8, f"the length of item {i:,} of {what}")
            (length,) = _U64.unpack_from(buf, pos)
            pos += 8
            if length > size - pos:
                self.pos = pos
                raise self.corrupt(f"item {i:,} of {what} claims a string of {length:,} bytes at byte {pos:,}, "
                                   f"but only {size - pos:,} bytes are left in the file")
            if items is not None:
                items.append(buf[pos:pos + length].decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return items

    def _alignment(self, fields: dict[str, object], types: dict[str, int]) -> int:
        if "general.alignment" not in fields:
            return _DEFAULT_ALIGNMENT
        alignment = fields["general.alignment"]
        if types["general.alignment"] != _UINT32:
            raise self.corrupt(f"general.alignment has value type {types['general.alignment']}; it must be uint32 (4)")
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self.corrupt(f"general.alignment is {alignment}, not a power of two")
        return alignment

    # -- tensors ---------------------------------------------------------------------------------
    def _tensors(self, n: int, alignment: int) -> tuple[TensorInfo, ...]:
        """The tensor table, each tensor's data checked to follow the previous one's (as llama.cpp
        requires) and to lie inside the file. Checked record by record: a count that runs on into
        the weights stops at the first record that cannot be a tensor."""
        tensors: list[TensorInfo] = []
        offsets: list[int] = []  # of each tensor's data, relative to the data section
        names: set[str] = set()
        expected = 0  # where the next tensor's data must start, relative to the data section
        for index in range(n):
            info, offset = self._tensor(index)
            if info.name in names:
                raise self.corrupt(f"tensor {_shown(info.name)} appears twice in the tensor table (record {index:,})")
            if offset != expected:
                raise self.corrupt(f"the data of tensor {_shown(info.name)} is at offset {offset:,} of the data section, "
                                   f"but the tensors before it end at {expected:,} (a corrupt shape, type or offset)")
            names.add(info.name)
            tensors.append(info)
            offsets.append(offset)
            expected = _pad(offset + info.n_bytes, alignment)
        data_start = _pad(self.pos, alignment)  # the data section starts aligned, after the table
        if tensors:  # a vocabulary-only file has no data section
            data_end = data_start + offset + info.n_bytes
            if data_end > self.size:
                raise ModelFileError(f"{self.path} is truncated: its tensors need {data_end:,} bytes "
                                     f"but the file has {self.size:,}")
        return tuple(replace(t, offset=data_start + o) for t, o in zip(tensors, offsets))

    def _tensor(self, index: int) -> tuple[TensorInfo, int]:
        """One record of the tensor table, and its data offset (relative to the data section)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        name = self.name(f"the name of tensor {index:,}")
        what = f"tensor {_shown(name)}"
        size = len(name.encode())
        if size >= _MAX_NAME:
            raise self.corrupt(f"the name of tensor {index:,} is {size:,} bytes long; llama.cpp allows {_MAX_NAME - 1}")
        n_dims = self.u32(f"the dimension count of {what}")
        if n_dims > _MAX_DIMS:
            raise self.corrupt(f"{what} has {n_dims:,} dimensions; ggml tensors have at most {_MAX_DIMS}")
        dims = tuple(self.u64(f"dimension {j} of {what}") for j in range(n_dims))
        if any(d > _INT64_MAX for d in dims):
            raise self.corrupt(f"{what} has shape {dims}, with a size that is negative as llama.cpp reads it")
        n_elements = math.prod(dims)
        if n_elements > _INT64_MAX:
            raise self.corrupt(f"{what} has shape {dims}: {n_elements:,} elements, more than llama.cpp can count")
        raw_type = self.u32(f"the ggml type of {what}")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.corrupt(f"{what} has ggml type {raw_type}, which is not a type this reader knows") from None
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        row = dims[0] if dims else 1
        if row % block:
            raise self.corrupt(f"{what} has rows of {row:,} elements, not a whole number of "
                               f"{ggml_type.name} blocks of {block}")
        offset = self.u64(f"the data offset of {what}")
        info = TensorInfo(name=name, ggml_type=ggml_type.name, shape=dims, n_elements=n_elements,
                          n_bytes=n_elements * type_size // block)
        return info, offset


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _shown(text: str | bytes) -> str:
    """A name from the file, quoted on one line and cut to a readable length."""
    return repr(text if len(text) <= 60 else text[:57]) + ("..." if len(text) > 60 else "")


# -- the summary ---------------------------------------------------------------------------------
class _Fields:
    """The metadata, read with the types llama.cpp expects: a wrong type is a clear error, not a crash."""

    def __init__(self, path: Path, values: dict[str, object]) -> None:
        self.path, self.values = path, values

    def _wrong(self, key: str, wanted: str) -> ModelFileError:
        value = self.values[key]
        shown = _shown(value) if isinstance(value, str) else repr(value)[:60]
        return ModelFileError(f"{self.path}: metadata key {key!r} should hold {wanted}, but holds {shown}")

    def integer(self, key: str) -> int | None:
        value = self.values.get(key)
        if value is None or isinstance(value, int):
            return value
        raise self._wrong(key, "an integer")

    def integers(self, key: str) -> tuple[int, ...]:
        """A per-layer list; empty when the key is absent or holds a single value."""
        value = self.values.get(key)
        if not isinstance(value, list):
            return ()
        if not all(isinstance(x, int) for x in value):
            raise self._wrong(key, "a list of integers")
        return tuple(value)

    def largest(self, key: str) -> int | None:
        """A value that may be given per layer (head_count_kv): the largest."""
        per_layer = self.integers(key)
        return max(per_layer, default=None) if per_layer else self.integer(key)

    def text(self, key: str) -> str | None:
        value = self.values.get(key)
        if value is None or isinstance(value, str):
            return value
        raise self._wrong(key, "text")

    def flag(self, key: str) -> bool:
        value = self.values.get(key, False)
        if isinstance(value, int):  # bool is an int
            return bool(value)
        raise self._wrong(key, "true or false")

    def texts(self, key: str) -> tuple[str, ...]:
        value = self.values.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise self._wrong(key, "a list of text")
        return tuple(value)


def _summarize(path: Path, file_size: int, f: _Fields, tensors: tuple[TensorInfo, ...]) -> GGUFInfo:
    arch = f.text("general.architecture")
    if not arch:
        raise ModelFileError(f"{path}: the GGUF header names no model architecture (general.architecture)")
    tokens = f.texts(_TOKENS)
    vocab = VocabInfo(
        kind=f.text("tokenizer.ggml.model") or "unknown",
        n_vocab=f.integer(f"{arch}.vocab_size") or len(tokens),
        bos=f.integer("tokenizer.ggml.bos_token_id"),
        eos=f.integer("tokenizer.ggml.eos_token_id"),
        add_bos=f.flag("tokenizer.ggml.add_bos_token"),
        add_eos=f.flag("tokenizer.ggml.add_eos_token"),
        tokens=tokens,
    )
    n_head = f.largest(f"{arch}.attention.head_count") or 0
    return GGUFInfo(
        path=str(path),
        file_size=file_size,
        name=f.text("general.name") or path.stem,
        architecture=arch,
        file_type=_file_type_name(f.integer("general.file_type")),
        n_params=sum(t.n_elements for t in tensors),
        n_layer=f.integer(f"{arch}.block_count") or 0,
        n_ctx_train=f.integer(f"{arch}.context_length") or 0,
        n_embd=f.integer(f"{arch}.embedding_length") or 0,
        n_head=n_head,
        n_head_kv=f.largest(f"{arch}.attention.head_count_kv") or n_head,
        key_length=f.integer(f"{arch}.attention.key_length"),
        value_length=f.integer(f"{arch}.attention.value_length"),
        sliding_window=f.integer(f"{arch}.attention.sliding_window"),
        n_ff=f.largest(f"{arch}.feed_forward_length"),
        n_head_kv_layers=f.integers(f"{arch}.attention.head_count_kv"),
        swa_layers=tuple(bool(x) for x in f.integers(f"{arch}.attention.sliding_window_pattern")),
        n_layer_nextn=f.integer(f"{arch}.nextn_predict_layers") or 0,
        chat_template=f.text("tokenizer.chat_template"),
        vocab=vocab,
        tensors=tensors,
        metadata={k: v for k, v in f.values.items() if k.startswith(f"{arch}.")},
    )


def _file_type_name(value: int | None) -> str:
    from gguf import LlamaFileType

    if value is None:
        return "unknown"
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"type {value}"


def _from_json(d: dict) -> GGUFInfo:
    vocab = d["vocab"]
    vocab = VocabInfo(**{**vocab, "tokens": tuple(vocab["tokens"])})
    tensors = tuple(TensorInfo(**{**t, "shape": tuple(t["shape"])}) for t in d["tensors"])
    lists = {k: tuple(d[k]) for k in ("n_head_kv_layers", "swa_layers")}
    return GGUFInfo(**{**d, **lists, "vocab": vocab, "tensors": tensors})
