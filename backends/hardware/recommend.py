"""Rank the speculative methods for a model on this machine by predicted decode speed.

predicted tok/s = plain decoding rate x the method's expected speedup, for methods that fit.

- Plain rate: measured on this model when SpecDeck has run it here (an answer's decode rate,
  or the one-token forward time of its verify-cost curve), else the roofline: bytes
  read per token (every block, the output projection, the KV cache at a typical context) over
  the bandwidth of the device holding them (RAM measured with a copy benchmark; VRAM from the
  card's bus width and memory clock).
- Speedup: measured against interleaved plain decoding by ``specdeck bench`` when known, else
  tau / (cost of verifying k drafted tokens + cost of drafting them), with tau and k measured in
  earlier answers on this model or, failing that, from the method's conservative per-task
  acceptance prior a, at the best k: tau(k) = (1 - a^(k+1)) / (1 - a). The verify cost is the
  model's measured cost curve when SpecDeck has measured one here (it does on first use of a
  drafting method), else a prior: nearly free on a GPU, which is memory-bound; on a CPU a jump
  to a batched kernel plus a share of a forward per token, larger for quantized weights, whose
  dequantization is compute (SmolLM2 on 2 Zen 4 cores, relative to one token: F16 1.97x for 1
  drafted token and 2.37x for 4; Q4_1 2.47x for 3). Methods with a sizer stop
  drafting when it does not pay, so predictions are floored just under 1x.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backends.core.costs import CostModel
from backends.core.errors import SpecDeckError
from backends.drafters import DATASTORE, DRAFT_MODEL, REGISTRY, TASKS, MethodSpec, describe
from backends.hardware.fit import FitReport, RuntimeSettings, file_bytes, method_extra, plan
from backends.hardware.observed import ObservedStore
from backends.hardware.shape import ModelShape, load_shape
from backends.hardware.types import HardwareReport
from backends.models.compat import draft_incompatibility
from backends.models.gguf_info import read_gguf_info

# Verify-cost priors, relative to a one-token forward: (fixed cost of any batch, cost per drafted token).
_VERIFY_COST_PRIOR = {"gpu": (0.0, 0.04), "cpu": (0.8, 0.2), "cpu-quantized": (0.0, 0.5)}
_CONTROLLER_FLOOR = 0.99
_TYPICAL_CONTEXT = 1024


@dataclass(frozen=True)
class Recommendation:
    method: str
    fits: bool
    available: bool  # False when a requirement is missing (e.g. no compatible draft model)
    predicted_tok_s: float | None
    predicted_speedup: float | None
    reason: str
    basis: str  # "measured", "measured acceptance", "prior" or "baseline"
    fit_label: str
    draft_model: str | None = None
    rejected_drafts: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Recommendations:
    model: str
    task: str
    plain_tok_s: float
    plain_basis: str
    ranked: tuple[Recommendation, ...]
    fit: FitReport = field(repr=False)
    compatible_drafts: tuple[ModelShape, ...] = ()  # candidate drafts with the target's vocabulary
    rejected_drafts: tuple[tuple[str, str], ...] = ()  # (file name, why not) for the others

    def to_json(self) -> list[dict]:
        return [asdict(r) | {"rejected_drafts": [{"model": m, "reason": why} for m, why in r.rejected_drafts]}
                for r in self.ranked]


@dataclass(frozen=True)
class _Context:
    shape: ModelShape
    hw: HardwareReport
    rt: RuntimeSettings
    task: str
    store: ObservedStore
    cpu_bw: float
    costs: Callable[[ModelShape, int], CostModel | None]  # (model, gpu layers) -> measured cost curve
    datastore_bytes: int | None = None  # the REST datastore offered, None: none


def recommend(model: str | Path, hw: HardwareReport, *, task: str = "chat", drafts: Sequence[str | Path] = (),
              rt: RuntimeSettings | None = None, cpu_bandwidth: float, store: ObservedStore | None = None,
              target_offers: frozenset[str] = frozenset(), datastore: str | Path | None = None,
              costs: Callable[[ModelShape, int], CostModel | None] = lambda shape, ngl: None) -> Recommendations:
    """Every registered method, best first; ``drafts`` are candidate draft model files, ``datastore``
    a REST datastore for the methods that retrieve (without one they are listed as unavailable)."""
    if task not in TASKS:
        raise SpecDeckError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    ctx = _Context(load_shape(model), hw, rt or RuntimeSettings(), task, store or ObservedStore(), cpu_bandwidth, costs,
                   file_bytes(datastore) if datastore else None)
    base_fit = plan(ctx.shape, hw, ctx.rt)
    plain, basis = _plain_rate(ctx, base_fit)
    compatible, rejected = _draft_candidates(ctx.shape, drafts)
    offers = target_offers | ({DRAFT_MODEL} if compatible else frozenset())
    recs = [_rate(ctx, spec, plain, compatible, rejected, offers) for spec in REGISTRY.values()]
    recs.sort(key=lambda r: (not (r.fits and r.available), -(r.predicted_tok_s or 0.0)))
    return Recommendations(ctx.shape.name, task, plain, basis, tuple(recs), base_fit, tuple(compatible), tuple(rejected))


# -- plain decoding rate ---------------------------------------------------------------------
def roofline_tok_s(shape: ModelShape, fit: FitReport, cpu_bw: float, gpu_bw: float | None) -> float:
    """Bandwidth-bound tokens/s: each device's bytes per token over its bandwidth, summed as time."""
    gpu_blocks = max(0, min(fit.gpu_layers, shape.total_layers) - 1)  # the output layer goes first
    kv_per_pos = _kv_bytes_per_position(fit)
    ctx = _typical_context(fit)
    on_gpu = sum(shape.block_bytes[shape.n_layer - gpu_blocks:]) + gpu_blocks / shape.n_layer * kv_per_pos * ctx
    on_cpu = sum(shape.block_bytes[: shape.n_layer - gpu_blocks]) + (1 - gpu_blocks / shape.n_layer) * kv_per_pos * ctx
    out = shape.output_bytes + shape.other_bytes
    if fit.gpu_layers >= 1:
        on_gpu += out
    else:
        on_cpu += out
    seconds = on_cpu / cpu_bw + (on_gpu / gpu_bw if on_gpu and gpu_bw else 0.0)
    return 1.0 / seconds


