"""``specdeck bench``: every method side by side on Spec-Bench prompts, measured honestly.

Methods run interleaved per prompt in one process (the order rotates from prompt to prompt, and
``--repeats`` plays each prompt again in reverse order), so every speedup is a ratio of runs taken
seconds apart on the same machine state. Each run starts from an empty KV cache (nothing is cached
between methods), a warm-up run per method is excluded, and multi-turn prompts are played turn by
turn with each method's own answers through the chat template. Peers are llama-cpp-python's own
``Llama.generate`` (``peer-llamacpp``) and its built-in prompt lookup (``peer-llamacpp-pld``), on
the same model file and thread count.

Besides speed, every record says whether the output matches plain greedy decoding (``ar``) and,
where it does not, the target's top-1 minus top-2 logit margin at the first differing token: a
tiny margin is a numerical near-tie between batched and one-token evaluation, a large one a bug.
``ideal_speedup`` is what the measured tau would give if the only costs were the measured target
forwards and draft time: measured speedup / ideal shows how much the Python loop eats.

On a shared machine another busy process distorts timings; each run records how much CPU other
processes used meanwhile (``other_cpu``, in cores) and the summary warns when it was high.

Where the machine reports power (an NVIDIA GPU through NVML, CPU package power through RAPL), a
telemetry sampler runs alongside and each record carries ``joules_per_token``: the energy drawn
from the start of its prompt's prefill to its last token, over the tokens it generated (``null``
without a power source). Speedups, acceptance and decode rates of SpecDeck's own methods are also
kept in the observed-speeds store, which the recommender reads.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence, TextIO

import numpy as np

from backends.core.costs import CostModel
from backends.core.timing import CpuWatch
from backends.core.errors import SpecDeckError
from backends.core.sampling import apply_repeat_penalty
from backends.core.types import Finished, GenerationSettings, Proposal, RunStats, SamplingSettings
from backends.drafters import baseline_method, is_baseline
from backends.drafters.auto import MethodSelector
from backends.factory import Session, SessionConfig
from backends.hardware.observed import ObservedStore
from backends.hardware.telemetry import Sampler, energy_joules
from backends.models.chat import Message

# Spec-Bench's questions ship with SpecDeck (assets/spec_bench): the installed app benches, samples and trains on them.
SPEC_BENCH = Path(__file__).resolve().parents[1] / "assets" / "spec_bench" / "question.jsonl"
MT_BENCH_SUBCATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
PEERS = {"peer-llamacpp": False, "peer-llamacpp-pld": True}  # llama-cpp-python's own runs: with its prompt lookup?
# Hugging Face transformers' own generate() on the same weights: plain, with its prompt lookup
# (prompt_lookup_num_tokens) and with assisted generation (the --draft-model as its assistant).
HF_PEERS = ("hf-ar", "hf-pld", "hf-assisted")
HF_PLD_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens
BACKEND_SEP = ":"  # "torch:eagle2": eagle2 on the torch backend, beside llama.cpp's runs
NOISY_OTHER_CPU = 0.15  # cores used by other processes during a run before we call it noisy
# The recommender's kinds of work, by Spec-Bench category (the rest is conversation).
TASK_OF_CATEGORY = {"summarization": "summarize", "rag": "rag"}


def spec_bench_category(raw: str) -> str:
    """Spec-Bench's six categories: the eight MT-bench sub-categories count as ``mt_bench``."""
    return "mt_bench" if raw in MT_BENCH_SUBCATEGORIES else raw


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int
    category: str
    turns: tuple[str, ...]


def default_prompts() -> Path:
    """Spec-Bench's question file, the copy shipped in assets/ (in the frozen app too)."""
    if not SPEC_BENCH.exists():
        raise SpecDeckError(f"Spec-Bench prompts not found at {SPEC_BENCH} (is the installation whole?); "
                            "pass --prompts FILE")
    return SPEC_BENCH


