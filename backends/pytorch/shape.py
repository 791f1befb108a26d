"""The shape of a decoder-only transformer, read from a Hugging Face ``config.json`` or a GGUF header.

One dataclass covers the families SpecDeck's torch model runs: llama, mistral, qwen2 and qwen3
(pre-norm blocks, SwiGLU, rotary positions; qwen2 adds q/k/v biases, qwen3 a per-head norm of q
and k) and gemma3 (the same plus the embedding scaled by sqrt(d), GELU, norms after attention and
the MLP too, and five sliding-window layers for every global one, each kind with its own rotary
base). A family it does not know is refused here, with its name, before any weight is read.

Example: SmolLM2-135M is ``TorchShape(family="llama", n_layer=30, d=576, n_head=9, n_kv=3,
head_dim=64, ffn=1536, n_vocab=49152, rope_theta=100000.0, ...)`` from either file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from backends.core.errors import ModelFileError

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
FAMILIES = LLAMA_LIKE + ("gemma3",)
GEMMA3_GLOBAL_EVERY = 6  # gemma3: layers 5, 11, 17, ... attend globally, the rest through the window
GEMMA3_LOCAL_THETA = 10000.0  # gemma3's sliding layers' rotary base (llama.cpp hard-codes it too)


@dataclass(frozen=True)
class TorchShape:
    """Sizes and the per-family switches of the forward pass (see the module docstring)."""

    family: str
    n_layer: int
    d: int
    n_head: int
    n_kv: int
    head_dim: int
    ffn: int
    n_vocab: int
    norm_eps: float
    rope_theta: float
    n_ctx_train: int = 0
    rope_theta_local: float = 0.0  # sliding-window layers' base (0: as the global ones)
    rope_linear: float = 1.0  # linear position scaling of the global layers (gemma3 4B+: 8)
    windows: tuple[int, ...] = ()  # per layer: its sliding window in tokens, 0 for full attention
    qk_norm: bool = False
    attn_bias: bool = False
    tied: bool = True  # the output layer is the embedding table
    attn_scale: float = 0.0  # 0: head_dim ** -0.5

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ModelFileError(f"the PyTorch backend runs {', '.join(FAMILIES)} models, not {self.family!r}")
        if self.n_head % self.n_kv or self.d <= 0 or self.n_layer <= 0:
            raise ModelFileError(f"an inconsistent shape: {self.n_head} heads over {self.n_kv} KV heads, "
                                 f"width {self.d}, {self.n_layer} layers")

    @property
    def gemma(self) -> bool:
        return self.family == "gemma3"

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def embed_scale(self) -> float:
        """gemma multiplies the embeddings by sqrt(d); the others by 1."""
        return math.sqrt(self.d) if self.gemma else 1.0

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def theta(self, layer: int) -> float:
        return self.rope_theta_local if self.window(layer) and self.rope_theta_local else self.rope_theta


def _gemma3_windows(n_layer: int, window: int, pattern: int = GEMMA3_GLOBAL_EVERY) -> tuple[int, ...]:
    return tuple(0 if (i + 1) % pattern == 0 else window for i in range(n_layer))


def _rope(config: dict[str, Any]) -> tuple[float, float, float]:
    """(global base, local base, linear factor) from a config's ``rope_parameters`` (transformers 5)
    or ``rope_theta``/``rope_scaling`` (older files); other scalings are refused."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:  # per layer kind
        full, local = params["full_attention"], params.get("sliding_attention", {})
    else:
        full, local = params or {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}, {}
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ModelFileError(f"rotary scaling {kind!r} is not supported by the PyTorch backend yet")
    factor = float(full.get("factor", 1.0)) if kind == "linear" else 1.0
    return float(full.get("rope_theta", 10000.0)), float(local.get("rope_theta", 0.0)), factor


def shape_from_hf(config: dict[str, Any]) -> TorchShape:
    """The shape a Hugging Face ``config.json`` describes (a multimodal gemma3's text part too)."""
    config = config.get("text_config", config) if config.get("model_type") == "gemma3" else config
    family = {"gemma3_text": "gemma3"}.get(config.get("model_type", ""), config.get("model_type", "?"))
    d, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
    n_layer = int(config["num_hidden_layers"])
    theta, local, factor = _rope(config)
    windows: tuple[int, ...] = ()
    if family == "gemma3":
        kinds = config.get("layer_types") or ["full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else
                                              "sliding_attention" for i in range(n_layer)]
        windows = tuple(int(config["sliding_window"]) if k == "sliding_attention" else 0 for k in kinds)
        local = local or GEMMA3_LOCAL_THETA
    elif config.get("sliding_window") and config.get("use_sliding_window", family == "mistral"):
        windows = (int(config["sliding_window"]),) * n_layer
    head_dim = int(config.get("head_dim") or d // n_head)
    scalar = config.get("query_pre_attn_scalar")
    return TorchShape(
        family=family, n_layer=n_layer, d=d, n_head=n_head, n_kv=int(config.get("num_key_value_heads", n_head)),
        head_dim=head_dim, ffn=int(config["intermediate_size"]), n_vocab=int(config["vocab_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_theta_local=local,
        rope_linear=factor, windows=windows, n_ctx_train=int(config.get("max_position_embeddings", 0)),
        qk_norm=family in ("qwen3", "gemma3"), attn_bias=bool(config.get("attention_bias", family == "qwen2")),
        tied=bool(config.get("tie_word_embeddings", family == "gemma3")),
        attn_scale=float(scalar) ** -0.5 if scalar else 0.0)


def shape_from_gguf(fields: dict[str, Any], *, has_output: bool, n_vocab: int) -> TorchShape:
    """The shape a GGUF header describes (``fields``: key -> value; ``general.architecture`` and the
    architecture's own keys, as ``GGUFInfo.metadata`` holds them).
    ``has_output``: the file has an output layer of its own (else it is tied to the embeddings)."""
    arch = str(fields.get("general.architecture", "?"))
    if arch not in ("llama", "qwen2", "qwen3", "gemma3"):
        raise ModelFileError(f"the PyTorch backend runs llama, qwen2, qwen3 and gemma3 GGUFs, not {arch!r}")

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    def need(key: str) -> int:
        """A size the model cannot be built without: a clear refusal, not a TypeError, when absent."""
        value = get(key)  # the header reader has checked that a present one is an integer
        if not value or value < 0:
            raise ModelFileError(f"the GGUF header gives no usable {arch}.{key} ({value!r}), "
                                 "which the PyTorch backend needs to build the model")
        return int(value)

    d, n_head, n_layer = need("embedding_length"), need("attention.head_count"), need("block_count")
    window = int(get("attention.sliding_window", 0) or 0)
    gemma = arch == "gemma3"
    scaling = str(get("rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise ModelFileError(f"rotary scaling {scaling!r} is not supported by the PyTorch backend yet")
    return TorchShape(
        family=arch, n_layer=n_layer, d=d, n_head=n_head, n_kv=int(get("attention.head_count_kv", n_head)),
        head_dim=int(get("attention.key_length", d // n_head)), ffn=need("feed_forward_length"), n_vocab=n_vocab,
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_theta_local=GEMMA3_LOCAL_THETA if gemma else 0.0,
        rope_linear=float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        windows=_gemma3_windows(n_layer, window) if gemma and window else (),
        n_ctx_train=int(get("context_length", 0)), qk_norm=arch in ("qwen3", "gemma3"), attn_bias=False,
        tied=not has_output)
