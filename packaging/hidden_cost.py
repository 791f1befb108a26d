"""What returning hidden states costs a llama.cpp verify, measured interleaved in one process.

    python packaging/hidden_cost.py [--model smollm2-135m-f16] [--rows 1,5,17] [--rounds 200]

Each round verifies the same root and chain twice on two contexts over one model, one keeping
hidden states and one not, in alternating order, and rolls both back; the ratio of the summed
times per row count is what a head method pays per verify for its states. Run it on a quiet
machine (it prints the CPU other processes used meanwhile).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.core.timing import CpuWatch  # noqa: E402
from backends.core.types import Proposal, Verdict  # noqa: E402
from backends.llamacpp.model import LlamaModel  # noqa: E402
from backends.llamacpp.target import LlamaTarget  # noqa: E402
from backends.models.catalog import resolve_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-f16")
    ap.add_argument("--rows", default="1,5,17")
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    model = LlamaModel(resolve_model(args.model))
    prompt = model.tokenize("Write a short story about a lighthouse keeper who finds a message in a bottle. " * 4)
    plain, keeping = LlamaTarget(model, n_ctx=1024), LlamaTarget(model, n_ctx=1024)
    plain.prefill(prompt[:-1])
    keeping.prefill(prompt[:-1], hidden=True)
    with CpuWatch() as watch:
        print(f"{model.name} ({model.weight_type}), {plain.n_threads} threads, prompt {len(prompt)} tokens")
        print("| rows | plain ms | with states ms | ratio |\n|---|---|---|---|")
        for rows in (int(r) for r in args.rows.split(",")):
            chain = Proposal.chain(prompt[1:rows])
            times = {"plain": 0.0, "hidden": 0.0}
            for i in range(args.rounds):
                order = [("plain", plain), ("hidden", keeping)] if i % 2 == 0 else [("hidden", keeping), ("plain", plain)]
                for name, target in order:
                    start = time.perf_counter()
                    out = target.verify(prompt[-1], chain)
                    if name == "hidden":
                        assert out.hidden is not None and out.hidden.shape[0] == rows
                    times[name] += time.perf_counter() - start
                    target.commit(Verdict((), (0,), chain.size, chain.size))
                    target.truncate(len(prompt) - 1)
            ratio = times["hidden"] / times["plain"]
            print(f"| {rows} | {1000 * times['plain'] / args.rounds:.2f} | {1000 * times['hidden'] / args.rounds:.2f} "
                  f"| {ratio:.3f} |")
    print(f"other processes used {watch.other_cores:.2f} cores meanwhile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
