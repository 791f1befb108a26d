"""Measure what loading a model really costs this process, to hold the fit estimate to account.

Run in a fresh interpreter (``python -m backends.hardware.memcheck MODEL N_CTX``) so nothing
else in the caller's process muddies the figure: the child imports SpecDeck, notes its resident
set, loads the model on the CPU with SpecDeck's own context settings, prefills a prompt longer
than one micro-batch and verifies a 16-token draft (the largest working set a chat reaches),
then reports the growth as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the warm window. "


def measure_growth(model: str | os.PathLike, n_ctx: int, *, timeout: float = 300) -> int:
    """Resident-set growth in bytes of a fresh process that loads ``model`` at ``n_ctx`` tokens."""
    out = subprocess.run([sys.executable, "-m", "backends.hardware.memcheck", str(model), str(n_ctx)],
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"memory check failed: {out.stderr.strip()[-2000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["growth_bytes"])


def _child(model: str, n_ctx: int) -> dict:
    import psutil

    from backends.core.types import Proposal
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget

    proc = psutil.Process()
    before = proc.memory_info().rss
    loaded = LlamaModel(model)
    target = LlamaTarget(loaded, n_ctx=n_ctx)
    tokens = loaded.tokenize(_PROMPT * 80)[: max(8, min(600, n_ctx - 40))]
    target.prefill(tokens[:-1])
    target.verify(tokens[-1], Proposal(tokens=tuple(tokens[:16]), parents=tuple(range(-1, 15))))
    after = proc.memory_info().rss
    target.close()
    loaded.close()
    return {"rss_before": before, "rss_after": after, "growth_bytes": after - before}


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], int(sys.argv[2]))))
