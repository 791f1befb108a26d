"""Head files: safetensors weights plus a JSON config that names the model the head was made for.

``name.safetensors`` holds the tensors (never a pickle); ``name.json`` holds what the head is
(``kind``, its hyperparameters), the target model's fingerprint, and how it was trained. A head
reads one model's hidden states, so it is refused, with both models named, for a model of another
architecture, size or vocabulary. A head trained on one quantization of a model still fits
another (F16 and Q4_1 SmolLM2 give nearly the same states); ``find_heads`` prefers the exact one.

A tensor that is only a copy of the target's own output rows for the head's ``vocab`` (a frozen
output layer: 4.7 MB of SmolLM2's 13 MB EAGLE head) is not stored: the JSON lists it under
``from_target`` and ``attach`` reads it from the model the head is used with.

Where heads are looked for: next to the model file (``model.gguf`` -> ``model.medusa.json``), the
user's heads folder (``specdeck train`` writes there), and the heads shipped in ``assets/heads``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backends.core.errors import HeadMismatchError, ModelFileError
from backends.models.gguf_info import read_gguf_info
from backends.models.paths import data_dir, write_atomic

SHIPPED = Path(__file__).resolve().parents[2] / "assets" / "heads"
FORMAT = 1  # the JSON config's version
HEAD_KINDS = ("medusa", "eagle", "eagle3", "mtp")  # the kinds of trained heads sessions look for


@dataclass(frozen=True)
class ModelFingerprint:
    """What a head depends on: the architecture, the sizes and the exact vocabulary."""

    name: str
    architecture: str
    file_type: str
    n_layer: int
    n_embd: int
    n_vocab: int
    vocab_digest: str  # sha256 of the token texts, 16 hex digits

    @classmethod
    def of(cls, model: str | os.PathLike) -> ModelFingerprint:
        """The fingerprint of a GGUF file, from its (cached) header, or of a Hugging Face folder."""
        if Path(model).is_dir():
            return cls._of_folder(Path(model))
        info = read_gguf_info(model)
        digest = hashlib.sha256("\n".join(info.vocab.tokens).encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return cls(info.name or Path(model).stem, info.architecture, info.file_type, info.n_layer, info.n_embd,
                   info.vocab.n_vocab, digest)

    @classmethod
    def _of_folder(cls, folder: Path) -> ModelFingerprint:
        """A Hugging Face folder's fingerprint, in the GGUF's terms: the family's name as a GGUF
        architecture, the token texts in id order (a GGUF converted from the same weights has the
        same list, so heads made for one serve the other; only the weight type differs)."""
        from backends.models.hf_folder import HFModelFolder
        from backends.pytorch.shape import shape_from_hf

        text = HFModelFolder(folder)
        shape = shape_from_hf(text.config)
        tokens = text.vocab_info.tokens
        digest = hashlib.sha256("\n".join(tokens).encode("utf-8", "surrogatepass")).hexdigest()[:16]
        dtype = str(text.config.get("torch_dtype") or text.config.get("dtype") or "unknown")
        return cls(folder.name, shape.family, dtype, shape.n_layer, shape.d, len(tokens), digest)

    def describe(self) -> str:
        return f"{self.name} ({self.file_type}, {self.architecture}, {self.n_layer} layers, {self.n_embd} wide)"

    def differences(self, other: ModelFingerprint) -> list[str]:
        """What makes a head for ``self`` unusable on ``other`` (the weight type does not)."""
        out = []
        for what in ("architecture", "n_layer", "n_embd", "n_vocab"):
            if getattr(self, what) != getattr(other, what):
                out.append(f"{what} {getattr(self, what)} vs {getattr(other, what)}")
        if self.vocab_digest != other.vocab_digest and self.n_vocab == other.n_vocab:
            out.append("a different vocabulary")
        return out


@dataclass
class HeadFile:
    """A trained head: ``kind`` ("medusa", "eagle"), hyperparameters, tensors, provenance."""

    kind: str
    config: dict[str, Any]
    target: ModelFingerprint
    tensors: dict[str, np.ndarray]
    training: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    from_target: tuple[str, ...] = ()  # tensors that are the target's output rows for ``vocab``: not stored

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``path`` (.safetensors) and its .json beside it; returns the .json path."""
        from safetensors.numpy import save_file

        weights = stem(path).with_name(stem(path).name + ".safetensors")
        weights.parent.mkdir(parents=True, exist_ok=True)
        tmp = weights.with_name(weights.name + ".tmp")
        save_file({k: np.ascontiguousarray(v) for k, v in self.tensors.items() if k not in self.from_target}, str(tmp))
        os.replace(tmp, weights)
        meta = {"format": FORMAT, "kind": self.kind, "weights": weights.name, "config": self.config,
                "target": asdict(self.target), "training": self.training}
        if self.from_target:
            meta["from_target"] = list(self.from_target)
        config = weights.with_name(stem(weights).name + ".json")
        write_atomic(config, json.dumps(meta, indent=1) + "\n")
        self.path = config
        return config

    @classmethod
    def load(cls, path: str | os.PathLike) -> HeadFile:
        """Read a head from its .json or .safetensors path; a clear error for anything wrong."""
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        config = stem(Path(path).expanduser())
        config = config.with_name(config.name + ".json")
        try:
            meta = json.loads(config.read_text())
            weights = config.with_name(meta["weights"])
            target = ModelFingerprint(**meta["target"])
            kind, hyper = str(meta["kind"]), dict(meta["config"])
            from_target = tuple(str(name) for name in meta.get("from_target", ()))
        except FileNotFoundError:
            raise ModelFileError(f"no head config at {config}") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelFileError(f"{config} is not a SpecDeck head config ({exc})") from None
        try:
            tensors = load_file(str(weights))
        except (OSError, SafetensorError) as exc:
            raise ModelFileError(f"the head weights {weights} cannot be read ({exc})") from None
        return cls(kind, hyper, target, tensors, dict(meta.get("training", {})), config, from_target)

    @staticmethod
    def kind_of(path: str | os.PathLike) -> str:
        """The kind of the head at ``path``, from its JSON config alone (no weights read)."""
        config = stem(Path(path).expanduser())
        config = config.with_name(config.name + ".json")
        try:
            return str(json.loads(config.read_text())["kind"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelFileError(f"{config} is not a SpecDeck head config ({exc})") from None

    def check_for(self, model: ModelFingerprint, kind: str | None = None) -> None:
        """Raise ``HeadMismatchError`` unless this head fits ``model`` (and is a ``kind`` head)."""
        if kind is not None and self.kind != kind:
            raise HeadMismatchError(f"{self.path or 'this head'} is a {self.kind} head, not a {kind} head")
        wrong = self.target.differences(model)
        if wrong:
            raise HeadMismatchError(f"this {self.kind} head was trained for {self.target.describe()}, not for "
                                    f"{model.describe()} ({'; '.join(wrong)}): train one for it with "
                                    f"`specdeck train {self.kind} --model ...`")

    def attach(self, model: str | os.PathLike) -> HeadFile:
        """Read the tensors listed in ``from_target`` from ``model`` (the one ``check_for`` passed):
        its output rows for ``vocab``, as float16 like the stored tensors."""
        from backends.models.weights import tensor_rows

        missing = [name for name in self.from_target if name not in self.tensors]
        if missing:
            self.tensor("vocab")  # a clear error when the file lacks it
            rows = tensor_rows(model, np.asarray(self.tensors["vocab"], np.int64)).astype(np.float16)
            self.tensors.update(dict.fromkeys(missing, rows))
        return self

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A tensor as float32, its shape checked (a truncated or edited file fails here, clearly)."""
        if name not in self.tensors:
            if name in self.from_target:
                raise ModelFileError(f"{self.path or 'the head'}: {name!r} is read from the target model (attach it)")
            raise ModelFileError(f"{self.path or 'the head'} has no tensor {name!r}")
        value = np.asarray(self.tensors[name], dtype=np.float32)
        if shape is not None and value.shape != shape:
            raise ModelFileError(f"{self.path or 'the head'}: tensor {name!r} is {value.shape}, expected {shape}")
        return value


def stem(path: str | os.PathLike) -> Path:
    """A head's path without .json or .safetensors: ``x.medusa.json`` -> ``x.medusa``."""
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".json", ".safetensors") else path


def user_heads_dir() -> Path:
    return data_dir() / "heads"


def head_stem(model: str | os.PathLike, kind: str) -> Path:
    """Where ``specdeck train`` puts a head for ``model`` by default (without suffix)."""
    return user_heads_dir() / f"{Path(model).stem}.{kind}"


def find_heads(model: str | os.PathLike, kind: str, *, fingerprint: ModelFingerprint | None = None) -> list[Path]:
    """Head configs of ``kind`` that fit ``model`` (whose ``fingerprint`` may be given), the exact
    weight type first."""
    fingerprint = fingerprint or ModelFingerprint.of(model)
    model = Path(model)
    folders = [model.parent, user_heads_dir(), SHIPPED]
    exact, close = [], []
    for folder in folders:
        for config in sorted(folder.glob(f"*.{kind}.json")) if folder.is_dir() else ():
            try:
                meta = json.loads(config.read_text())
                target = ModelFingerprint(**meta["target"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if meta.get("kind") != kind or target.differences(fingerprint):
                continue
            (exact if target.file_type == fingerprint.file_type else close).append(config)
    return exact + close
