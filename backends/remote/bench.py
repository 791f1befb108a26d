"""``specdeck bench --server URL [--server NAME=URL ...]``: Spec-Bench against serving engines.

Each server is one row, configured however its operator launched it (plain, ngram, EAGLE-3 ...);
the first server is the baseline the others are compared with, prompt by prompt. Servers take
turns on every prompt and the starting one rotates, so a drift in the machines' speed falls on
all alike (the same interleaving as the local bench). Rates are the server's decode rate as seen
by the client (time to first token excluded); acceptance and tau come from the server's own
counters (see ``backends.remote.session``). With greedy decoding a speculative server should
answer exactly as the plain one: ``identical`` counts the prompts whose text matches.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from backends.bench import BenchPrompt, default_prompts, load_prompts
from backends.core.types import Finished, GenerationSettings, RunStats, SamplingSettings
from backends.models.chat import Message
from backends.remote.client import ServerConfig
from backends.remote.session import RemoteSession


@dataclass(frozen=True)
class ServerRow:
    name: str
    config: ServerConfig


def parse_servers(values: Sequence[str], *, api_key: str | None = None) -> list[ServerRow]:
    """``["http://a:8000", "pld=http://b:8001"]`` as named rows (a bare URL is named ``host:port``,
    as the window's comparison names it)."""
    rows = []
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or name.startswith("http"):
            name, url = "", value
        config = ServerConfig(url, api_key=api_key)
        rows.append(ServerRow(name or config.name, config))
    if len({r.name for r in rows}) != len(rows):
        raise ValueError("two servers have the same name; name them as NAME=URL")
    return rows


def _answer(session: RemoteSession, prompt: BenchPrompt, gen: GenerationSettings) -> list[RunStats | str]:
    """Every turn of ``prompt``, each answered after the server's own previous answers:
    [stats of turn 1, text of turn 1, stats of turn 2, ...]."""
    messages: list[Message] = []
    out: list[RunStats | str] = []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        finished = None
        for event in session.generate(messages, gen):
            if isinstance(event, Finished):
                finished = event
        assert finished is not None
        out += [finished.stats, finished.text]
        messages.append({"role": "assistant", "content": finished.text})
    return out


def _record(name: str, prompt: BenchPrompt, turns: list[RunStats | str]) -> dict:
    stats = [t for t in turns if isinstance(t, RunStats)]
    later = sum(s.new_tokens - s.first_step_tokens for s in stats)
    seconds = sum(s.decode_s for s in stats)
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    tokens, forwards = sum(s.new_tokens for s in stats), sum(s.forwards for s in stats)
    return {"server": name, "category": prompt.category, "question_id": prompt.question_id,
            "decode_tok_s": later / seconds if seconds > 0 and later > 0 else float("nan"),
            "ttft_s": stats[0].ttft_s, "new_tokens": tokens, "drafted": drafted, "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else float("nan"),
            "tau": tokens / forwards if forwards else float("nan"), "declined": stats[0].declined,
            "text": "\n\n".join(t for t in turns if isinstance(t, str))}


def run_server_bench(servers: Sequence[ServerRow], *, prompts_file: Path | None = None, per_category: int = 10,
                     categories: Sequence[str] | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
                     seed: int = 0, out: TextIO = sys.stdout, progress: TextIO = sys.stderr) -> dict:
    """Bench ``servers`` on Spec-Bench prompts; prints a table and returns every record."""
    prompts = load_prompts(prompts_file or default_prompts(), per_category=per_category, categories=categories)
    gen = GenerationSettings(max_new_tokens=max_new_tokens, sampling=SamplingSettings(temperature=temperature, seed=seed))
    sessions = {row.name: RemoteSession(row.config) for row in servers}
    try:
        for row in servers:
            print(f"{row.name}: {sessions[row.name].info.label}", file=progress)
            _answer(sessions[row.name], BenchPrompt(0, "warmup", ("Say hello.",)), replace(gen, max_new_tokens=16))
        records: list[dict] = []
        names = [row.name for row in servers]
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            order = names[index % len(names):] + names[: index % len(names)]
            for name in order:
                records.append(_record(name, prompt, _answer(sessions[name], prompt, gen)))
            print(f"[{index + 1}/{len(prompts)}] {prompt.category} q{prompt.question_id} "
                  f"({time.perf_counter() - started:.0f} s)", file=progress, flush=True)
    finally:
        for session in sessions.values():
            session.close()
    summary = summarize(records, names)
    print(markdown(summary, names), file=out)
    return {"servers": {row.name: row.config.base for row in servers}, "summary": summary, "records": records}


def summarize(records: list[dict], names: Sequence[str]) -> dict:
    """Per server and category: median decode rate, speedup over the first server (median of
    per-prompt ratios), acceptance, tau and how many answers match the first server's."""
    base = names[0]
    by_key = {(r["server"], r["question_id"]): r for r in records}
    cats = sorted({r["category"] for r in records}) + ["overall"]
    out: dict = {}
    for name in names:
        out[name] = {}
        for cat in cats:
            rows = [r for r in records if r["server"] == name and cat in ("overall", r["category"])]
            if not rows:
                continue
            ratios = [r["decode_tok_s"] / by_key[(base, r["question_id"])]["decode_tok_s"] for r in rows
                      if by_key[(base, r["question_id"])]["decode_tok_s"] > 0]
            drafted = sum(r["drafted"] for r in rows)
            out[name][cat] = {
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rows),
                "speedup": statistics.median(ratios) if ratios else float("nan"),
                "acceptance_rate": sum(r["accepted"] for r in rows) / drafted if drafted else float("nan"),
                "tau": statistics.median(r["tau"] for r in rows),
                "identical": sum(r["text"] == by_key[(base, r["question_id"])]["text"] for r in rows),
                "prompts": len(rows),
            }
    return out


def markdown(summary: dict, names: Sequence[str]) -> str:
    lines = [f"| server | category | tok/s | vs {names[0]} | acceptance | tau | same text |", "|---|---|---|---|---|---|---|"]
    for name in names:
        for cat, g in summary[name].items():
            acc = f"{g['acceptance_rate']:.0%}" if g["acceptance_rate"] == g["acceptance_rate"] else "n/a"
            lines.append(f"| {name} | {cat} | {g['decode_tok_s']:.1f} | {g['speedup']:.2f}x | {acc} | "
                         f"{g['tau']:.2f} | {g['identical']}/{g['prompts']} |")
    return "\n".join(lines)
