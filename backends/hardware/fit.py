"""Will this model (and method) fit, and where: labelled memory terms per device.

The terms mirror what SpecDeck's llama.cpp target actually allocates (``LlamaTarget``: a unified
KV cache for ``n_seq_max`` = 32 tree paths, ``n_ubatch`` = 512, full-size sliding-window cache,
which is llama.cpp's context default):

- weights: exact tensor bytes. llama.cpp offloads the *last* N of n_layer + 1 "layers" (the
  output projection counts as one and goes first); the token embedding always stays on the CPU,
  and a tied output projection is duplicated onto the output layer's device.
- KV cache: cells (n_ctx rounded up to 256) x KV heads x (key + value length) x cache type, per
  layer, on that layer's device. Sliding-window layers are capped at their window only when the
  context is created with ``swa_full = False``.
- compute buffer: on a GPU llama.cpp reserves the worst case for a full micro-batch, which is the
  logits of n_ubatch rows (n_ubatch x n_vocab x 4 bytes: 96 MiB for SmolLM2, 512 MiB for Gemma-3)
  and that memory is really taken. On the CPU the same reservation is only address space: pages
  become resident when touched, and SpecDeck never asks for more than a verify step's rows of
  logits, so the CPU term is the activation peak of a full prompt micro-batch plus those rows.
- output buffer and runtime: the host logits buffer (32 rows) and llama.cpp's own tables
  (about 20 MiB plus ~125 bytes per vocabulary entry, measured on SmolLM2 and Gemma-3).

``tests/test_fit.py`` checks the CPU total against the measured growth of a process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from backends.core.errors import SpecDeckError
from backends.core.types import HIDDEN_STATES, LAYER_STATES
from backends.drafters import DRAFT_MODEL, HEAD_PREFIX, MethodSpec
from backends.hardware.shape import ModelShape
from backends.hardware.types import GpuInfo, HardwareReport

MiB = 1024**2
GiB = 1024**3
VRAM_MARGIN = 1 * GiB
MAX_CTX = 1 << 24  # 16M tokens: beyond any model's training context; larger is a typo
_KV_TYPES = {"f32": (4, 1), "f16": (2, 1), "bf16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32), "q4_1": (20, 32),
             "q5_0": (22, 32), "q5_1": (24, 32)}  # bytes per block, elements per block
_RUNTIME_BASE = 20 * MiB
_RUNTIME_PER_VOCAB = 125
_GPU_CONTEXT = 384 * MiB  # CUDA context + cuBLAS workspace: typical, not measured here (no GPU)
_TORCH_RUNTIME = 400 * MiB  # PyTorch CPU libraries once imported: typical

CPU = "cpu"

FITS_IN_VRAM = "fits in VRAM"
ON_CPU = "runs on CPU (fits in RAM)"
DOES_NOT_FIT = "does not fit"


@dataclass(frozen=True)
class RuntimeSettings:
    """How the model will be run; the defaults are SpecDeck's own llama.cpp target settings."""

    n_ctx: int = 4096
    n_ubatch: int = 512
    n_seq_max: int = 32
    cache_type: str = "f16"
    flash_attn: bool = True
    swa_full: bool = True
    verify_rows: int = 17  # the most logits rows one verify step asks for (16 drafted + 1)

    def __post_init__(self) -> None:
        if not 16 <= self.n_ctx <= MAX_CTX:
            raise SpecDeckError(f"context length {self.n_ctx} is out of range (16 .. {MAX_CTX:,} tokens)")
        if self.cache_type not in _KV_TYPES:
            raise SpecDeckError(f"KV cache type must be one of {', '.join(_KV_TYPES)}, got {self.cache_type!r}")


@dataclass(frozen=True)
class MemoryTerm:
    name: str
    bytes: int
    device: str  # "cpu" or "gpu0", "gpu1", ...


