"""Which lookahead shape (W, N, G) this machine settles on, and what each shape measured.

    python -m backends.bench_lookahead --model smollm2-135m-f16 --per-category 2

Runs lookahead with the adaptive bandit over Spec-Bench prompts (greedy, first turns), then
prints every shape the bandit tried: how often it ran, and its measured tokens per unit of verify
cost relative to plain decoding. On a CPU, where wide verification is dear, it settles on a
narrow shape or on plain decoding; on a GPU on a wide one.
"""

from __future__ import annotations

import argparse
import sys

from backends.bench import default_prompts, load_prompts
from backends.core.types import GenerationSettings
from backends.drafters.lookahead import LookaheadSettings, ShapeBandit
from backends.factory import Session, SessionConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-f16")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--window", type=int, default=LookaheadSettings.window)
    ap.add_argument("--ngram", type=int, default=LookaheadSettings.ngram)
    ap.add_argument("--guesses", type=int, default=LookaheadSettings.guesses)
    args = ap.parse_args(argv)
    settings = LookaheadSettings(window=args.window, ngram=args.ngram, guesses=args.guesses)
    gen = GenerationSettings(max_new_tokens=args.max_new_tokens)
    with Session(SessionConfig(model=args.model)) as session:
        for prompt in load_prompts(default_prompts(), per_category=args.per_category):
            tokens = session.model.chat_prompt([{"role": "user", "content": prompt.turns[0]}])
            session.reset()
            for _ in session.generate("lookahead", tokens, gen, method_settings=vars(settings)):
                pass
        bandit: ShapeBandit = session.memory[("lookahead", settings)]
    w, g = bandit.settled()
    print(f"settled on W={w}, N={settings.ngram}, G={g}" + ("  (plain decoding)" if (w, g) == (0, 0) else ""))
    for shape in [(0, 0), *bandit.shapes]:
        print(f"  W={shape[0]:2} G={shape[1]:2}: chosen {bandit.chosen.get(shape, 0):5} times, "
              f"measured speed {bandit.speed(shape):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