def load_prompts(path: Path, *, per_category: int, categories: Sequence[str] | None = None,
                 skip: int = 0) -> list[BenchPrompt]:
    """``per_category`` prompts per category, evenly spread over each category's questions.

    ``skip`` shifts the selection (to pick questions disjoint from another run's).
    """
    if not path.exists():
        raise SpecDeckError(f"prompt file not found: {path}")
    by_cat: dict[str, list[BenchPrompt]] = {}
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = BenchPrompt(int(row["question_id"]), spec_bench_category(row["category"]), tuple(row["turns"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise SpecDeckError(f"{path}:{line_no} is not a Spec-Bench record ({exc})") from exc
            by_cat.setdefault(prompt.category, []).append(prompt)
    wanted = list(categories) if categories else list(by_cat)
    unknown = [c for c in wanted if c not in by_cat]
    if unknown:
        raise SpecDeckError(f"unknown categories {unknown}; the file has {sorted(by_cat)}")
    chosen = []
    for cat in wanted:
        rows = sorted(by_cat[cat], key=lambda p: p.question_id)
        stride = max(1, len(rows) // max(per_category, 1))
        picks = [rows[(i * stride + skip) % len(rows)] for i in range(min(per_category, len(rows)))]
        chosen.extend(picks)
    return chosen


@dataclass(frozen=True)
class BenchConfig:
    model: str
    methods: tuple[str, ...]
    draft_model: str | None = None
    prompts: Path | None = None  # None: the shipped Spec-Bench questions
    per_category: int = 10
    categories: tuple[str, ...] | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    repeats: int = 1
    n_ctx: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int = -1  # AUTO: the fit estimator's offload on the running GPU backend (none: CPU)
    flash_attn: str = "auto"
    method_settings: dict = field(default_factory=dict)  # method -> {setting: value}
    heads: tuple[str, ...] = ()  # trained head files (else those found for the model)
    dtype: str = "auto"  # the torch backend's precision, for "torch:..." methods
    backend: str = "llamacpp"  # what runs methods named without a backend (ar, pld ...), and the reference


@dataclass(frozen=True)
class TurnRun:
    prompt: list[int]
    tokens: list[int]
    text: str
    stats: RunStats
    other_cpu: float
    t0: float = 0.0  # time.monotonic() at the start and end of the run, for energy
    t1: float = 0.0


# -- runners -------------------------------------------------------------------------------------
class EngineRunner:
    """One SpecDeck method through the engine."""

    def __init__(self, session: Session, method: str, settings: dict) -> None:
        self.session, self.method, self.settings = session, method, settings

    def run(self, prompt: list[int], gen: GenerationSettings) -> TurnRun:
        self.session.reset()  # nothing cached between methods
        t0 = time.monotonic()
        with CpuWatch() as watch:
            finished = None
            for event in self.session.generate(self.method, prompt, gen, method_settings=self.settings):
                if isinstance(event, Finished):
                    finished = event
        assert finished is not None
        return TurnRun(prompt, list(finished.tokens), finished.text, finished.stats, watch.other_cores, t0, time.monotonic())


class PeerRunner:
    """llama-cpp-python's high-level ``Llama.generate``, optionally with its prompt lookup."""

    def __init__(self, session: Session, method: str) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding() if PEERS[method] else None
        self.method = method
        self.session = session
        self.llm = llama_cpp.Llama(
            model_path=str(session.model.path), n_ctx=session.target.n_ctx, n_threads=session.target.n_threads,
            n_threads_batch=session.target.n_threads, n_batch=session.target.n_batch, draft_model=draft, verbose=False,
            flash_attn=session.config.flash_attn != "off",  # SpecDeck's "auto" enables it on CPUs
            # With a draft model, Llama always computes logits for every token but sizes its score
            # buffer from this flag; without it, prompts longer than n_batch crash (0.3.36).
            logits_all=draft is not None,
        )

    def run(self, prompt: list[int], gen: GenerationSettings) -> TurnRun:
        s = gen.sampling
        eog = self.session.model.eog_ids
        tokens: list[int] = []
        self.llm.reset()
        t0 = time.monotonic()
        with CpuWatch() as watch:
            start = time.perf_counter()
            first = start
            for token in self.llm.generate(prompt, temp=s.temperature, top_k=s.top_k if not s.greedy else 1,
                                           top_p=s.top_p, min_p=s.min_p, repeat_penalty=s.repeat_penalty, reset=True):
                if not tokens:
                    first = time.perf_counter()
                tokens.append(token)
                if token in eog or len(tokens) >= gen.max_new_tokens:
                    break
            end = time.perf_counter()
        text = self.session.model.detokenize(tokens)
        reason = "eos" if tokens and tokens[-1] in eog else "length"
        stats = RunStats(
            method=self.method, prompt_tokens=len(prompt), reused_tokens=0, new_tokens=len(tokens), forwards=0,
            drafted=0, accepted=0, prefill_s=0.0, ttft_s=first - start, decode_s=end - first, first_step_tokens=1,
            draft_s=0.0, verify_s=0.0, accept_s=0.0, drafted_at=(), accepted_at=(), finish_reason=reason,
        )
        return TurnRun(prompt, tokens, text, stats, watch.other_cores, t0, time.monotonic())

    def close(self) -> None:
        self.llm.close()


class _FirstToken:
    """A transformers streamer that notes when the first new token comes (its first ``put`` is the
    prompt), so a peer's decode rate excludes its prefill as SpecDeck's does."""

    def __init__(self) -> None:
        self.calls = 0
        self.first = 0.0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HFPeerRunner:
    """transformers' ``generate`` on the same model file (its GGUF reader) or folder, greedy only, in
    the torch session's precision and device (else fp32 on the CPU)."""

    def __init__(self, session: Session, method: str) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise SpecDeckError(f"{method} needs transformers and accelerate: pip install transformers accelerate") from None
        self.torch, self.method, self.session = torch, method, session
        if session.target.n_threads:
            torch.set_num_threads(session.target.n_threads)

        # the torch backend's device and precision when the session runs on it, else fp32 on the CPU
        torch_model = getattr(session.target, "model", None)
        dtype = getattr(torch_model, "dtype", torch.float32)
        self.device = getattr(torch_model, "device", torch.device("cpu"))

        def load(path: Path):
            if path.is_dir():  # a Hugging Face folder: its own weights, never its code
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=False)
            else:
                model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
            return model.to(self.device).eval()

        self.model = load(Path(session.model.path))
        self.extra: dict = {}
        if method == "hf-pld":
            self.extra = {"prompt_lookup_num_tokens": HF_PLD_TOKENS}
        elif method == "hf-assisted":
            if session.draft_model is None:
                raise SpecDeckError("hf-assisted needs an assistant: give --draft-model")
            self.extra = {"assistant_model": load(Path(session.draft_model.path))}

    def run(self, prompt: list[int], gen: GenerationSettings) -> TurnRun:
        if not gen.sampling.greedy:
            raise SpecDeckError(f"{self.method} runs greedy only (--temperature 0)")
        torch, eog = self.torch, self.session.model.eog_ids
        streamer = _FirstToken()
        t0 = time.monotonic()
        with CpuWatch() as watch, torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(torch.tensor([prompt], device=self.device), max_new_tokens=gen.max_new_tokens, do_sample=False,
                                      eos_token_id=sorted(eog), pad_token_id=sorted(eog)[0], streamer=streamer, **self.extra)
            end = time.perf_counter()
        tokens = out[0, len(prompt):].tolist()
        first = streamer.first or end
        reason = "eos" if tokens and tokens[-1] in eog else "length"
        stats = RunStats(
            method=self.method, prompt_tokens=len(prompt), reused_tokens=0, new_tokens=len(tokens), forwards=0,
            drafted=0, accepted=0, prefill_s=0.0, ttft_s=first - start, decode_s=end - first, first_step_tokens=1,
            draft_s=0.0, verify_s=0.0, accept_s=0.0, drafted_at=(), accepted_at=(), finish_reason=reason,
        )
        return TurnRun(prompt, tokens, self.session.model.detokenize(tokens), stats, watch.other_cores, t0, time.monotonic())

    def close(self) -> None:
        self.model = self.extra = None


def split_method(name: str, default: str = "llamacpp") -> tuple[str, str]:
    """("torch", "eagle2") for "torch:eagle2"; a name without a backend runs on ``default``."""
    backend, sep, method = name.rpartition(BACKEND_SEP)
    return (backend, method) if sep else (default, name)


def is_peer(name: str) -> bool:
    return name in PEERS or name in HF_PEERS


def reference_of(name: str, methods: Sequence[str], default: str = "llamacpp") -> str:
    """The plain decoding a method's output is checked against: its own backend's when the run has it."""
    backend, _ = split_method(name, default)
    own = f"{backend}{BACKEND_SEP}{baseline_method()}"
    return own if backend != default and own in methods else baseline_method()


# -- playing prompts -------------------------------------------------------------------------------
def play(runner, session: Session, prompt: BenchPrompt, gen: GenerationSettings) -> list[TurnRun]:
    """All turns of a prompt, each answered with the runner's own previous answers."""
    messages: list[Message] = []
    runs = []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        tokens = session.model.chat_prompt(messages)
        room = session.target.n_ctx - len(tokens) - 1
        if room < 1:
            raise SpecDeckError(f"question {prompt.question_id} does not fit the {session.target.n_ctx}-token context")
        run = runner.run(tokens, replace(gen, max_new_tokens=min(gen.max_new_tokens, room)))
        runs.append(run)
        messages.append({"role": "assistant", "content": run.text})
    return runs


def logit_margin(session: Session, context: list[int], sampling: SamplingSettings) -> tuple[float, int, int]:
    """Target's (top-1 minus top-2 logit, top-1, top-2) after ``context``, one-token evaluation."""
    target = session.target
    target.reset()
    target.prefill(context[:-1])
    row = target.verify(context[-1], Proposal()).row(0)
    target.reset()
    row = apply_repeat_penalty(row, context, sampling)
    top2 = np.argsort(-row)[:2]
    return float(row[top2[0]] - row[top2[1]]), int(top2[0]), int(top2[1])


def divergence(session: Session, runs: list[TurnRun], reference: list[TurnRun], sampling: SamplingSettings) -> dict | None:
    """Where a method's output first leaves ``ar``'s, how close the target was to a tie there, and
    whether that is within this model's measured batch noise (``near_tie``: a rounding effect of
    batched against one-token evaluation; beyond it, a bug)."""
    for turn, (mine, ref) in enumerate(zip(runs, reference)):
        if mine.tokens == ref.tokens:
            continue
        i = next((j for j, (a, b) in enumerate(zip(mine.tokens, ref.tokens)) if a != b), min(len(mine.tokens), len(ref.tokens)))
        context = ref.prompt + ref.tokens[:i]
        margin, top1, top2 = logit_margin(session, context, sampling)
        got = mine.tokens[i] if i < len(mine.tokens) else None
        noise = session.batch_noise()
        return {"turn": turn, "position": i, "margin": margin, "token": got,
                "ar_token": ref.tokens[i] if i < len(ref.tokens) else None, "target_top2": [top1, top2],
                "near_tie": margin <= noise.threshold, "batch_noise": noise.gap_shift,
                "explained": (f"identical up to {noise.describe(margin)} at token {i}" if margin <= noise.threshold
                              else f"differs from token {i}: {noise.describe(margin)}")}
    return None


# -- records and summaries ----------------------------------------------------------------------------
def _sum(runs: Iterable[TurnRun], attr: str) -> float:
    return sum(getattr(r.stats, attr) for r in runs)


def decode_rate(runs: list[TurnRun]) -> float:
    tokens = sum(r.stats.new_tokens - r.stats.first_step_tokens for r in runs)
    seconds = _sum(runs, "decode_s")
    return tokens / seconds if seconds > 0 else float("nan")


def joules_per_token(sampler: Sampler | None, runs: list[TurnRun]) -> float | None:
    """Energy of a prompt's turns over the tokens they generated; None without a power source."""
    if sampler is None:
        return None
    samples = sampler.history()
    energies = [energy_joules(samples, r.t0, r.t1) for r in runs]
    tokens = sum(r.stats.new_tokens for r in runs)
    if any(e is None for e in energies) or tokens == 0:
        return None
    return sum(energies) / tokens  # type: ignore[arg-type]


def make_record(method: str, prompt: BenchPrompt, repeats: list[list[TurnRun]], ar: list[list[TurnRun]] | None,
                div: dict | None, peer: bool, sampler: Sampler | None = None) -> dict:
    runs = repeats[0]
    rates = [decode_rate(r) for r in repeats]
    rate = statistics.median(rates)
    forwards = _sum(runs, "forwards")
    drafted, accepted = _sum(runs, "drafted"), _sum(runs, "accepted")
    new_tokens = int(_sum(runs, "new_tokens"))
    tau = new_tokens / forwards if forwards else float("nan")
    record = {
        "method": method, "category": prompt.category, "question_id": prompt.question_id,
        "decode_tok_s": rate, "decode_tok_s_runs": rates, "speedup": float("nan"), "ideal_speedup": float("nan"),
        "tau": tau, "acceptance_rate": accepted / drafted if drafted else float("nan"),
        "drafted": drafted, "accepted": accepted, "new_tokens": new_tokens, "forwards": forwards,
        "ttft_s": runs[0].stats.ttft_s, "draft_s": _sum(runs, "draft_s"), "verify_s": _sum(runs, "verify_s"),
        "accept_s": _sum(runs, "accept_s"), "accepted_at": _merge(runs, "accepted_at"), "drafted_at": _merge(runs, "drafted_at"),
        "matches_ar": div is None, "divergence_margin": None if div is None else div["margin"], "divergence": div,
        "other_cpu": max(r.other_cpu for rs in repeats for r in rs), "finish_reasons": [r.stats.finish_reason for r in runs],
        "text": "\n\n".join(r.text for r in runs), "peer": peer, "joules_per_token": joules_per_token(sampler, runs),
        "played": [r.stats.played for r in runs],  # per turn, what auto chose
    }
    if ar is not None:
        ar_rate = statistics.median(decode_rate(r) for r in ar)
        record["speedup"] = rate / ar_rate if ar_rate > 0 else float("nan")
        ar_forward = _sum(ar[0], "verify_s") / max(_sum(ar[0], "forwards"), 1)
        per_step = (record["verify_s"] + record["draft_s"]) / forwards if forwards else float("nan")
        record["ideal_speedup"] = tau * ar_forward / per_step if forwards and per_step > 0 else float("nan")
    return record


def _merge(runs: list[TurnRun], attr: str) -> list[int]:
    total: list[int] = []
    for r in runs:
        values = getattr(r.stats, attr)
        total.extend([0] * (len(values) - len(total)))
        for i, v in enumerate(values):
            total[i] += v
    return total


def summarize(records: list[dict], methods: Sequence[str]) -> dict:
    """Per method, per category and overall: throughput, speedup, tau, acceptance, exact match."""
    cats = sorted({r["category"] for r in records})
    out: dict = {}
    for m in methods:
        out[m] = {}
        for cat in cats + ["overall"]:
            rows = [r for r in records if r["method"] == m and (cat == "overall" or r["category"] == cat)]
            if rows:
                out[m][cat] = _group(rows, [r for r in records if is_baseline(r["method"]) and (cat == "overall" or r["category"] == cat)])
    return out


def _group(rows: list[dict], ar_rows: list[dict]) -> dict:
    speedups = [r["speedup"] for r in rows if not math.isnan(r["speedup"])]
    low, high = speedup_interval(rows, ar_rows)
    ideals = [r["ideal_speedup"] for r in rows if not math.isnan(r["ideal_speedup"])]
    drafted = sum(r["drafted"] for r in rows)
    forwards = sum(r["forwards"] for r in rows)
    accepted_at, drafted_at = _sum_lists(rows, "accepted_at"), _sum_lists(rows, "drafted_at")
    group = {
        "prompts": len(rows),
        "decode_tok_s": _overall_rate(rows),
        "speedup": _overall_rate(rows) / _overall_rate(ar_rows) if ar_rows else float("nan"),
        "speedup_low": low, "speedup_high": high,
        "mean_prompt_speedup": statistics.fmean(speedups) if speedups else float("nan"),
        "ideal_speedup": statistics.fmean(ideals) if ideals else float("nan"),
        "tau": sum(r["new_tokens"] for r in rows) / forwards if forwards else float("nan"),
        "acceptance_rate": sum(r["accepted"] for r in rows) / drafted if drafted else float("nan"),
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted_at, drafted_at)],
        "draft_s": sum(r["draft_s"] for r in rows),
        "verify_s": sum(r["verify_s"] for r in rows),
        "exact_match_rate": sum(r["matches_ar"] for r in rows) / len(rows),
        "divergence_margins": [r["divergence_margin"] for r in rows if r["divergence_margin"] is not None],
        "noisy_runs": sum(r["other_cpu"] > NOISY_OTHER_CPU for r in rows),
        "joules_per_token": _energy_per_token(rows),
    }
    group["efficiency"] = group["mean_prompt_speedup"] / group["ideal_speedup"] if ideals else float("nan")
    return group


def speedup_interval(rows: list[dict], ar_rows: list[dict], *, draws: int = 2000,
                     coverage: float = 0.9) -> tuple[float, float]:
    """A bootstrap interval for a group's speedup: prompts resampled with replacement, each
    method row paired with ``ar``'s row for the same prompt.

    With 10 prompts a category's speedup moves by a few hundredths from run to run (how much an
    answer repeats its prompt varies a lot between prompts); the interval says how far a
    figure can be trusted before anyone reads 0.96x against 1.00x as a difference.
    """
    def prompt(r: dict) -> tuple:
        return r["question_id"], r["category"]

    ar_by_prompt = {prompt(r): r for r in ar_rows}
    pairs = [(r, ar_by_prompt[prompt(r)]) for r in rows
             if prompt(r) in ar_by_prompt and r["decode_tok_s"] > 0 and ar_by_prompt[prompt(r)]["decode_tok_s"] > 0]
    if len(pairs) < 2:
        return float("nan"), float("nan")
    # [prompts, 4]: tokens and seconds of the method, then of ar
    table = np.array([[m["new_tokens"], m["new_tokens"] / m["decode_tok_s"], a["new_tokens"], a["new_tokens"] / a["decode_tok_s"]]
                      for m, a in pairs], dtype=np.float64)
    picks = np.random.default_rng(0).integers(0, len(pairs), size=(draws, len(pairs)))  # [draws, prompts]
    sums = table[picks].sum(axis=1)  # [draws, 4]
    ratios = (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])
    tail = (1.0 - coverage) / 2
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1.0 - tail))


