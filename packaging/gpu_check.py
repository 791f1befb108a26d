"""The GPU check: one run on a machine with a GPU, one table for the README.

    python packaging/gpu_check.py --out gpu-check.md [--model smollm2-135m-f16] [--per-category 2]

What it measures, all in this process, on the GPU module that passed its probe
(backends/models/gpu_runtime.py) and on the CPU for comparison:

1. the backend and device in use, and the offload the fit estimator chose (n_gpu_layers);
2. VRAM: the estimator's GPU terms against what the device reports used after loading (NVML
   where there is an NVIDIA card, else the module's own free-memory figure);
3. greedy output on the GPU against the CPU's, token by token, on Spec-Bench prompts: identical,
   or the first difference and the CPU's top-2 margin there (GPU kernels round differently, so a
   near-tie may flip; a wide margin would be a bug);
4. the verify-cost curve on the GPU (one forward of k drafted tokens relative to one token);
5. `specdeck bench` for ar, pld and draft on the GPU (tokens/s, speedup, J/token from NVML power),
   and `ar` on the CPU for the GPU/CPU ratio;
6. with ``--mtp-model FILE.gguf`` (a model with next-n layers: DeepSeek-V3, GLM-4.5, MiMo, or
   the tiny one tests/mtp_model.py writes), ``ar`` against ``mtp`` on the GPU: tokens/s, tau and
   the acceptance at each draft depth, and whether greedy output stayed identical.

It exits with 2 and says why when no GPU backend runs here. It downloads nothing.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-f16")
    p.add_argument("--draft-model", default="smollm2-135m-q4_1")
    p.add_argument("--per-category", type=int, default=2, help="Spec-Bench prompts per category (6 categories)")
    p.add_argument("--categories", default=None, help="comma-separated Spec-Bench categories (default: all six)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=Path, default=None, help="Spec-Bench question.jsonl (default: the shipped assets/spec_bench)")
    p.add_argument("--mtp-model", type=Path, default=None, help="a GGUF with next-n (MTP) layers: ar vs mtp")
    p.add_argument("--out", type=Path, default=Path("gpu-check.md"))
    args = p.parse_args(argv)
    args.categories = tuple(c.strip() for c in args.categories.split(",")) if args.categories else None

    from backends.models.llama_lib import gpu_runtime

    running = gpu_runtime()
    if running is None or running.backend is None:
        print(f"gpu check: no GPU backend runs here: {running.why if running else 'not probed'}", file=sys.stderr)
        return 2
    lines = [f"# SpecDeck GPU check, {time.strftime('%Y-%m-%d')}", "", f"Backend: {running.why}", ""]
    lines += vram_and_output(args)
    lines += speeds(args)
    if args.mtp_model is not None:
        lines += native_mtp(args)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def vram_and_output(args) -> list[str]:
    """Offload, VRAM estimate against measured, greedy GPU output against the CPU's, cost curve."""
    from backends.bench import default_prompts, load_prompts
    from backends.core.types import GenerationSettings, SamplingSettings
    from backends.factory import Session, SessionConfig

    before = _used_bytes()
    gpu = Session(SessionConfig(model=args.model, n_ctx=4096))
    after = _used_bytes()
    plan = gpu.offload
    estimate = sum(t.bytes for t in plan.terms if t.device != "cpu") if plan else 0
    measured = after - before if before is not None and after is not None else None
    out = [f"Offload: {gpu.placement} (n_gpu_layers {gpu.config.n_gpu_layers} of {gpu.model.n_layer + 1})", "",
           "| VRAM | bytes |", "|---|---|", f"| fit estimate (GPU terms) | {estimate / GIB:.3f} GiB |",
           f"| measured after load | {measured / GIB:.3f} GiB |" if measured is not None else "| measured | not readable |"]
    if measured:
        out.append(f"| estimate / measured | {estimate / measured:.2f} |")
    out.append("")
    prompts = load_prompts(args.prompts or default_prompts(), per_category=args.per_category, categories=args.categories)
    gen = GenerationSettings(max_new_tokens=args.max_new_tokens, sampling=SamplingSettings(temperature=0.0))
    cpu = Session(SessionConfig(model=args.model, n_ctx=4096, n_gpu_layers=0))
    try:
        rows = [_compare(gpu, cpu, gpu.model.chat_prompt([{"role": "user", "content": q.turns[0]}]), gen)
                for q in prompts]
        same = sum(1 for r in rows if r is None)
        out += [f"Greedy output, GPU against CPU, {len(rows)} Spec-Bench prompts x {args.max_new_tokens} tokens: "
                f"{same} identical; " + (", ".join(f"first difference at token {pos} (CPU top-2 margin {m:.3f})"
                                                    for pos, m in (r for r in rows if r is not None)) or "no difference"), ""]
        costs = gpu.cost_model()
        for context in costs.contexts:
            rel = costs.relative(context)
            shown = [k for k in (1, 2, 4, 8, 16, 32, 64) if k < len(rel)]
            out.append(f"Verify cost at {context} tokens of context, relative to one token "
                       f"({costs.seconds(0, context) * 1000:.2f} ms): " + ", ".join(f"{k}: {rel[k]:.2f}" for k in shown))
        out.append("")
    finally:
        cpu.close()
        gpu.close()
    return out


