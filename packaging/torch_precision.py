"""What each weight type costs and how far its logits drift on the PyTorch backend, on this CPU.

    .venv/bin/python packaging/torch_precision.py [--model smollm2-135m-f16] [--prompts 20]

Prints, for float16, bfloat16 and float32 weights in the activation and attention types the loader
gives them (``backends.pytorch.loader``), and for half-precision attention beside them: one token's
forward after 128 and 1024 tokens of context (median of 25, this process), then each half type's
largest logit difference from float32 over the test prompts, whether every position's top token
matches, and the largest residual value (float16's limit is 65504). The loader's own choice for
``auto`` is printed first. Numbers in the README's PyTorch section came from this script.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from backends.core.timing import median_seconds
from backends.llamacpp.model import LlamaModel
from backends.models.catalog import entry_path
from backends.pytorch.loader import activation_dtype, attention_dtype, cpu_weight_dtype
from backends.pytorch.model import Transformer
from backends.pytorch.weights import load_weights

CPU = torch.device("cpu")
PROMPTS = ["Name three primary colors.", "Write one sentence about the ocean.", "What is 12 times 12?",
           "def fib(n):\n    # return the n-th Fibonacci number\n", "Which planet is closest to the sun?",
           "Write a SQL query that counts the rows of a table named users.", "Describe a cat in five words.",
           "Say hello in Spanish, French and Italian.", "Give a synonym for 'happy'.", "Complete: The quick brown fox"]


def build(shape, weights, dt: torch.dtype, attention: torch.dtype | None = None) -> Transformer:
    """The model as the loader builds it for weights ``dt`` (``attention`` overrides its attention type)."""
    return Transformer(shape, dict(weights), dtype=dt, attention_dtype=attention or attention_dtype(CPU, dt),
                       activation_dtype=activation_dtype(dt))


def token_ms(model: Transformer, context: int) -> float:
    """Median time of one token's forward after ``context`` tokens, in ms."""
    cache = model.new_cache(context + 1)
    ids = torch.randint(100, 1000, (context,))
    model.forward(ids, torch.arange(context), cache, start=0, mask=torch.ones(context, context, dtype=torch.bool).tril(),
                  logits_rows=torch.zeros(0, dtype=torch.long))
    token, position, mask = torch.tensor([5]), torch.tensor([context]), torch.ones(1, context + 1, dtype=torch.bool)
    return median_seconds(lambda: model.forward(token, position, cache, start=context, mask=mask), repeats=25) * 1e3


def logits_and_states(model: Transformer, prompts: list[list[int]]) -> list[tuple[np.ndarray, float]]:
    """Every position's logits [n, vocab] and the largest |residual| of each prompt."""
    out = []
    layers = tuple(range(model.shape.n_layer))
    for ids in prompts:
        n = len(ids)
        logits, states = model.forward(torch.tensor(ids), torch.arange(n), model.new_cache(n), start=0,
                                       mask=torch.ones(n, n, dtype=torch.bool).tril(), states=layers)
        out.append((logits.numpy(), float(states.abs().max())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-f16")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    print(f"auto on this CPU: {cpu_weight_dtype()}")
    path = entry_path(args.model)
    shape, weights = load_weights(path)
    half = (torch.float16, torch.bfloat16)
    for dt, attention in [(torch.float16, None), (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16),
                          (torch.float32, None)]:
        model = build(shape, weights, dt, attention)
        times = ", ".join(f"after {c}: {token_ms(model, c):.1f} ms" for c in (128, 1024))
        print(f"{str(dt):15} activations {str(model.activation_dtype):15} attention {str(model.attention_dtype):15} {times}")
    vocab = LlamaModel(path, vocab_only=True)
    prompts = [vocab.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    exact = logits_and_states(build(shape, weights, torch.float32), prompts)
    for dt in half:
        got = logits_and_states(build(shape, weights, dt), prompts)
        worst = max(float(np.abs(a[0] - b[0]).max()) for a, b in zip(exact, got))
        same = all((a[0].argmax(-1) == b[0].argmax(-1)).all() for a, b in zip(exact, got))
        print(f"{str(dt):15} largest logit difference from float32 {worst:.3f}, every top token the same: {same}, "
              f"largest |residual| {max(b[1] for b in got):.0f} (float32 {max(a[1] for a in exact):.0f})")


if __name__ == "__main__":
    main()
