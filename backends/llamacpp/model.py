"""A GGUF model loaded by llama.cpp: weights, vocabulary, tokenizer and chat format.

One ``LlamaModel`` can back several contexts (``LlamaTarget``); the weights are loaded once.
Everything here goes through llama-cpp-python's low-level API, so SpecDeck sees exactly the
tokens llama.cpp sees.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from backends.core.errors import BackendError, Cancelled, ModelFileError
from backends.models.chat import ChatFormat, Message
from backends.models.gguf_info import VocabInfo, check_gguf_file
from backends.models.llama_lib import failure_reason, llama, recent_errors


# llama_ftype values (llama.h) of the weight types SpecDeck meets, by the names quantize uses.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}


# Architectures whose llama.cpp graph runs a next-n block in an MTP context (src/models/*.cpp that
# build LLM_GRAPH_TYPE_DECODER_MTP). glm4 and exaone4 files may hold next-n tensors too, but their
# graphs never run them.
MTP_GRAPHS = frozenset({"deepseek2", "deepseek32", "deepseek4", "glm4moe", "glm-dsa", "glm5-next", "qwen35",
                        "qwen35moe", "qwen3next", "step35", "hy_v3", "mimo2", "bailingmoe3", "cohere2moe",
                        "nemotron_h_moe"})


def mtp_in_header(path: str | os.PathLike) -> bool:
    """Whether a GGUF's header promises a next-n (MTP) block llama.cpp can run (read without
    loading the weights: the recommender and the library ask before a model is loaded)."""
    from backends.models.gguf_info import read_gguf_info

    info = read_gguf_info(path)
    return info.n_layer_nextn > 0 and info.architecture in MTP_GRAPHS


class LlamaModel:
    """Loaded weights and vocabulary. Close it (or use ``with``) to free the memory at once."""

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = 0, use_mmap: bool = True,
                 progress: Callable[[float], bool] | None = None, vocab_only: bool = False) -> None:
        """``progress(fraction)`` is called while the weights load; returning False cancels the load.
        ``vocab_only`` loads just the tokenizer (for tokenizing, e.g. building a datastore)."""
        self.path = check_gguf_file(path)
        self.n_gpu_layers = n_gpu_layers
        lib = llama()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_mmap = use_mmap
        params.vocab_only = vocab_only
        params.load_mtp = True  # a file's next-n (MTP) blocks, if it has any: the ``mtp`` drafter runs them
        cancelled = False
        if progress is not None:
            def on_progress(fraction: float, _user_data: ctypes.c_void_p) -> bool:
                nonlocal cancelled
                cancelled = not progress(float(fraction))
                return not cancelled

            callback = lib.llama_progress_callback(on_progress)  # referenced until the load returns
            params.progress_callback = callback
        recent_errors.clear()
        model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not model and cancelled:
            raise Cancelled(f"loading {self.path.name} was cancelled")
        if not model:
            reason = failure_reason()
            raise ModelFileError(f"llama.cpp could not load {self.path}: {reason}")
        self.ptr = model
        self.vocab_ptr = lib.llama_model_get_vocab(model)
        self.n_vocab: int = lib.llama_vocab_n_tokens(self.vocab_ptr)
        self.n_ctx_train: int = lib.llama_model_n_ctx_train(model)
        self.n_layer: int = lib.llama_model_n_layer(model)
        self.n_embd: int = lib.llama_model_n_embd(model)
        self.n_layer_nextn: int = lib.llama_model_n_layer_nextn(model)  # next-n (MTP) blocks after the n_layer
        self.bos: int = lib.llama_vocab_bos(self.vocab_ptr)
        self.eos: int = lib.llama_vocab_eos(self.vocab_ptr)
        self.add_bos: bool = bool(lib.llama_vocab_get_add_bos(self.vocab_ptr))
        self.add_eos: bool = bool(lib.llama_vocab_get_add_eos(self.vocab_ptr))
        self._pieces: list[bytes | None] = [None] * self.n_vocab

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "ptr", None):
            llama().llama_model_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not sys.is_finalizing():
            self.close()

    # -- metadata ------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, as llama.cpp read it."""
        buf = ctypes.create_string_buffer(4096)
        n = llama().llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    @cached_property
    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        llama().llama_model_desc(self.ptr, buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    @cached_property
    def size_bytes(self) -> int:
        return int(llama().llama_model_size(self.ptr))

    @cached_property
    def is_recurrent(self) -> bool:
        """Mamba, RWKV and the like: a state per sequence instead of a cache of positions."""
        return bool(llama().llama_model_is_recurrent(self.ptr))

    @cached_property
    def is_hybrid(self) -> bool:
        """Attention layers next to recurrent ones (LFM2, Granite-H, Qwen3-Next)."""
        return bool(llama().llama_model_is_hybrid(self.ptr))

    @property
    def has_mtp(self) -> bool:
        """Whether the file has a next-n (MTP) block that llama.cpp's graph for it can run."""
        return self.n_layer_nextn > 0 and self.meta("general.architecture") in MTP_GRAPHS and self.can_roll_back

    @property
    def can_roll_back(self) -> bool:
        """Whether a context over this model can forget its last positions (speculation needs it)."""
        return not (self.is_recurrent or self.is_hybrid)

    @cached_property
    def n_swa(self) -> int:
        """The sliding window of its sliding-window layers, 0 when it has none (Gemma 3: 512)."""
        return int(llama().llama_model_n_swa(self.ptr))

    @cached_property
    def weight_type(self) -> str:
        """The file's weight type as llama.cpp's quantize tool names it ("F16", "Q4_1", "Q4_K_M" ...)."""
        file_type = self.meta("general.file_type")
        return FILE_TYPES.get(int(file_type), f"type {file_type}") if file_type and file_type.isdigit() else "unknown"

    @cached_property
    def eog_ids(self) -> frozenset[int]:
        """Every end-of-generation token (EOS, EOT, <|im_end|>, <end_of_turn> ...)."""
        is_eog = llama().llama_vocab_is_eog
        return frozenset(t for t in range(self.n_vocab) if is_eog(self.vocab_ptr, t))

    @cached_property
    def vocab_info(self) -> VocabInfo:
        """The vocabulary as llama.cpp loaded it, for draft compatibility checks."""
        lib = llama()
        kinds = {1: "llama", 2: "gpt2", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}
        text = lib.llama_vocab_get_text
        return VocabInfo(
            kind=kinds.get(lib.llama_vocab_type(self.vocab_ptr), "unknown"),
            n_vocab=self.n_vocab,
            bos=self.bos if self.bos >= 0 else None,
            eos=self.eos if self.eos >= 0 else None,
            add_bos=self.add_bos,
            add_eos=self.add_eos,
            tokens=tuple((text(self.vocab_ptr, t) or b"").decode("utf-8", errors="replace") for t in range(self.n_vocab)),
        )

    # -- text ----------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama().llama_token * capacity)()
        n = llama().llama_tokenize(self.vocab_ptr, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (llama().llama_token * capacity)()
            n = llama().llama_tokenize(self.vocab_ptr, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            raise BackendError(f"llama.cpp could not tokenize the text (error {n})")
        return list(buf[:n])

    def token_piece(self, token: int) -> bytes:
        """The bytes one token stands for (special tokens render as nothing)."""
        piece = self._pieces[token]
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = llama().llama_token_to_piece(self.vocab_ptr, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama().llama_token_to_piece(self.vocab_ptr, token, buf, len(buf), 0, False)
            piece = self._pieces[token] = buf.raw[: max(n, 0)]
        return piece

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """The vocabulary entry of a token (special tokens included), for display."""
        raw = llama().llama_vocab_get_text(self.vocab_ptr, token)
        return (raw or b"").decode("utf-8", errors="replace")

    @cached_property
    def chat_format(self) -> ChatFormat:
        template = llama().llama_model_chat_template(self.ptr, None)
        return ChatFormat(
            template=template.decode("utf-8", errors="replace") if template else None,
            bos_token=self.token_text(self.bos) if self.bos >= 0 else "",
            eos_token=self.token_text(self.eos) if self.eos >= 0 else "",
        )

    def chat_prompt(self, messages: list[Message], *, chat_format: ChatFormat | None = None) -> list[int]:
        """The token ids of a conversation, ready for the assistant's next answer."""
        fmt = chat_format or self.chat_format
        text = fmt.render(messages, add_generation_prompt=True)
        # A template that writes the BOS token itself must not get a second one from the tokenizer.
        add_special = not (fmt.bos_token and text.startswith(fmt.bos_token))
        return self.tokenize(text, add_special=add_special, parse_special=True)

    @property
    def name(self) -> str:
        return self.meta("general.name") or Path(self.path).stem

    def new_context(self, what: str, **settings: object):
        """A llama.cpp context over this model with ``settings`` over the defaults (fields of
        ``llama_context_params``); ``BackendError`` naming ``what`` and llama.cpp's reason when
        it cannot be made (most often memory)."""
        lib = llama()
        params = lib.llama_context_default_params()
        params.no_perf = True
        for name, value in settings.items():
            setattr(params, name, value)
        recent_errors.clear()
        ctx = lib.llama_init_from_model(self.ptr, params)
        if not ctx:
            reason = "; ".join(recent_errors) or "out of memory?"
            raise BackendError(f"llama.cpp could not create {what}: {reason}")
        return ctx
