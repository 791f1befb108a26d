"""The command line for real: chat through a pipe, models, a small benchmark; plus memory growth."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from backends.bench import NOISY_OTHER_CPU, BenchConfig, default_prompts, load_prompts, run_bench, spec_bench_category
from backends.core.timing import SHORT_CONTEXT
from backends.core.types import GenerationSettings
from backends.factory import Session, SessionConfig
from backends.hardware.observed import ObservedStore
from backends.hardware.telemetry import Sampler
from backends.models.catalog import resolve_model

SAMPLE = Path(__file__).parent / "data" / "spec_bench_sample.jsonl"


def specdeck(*args: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backends.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def power_readable() -> bool | None:
    """What this machine's telemetry can tell of power: None without any source (no readable RAPL,
    no GPU), else whether two samples a moment apart carry a reading (a GPU may lack the sensor)."""
    sampler = Sampler.for_this_machine()
    try:
        if not sampler.has_power:
            return None
        sampler.sample_now()
        time.sleep(0.3)
        return sampler.sample_now().power_w is not None
    finally:
        sampler.stop()


def test_chat_streams_answers_and_prints_stats(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path))
    with Session(SessionConfig(model="smollm2-135m-q4_1")) as session:
        known = session.costs_known()
    result = specdeck("chat", "--max-new-tokens", "24", stdin="Name three colors.\n/new\nAnd three animals?\n")
    assert result.returncode == 0, result.stderr
    assert ("checking what verification costs" in result.stderr) == (not known)  # said only when it will measure
    assert "SpecDeck chat · smollm2-135m-q4_1 (SmolLM2-135M-Instruct.Q4_1.gguf) · method pld" in result.stderr
    seen = ObservedStore().lookup(resolve_model("smollm2-135m-q4_1"), "pld", "chat")
    assert seen is not None and seen.n == 2 and seen.decode_tok_s > 0  # what the recommender learns from chats
    stats_lines = [line for line in result.stdout.splitlines() if line.startswith("[pld")]
    assert len(stats_lines) == 2
    for line in stats_lines:
        assert "tok/s decode" in line and "tau" in line and "TTFT" in line
    assert "(new conversation)" in result.stdout
    assert "assistant> " in result.stdout


def test_chat_with_draft_model_and_sampling():
    result = specdeck("chat", "--model", "smollm2-135m-f16", "--method", "draft", "--draft-model", "smollm2-135m-q4_1",
                      "--temperature", "0.7", "--seed", "1", "--max-new-tokens", "16", stdin="Hello!\n")
    assert result.returncode == 0, result.stderr
    assert any(line.startswith("[draft") for line in result.stdout.splitlines())


def test_models_list_json_and_path():
    result = specdeck("models", "list", "--json")
    rows = json.loads(result.stdout)
    assert {r["id"] for r in rows} >= {"smollm2-135m-q4_1", "smollm2-135m-f16", "gemma3-270m-f16"}
    bundled = next(r for r in rows if r["id"] == "smollm2-135m-q4_1")
    assert bundled["present"] and bundled["size_bytes"] > 90e6
    path = specdeck("models", "path", "smollm2-135m-f16").stdout.strip()
    assert path.endswith("smollm2-135m-f16.gguf") and Path(path).exists()
    info = specdeck("models", "info", "smollm2-135m-q4_1").stdout
    assert "llama, Q4_1" in info and "gpt2 49152 tokens" in info and "layers 30" in info
    meta = json.loads(specdeck("models", "info", path, "--json").stdout)
    assert meta["file_type"] == "F16" and len(meta["tensors"]) == 272
    alone = specdeck("models")  # no subcommand: the list, not a usage error
    assert alone.returncode == 0 and alone.stdout.startswith("smollm2-135m-q4_1 ")


def test_prompt_selection_groups_mt_bench():
    assert spec_bench_category("coding") == "mt_bench" and spec_bench_category("rag") == "rag"
    prompts = load_prompts(SAMPLE, per_category=1)
    assert [p.category for p in prompts] == ["mt_bench", "summarization", "rag", "translation"]
    assert len(prompts[0].turns) == 2
    assert len(load_prompts(SAMPLE, per_category=5, categories=["summarization"])) == 2


def test_the_spec_bench_questions_ship_with_specdeck_and_need_nothing_beside_the_checkout(tmp_path):
    """The installed app benches, samples and trains on Spec-Bench: its questions are in assets/, whole."""
    path = default_prompts()
    assert path.is_relative_to(Path(__file__).resolve().parents[1] / "assets")
    prompts = load_prompts(path, per_category=100)
    counts = {c: sum(p.category == c for p in prompts) for c in {p.category for p in prompts}}
    assert counts == dict.fromkeys(("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"), 80)
    # from a folder with no ../shared beside it, the CLI finds them without --prompts
    result = subprocess.run([sys.executable, "-m", "backends.cli", "bench", "--methods", "ar", "--categories", "qa",
                             "--per-category", "1", "--max-new-tokens", "4"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert result.returncode == 0, result.stderr
    assert "| ar | qa |" in result.stdout


def test_bench_runs_methods_and_peers_side_by_side(tmp_path, smollm_f16_path):
    config = BenchConfig(model=str(smollm_f16_path), methods=("ar", "pld", "peer-llamacpp", "peer-llamacpp-pld"),
                         prompts=SAMPLE, per_category=1, categories=("mt_bench", "summarization"),
                         max_new_tokens=24, n_ctx=2048)
    out = tmp_path / "table.md"
    with out.open("w") as f:
        result = run_bench(config, out=f, progress=f)
    records = result["records"]
    assert len(records) == 2 * 4
    for r in records:
        for key in ("method", "category", "question_id", "decode_tok_s", "speedup", "ideal_speedup", "tau",
                    "acceptance_rate", "new_tokens", "matches_ar", "divergence_margin", "text"):
            assert key in r
        assert r["new_tokens"] > 0 and r["decode_tok_s"] > 0
    ar = [r for r in records if r["method"] == "ar"]
    assert all(r["speedup"] == pytest.approx(1.0) and r["tau"] == 1.0 for r in ar)
    assert all(r["matches_ar"] for r in records if r["method"] == "peer-llamacpp")  # same library, same greedy
    mt = next(r for r in records if r["method"] == "ar" and r["category"] == "mt_bench")
    assert "\n\n" in mt["text"]  # two turns, answered one after the other
    table = out.read_text()
    assert "| pld |" in table and "| peer-llamacpp-pld |" in table and f"verify cost at {SHORT_CONTEXT} tokens" in table
    assert "| peer-llamacpp-pld | pld |" in table  # paired against the fastest of SpecDeck's methods
    rivals = result["against_fastest"]  # pld has no rival of its own kind here; peers are never one
    assert set(rivals) == {"ar", "peer-llamacpp", "peer-llamacpp-pld"} and {v["rival"] for v in rivals.values()} == {"pld"}
    summary = result["summary"]
    assert set(summary["pld"]) == {"mt_bench", "summarization", "overall"}
    # Energy is measured where the machine has a power reading (RAPL, a GPU) and unknown, not zero, elsewhere.
    power = power_readable()
    assert result["meta"]["power_source"] == (power is not None)
    if power:
        assert all(r["joules_per_token"] > 0 for r in records) and summary["pld"]["overall"]["joules_per_token"] > 0
    elif power is None:
        assert all(r["joules_per_token"] is None for r in records) and summary["pld"]["overall"]["joules_per_token"] is None
    # The quiet runs of SpecDeck's own methods are remembered for the recommender, per kind of task.
    store = ObservedStore()
    for method in ("ar", "pld"):
        quiet = [r for r in records if r["method"] == method and r["other_cpu"] <= NOISY_OTHER_CPU]
        if quiet:
            assert store.lookup(smollm_f16_path, method, "summarize" if quiet[-1]["category"] == "summarization" else "chat")
    assert store.lookup(smollm_f16_path, "peer-llamacpp", "chat") is None


def test_bench_cli_writes_json_and_csv(tmp_path):
    js, cs = tmp_path / "b.json", tmp_path / "b.csv"
    result = specdeck("bench", "--model", "smollm2-135m-q4_1", "--methods", "ar,pld,auto", "--prompts", str(SAMPLE),
                      "--per-category", "1", "--categories", "translation", "--max-new-tokens", "8",
                      "--json", str(js), "--csv", str(cs))
    assert result.returncode == 0, result.stderr
    assert "| method |" in result.stdout
    data = json.loads(js.read_text())
    assert {r["method"] for r in data["records"]} == {"ar", "pld", "auto"}
    # auto says what it played for each turn, and the report counts it (the warm-up included)
    (auto,) = [r for r in data["records"] if r["method"] == "auto"]
    assert auto["played"] and set(auto["played"]) <= {"pld", "ar"}
    played = sum(arm["played"] for kinds in data["meta"]["auto_choices"].values() for arm in kinds.values())
    assert played == 1 + len(auto["played"]) and "auto on short prompts" in result.stdout
    assert cs.read_text().splitlines()[0].startswith("method,category,question_id")


def test_memory_does_not_grow_over_50_generations(smollm_q4_path):
    process = psutil.Process()
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=1024)) as s:
        prompt = s.model.chat_prompt([{"role": "user", "content": "Tell me a fact about the moon."}])
        settings = GenerationSettings(max_new_tokens=16)
        rss = []
        for i in range(50):
            s.reset()
            list(s.generate("pld" if i % 2 else "ar", prompt, settings))
            if i in (0, 49):
                gc.collect()
                rss.append(process.memory_info().rss)
    assert rss[1] - rss[0] < 50 * 2**20, f"RSS grew by {(rss[1] - rss[0]) / 2**20:.1f} MiB"


def test_chat_ctrl_c_stops_the_answer_and_the_chat_goes_on():
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "backends.cli", "chat", "--max-new-tokens", "3000"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("Count from 1 to 2000, one number per line.\n")
        proc.stdin.flush()
        seen = ""
        deadline = time.monotonic() + 120
        while "assistant> " not in seen or len(seen.split("assistant> ", 1)[1]) < 20:
            assert time.monotonic() < deadline, "no streamed answer"
            seen += proc.stdout.read(1)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(input="Say hello.\n", timeout=120)
    finally:
        proc.kill()
    output = seen + rest
    stats = [line for line in output.splitlines() if line.startswith("[pld")]
    assert proc.returncode == 0, err
    assert len(stats) == 2 and "stopped: cancelled" in stats[0]
    assert "you> Say hello." in output
