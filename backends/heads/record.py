"""Self-distillation data: the target's own answers and its hidden state at every position.

A head learns to predict what this model writes, so the data is the model answering prompts
itself (greedy, as it decodes by default), recorded through the engine like any other answer:
``Recorder`` is a drafter that proposes nothing and keeps the hidden states the target returns
(``HIDDEN_STATES``), the prompt's from ``begin`` and one per step from each verify's root row.
Any backend that offers hidden states can be recorded, with no code of its own; one that decodes
several sequences at once (``SEQUENCES``) is recorded faster by ``backends.train.record_together``,
into the same ``Sample``.

One answer is one ``Sample``: tokens [T] (prompt and answer) and states [T - 1, d] float16, the
state of position ``t`` having been computed from tokens ``0..t`` (the last token's state is never
needed: nothing follows it). Samples are stored one safetensors file each, so a recording that was
interrupted resumes at the next prompt.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from backends.core.errors import ModelFileError
from backends.core.protocols import Drafter
from backends.core.types import EMPTY_PROPOSAL, FINAL_STATE, HIDDEN_STATES, LAYER_STATES, Budget, Proposal, TargetOutput, Verdict


@dataclass(frozen=True)
class Sample:
    tokens: np.ndarray  # [T] int32: the prompt, then the answer
    states: np.ndarray  # [T - 1, d] float16: the state after each token but the last (d: the states' width)
    n_prompt: int  # how many of the tokens are the prompt


class Recorder(Drafter):
    """A drafter that drafts nothing and records the target's hidden states (of ``layers``:
    ``Drafter.state_layers``)."""

    def __init__(self, layers: tuple[int, ...] = ()) -> None:
        self.state_layers = tuple(layers)
        inner = any(il != FINAL_STATE for il in self.state_layers)
        self.requires = frozenset({HIDDEN_STATES} | ({LAYER_STATES} if inner else set()))
        self.rows: list[np.ndarray] = []

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        self.rows = [] if hidden is None else [np.asarray(hidden, dtype=np.float16)]

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        return EMPTY_PROPOSAL

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        if out.hidden is None:
            raise ModelFileError("the target returned no hidden states to record")
        self.rows.append(np.asarray(out.hidden[:1], dtype=np.float16))  # the root's state

    def sample(self, prompt: Sequence[int], answer: Sequence[int]) -> Sample:
        """The recorded answer; ``answer`` is what the engine emitted after ``prompt``."""
        tokens = np.array([*prompt, *answer], dtype=np.int32)
        states = np.concatenate(self.rows) if self.rows else np.zeros((0, 0), np.float16)
        n = len(tokens) - 1
        if len(states) < n:
            raise ModelFileError(f"recorded {len(states)} hidden states for {n} positions")
        return Sample(tokens, states[:n], len(prompt))


def sample_numbers(folder: Path) -> list[int]:
    """The sample numbers recorded in ``folder``: its ``NNNNNN.safetensors`` files only, not the
    trainers' checkpoints kept beside them."""
    return sorted(int(p.stem) for p in folder.glob("*.safetensors") if p.stem.isdigit())


class SampleStore:
    """A folder of recorded samples, one file per prompt index, plus a manifest of the source."""

    def __init__(self, folder: Path, source: dict) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        manifest = folder / "source.json"
        if manifest.exists():
            if json.loads(manifest.read_text()) != source:
                raise ModelFileError(f"{folder} holds samples of another recording; pick another --out folder")
        else:
            manifest.write_text(json.dumps(source, indent=1) + "\n")

    def _file(self, index: int) -> Path:
        return self.folder / f"{index:06d}.safetensors"

    def has(self, index: int) -> bool:
        return self._file(index).exists()

    def put(self, index: int, sample: Sample) -> None:
        from safetensors.numpy import save_file

        tmp = self._file(index).with_suffix(".tmp")
        save_file({"tokens": sample.tokens, "states": sample.states,
                   "n_prompt": np.array([sample.n_prompt], dtype=np.int32)}, str(tmp))
        os.replace(tmp, self._file(index))

    def indices(self) -> list[int]:
        return sample_numbers(self.folder)

    def get(self, index: int) -> Sample:
        from safetensors.numpy import load_file

        data = load_file(str(self._file(index)))
        return Sample(data["tokens"], data["states"], int(data["n_prompt"][0]))

    def samples(self) -> Iterator[tuple[int, Sample]]:
        for index in self.indices():
            yield index, self.get(index)
