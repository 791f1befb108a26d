"""Opening a model on the PyTorch backend: where it runs, in which precision, and its target.

Precision: ``auto`` is bfloat16 on a CUDA GPU that supports it (float16 otherwise). On a CPU it
is the weight type whose one-row matrix products run fastest here, timed once per process on
weights read from memory (``cpu_weight_dtype``): decoding a token is almost all such products.
torch 2.13's float16 one-row kernel (x86: AVX2 and AVX-512) streams weights from memory far faster
than its bfloat16 one: on 2 AMD EPYC Zen 4 cores (AVX512-BF16), 3072x576, float16 129 us,
bfloat16 237 us, float32 603 us; SmolLM2-135M's token 14.4 ms in float16, 26.0 ms in bfloat16. float16 weights keep float32 activations (their range is
too small for some models' residual stream) and, on a CPU, float32 attention, which is faster than
half precision there even with native bfloat16 (one token after 1024: 29.4 ms against 44.8 ms).
"""

from __future__ import annotations

import functools
import time
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
    """(torch device, the weights' torch dtype) for a model: a CUDA GPU when torch sees one, else the CPU."""
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
    return dev, cpu_weight_dtype()


def attention_dtype(dev, dt):
    """The KV cache's and attention's dtype for weights in ``dt``: float32 on a CPU, where
    half-precision attention is slow with or without native bfloat16 (SmolLM2 bfloat16, one token
    after 1024: AMD EPYC AVX2-only, 47 ms against 31 ms in float32; AMD EPYC Zen 4 with AVX512-BF16,
    44.8 against 29.4 ms); ``dt`` on a GPU."""
    torch = require_torch()
    return torch.float32 if dev.type == "cpu" else dt


def activation_dtype(dt):
    """The residual stream's dtype for weights in ``dt``: float32 beside float16, whose largest
    value (65504) Gemma-3-270M's residual passes (1e5: every logit NaN); ``dt`` otherwise."""
    torch = require_torch()
    return torch.float32 if dt == torch.float16 else dt


PROBE_BYTES = 128 << 20  # float16 weights the probe cycles through: more than a desktop CPU's caches hold


@functools.cache
def cpu_weight_dtype():
    """The dtype whose one-row matrix products run fastest on this CPU, timed once per process
    (about 0.3 s): products of one row with 2048x1024 matrices, cycling through ``PROBE_BYTES`` of
    float16 weights (twice that of float32) so that, as in a model's forward, the weights come from
    memory, not from a cache. With one 4096x1024 matrix kept in cache, bfloat16 tied with float16
    on an AMD EPYC Zen 4 and the choice flipped from run to run; from memory float16 takes 135-195
    us, bfloat16 235-312 us, float32 531-547 us (six processes), as a token sees them."""
    torch = require_torch()
    times = {dt: _product_seconds(torch, dt) for dt in (torch.float16, torch.bfloat16, torch.float32)}
    return min(times, key=times.get)


def _product_seconds(torch, dt) -> float:
    """Fastest of 4 passes after an untimed one (threads start, clocks rise): the mean time of
    ``x @ w.T`` over the probe's matrices in ``dt``."""
    import torch.nn.functional as F

    rows, cols = 2048, 1024
    count = PROBE_BYTES // (rows * cols * 2)
    mats = [torch.full((rows, cols), 0.01, dtype=dt) for _ in range(count)]
    x = torch.full((1, cols), 0.01, dtype=dt)
    best = float("inf")
    for round_ in range(5):
        start = time.perf_counter()
        for w in mats:
            F.linear(x, w)
        if round_:
            best = min(best, (time.perf_counter() - start) / count)
    return best


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
        model = Transformer(shape, weights, dtype=dt, device=dev, attention_dtype=attention_dtype(dev, dt),
                            activation_dtype=activation_dtype(dt))
    except RuntimeError as exc:  # out of memory on the device
        raise ModelFileError(f"{Path(path).name} does not fit on {dev} as {dt}: {exc}") from None
    return TorchTarget(model, token_piece=token_piece, eog_ids=eog_ids, n_ctx=n_ctx, name=name)