def _typical_context(fit: FitReport) -> int:
    return min(_TYPICAL_CONTEXT, fit.n_ctx)


def _kv_bytes_per_position(fit: FitReport) -> float:
    """The target's KV bytes per cached position, all layers (the draft's terms are named "draft ...")."""
    kv_bytes = sum(t.bytes for t in fit.terms if t.name.startswith("KV cache"))
    return kv_bytes / max(1, fit.n_ctx)


def _gpu_bandwidth(ctx: _Context, fit: FitReport) -> float | None:
    gpus = [g for g in ctx.hw.gpus if f"gpu{g.index}" in fit.available]
    return gpus[0].bandwidth_bytes_s if gpus else None


def _plain_rate(ctx: _Context, fit: FitReport) -> tuple[float, str]:
    seen = ctx.store.lookup(ctx.shape.path, "ar", ctx.task)
    if seen and seen.decode_tok_s:
        return seen.decode_tok_s, f"measured here ({seen.n} runs)"
    curve = ctx.costs(ctx.shape, fit.gpu_layers)
    if curve is not None:
        return 1.0 / curve.seconds(0, _typical_context(fit)), "measured here (one-token forward)"
    bw = _gpu_bandwidth(ctx, fit)
    rate = roofline_tok_s(ctx.shape, fit, ctx.cpu_bw, bw)
    where = f"{bw / 1e9:.0f} GB/s VRAM" if fit.gpu_layers and bw else f"{ctx.cpu_bw / 1e9:.0f} GB/s RAM"
    return rate, f"roofline ({where})"


# -- drafts ----------------------------------------------------------------------------------
def _draft_candidates(target: ModelShape, drafts: Sequence[str | Path]) -> tuple[list[ModelShape], list[tuple[str, str]]]:
    """Draft files that share the target's vocabulary and are smaller; the reason for each other."""
    if target.format != "gguf":
        return [], [(str(d), "draft models are GGUF files; this target is a PyTorch model") for d in drafts]
    target_vocab = read_gguf_info(target.path).vocab
    ok, rejected = [], []
    for d in drafts:
        name = Path(d).name
        if Path(d).resolve() == Path(target.path).resolve():
            continue
        try:
            info = read_gguf_info(d)
        except SpecDeckError as exc:
            rejected.append((name, str(exc)))
            continue
        reasons = draft_incompatibility(target_vocab, info.vocab)
        if info.weights_bytes >= sum(target.block_bytes) + target.embd_bytes:
            reasons.append("not smaller than the target, so drafting with it cannot save time")
        if reasons:
            rejected.append((name, "; ".join(reasons)))
        else:
            ok.append(load_shape(d))
    return ok, rejected


