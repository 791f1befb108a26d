"""Rows of a model's own weight tensors: from a GGUF with the gguf library (no llama.cpp needed),
or from a Hugging Face folder's safetensors; and whole GGUF tensors, which the PyTorch backend
loads the same way (``gguf_array``).

Trained heads reuse the target's token embeddings and output layer instead of copying them into
their own files (SmolLM2-135M's table is 49k x 576: 113 MB as float32). Only the rows asked for
are read: a GGUF tensor is memory-mapped at the offset SpecDeck's own header reader gives
(``backends.models.gguf_info``, cached per file; ``gguf.GGUFReader`` would parse every token string
first, 2.2 s for SmolLM2 and 10.4 s for Gemma-3's 262k tokens here, each time a head starts), and
a quantized row is a run of whole blocks, so rows are picked first and only those are
dequantized (with the ``gguf`` library); a safetensors tensor is read row by row through its
slices (bfloat16 needs torch to read, which the PyTorch backend that runs folders has).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from backends.core.errors import ModelFileError

if TYPE_CHECKING:
    from backends.models.gguf_info import TensorInfo

EMBEDDINGS = ("token_embd.weight",)
OUTPUT = ("output.weight", "token_embd.weight")  # tied embeddings serve as the output layer


class _Rows:
    """One weight matrix whose rows can be read by index: ``n_rows`` and ``read(rows)`` [n, d] float32."""

    def __init__(self, n_rows: int, read) -> None:
        self.n_rows = n_rows
        self.read = read


def _tensor(model_path: str | Path, names: Sequence[str]) -> _Rows:
    if Path(model_path).is_dir():
        return _folder_tensor(Path(model_path), names)
    from backends.models.gguf_info import read_gguf_info

    by_name = {t.name: t for t in read_gguf_info(model_path).tensors}  # a bad file: ModelFileError, saying why
    for name in names:
        if name in by_name:
            return _gguf_rows(Path(model_path), by_name[name])
    raise ModelFileError(f"{Path(model_path).name} has none of {', '.join(names)}")


def _raw_rows(path: Path, tensor: "TensorInfo") -> np.ndarray:
    """A GGUF tensor's bytes, mapped from the file at its offset: [rows, row bytes], as ggml
    stores it (``shape[0]`` is the row length; a row of a quantized type is whole blocks)."""
    n_rows = tensor.n_elements // tensor.shape[0] if tensor.shape and tensor.shape[0] else 1
    return np.memmap(path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(n_rows, tensor.n_bytes // n_rows))


def _dequantize(raw: np.ndarray, tensor: "TensorInfo") -> np.ndarray:
    import gguf

    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[tensor.ggml_type]), dtype=np.float32)


def _gguf_rows(path: Path, tensor: "TensorInfo") -> _Rows:
    """A 2-D GGUF tensor whose rows are dequantized when read."""
    data = _raw_rows(path, tensor)
    return _Rows(len(data), lambda rows: _dequantize(data[list(rows)], tensor))


def gguf_array(path: str | Path, tensor: "TensorInfo") -> np.ndarray:
    """A whole GGUF tensor as float32, numpy's order (ggml's shape reversed), read at the offset
    ``read_gguf_info`` found: what a runtime other than llama.cpp loads a GGUF with."""
    return _dequantize(_raw_rows(Path(path), tensor), tensor).reshape(tuple(reversed(tensor.shape)))


def _folder_tensor(folder: Path, names: Sequence[str]) -> _Rows:
    """The first of ``names`` (GGUF names) in the folder's safetensors files, found through the
    PyTorch backend's canonical names (``hf_name``/``gguf_name``: ``model.embed_tokens.weight``
    and a multimodal gemma3's ``model.language_model.embed_tokens.weight`` are both "embed")."""
    from safetensors import safe_open

    from backends.pytorch.weights import gguf_name, hf_name

    found: dict[str, tuple] = {}  # canonical name -> (file handle, its name there)
    for file in sorted(folder.glob("*.safetensors")):
        handle = safe_open(str(file), framework="pt")
        for key in handle.keys():
            canonical = hf_name(key, family="")  # the family only tells layer norms apart
            if canonical is not None:
                found.setdefault(canonical, (handle, key))
    for canonical in (gguf_name(name) for name in names):
        if canonical in found:
            handle, key = found[canonical]
            matrix = handle.get_slice(key)
            n_rows, d = matrix.get_shape()

            def read(rows: Sequence[int]) -> np.ndarray:
                out = np.zeros((len(rows), d), dtype=np.float32)
                for k, row in enumerate(rows):
                    out[k] = matrix[row : row + 1].float().numpy()[0]
                return out

            return _Rows(int(n_rows), read)
    raise ModelFileError(f"{folder.name} has none of {', '.join(names)} (as a Hugging Face checkpoint names them)")


def tensor_rows(model_path: str | Path, rows: np.ndarray, names: Sequence[str] = OUTPUT) -> np.ndarray:
    """Rows ``rows`` of the first tensor of ``names`` the model has, [len(rows), d] float32."""
    return _tensor(model_path, names).read(np.asarray(rows).tolist())


class TokenEmbeddings:
    """A model's token embedding rows, read when first asked for and kept (a chat touches a few
    thousand of the vocabulary's rows). Call with token ids [n] for rows [n, d] float32."""

    def __init__(self, model_path: str | Path) -> None:
        self._tensor = _tensor(model_path, EMBEDDINGS)
        self.n_vocab = self._tensor.n_rows
        self._rows: dict[int, np.ndarray] = {}

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        missing = sorted({int(t) for t in tokens} - self._rows.keys())
        if missing:
            if missing[0] < 0 or missing[-1] >= self.n_vocab:
                raise ModelFileError(f"token id {missing[-1]} is outside the model's {self.n_vocab} embeddings")
            for t, row in zip(missing, self._tensor.read(missing)):
                self._rows[t] = row
        return np.stack([self._rows[int(t)] for t in tokens])
