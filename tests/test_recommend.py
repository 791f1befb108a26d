"""The method recommender: ranking, draft filtering, measured figures over priors, GPU fixtures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from backends.core.costs import CostModel
from backends.core.errors import SpecDeckError
from backends.core.types import ROLLBACK
from backends.drafters import REGISTRY
from backends.hardware.fit import plan
from backends.hardware.gpus import nvidia_gpus
from backends.hardware.observed import ObservedStore
from backends.hardware.recommend import recommend, roofline_tok_s
from backends.hardware.shape import load_shape
from backends.hardware.types import LlamaBuild, RamInfo
from backends.models.catalog import resolve_model
from tests.hw_replay import load_replay, recorded_cpu_machine

CPU_BW = 30e9


@pytest.fixture(scope="module")
def paths():
    return {m: resolve_model(m) for m in ("smollm2-135m-f16", "smollm2-135m-q4_1", "gemma3-270m-q4_k_m")}


@pytest.fixture(scope="module")
def hw():
    """A CPU-only machine (the recorded development VM), whatever GPU the machine running the tests has."""
    return recorded_cpu_machine()


@pytest.fixture
def store(tmp_path):
    return ObservedStore(tmp_path / "observed.json")


def rec(paths, hw, store, *, task="chat", drafts=("smollm2-135m-q4_1", "gemma3-270m-q4_k_m"),
        target_offers=frozenset({ROLLBACK}), **kw):
    return recommend(paths["smollm2-135m-f16"], hw, task=task, drafts=[paths[d] for d in drafts], cpu_bandwidth=CPU_BW,
                     store=store, target_offers=target_offers, **kw)


def test_a_model_that_cannot_roll_back_is_offered_plain_decoding_only(paths, hw, store):
    """A recurrent or hybrid model (Mamba, RWKV, LFM2) cannot forget a rejected guess: every method
    that drafts is unavailable, and says so, even with a compatible draft model present."""
    result = rec(paths, hw, store, target_offers=frozenset())
    available = [r.method for r in result.ranked if r.available]
    assert available == ["ar"] and result.ranked[0].method == "ar"
    pld = next(r for r in result.ranked if r.method == "pld")
    assert "cache can forget rejected guesses" in pld.reason


def test_every_method_ranked_with_a_reason(paths, hw, store):
    result = rec(paths, hw, store)
    assert [r.method for r in result.ranked].count("ar") == 1 and {r.method for r in result.ranked} == set(REGISTRY)
    speeds = [r.predicted_tok_s for r in result.ranked if r.available]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r.reason and r.fits for r in result.ranked)
    rest = next(r for r in result.ranked if r.method == "rest")  # no datastore given
    assert not rest.available and "specdeck datastore build" in rest.reason
    assert result.plain_basis.startswith("roofline")
    draft = next(r for r in result.ranked if r.method == "draft")
    assert draft.available and draft.draft_model == Path(paths["smollm2-135m-q4_1"]).name
    rejected = dict(draft.rejected_drafts)
    assert "tokenizer type differs" in rejected[Path(paths["gemma3-270m-q4_k_m"]).name]
    for item in result.to_json():
        assert {"method", "fits", "predicted_tok_s", "predicted_speedup", "reason"} <= set(item)


def test_without_a_compatible_draft_the_draft_method_is_unavailable(paths, hw, store):
    result = rec(paths, hw, store, drafts=("gemma3-270m-q4_k_m",))
    draft = next(r for r in result.ranked if r.method == "draft")
    assert not draft.available and draft.predicted_tok_s is None
    assert "needs a draft model" in draft.reason and "the one draft file checked cannot" in draft.reason
    assert [(m, "tokenizer type differs" in why) for m, why in draft.rejected_drafts] == [("gemma3-270m-q4_k_m.gguf", True)]
    assert all(r.available for r in result.ranked[: result.ranked.index(draft)])  # unavailable ones come last


def test_measured_speedups_beat_priors(paths, hw, store):
    target = paths["smollm2-135m-f16"]
    store.record(target, "ar", "summarize", decode_tok_s=90.0)
    store.record(target, "pld", "summarize", decode_tok_s=117.0, tau=1.6, drafted_per_step=1.2, speedup=1.3)
    result = rec(paths, hw, store, task="summarize")
    best = result.ranked[0]
    assert best.method == "pld" and best.basis == "measured"
    assert best.predicted_speedup == pytest.approx(1.3) and best.predicted_tok_s == pytest.approx(117.0)
    assert result.plain_tok_s == pytest.approx(90.0) and result.plain_basis.startswith("measured")


def test_measured_acceptance_with_a_measured_cost_curve(paths, hw, store):
    """tau 2.0 at 2 drafted tokens per step on a flat cost curve: about 2x, and the curve's one-token time sets the plain rate."""
    target = paths["smollm2-135m-f16"]
    store.record(target, "pld", "code", decode_tok_s=150.0, tau=2.0, drafted_per_step=2.0)
    flat = CostModel({64: [0.01] * 17, 1024: [0.01] * 17})
    result = rec(paths, hw, store, task="code", costs=lambda shape, ngl: flat)
    pld = next(r for r in result.ranked if r.method == "pld")
    assert pld.basis == "measured acceptance" and pld.predicted_speedup == pytest.approx(2.0)
    assert result.plain_tok_s == pytest.approx(100.0)