def against_fastest(records: list[dict], methods: Sequence[str]) -> dict[str, dict]:
    """Each method against the fastest *other* method overall, paired prompt by prompt.

    Methods that combine others (``auto``, ``specinfer``) must at least tie with the best of
    their parts, and two methods within a percent of each other cannot be told apart from their
    speedups over ``ar`` alone: both move with ``ar``'s own runs. Paired directly, the interval
    shows whether a gap is real. ``ar`` and the peers are compared but never the rival.
    """
    rows = {m: [r for r in records if r["method"] == m] for m in methods}
    rates = {m: _overall_rate(rs) for m, rs in rows.items() if rs}
    rivals = [m for m in rates if not is_baseline(m) and not is_peer(m)]
    out: dict[str, dict] = {}
    for m in methods:
        others = [o for o in rivals if o != m]
        if m not in rates or not others:
            continue
        best = max(others, key=lambda o: rates[o])
        low, high = speedup_interval(rows[m], rows[best])
        out[m] = {"rival": best, "ratio": rates[m] / rates[best], "low": low, "high": high}
    return out


def _overall_rate(rows: list[dict]) -> float:
    """Tokens over seconds of a group of answers (long answers weigh by their length)."""
    timed = [r for r in rows if r["decode_tok_s"] and r["decode_tok_s"] == r["decode_tok_s"]]
    seconds = sum(r["new_tokens"] / r["decode_tok_s"] for r in timed)
    return sum(r["new_tokens"] for r in timed) / seconds if seconds else float("nan")


