"""What a serving engine says about its own speculative decoding, in SpecDeck's terms.

A remote server drafts and verifies by itself; SpecDeck only sees text arrive. The acceptance it
charts therefore comes from the server's own counters, read before and after (and during) an
answer, and the difference is what that answer (plus anything else the server ran meanwhile)
drafted and accepted:

- **vLLM v1** (0.8 and later) exports Prometheus counters on ``/metrics``:
  ``vllm:spec_decode_num_drafts_total`` (verify steps that carried a draft),
  ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
  ``..._num_accepted_tokens_per_pos_total{position="0"}`` (0-based), one series per engine and
  model. Mean acceptance length τ = 1 + accepted / drafts (the bonus token counted, as SpecDeck
  counts it).
- **vLLM v0** (0.7-0.8 with the old engine) exports the gauges
  ``vllm:spec_decode_draft_acceptance_rate`` and ``vllm:spec_decode_efficiency`` and the counters
  ``vllm:spec_decode_num_draft_tokens_total`` / ``..._num_accepted_tokens_total`` /
  ``..._num_emitted_tokens_total`` (no count of drafts: τ is unknown there).
- **llama-server** reports per request: the final streamed chunk (or the response) has
  ``timings`` with ``predicted_per_second`` and, only when drafting happened, ``draft_n`` and
  ``draft_n_accepted``.

The exposition text is parsed with ``prometheus_client``'s parser, never by hand.

Example: counters before ``drafts=10, draft_tokens=40, accepted=25`` and after
``drafts=30, draft_tokens=120, accepted=90`` give ``SpecDelta(drafts=20, drafted=80,
accepted=65)``: acceptance 81%, τ = 1 + 65/20 = 4.25.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from backends.hardware.types import GpuSample

_V1 = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_emitted_tokens": "emitted",  # v0 only
}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
_V0_GAUGES = {"vllm:spec_decode_draft_acceptance_rate": "acceptance_rate", "vllm:spec_decode_efficiency": "efficiency"}


@dataclass(frozen=True)
class SpecCounters:
    """One reading of a server's speculative-decoding counters (summed over its engines).

    ``drafts`` is None where the server does not count drafts (vLLM v0); the gauges are the v0
    server's own running rates, None elsewhere."""

    drafts: float | None
    draft_tokens: float
    accepted: float
    per_position: tuple[float, ...] = ()  # accepted at draft position 1, 2, ... (v1)
    acceptance_rate: float | None = None  # v0 gauge
    efficiency: float | None = None  # v0 gauge

    def minus(self, before: SpecCounters | None) -> SpecDelta:
        """What happened between ``before`` and this reading (a restarted server, whose
        counters went down, counts from zero)."""
        if before is None or self.draft_tokens < before.draft_tokens:
            before = SpecCounters(0.0 if self.drafts is not None else None, 0.0, 0.0)
        drafts = None if self.drafts is None or before.drafts is None else self.drafts - before.drafts
        width = max(len(self.per_position), len(before.per_position))
        mine = self.per_position + (0.0,) * (width - len(self.per_position))
        theirs = before.per_position + (0.0,) * (width - len(before.per_position))
        return SpecDelta(drafts=drafts, drafted=self.draft_tokens - before.draft_tokens,
                         accepted=self.accepted - before.accepted,
                         per_position=tuple(a - b for a, b in zip(mine, theirs)))


@dataclass(frozen=True)
class SpecDelta:
    """Drafted and accepted tokens over a span of time (one answer, one chart tick)."""

    drafts: float | None
    drafted: float
    accepted: float
    per_position: tuple[float, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted > 0 else None

    @property
    def tau(self) -> float | None:
        """Tokens per verify step, the bonus token included; None without a count of drafts."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        """Share of drafts whose token at position d + 1 was accepted."""
        return tuple(a / self.drafts for a in self.per_position) if self.drafts else ()


def parse_vllm(text: str, *, model: str | None = None) -> SpecCounters | None:
    """vLLM's speculative-decoding counters from ``/metrics`` text, None when it has none (a
    server started without a draft method). ``model`` keeps only that model's series."""
    totals: dict[str, float] = {}
    gauges: dict[str, float] = {}
    positions: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removesuffix("_total")
        for sample in family.samples:
            if model is not None and sample.labels.get("model_name", model) != model:
                continue
            if name in _V1 and sample.name.endswith("_total"):
                totals[_V1[name]] = totals.get(_V1[name], 0.0) + sample.value
            elif name == _PER_POSITION and sample.name.endswith("_total"):
                position = int(sample.labels.get("position", "0"))
                positions[position] = positions.get(position, 0.0) + sample.value
            elif name in _V0_GAUGES:
                gauges[_V0_GAUGES[name]] = sample.value
    if "draft_tokens" not in totals and not gauges:
        return None
    per_position = tuple(positions.get(i, 0.0) for i in range(max(positions) + 1)) if positions else ()
    return SpecCounters(drafts=totals.get("drafts"), draft_tokens=totals.get("draft_tokens", 0.0),
                        accepted=totals.get("accepted", 0.0), per_position=per_position,
                        acceptance_rate=gauges.get("acceptance_rate"), efficiency=gauges.get("efficiency"))


@dataclass(frozen=True)
class ServerTimings:
    """llama-server's ``timings`` of one request."""

    predicted_per_second: float | None
    predicted_n: int | None
    prompt_n: int | None
    draft: SpecDelta | None  # None: the server did not draft for this request


def parse_timings(timings: object) -> ServerTimings | None:
    """A llama-server ``timings`` object; ``draft_n``/``draft_n_accepted`` appear only when it
    drafted. None for anything that is not such an object."""
    if not isinstance(timings, dict):
        return None

    def number(key: str) -> float | None:
        value = timings.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    drafted, accepted = number("draft_n"), number("draft_n_accepted")
    draft = SpecDelta(drafts=None, drafted=drafted, accepted=accepted or 0.0) if drafted is not None else None
    predicted, prompt = number("predicted_n"), number("prompt_n")
    return ServerTimings(predicted_per_second=number("predicted_per_second"),
                         predicted_n=int(predicted) if predicted is not None else None,
                         prompt_n=int(prompt) if prompt is not None else None, draft=draft)


# NVIDIA's dcgm-exporter (port 9400 by default, beside vLLM on GPU servers and in Kubernetes):
# gauges per GPU, labelled gpu="0", "1", ...; framebuffer figures are in MiB.
_DCGM = {"DCGM_FI_DEV_POWER_USAGE": "power_w", "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
         "DCGM_FI_DEV_GPU_UTIL": "utilization_pct", "DCGM_FI_DEV_FB_USED": "vram_used_mib",
         "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "energy_mj"}


def parse_dcgm(text: str) -> tuple[GpuSample, ...]:
    """The GPUs a dcgm-exporter reports, as SpecDeck's live GPU samples (empty: none)."""
    cards: dict[int, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        field = _DCGM.get(family.name.removesuffix("_total"))
        if field is None:
            continue
        for sample in family.samples:
            gpu = sample.labels.get("gpu")
            if gpu is not None and gpu.isdigit():
                cards.setdefault(int(gpu), {})[field] = sample.value
    return tuple(GpuSample(index=i, power_w=c.get("power_w"), temperature_c=c.get("temperature_c"),
                           utilization_pct=c.get("utilization_pct"),
                           vram_used_bytes=int(c["vram_used_mib"] * 2**20) if "vram_used_mib" in c else None,
                           energy_mj=int(c["energy_mj"]) if "energy_mj" in c else None)
                 for i, c in sorted(cards.items()))
