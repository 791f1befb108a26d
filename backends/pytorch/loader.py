"""Opening a model on the PyTorch backend: where it runs, in which precision, and its target.

Precision: ``auto`` is bfloat16 on a CUDA GPU that supports it (float16 otherwise) and on a CPU
that multiplies bfloat16 natively (AVX512-BF16, AMX); float32 on other CPUs. There bfloat16 is
converted around every matmul: decoding one token is faster (it reads half the bytes; AMD EPYC,
AVX2 only, SmolLM2-135M: 33.8 ms against 57.2 ms), but every batch is far slower (16 rows: 303 ms
against 137 ms), so a prompt's prefill and any verification lose more than plain decoding
gains. ``--dtype bfloat16`` takes it anyway (short prompts, plain decoding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from backends.core.errors import BackendError, ModelFileError, SpecDeckError

DTYPES = ("auto", "float32", "bfloat16", "float16")


def require_torch():
    from backends.addons import require

    try:
        return require("torch", "the PyTorch backend")
    except SpecDeckError as exc:
        raise BackendError(str(exc)) from None


def device_and_dtype(dtype: str = "auto", device: str = "auto"):
    """(torch device, torch dtype) for a model: a CUDA GPU when torch sees one, else the CPU."""
    torch = require_torch()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype != "auto":
        return dev, getattr(torch, dtype)
    if dev.type == "cuda":
        return dev, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return dev, torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def attention_dtype(dev, dt):
    """The KV cache's and attention's dtype for weights in ``dt``: float32 for half-precision
    weights on a CPU without native bfloat16, whose bfloat16 attention is slow (2 AMD EPYC cores,
    SmolLM2 bfloat16, one token after 1024: 47 ms a forward with bfloat16 attention, 31 ms with
    float32; after 128: 29 and 28 ms); ``dt`` elsewhere."""
    torch = require_torch()
    if dev.type == "cpu" and dt in (torch.bfloat16, torch.float16) and not cpu_has_native_bf16():
        return torch.float32
    return dt


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16), as torch uses it."""
    torch = require_torch()
    try:
        return bool(torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")) or _cpuinfo_bf16()
    except AttributeError:
        return _cpuinfo_bf16()


def _cpuinfo_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return False
    return "avx512_bf16" in flags


def open_torch_target(path: str | Path, *, token_piece: Callable[[int], bytes], eog_ids: frozenset[int],
                      n_ctx: int, n_threads: int | None = None, dtype: str = "auto", device: str = "auto",
                      name: str = "model", progress: Callable[[float], bool] | None = None):
    """The ``TorchTarget`` for a GGUF or a Hugging Face folder; weights load once per process."""
    torch = require_torch()
    from backends.pytorch.model import Transformer
    from backends.pytorch.target import TorchTarget
    from backends.pytorch.weights import load_weights

    if n_threads:
        torch.set_num_threads(n_threads)
    dev, dt = device_and_dtype(dtype, device)
    shape, weights = load_weights(path, progress=progress)
    if shape.n_ctx_train:
        n_ctx = min(n_ctx, shape.n_ctx_train)
    try:
        model = Transformer(shape, weights, dtype=dt, device=dev, attention_dtype=attention_dtype(dev, dt))
    except RuntimeError as exc:  # out of memory on the device
        raise ModelFileError(f"{Path(path).name} does not fit on {dev} as {dt}: {exc}") from None
    return TorchTarget(model, token_piece=token_piece, eog_ids=eog_ids, n_ctx=n_ctx, name=name)