def against_fastest_markdown(table: dict[str, dict]) -> str:
    lines = ["| method | against | ratio | 90% interval |", "|---|---|---|---|"]
    for m, v in table.items():
        lines.append(f"| {m} | {v['rival']} | {_fmt(v['ratio'], '{:.3f}')} "
                     f"| {_fmt(v['low'], '{:.3f}')}-{_fmt(v['high'], '{:.3f}')} |")
    return "\n".join(lines)


def _energy_per_token(rows: list[dict]) -> float | None:
    if not rows or any(r["joules_per_token"] is None for r in rows):
        return None
    tokens = sum(r["new_tokens"] for r in rows)
    return sum(r["joules_per_token"] * r["new_tokens"] for r in rows) / tokens if tokens else None


def _sum_lists(rows: list[dict], key: str) -> list[int]:
    total: list[int] = []
    for r in rows:
        total.extend([0] * (len(r[key]) - len(total)))
        for i, v in enumerate(r[key]):
            total[i] += v
    return total


def markdown(summary: dict, methods: Sequence[str]) -> str:
    """Two tables: speedup per category, then every figure per method and category."""
    cats = sorted({c for m in summary.values() for c in m if c != "overall"}) + ["overall"]
    lines = ["| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for m in methods:
        cells = [_fmt(summary[m].get(c, {}).get("speedup"), "{:.2f}x") for c in cats]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "| method | category | tok/s | speedup | 90% interval | ideal | efficiency | tau | acceptance | by position "
              "| draft s | verify s | exact match | divergence margins | noisy runs | J/token |", "|---" * 16 + "|"]
    for m in methods:
        for c in cats:
            if c in summary[m]:
                lines.append(_detail_row(m, c, summary[m][c]))
    return "\n".join(lines)


