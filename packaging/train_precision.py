"""A head trained in float32 and under bfloat16 autocast, on the CPU or a CUDA GPU: the same
recording, seed and steps.

    python packaging/train_precision.py [--model smollm2-135m-f16] [--kind eagle] [--data self]
        [--steps 300] [--precisions bfloat16,float32] [--devices cpu,cuda]

Trains from a recording ``specdeck train`` made before (nothing is recorded here; ``--data``,
``--max-new-tokens`` and ``--follow-ups`` name it as ``specdeck train`` does), one precision
after the other in this process (each precision on each device), and prints for each the wall
time of the run (held-out evaluations included), the final loss and the best held-out agreement
per draft depth. Checkpoints go to a scratch folder, so nothing of a real run is touched. Run it on
a quiet machine. On a machine with a GPU, record first (``specdeck train eagle --model M --data
spec-bench --prompts 100 --steps 1``), then compare: ``--devices cpu,cuda --steps 300``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-f16")
    p.add_argument("--kind", default="eagle", choices=("medusa", "eagle", "eagle3", "mtp"))
    p.add_argument("--data", default="self")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--follow-ups", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precisions", default="bfloat16,float32")
    p.add_argument("--devices", default="cpu", help="cpu, cuda, or both: cpu,cuda")
    args = p.parse_args(argv)

    from backends.factory import Session, SessionConfig
    from backends.heads.files import ModelFingerprint
    from backends.heads.record import SampleStore
    from backends.train import TRAINERS, data_folder, record_layers, sample_numbers

    with Session(SessionConfig(model=args.model, n_ctx=512)) as s:
        path, n_layer = Path(s.model.path), s.model.n_layer
        eog, n_vocab = sorted(s.model.eog_ids), s.model.n_vocab
    fingerprint = ModelFingerprint.of(path)
    needed = record_layers(args.kind, n_layer)
    folder = data_folder(fingerprint, args.data, args.max_new_tokens, needed, args.follow_ups)
    if not sample_numbers(folder):
        print(f"no recording in {folder}: run `specdeck train {args.kind} --model {args.model} --data {args.data}` "
              "first", file=sys.stderr)
        return 1
    samples = list(SampleStore(folder, json.loads((folder / "source.json").read_text())).samples())
    print(f"{args.kind} head, {len(samples)} recorded answers from {folder}, {args.steps} steps, seed {args.seed}")
    for device in args.devices.split(","):
        for precision in args.precisions.split(","):
            with tempfile.TemporaryDirectory() as scratch:
                trainer, positions, _ = TRAINERS[args.kind](samples, path, fingerprint, eog, n_vocab, Path(scratch),
                                                            seed=args.seed, precision=precision, device=device)
                start = time.perf_counter()
                result = trainer.run(args.steps)
                seconds = time.perf_counter() - start
            agreement = " ".join(f"{a:.3f}" for a in result.agreement)
            print(f"{device:>4} {precision:>9} (ran {trainer.precision}): {seconds:.0f} s, loss {result.loss:.4f}, "
                  f"held-out agreement by depth {agreement}, {positions:,} positions", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
