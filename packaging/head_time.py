"""What one draft depth costs each head runner, measured interleaved in one process.

    python packaging/head_time.py [--model smollm2-135m-f16] [--rounds 300]

One row per depth, log-probabilities included (what a chain drafter pays per guess): the
model's EAGLE-3 head run by numpy (``eagle3``) and by llama.cpp beside the target
(``eagle3-native``), its MTP module and EAGLE head (numpy), each after the same 64-row prefix;
the rounds alternate between them and the medians are printed, with one verify of one row on
the target for scale. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PREFIX = 64  # rows already in each head's cache, as after a prompt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-f16")
    p.add_argument("--rounds", type=int, default=300)
    args = p.parse_args(argv)

    from backends.factory import Session, SessionConfig
    from backends.heads.eagle import EagleHead
    from backends.heads.eagle3 import Eagle3Head
    from backends.heads.files import HEAD_KINDS
    from backends.heads.mtp import MTPModuleHead

    with Session(SessionConfig(model=args.model, n_ctx=1024)) as s:
        kinds = s.head_kinds
        heads = {}
        if "eagle3" in kinds:
            head = s.head("eagle3")
            heads["eagle3 (numpy)"] = Eagle3Head(head, s.embeddings)
            heads["eagle3-native (llama.cpp)"] = s.engine_head(head)
        if "mtp" in kinds:
            heads["mtp-trained (numpy)"] = MTPModuleHead(s.head("mtp"), s.embeddings)
        if "eagle" in kinds:
            heads["eagle (numpy)"] = EagleHead(s.head("eagle"), s.embeddings)
        if not heads:
            print(f"no trained heads ({', '.join(HEAD_KINDS)}) for {args.model}", file=sys.stderr)
            return 2
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, s.fingerprint.n_vocab, size=PREFIX + 1)
        caches = {name: _prefilled(h, tokens, rng) for name, h in heads.items()}
        times: dict[str, list[float]] = {name: [] for name in heads}
        for _ in range(args.rounds):
            for name, h in heads.items():
                cache, last = caches[name]
                t0 = time.perf_counter()
                h.log_probs(h.forward(last, tokens[PREFIX:], np.array([PREFIX]), cache, np.ones((1, 1), bool)))
                times[name].append(time.perf_counter() - t0)
                cache.drop_scratch()
        costs = s.cost_model()
        forward = costs.seconds(0, costs.contexts[0])
        print(f"target verify of one row: {forward * 1e3:.2f} ms")
        for name, t in times.items():
            print(f"{name}: {np.median(t) * 1e3:.2f} ms per depth ({np.median(t) / forward:.2f} of a verify)")
    return 0


def _prefilled(head, tokens: np.ndarray, rng) -> tuple[object, np.ndarray]:
    """A cache holding ``PREFIX`` rows of random states, and the last row's output."""
    cache = head.new_cache()
    feats = head.features(rng.normal(size=(PREFIX, head.feature_width)).astype(np.float32))
    out = head.forward(feats, tokens[:PREFIX], np.arange(PREFIX), cache, np.tril(np.ones((PREFIX, PREFIX), bool)))
    cache.commit()
    return cache, out[-1:].copy()


if __name__ == "__main__":
    sys.exit(main())