def _detail_row(method: str, category: str, g: dict) -> str:
    by_pos = " ".join(_fmt(a, "{:.2f}") for a in g["acceptance_by_position"][:8]) or "-"
    margins = ", ".join(f"{x:.3f}" for x in g["divergence_margins"][:4]) or "-"
    if len(g["divergence_margins"]) > 4:
        margins += f" (+{len(g['divergence_margins']) - 4}, max {max(g['divergence_margins']):.3f})"
    interval = f"{_fmt(g['speedup_low'], '{:.2f}')}-{_fmt(g['speedup_high'], '{:.2f}')}"
    return (f"| {method} | {category} | {_fmt(g['decode_tok_s'], '{:.1f}')} | {_fmt(g['speedup'], '{:.2f}x')} | {interval} "
            f"| {_fmt(g['ideal_speedup'], '{:.2f}x')} | {_fmt(g['efficiency'], '{:.2f}')} | {_fmt(g['tau'], '{:.2f}')} "
            f"| {_fmt(g['acceptance_rate'], '{:.0%}')} | {by_pos} | {g['draft_s']:.1f} | {g['verify_s']:.1f} "
            f"| {g['exact_match_rate']:.0%} | {margins} | {g['noisy_runs']} | {_fmt(g['joules_per_token'], '{:.3f}')} |")


