"""``specdeck hw``, ``specdeck fit`` and ``specdeck recommend``: the hardware layer on the command line."""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
from pathlib import Path

from backends.hardware.fit import FitReport, RuntimeSettings
from backends.hardware.offload import with_gpu_module

MiB = 1024**2


def add_commands(sub: argparse._SubParsersAction) -> None:
    from backends.drafters import REGISTRY, TASKS

    hw = sub.add_parser("hw", help="what this machine has: CPU, RAM, GPUs, llama.cpp build")
    hw.add_argument("--json", action="store_true")
    hw.add_argument("--bandwidth", action="store_true", help="also measure RAM bandwidth (cached)")

    fit = sub.add_parser("fit", help="will a model fit in VRAM/RAM, with every memory term")
    _model_args(fit)
    fit.add_argument("--method", default="ar", choices=sorted(REGISTRY))
    fit.add_argument("--draft-model", default=None, help="draft model (id or .gguf path) for the draft method")
    fit.add_argument("--n-gpu-layers", type=int, default=None, help="check this many layers instead of the most that fit")
    fit.add_argument("--heads", default=None, help="a trained heads file (.safetensors) the method loads")
    fit.add_argument("--datastore", default=None, help="a REST datastore file (memory-mapped)")
    fit.add_argument("--measure", action="store_true",
                     help="also load the model on the CPU in a fresh process and compare its memory growth")

    rec = sub.add_parser("recommend", help="rank the methods for a model on this machine")
    _model_args(rec)
    rec.add_argument("--task", default="chat", choices=TASKS)
    rec.add_argument("--draft-model", action="append", default=[], help="a candidate draft (default: the catalog's present models)")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="known model id, a .gguf file, or a Hugging Face model folder")
    p.add_argument("--ctx", type=int, default=4096, help="context length in tokens")
    p.add_argument("--cache-type", default="f16", help="KV cache type: f16, q8_0, q4_0")
    p.add_argument("--json", action="store_true")


def _model_path(spec: str) -> Path:
    from backends.models.catalog import CATALOG, resolve_model

    path = Path(spec)
    if spec not in CATALOG and (path.is_dir() or path.suffix == ".safetensors"):
        return path
    return resolve_model(spec)


def cmd_hw(args: argparse.Namespace) -> int:
    from backends.hardware.bandwidth import cpu_bandwidth
    from backends.hardware.detect import detect_hardware, format_report

    report = detect_hardware()
    bandwidth = cpu_bandwidth(report.cpu, report.ram.total_bytes) if args.bandwidth else None
    if args.json:
        data = report.to_json()
        if bandwidth is not None:
            data["ram"]["bandwidth_bytes_s"] = bandwidth
        print(json.dumps(data, indent=1))
        return 0
    print(format_report(report))
    if bandwidth is not None:
        print(f"RAM bandwidth  {bandwidth / 1e9:.1f} GB/s (copy, one thread per core)")
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    from backends.drafters import DRAFT_MODEL, method_spec
    from backends.hardware.detect import detect_hardware
    from backends.hardware.fit import file_bytes, method_extra, plan, trained_head_bytes
    from backends.hardware.shape import load_shape

    spec = method_spec(args.method)
    if DRAFT_MODEL in spec.requires and not args.draft_model:
        from backends.core.errors import SpecDeckError

        raise SpecDeckError(f"{args.method} needs --draft-model")
    rt = RuntimeSettings(n_ctx=args.ctx, cache_type=args.cache_type)
    draft = load_shape(_model_path(args.draft_model)) if args.draft_model and DRAFT_MODEL in spec.requires else None
    shape = load_shape(_model_path(args.model))
    heads = file_bytes(args.heads) if args.heads else trained_head_bytes(spec, _model_path(args.model), rt.n_ctx)
    extra = method_extra(spec, rt.n_ctx, draft=draft, heads_bytes=heads, hidden_size=shape.n_embd,
                         datastore_bytes=file_bytes(args.datastore) if args.datastore else 0)
    report = plan(shape, with_gpu_module(detect_hardware()), rt, extra, gpu_layers=args.n_gpu_layers)
    data = report.to_json()
    if args.measure:
        data["measured"] = _measure(shape, report)
    print(json.dumps(data, indent=1) if args.json else format_fit(report, data.get("measured"), given=args.model))
    return 0 if report.fits else 1


def _measure(shape, report: FitReport) -> dict:
    """The model alone on the CPU: measured growth of a fresh process against the CPU estimate."""
    from backends.core.errors import SpecDeckError
    from backends.hardware.detect import detect_hardware
    from backends.hardware.fit import plan
    from backends.hardware.memcheck import measure_growth

    if shape.format != "gguf":
        raise SpecDeckError("--measure loads GGUF models with llama.cpp; this is a PyTorch model")
    alone = plan(shape, detect_hardware(), RuntimeSettings(n_ctx=report.n_ctx), gpu_layers=0).total_bytes
    measured = measure_growth(shape.path, report.n_ctx)
    return {"estimate_bytes": alone, "measured_bytes": measured, "error": alone / measured - 1}


