"""Wiring a backend to a method, in one place used by the CLI chat, the bench and the GUI worker.

A ``Session`` holds what is expensive to load (the target model and context, an optional draft
model) and builds a fresh, cheap drafter for every answer. Adding a backend touches no drafter and
adding a drafter touches no backend: both only meet here, through the registry and the protocols.

Example::

    with Session(SessionConfig(model="smollm2-135m-f16")) as s:
        prompt = s.model.chat_prompt([{"role": "user", "content": "Hi"}])
        for event in s.generate("pld", prompt, GenerationSettings(max_new_tokens=32)):
            ...
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from backends.core.costs import measure_verify_costs, time_forwards
from backends.core.engine import generate
from backends.core.errors import IncompatibleDraftError, SpecDeckError
from backends.core.protocols import Drafter
from backends.core.types import Event, GenerationSettings, SamplingSettings
from backends.drafters import DRAFT_MODEL, DrafterResources, describe, method_spec
from backends.llamacpp.model import LlamaModel
from backends.llamacpp.target import LlamaTarget
from backends.models.catalog import resolve_model
from backends.models.compat import draft_incompatibility

COST_CURVE_LENGTH = 16  # longest draft the measured cost curve covers


@dataclass(frozen=True)
class SessionConfig:
    model: str  # a known id or a path to a .gguf file
    draft_model: str | None = None
    n_ctx: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int = 0
    flash_attn: str = "auto"


class Session:
    """A loaded target (and maybe a draft model), ready to answer with any method it can run."""

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self.model = LlamaModel(resolve_model(config.model), n_gpu_layers=config.n_gpu_layers)
        self.draft_model: LlamaModel | None = None
        self.draft_target: LlamaTarget | None = None
        self._costs: tuple[float, ...] | None = None
        self._draft_cost: float | None = None
        try:
            self.target = self._context(self.model)
            if config.draft_model:
                self._load_draft(config.draft_model)
        except BaseException:
            self.close()
            raise

    def _context(self, model: LlamaModel) -> LlamaTarget:
        n_ctx = min(self.config.n_ctx, model.n_ctx_train) if model.n_ctx_train > 0 else self.config.n_ctx
        return LlamaTarget(model, n_ctx=n_ctx, n_threads=self.config.n_threads, flash_attn=self.config.flash_attn)

    def _load_draft(self, spec: str) -> None:
        draft = LlamaModel(resolve_model(spec), n_gpu_layers=self.config.n_gpu_layers)
        reasons = draft_incompatibility(self.model.vocab_info, draft.vocab_info)
        if reasons:
            draft.close()
            raise IncompatibleDraftError(f"{spec} cannot draft for {self.config.model}: " + "; ".join(reasons))
        self.draft_model = draft
        self.draft_target = self._context(draft)

    def reset(self) -> None:
        """Empty every KV cache (the next answer computes its whole prompt)."""
        self.target.reset()
        if self.draft_target is not None:
            self.draft_target.reset()

    # -- capabilities and costs ----------------------------------------------------------------
    @property
    def offers(self) -> frozenset[str]:
        return self.target.offers | ({DRAFT_MODEL} if self.draft_target is not None else frozenset())

    def costs(self) -> tuple[float, ...]:
        """The target's relative verify cost for 0..16 drafted tokens, measured once per session."""
        if self._costs is None:
            self._costs = measure_verify_costs(self.target, COST_CURVE_LENGTH, reps=3)
        return self._costs

    def set_costs(self, costs: Sequence[float], draft_cost: float | None = None) -> None:
        """Use costs measured elsewhere (the bench measures once and shares them)."""
        self._costs = tuple(costs)
        if draft_cost is not None:
            self._draft_cost = draft_cost

    def draft_cost(self) -> float:
        """One draft-model forward relative to one target forward."""
        if self._draft_cost is None:
            if self.draft_target is None:
                return 0.0
            target_s = time_forwards(self.target, 0, reps=5)[0]
            draft_s = time_forwards(self.draft_target, 0, reps=5)[0]
            self._draft_cost = draft_s / target_s
        return self._draft_cost

    # -- answering -----------------------------------------------------------------------------
    def drafter(self, method: str, sampling: SamplingSettings, **settings: Any) -> Drafter:
        spec = method_spec(method)
        missing = spec.requires - self.offers
        if missing:
            raise SpecDeckError(f"{method} needs {describe(missing)}, which this session does not have")
        resources = DrafterResources(
            sampling=sampling,
            target_vocab=self.model.n_vocab,
            costs=self.costs,
            draft=self.draft_target,
            draft_cost=self.draft_cost,
        )
        drafter = spec.build(spec.settings(**settings), resources)
        missing = drafter.requires - self.target.offers
        if missing:
            raise SpecDeckError(f"{method} with these settings needs {describe(missing)}")
        return drafter

    def generate(
        self,
        method: str,
        prompt: Sequence[int],
        settings: GenerationSettings,
        *,
        cancel: threading.Event | None = None,
        method_settings: dict[str, Any] | None = None,
    ) -> Iterator[Event]:
        drafter = self.drafter(method, settings.sampling, **(method_settings or {}))
        return generate(self.target, drafter, prompt, settings, cancel=cancel, method=method)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        for obj in (getattr(self, "draft_target", None), getattr(self, "target", None),
                    getattr(self, "draft_model", None), getattr(self, "model", None)):
            if obj is not None:
                obj.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
