"""A Hugging Face model folder's vocabulary and chat template, for the PyTorch backend.

A folder holds ``config.json``, ``tokenizer.json`` (the ``tokenizers`` library's file),
``tokenizer_config.json`` (special tokens, the chat template unless ``chat_template.jinja`` has
it) and often ``generation_config.json`` (the end-of-generation ids). ``HFModelFolder`` reads them
and answers what the rest of SpecDeck asks of a GGUF's ``LlamaModel`` about text: tokenize, the
bytes of each token (for streaming and stop strings), the chat prompt, the end tokens, the
vocabulary for draft compatibility. It never runs code from the folder.

Token bytes: byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM) spell each byte as one
printable character, which is mapped back; SentencePiece vocabularies (Llama 2, Mistral, Gemma)
write a space as "▁" and unknown bytes as "<0xNN>". Special tokens stand for no text.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from backends.core.errors import ModelFileError
from backends.models.chat import ChatFormat, Message
from backends.models.gguf_info import VocabInfo


def is_hf_folder(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, reversed (character -> byte)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path.name} in {path.parent.name} cannot be read ({exc})") from None


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


class HFModelFolder:
    """The text side of a Hugging Face folder (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path)
        if not is_hf_folder(self.path):
            raise ModelFileError(f"{self.path} is not a Hugging Face model folder (no config.json)")
        file = self.path / "tokenizer.json"
        if not file.is_file():
            raise ModelFileError(f"{self.path.name} has no tokenizer.json (SpecDeck reads the fast tokenizer's file only)")
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust library raises its own exception type
            raise ModelFileError(f"{self.path.name}/tokenizer.json cannot be read ({exc})") from None
        self.config = _read_json(self.path / "config.json")
        text_config = self.config.get("text_config", self.config)
        self._tok_config = _read_json(self.path / "tokenizer_config.json")
        self._generation = _read_json(self.path / "generation_config.json")
        self.n_vocab: int = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.n_layer: int = int(text_config.get("num_hidden_layers", 0))
        self.n_embd: int = int(text_config.get("hidden_size", 0))
        self.n_ctx_train: int = int(text_config.get("max_position_embeddings", 0))
        self.n_gpu_layers = 0
        self.bos = self._id(_token_text(self._tok_config.get("bos_token")))
        self.eos = self._id(_token_text(self._tok_config.get("eos_token")))
        self.add_bos = bool(self._tok_config.get("add_bos_token", False))
        self.add_eos = bool(self._tok_config.get("add_eos_token", False))
        self._special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        self._pieces: dict[int, bytes] = {}
        self._bytes = _byte_decoder() if self._byte_level() else None

    def _id(self, text: str) -> int:
        found = self.tokenizer.token_to_id(text) if text else None
        return -1 if found is None else int(found)

    def _byte_level(self) -> bool:
        spec = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        kinds = [spec.get("type")] + [d.get("type") for d in spec.get("decoders", []) or []]
        return "ByteLevel" in kinds

    # -- what LlamaModel answers about text ----------------------------------------------------
    @property
    def name(self) -> str:
        return self.path.name

    can_roll_back = True  # transformers, not recurrent states
    is_recurrent = is_hybrid = False

    def meta(self, key: str) -> str | None:
        return None

    def close(self) -> None:
        pass

    @cached_property
    def eog_ids(self) -> frozenset[int]:
        """The generation config's end ids, the tokenizer's EOS and the chat's end-of-turn markers."""
        ids = self._generation.get("eos_token_id", self.config.get("eos_token_id"))
        ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
        ends = {int(i) for i in ids} | ({self.eos} if self.eos >= 0 else set())
        for marker in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>"):
            if (t := self._id(marker)) >= 0:
                ends.add(t)
        return frozenset(ends)

    @cached_property
    def vocab_info(self) -> VocabInfo:
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        tokens = [""] * self.n_vocab
        for text, i in vocab.items():
            if 0 <= i < self.n_vocab:
                tokens[i] = text
        return VocabInfo(kind="gpt2" if self._bytes else "llama", n_vocab=self.n_vocab,
                         bos=self.bos if self.bos >= 0 else None, eos=self.eos if self.eos >= 0 else None,
                         add_bos=self.add_bos, add_eos=self.add_eos, tokens=tuple(tokens))

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special).ids  # the file's post-processor adds BOS
        if add_special and self.add_bos and self.bos >= 0 and (not ids or ids[0] != self.bos):
            ids = [self.bos, *ids]
        return list(ids)

    def token_text(self, token: int) -> str:
        return self.tokenizer.id_to_token(token) or ""

    def token_piece(self, token: int) -> bytes:
        """The bytes one token stands for (special tokens: none)."""
        piece = self._pieces.get(token)
        if piece is None:
            text = self.token_text(token)
            if text in self._special:
                piece = b""
            elif self._bytes is not None:
                piece = bytes(self._bytes.get(c, 32) for c in text)
            elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                piece = bytes([int(text[3:5], 16)])
            else:
                piece = text.replace("▁", " ").encode("utf-8")
            self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode("utf-8", errors="replace")

    @cached_property
    def chat_format(self) -> ChatFormat:
        template = self._tok_config.get("chat_template")
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return ChatFormat(template=template or None, bos_token=self.token_text(self.bos) if self.bos >= 0 else "",
                          eos_token=self.token_text(self.eos) if self.eos >= 0 else "")

    def chat_prompt(self, messages: list[Message], *, chat_format: ChatFormat | None = None) -> list[int]:
        fmt = chat_format or self.chat_format
        text = fmt.render(messages, add_generation_prompt=True)
        add_special = not (fmt.bos_token and text.startswith(fmt.bos_token))
        return self.tokenize(text, add_special=add_special)
