"""The child process that runs llama.cpp's CPU code where dying is allowed (see llama_runtime).

    python -m backends.models.llama_probe score MODULE...   # ggml's score of each CPU variant
    python -m backends.models.llama_probe probe MODULE|-    # decode through every weight type
    python -m backends.models.llama_probe gpu CPU GPU_MODULE # a GPU module's devices, a decode on them

It prints one JSON object a line and flushes after each, so when a signal kills it the parent
knows the last stage it reached ("decoding a batch of 17 tokens on Q8_0"). The bundled model
(Q4_1) is re-quantized into a scratch folder as Q4_K_M, Q8_0 and F16 (about 4 s), unless the
catalog already holds those variants: each weight type has its own matmul kernels, and one of
them may be the one with the instruction the machine refuses.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# (catalog id that may already exist, llama.cpp file type to derive it with)
WEIGHT_TYPES = (("smollm2-135m-q4_1", None), ("smollm2-135m-q4_k_m", "Q4_K_M"),
                ("smollm2-135m-q8_0", "Q8_0"), ("smollm2-135m-f16", "F16"))
BATCH = 17  # past llama.cpp's matrix-vector path: the matrix-matrix kernels run too
GPU_CLEAR_MARGIN = 1.0  # a top-2 logit gap no GPU rounding closes (Q4_1 batch noise on a CPU: 0.17)


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
    """(label, path) for each weight type, deriving the missing ones from the bundled file.

    ``SPECDECK_PROBE_MODEL=FILE`` probes with that one file instead, where the bundled model is
    not installed (the GPU check on a machine that gets only the source tree)."""
    from backends.models.catalog import CATALOG, entry_path, is_present, quantize

    given = os.environ.get("SPECDECK_PROBE_MODEL")
    if given:
        yield Path(given).name, Path(given)
        return
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


def _decode_through(lib, label: str, path: Path, n_gpu_layers: int = 0, where: str = "this CPU") -> np.ndarray:
    """Load, then decode a batch and one token; the logits must be finite. Returns every row's
    logits ([BATCH + 1, vocab])."""
    emit(stage=f"loading the {label} model" + (" onto the GPU" if n_gpu_layers else ""))
    mparams = lib.llama_model_default_params()
    mparams.n_gpu_layers = n_gpu_layers
    model = lib.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load the {label} model {path}")
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 64, 32, 32
    cparams.no_perf = True
    ctx = lib.llama_init_from_model(model, cparams)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = lib.llama_batch_init(32, 0, 1)
    rows = []
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
                raise RuntimeError(f"the {label} kernels give non-finite logits on {where}")
            rows.append(np.array(logits))
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    return np.concatenate(rows)


def gpu(cpu_module: str, module: str) -> None:
    """Load the GPU ``module`` beside the CPU code, list its devices, then decode the bundled model
    fully offloaded: finite logits, and the CPU's top token wherever the CPU's top two are clearly
    apart (GPU kernels round differently, so near-ties may flip)."""
    from backends.models import gpu_runtime, llama_lib

    emit(stage=f"loading {Path(module).name}")
    llama_lib.pin_cpu_module(None if cpu_module == "-" else cpu_module, gpu_module=module)
    lib = llama_lib.llama()
    emit(stage="listing the GPU devices")
    devices = gpu_runtime.list_devices()
    emit(devices=[vars(d) for d in devices])
    if not devices:
        emit(error="it sees no GPU (a Vulkan driver that offers only a CPU renderer such as llvmpipe is not used; "
                   "GGML_VK_VISIBLE_DEVICES=0 forces it)")
        return
    label, path = next(_models(Path(tempfile.gettempdir())))  # the bundled Q4_1
    on_cpu = _decode_through(lib, label, path)
    on_gpu = _decode_through(lib, label, path, n_gpu_layers=999, where=devices[0].description)
    top2 = np.sort(on_cpu, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > GPU_CLEAR_MARGIN
    differ = clear & (on_cpu.argmax(axis=1) != on_gpu.argmax(axis=1))
    if differ.any():
        emit(error=f"its results differ from the CPU's at {int(differ.sum())} of {int(clear.sum())} clear positions "
                   f"(largest logit difference {float(np.abs(on_cpu - on_gpu).max()):.2f})")
        return
    emit(ok=True, max_logit_difference=float(np.abs(on_cpu - on_gpu).max()))


def main(argv: list[str]) -> int:
    start = time.perf_counter()
    try:
        if argv[:1] == ["score"]:
            score(argv[1:])
        elif argv[:1] == ["probe"] and len(argv) == 2:
            probe(argv[1])
        elif argv[:1] == ["gpu"] and len(argv) == 3:
            gpu(argv[1], argv[2])
        else:
            emit(error="usage: llama_probe score MODULE... | probe MODULE|- | gpu CPU_MODULE|- GPU_MODULE")
            return 2
    except Exception as exc:  # the parent turns this into a reason line; a signal needs no catch
        emit(error=f"{type(exc).__name__}: {exc}")
        return 1
    emit(seconds=round(time.perf_counter() - start, 3))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
