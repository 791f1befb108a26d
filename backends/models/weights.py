"""Rows of a GGUF model's own weight tensors, read with the gguf library (no llama.cpp needed).

Trained heads reuse the target's token embeddings and output layer instead of copying them into
their own files (SmolLM2-135M's table is 49k x 576: 113 MB as float32). A GGUF tensor is
memory-mapped and a quantized row is a run of whole blocks, so rows are picked first and only
those are dequantized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from backends.core.errors import ModelFileError

EMBEDDINGS = ("token_embd.weight",)
OUTPUT = ("output.weight", "token_embd.weight")  # tied embeddings serve as the output layer


def _tensor(model_path: str | Path, names: Sequence[str]):
    import gguf

    try:
        reader = gguf.GGUFReader(str(model_path))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{Path(model_path).name} cannot be read as GGUF ({exc})") from None
    by_name = {t.name: t for t in reader.tensors}
    for name in names:
        if name in by_name:
            return by_name[name]
    raise ModelFileError(f"{Path(model_path).name} has none of {', '.join(names)}")


def _dequantize(tensor, rows: Sequence[int]) -> np.ndarray:
    import gguf

    return np.asarray(gguf.quants.dequantize(tensor.data[list(rows)], tensor.tensor_type), dtype=np.float32)


def tensor_rows(model_path: str | Path, rows: np.ndarray, names: Sequence[str] = OUTPUT) -> np.ndarray:
    """Rows ``rows`` of the first tensor of ``names`` the file has, [len(rows), d] float32."""
    return _dequantize(_tensor(model_path, names), np.asarray(rows).tolist())


class TokenEmbeddings:
    """A model's token embedding rows, read when first asked for and kept (a chat touches a few
    thousand of the vocabulary's rows). Call with token ids [n] for rows [n, d] float32."""

    def __init__(self, model_path: str | Path) -> None:
        self._tensor = _tensor(model_path, EMBEDDINGS)
        self.n_vocab = int(self._tensor.data.shape[0])
        self._rows: dict[int, np.ndarray] = {}

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        missing = sorted({int(t) for t in tokens} - self._rows.keys())
        if missing:
            if missing[0] < 0 or missing[-1] >= self.n_vocab:
                raise ModelFileError(f"token id {missing[-1]} is outside the model's {self.n_vocab} embeddings")
            for t, row in zip(missing, _dequantize(self._tensor, missing)):
                self._rows[t] = row
        return np.stack([self._rows[int(t)] for t in tokens])