def test_cpu_priors_are_cautious_and_gpu_priors_favour_speculation_fixture(paths, hw, store):
    on_cpu = rec(paths, hw, store, task="summarize")
    assert all(r.predicted_speedup <= 1.0 for r in on_cpu.ranked if r.available)  # batched verify is dear on a CPU
    gpus, _ = nvidia_gpus(load_replay("nvml_rtx4090.json"))
    cuda = LlamaBuild(version="0.3.36", backends=("CUDA", "CPU"), gpu_offload=True, system_info="")
    on_gpu = rec(paths, replace(hw, gpus=gpus, llama_cpp=cuda), store, task="summarize")
    assert on_gpu.ranked[0].method in ("pld", "draft", "auto") and on_gpu.ranked[0].predicted_speedup > 1.2
    assert "VRAM" in on_gpu.plain_basis and on_gpu.plain_tok_s > 10 * on_cpu.plain_tok_s


def test_nothing_fits_in_a_tiny_machine(paths, hw, store):
    tiny = replace(hw, ram=RamInfo(total_bytes=64 * 2**20, available_bytes=32 * 2**20))
    result = rec(paths, tiny, store)
    assert not any(r.fits for r in result.ranked)
    assert all(r.predicted_tok_s is None for r in result.ranked)
    assert "does not fit" in next(r for r in result.ranked if r.method == "pld").reason


def test_unknown_task_is_refused(paths, hw, store):
    with pytest.raises(SpecDeckError, match="task must be one of"):
        rec(paths, hw, store, task="poetry")


def test_roofline_is_bandwidth_over_bytes(paths, hw):
    shape = load_shape(paths["smollm2-135m-f16"])
    fit = plan(shape, hw)
    rate = roofline_tok_s(shape, fit, CPU_BW, None)
    per_token = sum(shape.block_bytes) + shape.output_bytes + shape.other_bytes
    assert CPU_BW / per_token * 0.8 < rate < CPU_BW / per_token  # the KV cache adds a little


def test_specdeck_recommend_json():
    out = subprocess.run([sys.executable, "-m", "backends.cli", "recommend", "smollm2-135m-q4_1", "--task", "summarize",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ranked = json.loads(out.stdout)
    assert isinstance(ranked, list) and {r["method"] for r in ranked} == set(REGISTRY)
    assert all({"method", "fits", "predicted_tok_s", "predicted_speedup", "reason"} <= set(r) for r in ranked)
    text = subprocess.run([sys.executable, "-m", "backends.cli", "recommend", "smollm2-135m-q4_1"],
                          capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and "plain decoding about" in text.stdout
    lines = text.stdout.splitlines()
    assert lines[0].startswith("smollm2-135m-q4_1 ")  # named as the user named it, not by the file's general.name
    rows = [line for line in lines if re.match(r"\d+\. ", line)]
    assert len(rows) == len(REGISTRY) and len({line.index("[") for line in rows}) == 1  # one column for the fit
    for name, why in {(d["model"], d["reason"]) for r in ranked for d in r["rejected_drafts"]}:
        assert text.stdout.count(f"{name}:") == 1  # each file that cannot draft is explained once