# -- one method ------------------------------------------------------------------------------
def _rate(ctx: _Context, spec: MethodSpec, plain: float, drafts: list[ModelShape],
          rejected: list[tuple[str, str]], offers: frozenset[str]) -> Recommendation:
    missing = spec.requires - offers
    if spec.needs_datastore and ctx.datastore_bytes is None:
        missing = missing | {DATASTORE}
    if missing:
        why = f"needs {describe(missing)}"
        if DRAFT_MODEL in missing:
            checked = "the one draft file checked cannot" if len(rejected) == 1 else \
                f"none of the {len(rejected)} draft files checked can"
            why += f"; {checked} (why: given with the drafts)" if rejected else "; none found"
        fit = plan(ctx.shape, ctx.hw, ctx.rt, method_extra(spec, ctx.rt.n_ctx))
        return Recommendation(spec.name, fit.fits, False, None, None, f"{spec.summary} - {why}", "prior", fit.label,
                              rejected_drafts=tuple(rejected))
    candidates: list[ModelShape | None] = list(drafts) if DRAFT_MODEL in spec.requires else [None]
    store_bytes = ctx.datastore_bytes if spec.needs_datastore else 0
    options = [(d, plan(ctx.shape, ctx.hw, ctx.rt, method_extra(spec, ctx.rt.n_ctx, draft=d, datastore_bytes=store_bytes or 0)))
               for d in candidates]
    scored = [(_speedup(ctx, spec, fit, d, plain), d, fit) for d, fit in options]
    (speedup, basis), draft, fit = max(scored, key=lambda s: (s[2].fits, s[0][0]))
    return Recommendation(
        method=spec.name, fits=fit.fits, available=True,
        predicted_tok_s=plain * speedup if fit.fits else None, predicted_speedup=speedup,
        reason=_sentence(spec, speedup, basis, ctx.task, fit, draft), basis=basis, fit_label=fit.label,
        draft_model=Path(draft.path).name if draft else None, rejected_drafts=tuple(rejected),
    )


def _speedup(ctx: _Context, spec: MethodSpec, fit: FitReport, draft: ModelShape | None, plain: float) -> tuple[float, str]:
    if not spec.prior_draft:
        return 1.0, "baseline"
    seen = ctx.store.lookup(ctx.shape.path, spec.name, ctx.task)
    if seen and seen.speedup:
        return seen.speedup, "measured"
    verify = _verify_cost(ctx, fit)
    draft_cost = plain / _draft_rate(ctx, draft, fit) if draft is not None else 0.0

    def gain(tau: float, k: float) -> float:
        return tau / (verify(k) + k * draft_cost)

    if seen and seen.tau and seen.drafted_per_step is not None:
        return max(_CONTROLLER_FLOOR, gain(seen.tau, seen.drafted_per_step)), "measured acceptance"
    a = spec.prior_acceptance.get(ctx.task, 0.0)
    best = max(gain((1 - a ** (k + 1)) / (1 - a), k) for k in range(1, spec.prior_draft + 1))
    return max(_CONTROLLER_FLOOR, best), "prior"


def _verify_cost(ctx: _Context, fit: FitReport) -> Callable[[float], float]:
    """Cost of verifying k drafted tokens relative to a one-token forward (k may be fractional)."""
    curve = ctx.costs(ctx.shape, fit.gpu_layers)
    if curve is not None:
        rel = curve.relative(_typical_context(fit))
        return lambda k: _interpolate(rel, k)
    fixed, per_token = _VERIFY_COST_PRIOR[_regime(ctx.shape, fit)]
    return lambda k: 1.0 + (fixed if k > 0 else 0.0) + per_token * k


def _interpolate(values: list[float], k: float) -> float:
    if k >= len(values) - 1:
        return values[-1] + (values[-1] - values[-2]) * (k - len(values) + 1)
    lo = int(k)
    return values[lo] + (values[lo + 1] - values[lo]) * (k - lo)


def _regime(shape: ModelShape, fit: FitReport) -> str:
    if fit.gpu_layers >= fit.total_layers:
        return "gpu"
    return "cpu-quantized" if shape.quantized else "cpu"


def _draft_rate(ctx: _Context, draft: ModelShape, fit: FitReport) -> float:
    seen = ctx.store.lookup(draft.path, "ar", ctx.task)
    if seen and seen.decode_tok_s:
        return seen.decode_tok_s
    draft_ngl = draft.total_layers if fit.gpu_layers >= fit.total_layers else 0
    curve = ctx.costs(draft, draft_ngl)
    if curve is not None:
        return 1.0 / curve.seconds(0, _typical_context(fit))
    draft_fit = plan(draft, ctx.hw, ctx.rt, gpu_layers=draft_ngl)
    return roofline_tok_s(draft, draft_fit, ctx.cpu_bw, _gpu_bandwidth(ctx, fit))


def _sentence(spec: MethodSpec, speedup: float, basis: str, task: str, fit: FitReport, draft: ModelShape | None) -> str:
    if basis == "baseline":
        return spec.summary
    using = f" ({Path(draft.path).name})" if draft else ""
    how = {"measured": "measured on this model", "measured acceptance": "from acceptance measured on this model",
           "prior": f"a cautious estimate for {task} until SpecDeck has measured it here"}[basis]
    where = "" if fit.fits else f"; {fit.label}"
    return f"{spec.summary}{using} - about {speedup:.2f}x ({how}){where}"