@dataclass(frozen=True)
class FitReport:
    model: str
    label: str
    fits: bool
    gpu_layers: int
    total_layers: int
    max_gpu_layers: int
    n_ctx: int
    terms: tuple[MemoryTerm, ...]
    available: dict[str, int]  # device -> bytes usable (VRAM free minus the margin, RAM available)
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    def device_bytes(self, device: str) -> int:
        return sum(t.bytes for t in self.terms if t.device == device)

    def to_json(self) -> dict:
        out = asdict(self)
        out["total_bytes"] = self.total_bytes
        out["device_bytes"] = {d: self.device_bytes(d) for d in sorted({t.device for t in self.terms})}
        return out


# -- terms -------------------------------------------------------------------------------------
def kv_cells(shape: ModelShape, rt: RuntimeSettings, layer: int) -> int:
    cells = _pad(min(rt.n_ctx, MAX_CTX), 256)
    if shape.swa[layer] and shape.swa_window and not rt.swa_full:
        cells = min(cells, _pad(shape.swa_window * rt.n_seq_max + rt.n_ubatch, 256))
    return cells


def kv_layer_bytes(shape: ModelShape, rt: RuntimeSettings, layer: int) -> int:
    block, per_block = _KV_TYPES[rt.cache_type] if shape.format == "gguf" else (_kv_bytes(shape), 1)
    elements = kv_cells(shape, rt, layer) * shape.head_kv[layer] * (shape.key_length + shape.value_length)
    return -(-elements // per_block) * block


def activation_bytes(shape: ModelShape, rt: RuntimeSettings) -> int:
    """Peak f32 activations of one micro-batch: FFN gate/up/act plus residual streams (+ KQ without flash attention)."""
    n = min(rt.n_ubatch, rt.n_ctx)
    peak = n * 4 * (3 * shape.n_ff + 2 * shape.n_embd)
    if not rt.flash_attn:
        peak += n * _pad(rt.n_ctx, 256) * shape.n_head * 4
    return peak


def model_terms(shape: ModelShape, rt: RuntimeSettings, gpu_layers: int, gpu: str | None, *, label: str = "",
                shared_runtime: bool = True) -> list[MemoryTerm]:
    """Every allocation of one loaded model with ``gpu_layers`` of its n_layer + 1 layers on ``gpu``."""
    prefix = f"{label} " if label else ""
    ngl = max(0, min(gpu_layers, shape.total_layers)) if gpu else 0
    first_gpu_block = shape.total_layers - ngl  # blocks at or after this index are offloaded
    out_dev = gpu if ngl >= 1 and gpu else CPU
    terms: list[MemoryTerm] = []
    for dev, layers in ((CPU, range(0, min(first_gpu_block, shape.n_layer))), (gpu, range(first_gpu_block, shape.n_layer))):
        if dev is None or not layers:
            continue
        terms.append(MemoryTerm(f"{prefix}weights: {len(layers)} blocks", sum(shape.block_bytes[i] for i in layers), dev))
        cells = sorted({kv_cells(shape, rt, i) for i in layers})
        kv_name = f"{prefix}KV cache ({_kv_type(shape, rt)}, {'/'.join(map(str, cells))} cells, {len(layers)} layers)"
        terms.append(MemoryTerm(kv_name, sum(kv_layer_bytes(shape, rt, i) for i in layers), dev))
    terms.append(MemoryTerm(f"{prefix}weights: token embeddings", shape.embd_bytes, CPU))
    out_bytes = shape.other_bytes + (shape.output_bytes if (not shape.tied_output or out_dev != CPU) else 0)
    tied = "" if not shape.tied_output else " (copy of the tied embeddings)" if out_dev != CPU else \
        " (reads the token embeddings: its norm only)"
    terms.append(MemoryTerm(f"{prefix}weights: output layer{tied}", out_bytes, out_dev))
    terms += _compute_terms(shape, rt, out_dev, gpu if ngl else None, prefix)
    terms += _runtime_terms(shape, gpu if ngl else None, prefix, shared_runtime)
    return [t for t in terms if t.bytes > 0]


def reserved_compute_bytes(shape: ModelShape, rt: RuntimeSettings, *, with_output: bool) -> int:
    """llama.cpp's worst-case compute buffer: a full micro-batch with logits for every row.

    The logits of n_ubatch rows plus the last hidden states dominate whenever the output layer is
    on the device (llama.cpp logs 98.25 MiB for SmolLM2 and 514.5 MiB for Gemma-3 at n_ubatch 512).
    """
    n = min(rt.n_ubatch, rt.n_ctx)
    return max(activation_bytes(shape, rt), (n * shape.n_vocab * 4 if with_output else 0) + 2 * n * shape.n_embd * 4)


def output_buffer_bytes(shape: ModelShape, rt: RuntimeSettings) -> int:
    """Host logits buffer: one row per sequence slot at first, grown to the largest verify."""
    return max(rt.n_seq_max, rt.verify_rows) * shape.n_vocab * 4


def _compute_terms(shape: ModelShape, rt: RuntimeSettings, out_dev: str, gpu: str | None, prefix: str) -> list[MemoryTerm]:
    rows = max(rt.n_seq_max, rt.verify_rows)
    terms = [MemoryTerm(f"{prefix}output buffer (logits, {rows} rows)", output_buffer_bytes(shape, rt), CPU)]
    if gpu is not None:
        reserved = reserved_compute_bytes(shape, rt, with_output=out_dev == gpu)
        terms.append(MemoryTerm(f"{prefix}compute buffer (reserved for {min(rt.n_ubatch, rt.n_ctx)}-token batches)", reserved, gpu))
    cpu_logits = rt.verify_rows * shape.n_vocab * 4 if out_dev == CPU else 0
    terms.append(MemoryTerm(f"{prefix}compute buffer (working set)", activation_bytes(shape, rt) + cpu_logits, CPU))
    return terms


def _runtime_terms(shape: ModelShape, gpu: str | None, prefix: str, shared: bool) -> list[MemoryTerm]:
    if shape.format == "safetensors":
        base = _TORCH_RUNTIME if shared else 0
        terms = [MemoryTerm(f"{prefix}PyTorch runtime", base, CPU)]
    else:
        base = _RUNTIME_BASE if shared else 0
        terms = [MemoryTerm(f"{prefix}llama.cpp runtime and tokenizer tables", base + _RUNTIME_PER_VOCAB * shape.n_vocab, CPU)]
    if gpu is not None and shared:
        terms.append(MemoryTerm("GPU runtime (CUDA context, cuBLAS workspace)", _GPU_CONTEXT, gpu))
    return terms


# -- planning ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Extra:
    """Memory a method adds: a draft model and trained heads (both on the GPU when the whole target
    is), and terms with a fixed place (n-gram pools, a memory-mapped REST datastore: RAM)."""

    draft: ModelShape | None = None
    heads_bytes: int = 0  # a Medusa/EAGLE/MTP heads file (safetensors): its size is its memory
    terms: tuple[MemoryTerm, ...] = field(default_factory=tuple)


def method_extra(spec: MethodSpec, n_ctx: int, *, draft: ModelShape | None = None, heads_bytes: int = 0,
                 datastore_bytes: int = 0, hidden_size: int = 0) -> Extra:
    """What a method adds to its target's memory: its own pool, a draft only if it needs one, and
    for methods that read hidden states the states the target keeps (float16, one per position;
    ``FUSED_LAYERS`` layers side by side for methods that read layer inputs)."""
    from backends.heads.eagle3 import FUSED_LAYERS

    width = hidden_size * (FUSED_LAYERS if LAYER_STATES in spec.requires else 1)
    states = n_ctx * width * 2 if HIDDEN_STATES in spec.requires else 0
    terms = (MemoryTerm(f"{spec.name} pool", spec.pool_bytes(n_ctx), CPU),
             MemoryTerm("REST datastore (memory-mapped)", datastore_bytes, CPU),
             MemoryTerm("hidden states kept for the head (float16)", states, CPU))
    return Extra(draft=draft if DRAFT_MODEL in spec.requires else None, heads_bytes=heads_bytes,
                 terms=tuple(t for t in terms if t.bytes))


def trained_head_bytes(spec: MethodSpec, model: str | Path, n_ctx: int = 0) -> int:
    """Memory of the trained heads a method needs for ``model``, as found for it (numpy runs them
    in float32: twice their float16 file, plus the target's output rows a file does not store), and
    of a head's own KV cache for ``n_ctx`` positions (float32 keys and values, for heads with
    attention: EAGLE); 0 when it needs none or none is there yet."""
    import json

    from backends.heads.files import find_heads, stem

    total = 0
    for kind in sorted(r[len(HEAD_PREFIX):] for r in spec.requires if r.startswith(HEAD_PREFIX)):
        found = find_heads(model, kind)
        if found:
            total += 2 * file_bytes(stem(found[0]).with_name(stem(found[0]).name + ".safetensors"))
            try:
                meta = json.loads(Path(found[0]).read_text())
                config = meta["config"]
                total += n_ctx * 2 * int(config.get("n_kv_head", 0)) * int(config.get("head_dim", 0)) * 4
                rows = int(config.get("draft_vocab", 0)) * int(config.get("d_model", 0)) * 4  # float32
                total += rows * len(meta.get("from_target", ()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass  # an unreadable config is refused, with its reason, when the head is loaded
    return total


def file_bytes(path: str | Path) -> int:
    """Size of a heads file or datastore; a missing one is a clear error."""
    try:
        return Path(path).stat().st_size
    except OSError as exc:
        raise SpecDeckError(f"cannot read {path}: {exc.strerror or exc}") from exc


def plan(shape: ModelShape, hw: HardwareReport, rt: RuntimeSettings | None = None, extra: Extra = Extra(), *,
         gpu_layers: int | None = None) -> FitReport:
    """The most GPU layers that fit (or the given ``gpu_layers``), with every term and a label."""
    rt = _effective(shape, rt or RuntimeSettings())
    notes = list(_context_notes(shape, rt))
    gpu, gpu_note = _usable_gpu(shape, hw)
    notes += [gpu_note] if gpu_note else []
    available = {CPU: hw.ram.available_bytes}
    if gpu is not None:
        free = gpu.vram_free_bytes if gpu.vram_free_bytes is not None else gpu.vram_total_bytes or 0
        available[f"gpu{gpu.index}"] = max(0, free - VRAM_MARGIN)
    gpu_name = f"gpu{gpu.index}" if gpu is not None else None
    max_fit = _max_fit(shape, rt, gpu_name, extra, available)
    # More layers on the GPU only ever take memory off the CPU, so the most that fit is the best plan.
    ngl = 0 if gpu_name is None else max_fit if gpu_layers is None else max(0, min(gpu_layers, shape.total_layers))
    terms = _all_terms(shape, rt, ngl, gpu_name, extra)
    fits = all(sum(t.bytes for t in terms if t.device == d) <= cap for d, cap in available.items())
    return FitReport(
        model=shape.name, label=_label(fits, ngl, shape.total_layers), fits=fits, gpu_layers=ngl,
        total_layers=shape.total_layers, max_gpu_layers=max_fit, n_ctx=rt.n_ctx, terms=tuple(terms),
        available=available, notes=tuple(notes),
    )


def _all_terms(shape: ModelShape, rt: RuntimeSettings, ngl: int, gpu: str | None, extra: Extra) -> list[MemoryTerm]:
    terms = model_terms(shape, rt, ngl, gpu)
    # Drafts and heads go to the GPU only when the whole target is there; otherwise to the CPU.
    full = gpu is not None and ngl >= shape.total_layers
    if extra.heads_bytes:
        terms.append(MemoryTerm("heads (trained draft heads)", extra.heads_bytes, gpu if full and gpu else CPU))
    if extra.draft is not None:
        draft_rt = _effective(extra.draft, rt)
        terms += model_terms(extra.draft, draft_rt, extra.draft.total_layers if full else 0, gpu if full else None,
                             label="draft", shared_runtime=False)
    return terms + list(extra.terms)


def _max_fit(shape: ModelShape, rt: RuntimeSettings, gpu: str | None, extra: Extra, available: dict[str, int]) -> int:
    if gpu is None:
        return 0
    for ngl in range(shape.total_layers, -1, -1):
        terms = _all_terms(shape, rt, ngl, gpu, extra)
        if sum(t.bytes for t in terms if t.device == gpu) <= available[gpu]:
            return ngl
    return 0


def torch_dtype_bytes(hw: HardwareReport | None) -> int:
    """What the PyTorch backend's ``auto`` precision takes per weight on this machine, without
    importing torch: half precision on an NVIDIA GPU, and on a CPU for which torch has vectorized
    half-precision kernels (x86 with F16C, ARM with fp16), where the loader's timing picks float16
    or bfloat16 (``backends.pytorch.loader.cpu_weight_dtype``); float32 otherwise."""
    if hw is None:
        return 4
    return 2 if _nvidia(hw) or {"f16c", "fp16", "avx512_bf16", "amx_bf16"} & set(hw.cpu.flags) else 4


def torch_kv_bytes(hw: HardwareReport | None) -> int:
    """The PyTorch backend's KV cache per element: the weights' dtype on an NVIDIA GPU, float32 on
    a CPU (``backends.pytorch.loader.attention_dtype``)."""
    return torch_dtype_bytes(hw) if hw is not None and _nvidia(hw) else 4


def _nvidia(hw: HardwareReport) -> bool:
    return any(g.vendor == "nvidia" and g.vram_total_bytes for g in hw.gpus)


def _label(fits: bool, ngl: int, total: int) -> str:
    if not fits:
        return DOES_NOT_FIT
    if ngl >= total:
        return FITS_IN_VRAM
    if ngl > 0:
        return f"partial offload ({ngl} of {total} layers)"
    return ON_CPU


def _effective(shape: ModelShape, rt: RuntimeSettings) -> RuntimeSettings:
    """SpecDeck caps the context at the model's training length, as its session does."""
    if shape.n_ctx_train and rt.n_ctx > shape.n_ctx_train:
        return replace(rt, n_ctx=shape.n_ctx_train)
    return rt


def _context_notes(shape: ModelShape, rt: RuntimeSettings) -> list[str]:
    return [f"context capped at the model's training length, {shape.n_ctx_train} tokens"] if rt.n_ctx == shape.n_ctx_train else []


def _usable_gpu(shape: ModelShape, hw: HardwareReport) -> tuple[GpuInfo | None, str | None]:
    """The GPU with the most free memory that this model's backend can use, or why none."""
    gpus = [g for g in hw.gpus if g.vram_total_bytes]
    if not gpus:
        return None, None
    if shape.format == "gguf":
        build = hw.llama_cpp
        if build is None or not build.gpu_offload:
            return None, f"the installed llama.cpp is a CPU-only build, so {gpus[0].name} is not used (install a CUDA or Vulkan build)"
    elif not any(g.vendor == "nvidia" for g in gpus):
        return None, "PyTorch models use an NVIDIA GPU through CUDA; none found"
    else:
        gpus = [g for g in gpus if g.vendor == "nvidia"]
    best = max(gpus, key=lambda g: g.vram_free_bytes if g.vram_free_bytes is not None else g.vram_total_bytes or 0)
    note = "several GPUs: the estimate places layers on the one with the most free memory" if len(gpus) > 1 else None
    return best, note


def _kv_type(shape: ModelShape, rt: RuntimeSettings) -> str:
    return rt.cache_type if shape.format == "gguf" else f"{_kv_bytes(shape) * 8}-bit"


def _kv_bytes(shape: ModelShape) -> int:
    return shape.kv_dtype_bytes or shape.weight_dtype_bytes


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to