def _fmt(value, pattern: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def _clean(obj):
    """JSON without NaN: NaN becomes null."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


# -- the whole benchmark ---------------------------------------------------------------------------
def run_bench(config: BenchConfig, *, out: TextIO = sys.stdout, progress: TextIO = sys.stderr) -> dict:
    methods = list(config.methods)
    plain = baseline_method()
    if plain not in methods:
        methods.insert(0, plain)  # every speedup is relative to plain decoding
    prompts = load_prompts(config.prompts or default_prompts(), per_category=config.per_category, categories=config.categories)
    sampling = SamplingSettings(temperature=config.temperature, seed=config.seed)
    gen = GenerationSettings(max_new_tokens=config.max_new_tokens, sampling=sampling)
    session = Session(_session_config(config, config.backend))
    sampler = Sampler.for_this_machine()
    if not sampler.has_power:  # no power reading to integrate: telemetry would only cost CPU
        sampler.stop()
        sampler = None
    try:
        if sampler is not None:
            sampler.start()
        return _run(session, config, methods, prompts, gen, out, progress, sampler)
    finally:
        if sampler is not None:
            sampler.stop()
        session.close()


def _session_config(config: BenchConfig, backend: str = "llamacpp") -> SessionConfig:
    return SessionConfig(model=config.model, draft_model=config.draft_model, n_ctx=config.n_ctx,
                         n_threads=config.n_threads, n_gpu_layers=config.n_gpu_layers, flash_attn=config.flash_attn,
                         heads=config.heads, backend=backend, dtype=config.dtype)


class _Runners:
    """A runner per method, each with the session of its backend (opened once, the first time a
    method asks for it: "torch:ar" and "torch:eagle2" share one torch session)."""

    def __init__(self, session: Session, config: BenchConfig, methods: Sequence[str]) -> None:
        self.config = config
        self.sessions: dict[str, Session] = {config.backend: session}
        self.runners = {m: self._runner(m) for m in methods}

    def session(self, backend: str) -> Session:
        if backend not in self.sessions:
            self.sessions[backend] = Session(_session_config(self.config, backend))
        return self.sessions[backend]

    def _runner(self, name: str):
        if name in PEERS:
            return PeerRunner(self.session("llamacpp"), name)
        if name in HF_PEERS:
            return HFPeerRunner(self.sessions[self.config.backend], name)
        backend, method = split_method(name, self.config.backend)
        return EngineRunner(self.session(backend), method, self.config.method_settings.get(name, {}))

    def close(self) -> None:
        for runner in self.runners.values():
            if hasattr(runner, "close"):
                runner.close()
        for backend, session in self.sessions.items():
            if backend != self.config.backend:  # the caller's
                session.close()


def print_costs(costs: CostModel, contexts: Sequence[int], progress: TextIO) -> None:
    for context in contexts:
        rel = costs.relative(context)
        shown = list(range(min(len(rel), 17))) + [k for k in (32, 64) if k < len(rel)]
        print(f"verify cost at {context} tokens of context (relative to one token): "
              + ", ".join(f"{k}: {rel[k]:.2f}" for k in shown), file=progress)


def _run(session: Session, config: BenchConfig, methods: list[str], prompts: list[BenchPrompt],
         gen: GenerationSettings, out: TextIO, progress: TextIO, sampler: Sampler | None) -> dict:
    costs = session.cost_model()  # measured once, shared by every method of this run
    draft_costs = session.draft_cost_model()
    pool = _Runners(session, config, methods)
    try:
        return _run_prompts(session, pool, config, methods, prompts, gen, out, progress, sampler, costs, draft_costs)
    finally:
        pool.close()


def _run_prompts(session: Session, pool: _Runners, config: BenchConfig, methods: list[str], prompts: list[BenchPrompt],
                 gen: GenerationSettings, out: TextIO, progress: TextIO, sampler: Sampler | None, costs: CostModel,
                 draft_costs: CostModel | None) -> dict:
    runners, plain = pool.runners, baseline_method()
    print_costs(costs, costs.contexts, progress)
    measured_at_load = list(costs.contexts)
    for m, runner in runners.items():  # warm-up, excluded from every figure
        play(runner, runner.session, BenchPrompt(0, "warmup", ("Say hello.",)), replace(gen, max_new_tokens=16))
    records = []
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        order = methods[index % len(methods):] + methods[: index % len(methods)]
        results: dict[str, list[list[TurnRun]]] = {m: [] for m in methods}
        for repeat in range(config.repeats):
            # Repeats alternate the order (A B C, C B A, ...): a drift of the machine's speed over
            # the prompt's runs then falls on every method alike.
            for m in order if repeat % 2 == 0 else order[::-1]:
                results[m].append(play(runners[m], runners[m].session, prompt, gen))
        for m in methods:
            ref = reference_of(m, methods, config.backend)
            div = None if m == ref else divergence(runners[ref].session, results[m][0], results[ref][0], gen.sampling)
            records.append(make_record(m, prompt, results[m], results[plain], div, is_peer(m), sampler))
        elapsed = time.perf_counter() - started
        print(f"[{index + 1}/{len(prompts)}] {prompt.category} q{prompt.question_id}: "
              + ", ".join(f"{r['method']} {r['speedup']:.2f}x" for r in records[-len(methods):]) + f" ({elapsed:.0f} s)",
              file=progress, flush=True)
    print_costs(costs, [c for c in costs.contexts if c not in measured_at_load], progress)  # at the first long prompt
    if config.backend == "llamacpp":  # the recommender plans llama.cpp's methods
        remember(session.model.path, records)
    summary = summarize(records, methods)
    print(markdown(summary, methods), file=out)
    rivals = against_fastest(records, methods)
    if rivals:
        print("\nEach method against the fastest other one, paired prompt by prompt:\n\n"
              + against_fastest_markdown(rivals), file=out)
    choices = auto_choices(session)
    for kind, arms in choices.items():
        print(f"\nauto on {kind} prompts: " + ", ".join(
            f"{arm} played {c['played']}x" + (f" ({c['handed_over']} handed over)" if c["handed_over"] else "")
            + f" at {c['speed']:.2f}x" for arm, c in arms.items()), file=out)
    noisy = sum(r["other_cpu"] > NOISY_OTHER_CPU for r in records)
    if noisy:
        print(f"\nwarning: {noisy} of {len(records)} runs shared the CPU with another busy process "
              f"(> {NOISY_OTHER_CPU} cores); their timings are suspect", file=out)
    meta = {"model": config.model, "model_path": str(session.model.path), "draft_model": config.draft_model,
            "methods": methods, "max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
            "per_category": config.per_category, "repeats": config.repeats, "n_threads": session.target.n_threads,
            "verify_costs": {c: costs.relative(c) for c in costs.contexts},
            "one_token_seconds": {c: costs.seconds(0, c) for c in costs.contexts},
            "draft_one_token_seconds": {c: draft_costs.seconds(0, c) for c in draft_costs.contexts} if draft_costs else None,
            "prompts": len(prompts), "power_source": sampler is not None, "auto_choices": choices}
    return {"meta": meta, "summary": _clean(summary), "against_fastest": _clean(rivals), "records": _clean(records)}


def auto_choices(session: Session) -> dict:
    """What ``auto`` played, per kind of prompt: for each arm, answers played (the warm-up
    included) and the speed it measured relative to plain decoding."""
    out: dict = {}
    for selector in session.memory.values():
        if isinstance(selector, MethodSelector):
            out.update(selector.report())
    return out


def remember(model_path: Path, records: list[dict]) -> None:
    """Keep each engine method's figures per kind of task, from quiet runs, for the recommender."""
    quiet = [r for r in records if not r["peer"] and r["other_cpu"] <= NOISY_OTHER_CPU
             and split_method(r["method"])[0] == "llamacpp"]  # the recommender plans llama.cpp's methods
    store = ObservedStore()
    for method, task in sorted({(r["method"], TASK_OF_CATEGORY.get(r["category"], "chat")) for r in quiet}):
        def of(m: str) -> list[dict]:
            return [r for r in quiet if r["method"] == m and TASK_OF_CATEGORY.get(r["category"], "chat") == task]

        rows = of(method)
        group = _group(rows, of(baseline_method()))
        forwards = sum(r["forwards"] for r in rows)
        store.record(model_path, method, task, decode_tok_s=group["decode_tok_s"], tau=group["tau"],
                     drafted_per_step=sum(r["drafted"] for r in rows) / forwards if forwards else None,
                     speedup=None if is_baseline(method) else group["speedup"])


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1))