def measured_costs(shape, gpu_layers: int):
    """The verify-cost curve a chat session measured for this model with default settings, if any."""
    from backends.core.costs import CostModel
    from backends.llamacpp.target import default_threads
    from backends.models.cost_cache import cost_curve_file, load_cost_curves

    if shape.format != "gguf":
        return None
    curves = load_cost_curves(cost_curve_file(shape.path, default_threads(), gpu_layers, "auto"))
    return CostModel(curves) if curves else None


def format_fit(report: FitReport, measured: dict | None = None, *, given: str = "") -> str:
    lines = [f"{named_as_given(given, report.model)} at {report.n_ctx} tokens of context: {report.label}"]
    for device in sorted({t.device for t in report.terms}):
        used, cap = report.device_bytes(device), report.available.get(device)
        room = f" of {cap / MiB:,.0f} MiB usable" if cap is not None else ""
        lines.append(f"  {device.upper()}: {used / MiB:,.1f} MiB{room}")
        lines += [f"    {t.bytes / MiB:10,.1f} MiB  {t.name}" for t in report.terms if t.device == device]
    if report.available.keys() - {"cpu"}:
        lines.append(f"  most GPU layers that fit: {report.max_gpu_layers} of {report.total_layers}")
    lines += [f"  note: {n}" for n in report.notes]
    if measured:
        lines.append(f"  measured: the model alone on the CPU grew a fresh process by {measured['measured_bytes'] / MiB:,.1f} MiB; "
                     f"estimated {measured['estimate_bytes'] / MiB:,.1f} MiB ({measured['error']:+.1%})")
    return "\n".join(lines)


def cmd_recommend(args: argparse.Namespace) -> int:
    from backends.hardware.bandwidth import cpu_bandwidth
    from backends.hardware.detect import detect_hardware
    from backends.hardware.recommend import recommend
    from backends.core.types import LAYER_STATES, NATIVE_EAGLE3, NATIVE_MTP
    from backends.llamacpp.model import mtp_in_header
    from backends.llamacpp.states import LAYER_INPUT_GRAPHS
    from backends.models.gguf_info import read_gguf_info
    from backends.llamacpp.target import LlamaTarget
    from backends.models.catalog import CATALOG, is_present, resolve_model

    from backends.drafters import head_requirement
    from backends.heads.files import HEAD_KINDS, find_heads

    hw = with_gpu_module(detect_hardware())
    drafts = [_model_path(d) for d in args.draft_model] or [resolve_model(m) for m in CATALOG if is_present(m)]
    model = _model_path(args.model)
    heads = frozenset(head_requirement(k) for k in HEAD_KINDS if find_heads(model, k))  # trained for this model
    heads |= {NATIVE_MTP} if mtp_in_header(model) else set()  # its own next-n block
    if read_gguf_info(model).architecture in LAYER_INPUT_GRAPHS:  # layer inputs, and llama.cpp runs EAGLE-3 heads
        heads |= {LAYER_STATES, NATIVE_EAGLE3}
    result = recommend(model, hw, task=args.task, drafts=drafts,
                       rt=RuntimeSettings(n_ctx=args.ctx, cache_type=args.cache_type),
                       cpu_bandwidth=cpu_bandwidth(hw.cpu, hw.ram.total_bytes), target_offers=LlamaTarget.offers | heads,
                       costs=measured_costs)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 0
    print(_recommendations_text(args.model, result))
    return 0


def named_as_given(given: str, internal: str) -> str:
    """The model as the user named it (an id, or a file's name), then ``internal`` (the file's own
    ``general.name``, or its file name) in brackets where it says something else: users tell their
    files apart by the names they gave."""
    name = Path(given).name if given else internal
    return name if internal in ("", name) else f"{name} ({internal})"


def _recommendations_text(given: str, result) -> str:
    """The ranking as a table whose columns line up, named as the user named the model; each draft file that
    cannot serve is listed once, under the table, not inside every method that needs one; the
    reasons wrap at the terminal's width."""
    lines = [f"{named_as_given(given, result.model)}, task {result.task}: plain decoding about {result.plain_tok_s:.0f} tok/s, {result.plain_basis}"]
    number = len(str(len(result.ranked))) + 1  # "9." or "14."
    width = max(len(r.method) for r in result.ranked)
    columns, indent = max(60, shutil.get_terminal_size().columns - 1), " " * (number + 1)
    for i, r in enumerate(result.ranked, 1):
        speed = f"{r.predicted_tok_s:6.0f} tok/s {r.predicted_speedup:5.2f}x" if r.predicted_tok_s else f"{'-':>19}"
        state = r.fit_label if r.available else "unavailable"
        lines.append(f"{f'{i}.':<{number}} {r.method:<{width}} {speed}  [{state}]")
        lines.append(textwrap.fill(r.reason, columns, initial_indent=indent, subsequent_indent=indent))
    rejected = {m: why for r in result.ranked for m, why in r.rejected_drafts}
    if rejected:
        lines.append("Draft model files that cannot draft for this model:")
        lines += [textwrap.fill(f"{model}: {why}", columns, initial_indent="  ", subsequent_indent="    ")
                  for model, why in rejected.items()]
    return "\n".join(lines)
