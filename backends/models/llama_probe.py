"""The child process that runs llama.cpp's CPU code where dying is allowed (see llama_runtime).

    python -m backends.models.llama_probe score MODULE...   # ggml's score of each CPU variant
    python -m backends.models.llama_probe probe MODULE|-    # decode through every weight type

It prints one JSON object a line and flushes after each, so when a signal kills it the parent
knows the last stage it reached ("decoding a batch of 17 tokens on Q8_0"). The bundled model
(Q4_1) is re-quantized into a scratch folder as Q4_K_M, Q8_0 and F16 (about 4 s), unless the
catalog already holds those variants: each weight type has its own matmul kernels, and one of
them may be the one with the instruction the machine refuses.
"""

from __future__ import annotations

import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# (catalog id that may already exist, llama.cpp file type to derive it with)
WEIGHT_TYPES = (("smollm2-135m-q4_1", None), ("smollm2-135m-q4_k_m", "Q4_K_M"),
                ("smollm2-135m-q8_0", "Q8_0"), ("smollm2-135m-f16", "F16"))
BATCH = 17  # past llama.cpp's matrix-vector path: the matrix-matrix kernels run too


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def score(modules: list[str]) -> None:
    """Load each module and ask it how well it fits this CPU (0: it cannot run here)."""
    import llama_cpp  # noqa: F401 - loads libggml-base, which every variant links against

    from backends.models.llama_runtime import _variant_name
    for path in modules:
        emit(stage=f"loading {Path(path).name}")
        lib = ctypes.CDLL(path)
        fn = getattr(lib, "ggml_backend_score", None)
        value = int(fn()) if fn is not None else 0
        emit(variant=_variant_name(Path(path)), score=value)


def probe(module: str) -> None:
    from backends.models import llama_lib

    emit(stage="loading the CPU module")
    llama_lib.pin_cpu_module(None if module == "-" else module)
    lib = llama_lib.llama()
    with tempfile.TemporaryDirectory(prefix="specdeck-probe-") as scratch:
        for label, path in _models(Path(scratch)):
            _decode_through(lib, label, path)
    emit(ok=True)


def _models(scratch: Path):
    """(label, path) for each weight type, deriving the missing ones from the bundled file."""
    from backends.models.catalog import CATALOG, entry_path, is_present, quantize

    emit(stage="finding the bundled model")
    bundled = entry_path(WEIGHT_TYPES[0][0])
    for model_id, ftype in WEIGHT_TYPES:
        label = ftype or "Q4_1"
        if ftype is None:
            yield label, bundled
            continue
        present = model_id in CATALOG and is_present(model_id)
        path = entry_path(model_id) if present else scratch / f"probe-{label}.gguf"
        if not present:
            emit(stage=f"quantizing to {label}")
            quantize(bundled, path, ftype)
        yield label, path


def _decode_through(lib, label: str, path: Path) -> None:
    """Load, then decode a batch and one token; the logits must be finite."""
    emit(stage=f"loading the {label} model")
    mparams = lib.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load the {label} model {path}")
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 64, 32, 32
    cparams.no_perf = True
    ctx = lib.llama_init_from_model(model, cparams)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = lib.llama_batch_init(32, 0, 1)
    try:
        tokens = [1 + (i * 37) % 1000 for i in range(BATCH + 1)]
        for stage, chunk, start in ((f"decoding a batch of {BATCH} tokens", tokens[:BATCH], 0),
                                    ("decoding one token", tokens[BATCH:], BATCH)):
            emit(stage=f"{stage} on {label}")
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, start + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            batch.n_tokens = len(chunk)
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama_decode failed on the {label} model")
            logits = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(len(chunk), n_vocab))
            if not np.isfinite(logits).all():
                raise RuntimeError(f"the {label} kernels give non-finite logits on this CPU")
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def main(argv: list[str]) -> int:
    start = time.perf_counter()
    try:
        if argv[:1] == ["score"]:
            score(argv[1:])
        elif argv[:1] == ["probe"] and len(argv) == 2:
            probe(argv[1])
        else:
            emit(error="usage: llama_probe score MODULE... | probe MODULE|-")
            return 2
    except Exception as exc:  # the parent turns this into a reason line; a signal needs no catch
        emit(error=f"{type(exc).__name__}: {exc}")
        return 1
    emit(seconds=round(time.perf_counter() - start, 3))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