CSV_FIELDS = ["method", "category", "question_id", "decode_tok_s", "speedup", "ideal_speedup", "tau",
              "acceptance_rate", "new_tokens", "matches_ar", "divergence_margin", "other_cpu", "ttft_s", "joules_per_token"]


def write_csv(result: dict, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["records"])


def held_out_prompts(path: Path, *, per_category: int, exclude_per_category: int) -> list[BenchPrompt]:
    """``per_category`` prompts per category that a bench with ``--per-category
    exclude_per_category`` does not evaluate (material for a datastore that must not contain the
    evaluated answers)."""
    evaluated = {p.question_id for p in load_prompts(path, per_category=exclude_per_category)}
    everything = load_prompts(path, per_category=10**6)
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in everything:
        if p.question_id not in evaluated:
            by_cat.setdefault(p.category, []).append(p)
    return [p for rows in by_cat.values() for p in rows[:per_category]]


def write_answers(config: BenchConfig, out: Path, *, exclude_per_category: int, progress: TextIO = sys.stderr) -> int:
    """The model's own greedy answers (every turn) to held-out Spec-Bench prompts, one JSONL line
    per prompt: what a user's exported chats would give a REST datastore. Returns the count."""
    prompts = held_out_prompts(config.prompts or default_prompts(), per_category=config.per_category,
                               exclude_per_category=exclude_per_category)
    gen = GenerationSettings(max_new_tokens=config.max_new_tokens, sampling=SamplingSettings())
    out.parent.mkdir(parents=True, exist_ok=True)
    with Session(SessionConfig(model=config.model, n_ctx=config.n_ctx, n_threads=config.n_threads)) as session, \
            out.open("w") as f:
        runner = EngineRunner(session, baseline_method(), {})
        for i, prompt in enumerate(prompts, 1):
            runs = play(runner, session, prompt, gen)
            f.write(json.dumps({"question_id": prompt.question_id, "category": prompt.category,
                                "turns": [r.text for r in runs]}) + "\n")
            print(f"\r  answered {i} of {len(prompts)}", end="", file=progress, flush=True)
    print(file=progress)
    return len(prompts)
