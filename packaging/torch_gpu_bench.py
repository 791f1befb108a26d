"""The PyTorch backend's bench on a CUDA GPU: one run on a lent machine, one table for the README.

    python packaging/torch_gpu_bench.py --model PATH --out torch-gpu.md [--draft-model PATH]
                                        [--per-category 10] [--max-new-tokens 128] [--prompts FILE]

``PATH`` is a 1B-8B model: a Hugging Face folder (config.json + safetensors) or a GGUF. Every
method runs on SpecDeck's torch model in bfloat16 on the GPU, interleaved per prompt with plain
decoding in the same process (``specdeck bench --backend torch``): ar, pld, lookahead, self, and
the trained-head methods (eagle2, eagle3, medusa, mtp-trained) whose heads exist for the model;
beside them transformers' own generate on the same weights and device (hf-ar, hf-pld, and
hf-assisted with ``--draft-model``) when transformers is installed, and llama.cpp's plain decoding
for a GGUF (``llamacpp:ar``). It writes the bench's table, the summary per method (tokens/s,
speedup over torch ``ar``, tau, acceptance per position, exact match with ``ar``) and the GPU in
use to ``--out`` (and the records beside it as JSON). It exits with 2 and says why when torch
sees no CUDA GPU; it downloads nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEAD_METHODS = {"eagle": "eagle2", "eagle3": "eagle3", "medusa": "medusa", "mtp": "mtp-trained"}


def methods_for(model: Path, *, draft: bool) -> list[str]:
    """The methods worth running for this model here (heads only where some exist for it)."""
    from backends.heads.files import ModelFingerprint, find_heads

    methods = ["ar", "pld", "lookahead", "self"]
    if model.is_file():
        fingerprint = ModelFingerprint.of(model)
        methods += [m for kind, m in HEAD_METHODS.items() if find_heads(model, kind, fingerprint=fingerprint)]
        methods.append("llamacpp:ar")
    if draft:
        methods.append("draft")
    if importlib.util.find_spec("transformers") is not None:
        methods += ["hf-ar", "hf-pld"] + (["hf-assisted"] if draft else [])
    return methods


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="a Hugging Face folder or a GGUF (1B-8B)")
    p.add_argument("--draft-model", default=None, help="a GGUF draft model with the same vocabulary")
    p.add_argument("--out", type=Path, default=Path("torch-gpu.md"))
    p.add_argument("--per-category", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=Path, default=None, help="Spec-Bench question.jsonl (default: the shipped assets/spec_bench)")
    p.add_argument("--methods", default=None, help="comma-separated, instead of the list chosen for the model")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("torch is not installed: pip install 'specdeck[torch]' (a CUDA build of torch)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"torch {torch.__version__} sees no CUDA GPU here; nothing to measure", file=sys.stderr)
        return 2
    from backends.bench import BenchConfig, run_bench, write_json

    methods = args.methods.split(",") if args.methods else methods_for(args.model, draft=args.draft_model is not None)
    config = BenchConfig(model=str(args.model), methods=tuple(methods), draft_model=args.draft_model,
                         prompts=args.prompts, per_category=args.per_category, max_new_tokens=args.max_new_tokens,
                         backend="torch", dtype="bfloat16", n_gpu_layers=-1)
    table = io.StringIO()
    result = run_bench(config, out=table)
    gpu = torch.cuda.get_device_properties(0)
    header = (f"# PyTorch backend on {gpu.name} ({gpu.total_memory / 2**30:.0f} GiB), bfloat16, torch {torch.__version__}\n\n"
              f"Model: `{args.model}`; {result['meta']['prompts']} Spec-Bench prompts, {args.max_new_tokens} new tokens, "
              f"greedy; speedups against the torch backend's `ar`, interleaved per prompt.\n\n")
    args.out.write_text(header + table.getvalue())
    write_json(result, args.out.with_suffix(".json"))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
