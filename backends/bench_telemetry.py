"""Does the telemetry sampler slow generation? Plain decoding with and without it, interleaved.

    python -m backends.bench_telemetry --model smollm2-135m-f16 --per-category 5

Each Spec-Bench prompt is answered twice by ``ar``, once with a running sampler (the GUI's
default 2 Hz: CPU %, RAM, RAPL and NVML when present) and once without, in alternating order.
The ratio of the two decode rates is the sampler's cost; the acceptance bar is >= 0.98.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from backends.bench import EngineRunner, decode_rate, default_prompts, load_prompts, play  # noqa: E402
from backends.drafters import baseline_method  # noqa: E402
from backends.core.timing import CpuWatch  # noqa: E402
from backends.core.types import GenerationSettings  # noqa: E402
from backends.factory import Session, SessionConfig  # noqa: E402
from backends.hardware.telemetry import Sampler  # noqa: E402


def measure(model: str, *, per_category: int, max_new_tokens: int, interval: float) -> dict:
    prompts = load_prompts(default_prompts(), per_category=per_category)
    gen = GenerationSettings(max_new_tokens=max_new_tokens)
    rates: dict[bool, list[tuple[int, float]]] = {True: [], False: []}
    with Session(SessionConfig(model=model)) as session, CpuWatch() as watch:
        runner = EngineRunner(session, baseline_method(), {})
        play(runner, session, prompts[0], gen)  # warm-up
        for i, prompt in enumerate(prompts):
            for sampling in ((True, False) if i % 2 else (False, True)):
                sampler = Sampler.for_this_machine(interval=interval).start() if sampling else None
                try:
                    runs = play(runner, session, prompt, gen)
                finally:
                    if sampler is not None:
                        sampler.stop()
                tokens = sum(r.stats.new_tokens - r.stats.first_step_tokens for r in runs)
                rates[sampling].append((tokens, tokens / decode_rate(runs)))
    on, off = (sum(t for t, _ in rates[k]) / sum(s for _, s in rates[k]) for k in (True, False))
    return {"prompts": len(prompts), "with_sampler_tok_s": on, "without_tok_s": off, "ratio": on / off,
            "other_cpu_cores": watch.other_cores}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-f16")
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples (0.5 = 2 Hz)")
    args = p.parse_args()
    r = measure(args.model, per_category=args.per_category, max_new_tokens=args.max_new_tokens, interval=args.interval)
    print(f"{r['prompts']} prompts: {r['without_tok_s']:.1f} tok/s without the sampler, {r['with_sampler_tok_s']:.1f} "
          f"with it: ratio {r['ratio']:.3f} (other processes used {r['other_cpu_cores']:.2f} cores meanwhile)")


if __name__ == "__main__":
    main()