def _compare(gpu, cpu, prompt: list[int], gen) -> tuple[int, float] | None:
    """None when both give the same tokens, else (position, the CPU's top-2 margin there)."""
    from backends.bench import logit_margin
    from backends.core.types import Finished

    def tokens(session) -> list[int]:
        session.reset()
        done = [e for e in session.generate("ar", prompt, gen) if isinstance(e, Finished)][-1]
        return list(done.tokens)

    a, b = tokens(gpu), tokens(cpu)
    if a == b:
        return None
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return pos, logit_margin(cpu, prompt + b[:pos], gen.sampling)[0]


def speeds(args) -> list[str]:
    """`specdeck bench` on the GPU (ar, pld, draft) and ar on the CPU."""
    from backends.bench import BenchConfig, run_bench

    common = dict(model=args.model, per_category=args.per_category, max_new_tokens=args.max_new_tokens,
                  prompts=args.prompts, categories=args.categories)
    on_gpu = run_bench(BenchConfig(methods=("ar", "pld", "draft"), draft_model=args.draft_model, **common),
                       out=io.StringIO(), progress=sys.stderr)
    on_cpu = run_bench(BenchConfig(methods=("ar",), n_gpu_layers=0, **common), out=io.StringIO(), progress=sys.stderr)
    cpu_ar = on_cpu["summary"]["ar"]["overall"]["decode_tok_s"]
    out = ["| method (GPU) | tok/s | speedup over GPU ar | 90% interval | J/token |", "|---|---|---|---|---|"]
    for method, cats in on_gpu["summary"].items():
        g = cats["overall"]
        joules = f"{g['joules_per_token']:.3f}" if g.get("joules_per_token") is not None else "-"
        out.append(f"| {method} | {g['decode_tok_s']:.1f} | {g['speedup']:.2f}x | {g['speedup_low']:.2f}-"
                   f"{g['speedup_high']:.2f} | {joules} |")
    gpu_ar = on_gpu["summary"]["ar"]["overall"]["decode_tok_s"]
    out += ["", f"ar on the CPU: {cpu_ar:.1f} tok/s; ar on the GPU / ar on the CPU: {gpu_ar / cpu_ar:.2f}x", "",
            "Verify costs on the GPU, as the bench measured them: "
            + json.dumps({c: [round(x, 2) for x in v[:17]] for c, v in on_gpu["meta"]["verify_costs"].items()})]
    return out


def native_mtp(args) -> list[str]:
    """`specdeck bench` of ar and mtp on the model with next-n layers, on the GPU."""
    from backends.bench import BenchConfig, run_bench

    result = run_bench(BenchConfig(methods=("ar", "mtp"), model=str(args.mtp_model), per_category=args.per_category,
                                   max_new_tokens=args.max_new_tokens, prompts=args.prompts, categories=args.categories),
                       out=io.StringIO(), progress=sys.stderr)
    out = ["", f"## Native MTP: {args.mtp_model.name}", "",
           "| method (GPU) | tok/s | speedup over ar | tau | acceptance by depth | identical to ar |", "|---|---|---|---|---|---|"]
    for method, cats in result["summary"].items():
        g = cats["overall"]
        depths = " ".join("-" if a is None else f"{a:.0%}" for a in g.get("acceptance_by_position", [])[:4]) or "-"
        out.append(f"| {method} | {g['decode_tok_s']:.1f} | {g['speedup']:.2f}x | {g['tau']:.2f} | {depths} | "
                   f"{g['exact_match_rate']:.0%} of prompts |")
    return out


def _used_bytes() -> int | None:
    """Memory in use on the first GPU: NVML where it reads the card, else ggml's free figure."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVIDIA card or driver: ask the GPU module instead
        from backends.models.gpu_runtime import list_devices

        devices = list_devices()
        return devices[0].total_bytes - devices[0].free_bytes if devices else None


if __name__ == "__main__":
    sys.exit(main())
