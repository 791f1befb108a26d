"""``specdeck train medusa|eagle|eagle3|mtp``: a head for the user's own model, made on the user's own PC.

Two phases, both resumable (run the same command again after Ctrl+C or a crash):

1. Record. The model answers prompts itself, greedy, and its hidden states are kept
   (``backends.heads.record``; for EAGLE-3 three layers' inputs besides the final state,
   ``record_layers``), one file per answer under the cache folder; a rerun skips the
   conversations already there. A target that decodes several sequences in one forward
   (``SEQUENCES``) answers as many conversations at once as its measured cost curve says pay:
   on 2 AMD EPYC cores, 14 at once record SmolLM2 F16 answers at 147 tokens/s against 75 one by
   one. Prompts: Spec-Bench questions a ``specdeck bench`` does not evaluate
   (``spec-bench``, 60 per category at most), the user's saved chats in the window (``chats``),
   questions the model writes itself (``self``: as many as wanted, no download; ``own_questions``),
   a JSONL file of ``{"turns": [...]}``, ``{"prompt": ...}`` or ``{"messages": [...]}`` lines, or
   several of these joined by commas (``spec-bench,self``: each recorded into its own folder,
   trained on together). Every turn of a conversation is answered with the model's own earlier
   answers, the way a chat goes.
2. Train (``backends.heads.training``): the step count is fixed when training starts, from
   the time left and a measured step, and kept by a resumed run.

``--minutes`` is the whole budget; recording gets ``record_share`` of it. The head is written
next to the user's other heads (``files.head_stem``), where sessions find it for that model.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import sys
import time
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence, TextIO

import numpy as np

from backends.core.costs import CostModel
from backends.core.errors import SpecDeckError
from backends.core.text import TextStream
from backends.core.protocols import pick_states
from backends.core.sampling import make_rng, sample_token, target_distribution
from backends.core.types import FINAL_STATE, SEQUENCES, Finished, GenerationSettings, SamplingSettings
from backends.heads.files import ModelFingerprint, head_stem
from backends.heads.record import Recorder, Sample, SampleStore, sample_numbers
from backends.models.paths import cache_dir, data_dir, write_atomic
from backends.models.weights import tensor_rows

SPEC_BENCH_PER_CATEGORY = 60
TURNS = 16  # sample number = conversation * TURNS + turn
SOURCE_STRIDE = TURNS * 20 * 10**9  # sample numbers of the j-th --data source start at j * SOURCE_STRIDE (held_out's choice kept)
EVALUATED_PER_CATEGORY = 20  # never train on what `specdeck bench --per-category 20` or fewer evaluates
MAX_SEQUENCES = 16  # conversations answered at once at most while recording
SEQUENCE_CONTEXT = 4096  # tokens each of them may hold (a turn that would need more ends its conversation)
RECORD_KV_SHARE = 0.125  # of the memory available, what their KV caches may take
PROGRESS_EVERY = 2.0  # seconds between recording progress reports while no conversation ends
FOLLOW_UP_TURNS = 3  # follow-up turns per conversation by default (see ``with_follow_ups``)
FOLLOW_UPS = (  # what a user asks next, whatever the first question was (``with_follow_ups``)
    "Can you explain that in more detail?",
    "Give me a concrete example.",
    "Summarize your answer in three sentences.",
    "What are common mistakes people make here?",
    "Explain it as if I were ten years old.",
    "What would an expert add to your answer?",
    "Rewrite your answer as a numbered list.",
    "What are the pros and cons?",
    "Are there exceptions or special cases?",
    "How would you explain this to a colleague in one paragraph?",
    "What should I read or learn next about this?",
)


@dataclass(frozen=True)
class TrainRequest:
    kind: str
    model: str
    data: str = "spec-bench"
    minutes: float = 30.0
    record_share: float = 0.5
    max_new_tokens: int = 256
    follow_ups: int = FOLLOW_UP_TURNS  # turns asked after each conversation's own (``with_follow_ups``)
    prompts: int | None = None  # at most this many prompts (None: as many as the time allows)
    steps: int | None = None  # training steps (None: as many as the time allows)
    seed: int = 0
    precision: str = "auto"  # the training products' type (``training_precision``)
    device: str = "auto"  # where the head trains (``training_device``: a CUDA GPU torch sees, else the CPU)
    out: Path | None = None
    n_threads: int | None = None


def with_follow_ups(turns: dict[int, list[str]], n: int) -> dict[int, list[str]]:
    """Each conversation with ``n`` follow-up turns after its own (``FOLLOW_UPS``, a different
    run of them per conversation, fixed by its key).

    Why: a head learns from positions, and a PC has few prompts (Spec-Bench leaves 360 that no
    bench evaluates). Asking on, as a chat goes, gives the model's own answers in longer contexts
    of its own text, which is also where a chat spends its tokens."""
    if n <= 0:
        return turns
    out = {}
    for key, own in turns.items():
        start = (key * 7) % len(FOLLOW_UPS)
        extra = [FOLLOW_UPS[(start + i) % len(FOLLOW_UPS)] for i in range(min(n, len(FOLLOW_UPS)))]
        out[key] = (own + extra)[:TURNS]
    return out


OWN_QUESTIONS = "self"  # --data: questions the model writes itself (``own_questions``)
OWN_QUESTION_TOKENS = 96  # longest question the model writes
QUESTION_SEQUENCES = 8  # questions written at once where the target decodes several sequences
OWN_QUESTIONS_COUNT = 1000  # questions written when --prompts does not say
QUESTIONS = "questions.jsonl"  # ``--data self``: the questions, kept in the recording's folder
QUESTIONS_SHARE = 0.25  # of the recording's time, what writing the questions may take


def user_turn_prefix(model) -> list[int]:
    """The tokens a chat holds before the user's words (the model's chat template up to where a
    user message starts): two one-message chats rendered, their common prefix."""
    a = model.chat_prompt([{"role": "user", "content": "Alpha"}])
    b = model.chat_prompt([{"role": "user", "content": "Zulu"}])
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return list(a[:n])


def own_questions(session, count: int, seed: int, deadline: float = float("inf"),
                  progress: Callable[[int], None] = lambda done: None, *, first_try: int = 0,
                  known: Sequence[str] = ()) -> list[tuple[int, str]]:
    """``count`` distinct questions the model writes itself, sampled from where its chat template
    opens a user turn (the Magpie recipe: an instruction-tuned model has learned what users ask).

    Why: a head generalizes from the variety of what it saw. Spec-Bench leaves 360 prompts; a head
    trained on their answers agrees with the model on 72% of the training conversations' tokens
    and 38% of held-out ones (SmolLM2 EAGLE, measured). Questions of the model's own cost a fraction
    of a second each, need no download, and come in the kind of text the model answers in. A
    target that decodes several sequences at once writes ``QUESTION_SEQUENCES`` together.

    Returns (try number, question) pairs. Try ``n`` samples from seed ``seed * 1_000_003 + n``;
    ``first_try`` and ``known`` (questions written before, never repeated) continue a seed's
    questions where an earlier call stopped."""
    prefix = user_turn_prefix(session.model)
    tries = _QuestionTries(count, deadline, progress, first_try, known)
    if SEQUENCES in session.target.offers and prefix:
        _write_together(session, prefix, seed, tries)
    else:
        _write_one_by_one(session, prefix, seed, tries)
    return tries.kept


class _QuestionTries:
    """Which question tries to start, and which finished ones are kept: the first ``count``, in
    try order, that the model ended itself (not cut off), distinct, of at least 12 characters.

    Only tries finished with none unfinished before them are judged, and new ones start until
    those give ``count``: the questions kept are the same whether one or several are written at
    once and whatever order they finish in, and asking for fewer gives the first of them."""

    def __init__(self, count: int, deadline: float, progress: Callable[[int], None], first: int = 0,
                 known: Sequence[str] = ()) -> None:
        self.count, self.deadline, self.progress, self.first = count, deadline, progress, first
        self.started = self.judged = first
        self.kept: list[tuple[int, str]] = []
        self._seen = {q.lower() for q in known}
        self._finished: dict[int, str | None] = {}

    def next(self) -> int | None:
        """The next try's number, or None when no more are needed (or the time is up)."""
        if (len(self.kept) >= self.count or self.started - self.first >= 4 * self.count
                or time.time() > self.deadline):
            return None
        self.started += 1
        return self.started - 1

    def finished(self, attempt: int, text: str | None) -> None:
        """Try ``attempt`` wrote ``text`` (None: cut off before the model ended it)."""
        self._finished[attempt] = text
        while self.judged in self._finished and len(self.kept) < self.count:
            text = self._finished.pop(self.judged)
            self.judged += 1
            if text is not None and len(text) >= 12 and text.lower() not in self._seen:
                self._seen.add(text.lower())
                self.kept.append((self.judged - 1, text))
                self.progress(len(self.kept))


def _question_sampling(seed: int, attempt: int) -> SamplingSettings:
    return SamplingSettings(temperature=1.0, top_k=0, top_p=0.95, min_p=0.0, seed=seed * 1_000_003 + attempt)


def _write_one_by_one(session, prefix: list[int], seed: int, tries: _QuestionTries) -> None:
    """Each try through the engine: any target."""
    from backends.core.engine import generate
    from backends.drafters.ar import ARDrafter

    eog = session.model.eog_ids
    while (attempt := tries.next()) is not None:
        finished = None
        for event in generate(session.target, ARDrafter(), prefix, GenerationSettings(
                max_new_tokens=OWN_QUESTION_TOKENS, sampling=_question_sampling(seed, attempt))):
            if isinstance(event, Finished):
                finished = event
        ended = finished is not None and bool(finished.tokens) and finished.tokens[-1] in eog
        tries.finished(attempt, finished.text.strip() if ended else None)


@dataclass
class _Question:
    """A question being written in one of the batch's sequences."""

    attempt: int
    sampling: SamplingSettings
    rng: np.random.Generator
    tokens: list[int]  # written so far
    feed: list[int]  # what the sequence takes next


def _write_together(session, prefix: list[int], seed: int, tries: _QuestionTries) -> None:
    """``QUESTION_SEQUENCES`` tries at once, one per sequence, each sampled from its own seed as
    the engine samples (``target_distribution``, ``sample_token``); a finished one's sequence keeps
    the prefix and starts the next try. The width is fixed, not measured: every run then decodes
    the same batches, which keeps a seed's questions the same (other shapes move a near-tie)."""
    model, eog = session.model, session.model.eog_ids
    room = -(-(len(prefix) + OWN_QUESTION_TOKENS + 1) // 256) * 256  # llama.cpp sizes contexts in 256s
    with session.target.sequences(QUESTION_SEQUENCES, room) as seqs:
        slots: list[_Question | None] = [None] * seqs.n_seqs

        def start(s: int) -> None:
            attempt = tries.next()
            if attempt is None:
                slots[s] = None
                return
            seqs.truncate(s, len(prefix) - 1)  # the last prefix token again: its logits start the question
            sampling = _question_sampling(seed, attempt)
            slots[s] = _Question(attempt, sampling, make_rng(sampling.seed), [], list(prefix[seqs.n_past[s]:]))

        for s in range(seqs.n_seqs):
            start(s)
        while any(slots):
            feeds = forward_feeds([(s, q.feed) for s, q in enumerate(slots) if q], seqs.n_batch)
            for (s, fed), step in zip(feeds, seqs.decode(feeds)):
                q = slots[s]
                q.feed = q.feed[len(fed):]
                if q.feed:
                    continue  # more of the prefix to come
                token = sample_token(target_distribution(step.logits, [*prefix, *q.tokens], q.sampling), q.rng)
                if token in eog or len(q.tokens) + 1 >= OWN_QUESTION_TOKENS:
                    text = TextStream(model.token_piece)
                    text.push(q.tokens)
                    text.flush()
                    tries.finished(q.attempt, text.text.strip() if token in eog else None)
                    start(s)
                else:
                    q.tokens.append(token)
                    q.feed = [token]


def own_conversations(session, folder: Path, req: TrainRequest, *, deadline: float,
                      report: Callable[[dict], None]) -> dict[int, list[str]]:
    """``--data self``: the model's own questions, one conversation each, kept in the recording's
    folder (``questions.jsonl``, with each one's try number) so a resumed recording asks the same
    ones, and a run that asks for more (``--prompts``) goes on with the seed's next tries. No
    follow-up turns: they make more of few prompts, and here prompts are as many as wanted."""
    path = folder / QUESTIONS
    rows = _question_rows(path)
    count = max(req.prompts or OWN_QUESTIONS_COUNT, len(rows))
    if len(rows) < count:
        known = [str(row["prompt"]) for row in rows]
        # a file written before try numbers were kept: at most 4 tries went to each of its questions
        first = max((int(row["try"]) + 1 for row in rows if "try" in row), default=4 * len(rows))
        more = own_questions(session, count - len(rows), req.seed, deadline, first_try=first, known=known,
                             progress=lambda done: report({"phase": "questions", "done": len(rows) + done,
                                                           "total": count}))
        if not rows and not more:
            raise SpecDeckError(f"{session.model.path} wrote no question of its own in the time given (more "
                                "--minutes; or the model has no chat template)")
        rows += [{"prompt": q, "try": n} for n, q in more]
        write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return conversations(str(path))


def _question_rows(path: Path) -> list[dict]:
    """The questions written so far (``{"prompt": ..., "try": n}`` a line), none if no file yet."""
    if not path.exists():
        return []
    try:
        raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [{"prompt": str(row["prompt"]), **({"try": int(row["try"])} if "try" in row else {})} for row in raw]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SpecDeckError(f"{path} is damaged ({exc}): delete it, and the model writes its questions anew") from None


def conversations(data: str) -> dict[int, list[str]]:
    """The user turns of each conversation of a data source, by a key that stays the conversation's
    (its position in a file; a saved chat's id, which deleting other chats does not change)."""
    if data == "spec-bench":
        from backends.bench import default_prompts, held_out_prompts

        prompts = held_out_prompts(default_prompts(), per_category=SPEC_BENCH_PER_CATEGORY,
                                   exclude_per_category=EVALUATED_PER_CATEGORY)
        return dict(enumerate(list(p.turns) for p in prompts))
    if data == "chats":
        return saved_chats(data_dir() / "conversations.sqlite3")
    path = Path(data).expanduser()
    if not path.is_file():
        raise SpecDeckError(f"--data takes spec-bench, chats or a JSONL file; {data} is none of them")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "turns" in row:
                turns = [str(t) for t in row["turns"]]
            elif "prompt" in row:
                turns = [str(row["prompt"])]
            else:
                turns = [str(m["content"]) for m in row["messages"] if m.get("role") == "user"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SpecDeckError(f"{path}:{n}: expected {{'turns': [...]}}, {{'prompt': ...}} or "
                                f"{{'messages': [...]}} ({exc})") from None
        if turns:
            out.append(turns)
    if not out:
        raise SpecDeckError(f"{path} holds no prompts")
    return dict(enumerate(out))


def saved_chats(path: Path) -> dict[int, list[str]]:
    """What the user asked in the window's saved conversations (the SQLite file the window keeps,
    ``desktop/store.py``: table ``messages``, by conversation and position), read-only."""
    if not path.exists():
        raise SpecDeckError("there are no saved chats yet: chat in the window first, or train on spec-bench")
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            rows = db.execute("SELECT conversation, content FROM messages WHERE role = 'user' AND content != '' "
                              "ORDER BY conversation, position").fetchall()
    except sqlite3.Error as exc:
        raise SpecDeckError(f"the saved chats in {path} cannot be read ({exc})") from None
    out: dict[int, list[str]] = {}
    for conversation, content in rows:
        out.setdefault(int(conversation), []).append(str(content))
    if not out:
        raise SpecDeckError("the saved chats hold no messages yet")
    return out


def data_sources(data: str) -> list[str]:
    """The sources of ``--data``: one, or several joined by commas (``spec-bench,self``), each
    recorded into its own folder and trained on together."""
    sources = list(dict.fromkeys(src.strip() for src in data.split(",") if src.strip()))
    if not sources:
        raise SpecDeckError("--data names no source: spec-bench, chats, self or a JSONL file")
    return sources


def data_tag(data: str) -> str:
    """A source's name in folder names."""
    return data if data in ("spec-bench", "chats", OWN_QUESTIONS) else Path(data).stem


def data_folder(fingerprint: ModelFingerprint, data: str, max_new_tokens: int, layers: tuple[int, ...] = (),
                follow_ups: int = 0) -> Path:
    tag = data_tag(data)
    tag += f"-follow{follow_ups}" if follow_ups else ""
    which = "-layers" + "_".join(map(str, layers)) if layers else ""  # recordings of other states apart
    return model_folder(fingerprint) / f"{tag}-{max_new_tokens}{which}"


def model_folder(fingerprint: ModelFingerprint) -> Path:
    """Where one model's recordings live: by vocabulary, weight type and a digest of the model's
    name and shape, since the sizes of one family share a vocabulary (SmolLM2 135M and 360M,
    Qwen2.5 0.5B to 72B) and each records its own states. Recordings made before the digest was
    part of the name (2026-12-07) are moved here when every one of them is this model's."""
    root = cache_dir() / "train"
    digest = hashlib.sha256(fingerprint.describe().encode()).hexdigest()[:8]
    folder = root / f"{fingerprint.vocab_digest}-{fingerprint.file_type}-{digest}"
    before = root / f"{fingerprint.vocab_digest}-{fingerprint.file_type}"
    if not folder.exists() and before.is_dir() and _only_recordings_of(before, fingerprint):
        before.rename(folder)
    return folder


def _only_recordings_of(folder: Path, fingerprint: ModelFingerprint) -> bool:
    """Whether every recording in ``folder`` says it is of this model (and there is one)."""
    manifests = list(folder.glob("*/source.json"))
    try:
        return bool(manifests) and all(json.loads(m.read_text())["model"] == fingerprint.describe() for m in manifests)
    except (OSError, ValueError, KeyError, TypeError):
        return False


class Conversation:
    """One conversation answered turn by turn, the model's own answers fed back as a chat goes."""

    def __init__(self, key: int, turns: Sequence[str], model, *, room: int, max_new_tokens: int) -> None:
        self.key, self.turns, self.model = key, list(turns[:TURNS]), model
        self.room, self.max_new_tokens = room, max_new_tokens
        self.messages: list[dict] = []
        self.turn = -1

    def next_prompt(self) -> list[int] | None:
        """The next turn's prompt; None after the last turn or when a prompt leaves no room for an answer."""
        self.turn += 1
        if self.turn >= len(self.turns):
            return None
        self.messages.append({"role": "user", "content": self.turns[self.turn]})
        prompt = self.model.chat_prompt(self.messages)
        return prompt if len(prompt) + self.max_new_tokens < self.room else None

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    @property
    def sample_number(self) -> int:
        return self.key * TURNS + self.turn


def record(session, turns: dict[int, list[str]], store: SampleStore, *, max_new_tokens: int, deadline: float,
           limit: int | None, report: Callable[[dict], None], layers: tuple[int, ...] = ()) -> int:
    """Answer conversations in order until ``deadline``; returns how many are recorded in all.

    A target that decodes several sequences at once (``SEQUENCES``) answers as many conversations
    together as its measured cost curve says pay; any other records through the engine."""
    keys = [k for k in list(turns)[:limit] if not store.has(k * TURNS)]
    total, start = len(list(turns)[:limit]), time.perf_counter()
    already = total - len(keys)
    together = SEQUENCES in session.target.offers
    room = min(session.target.n_ctx, SEQUENCE_CONTEXT) if together else session.target.n_ctx

    def conversations() -> Iterator[Conversation]:
        for key in keys:
            if time.time() > deadline:
                return
            yield Conversation(key, turns[key], session.model, room=room, max_new_tokens=max_new_tokens)

    shown = [-1, 0.0]  # conversations done and the time at the last report

    def progress(done: int, tokens: int) -> None:
        """Reported when a conversation is done, and every ``PROGRESS_EVERY`` seconds between:
        a batch of long answers can take a minute to finish its first conversation."""
        now = time.perf_counter()
        if done == shown[0] and now - shown[1] < PROGRESS_EVERY:
            return
        shown[:] = done, now
        report({"phase": "record", "done": already + done, "total": total,
                "tokens_per_s": tokens / max(now - start, 1e-9), "eta_s": max(0.0, deadline - time.time())})

    if keys:  # the model is loaded and answering: say so before the first answer is done
        progress(0, 0)

    if together:
        with session.target.sequences(recording_sequences(session, room), room, layers) as seqs:
            record_together(seqs, conversations(), store, eog=session.model.eog_ids,
                            piece=session.model.token_piece, max_new_tokens=max_new_tokens, progress=progress)
    else:
        record_one_by_one(session.target, conversations(), store, max_new_tokens=max_new_tokens, progress=progress,
                          layers=layers)
    return len({n // TURNS for n in store.indices()})


def widest_paying_batch(costs: CostModel, context: int, cap: int) -> int:
    """How many rows one forward should take to decode the most rows per second, from the
    measured curve: the smallest count within 5% of the best (more rows cost memory for little).

    Example: rows costing [1, 1.86, 1.9, 1.95, 1.98] x one row give 5 (2.5 rows per unit of time)."""
    rates = [n / costs.batch_seconds(n, context) for n in range(1, max(1, cap) + 1)]
    best = max(rates)
    return next(n for n, rate in enumerate(rates, 1) if rate >= 0.95 * best)


def recording_sequences(session, n_ctx_seq: int) -> int:
    """How many conversations to answer at once: the widest batch the measured cost curve says
    pays (at most ``MAX_SEQUENCES``), fewer if their KV caches would take more than
    ``RECORD_KV_SHARE`` of the memory available now."""
    import psutil

    from backends.hardware.shape import load_shape

    n = widest_paying_batch(session.cost_model(), n_ctx_seq // 2, MAX_SEQUENCES)
    shape = load_shape(session.model.path)
    per_token = sum(h * (shape.key_length + shape.value_length) * 2 for h in shape.head_kv)  # f16 K and V
    fits = int(psutil.virtual_memory().available * RECORD_KV_SHARE) // max(1, per_token * n_ctx_seq)
    return max(1, min(n, fits))


def record_one_by_one(target, conversations: Iterator[Conversation], store: SampleStore, *, max_new_tokens: int,
                      progress: Callable[[int, int], None], layers: tuple[int, ...] = ()) -> None:
    """Each turn through the engine with a ``Recorder``: any target that offers hidden states."""
    from backends.core.engine import generate

    gen = GenerationSettings(max_new_tokens=max_new_tokens, sampling=SamplingSettings())
    tokens = 0
    for done, conv in enumerate(conversations, 1):
        while (prompt := conv.next_prompt()) is not None:
            recorder = Recorder(layers)
            finished = None
            for event in generate(target, recorder, prompt, gen):
                if isinstance(event, Finished):
                    finished = event
            answer = finished.tokens if finished else ()
            store.put(conv.sample_number, recorder.sample(prompt, answer))
            tokens += len(answer)
            conv.answered(finished.text if finished else "")
            progress(done - 1, tokens)
        progress(done, tokens)


@dataclass
class _Slot:
    """A conversation in one of the batch's sequences: what the sequence holds and is to be fed."""

    conv: Conversation
    tokens: list[int]  # the turn's prompt, then its answer so far
    n_prompt: int
    fed: int  # tokens[:fed] are in the sequence's cache
    states: list[np.ndarray]  # [fed, d] float16 in all: the state after each fed token


def forward_feeds(pending: Sequence[tuple[int, Sequence[int]]], n_batch: int) -> list[tuple[int, list[int]]]:
    """What one forward of several sequences takes: each sequence's next tokens (sequence id,
    tokens), the one-token ones (decoding) first, then the longer ones (prompts), in sequence
    order, each cut to the rows left of ``n_batch``: a long prompt goes in chunks."""
    feeds, budget = [], n_batch
    for s, tokens in sorted(pending, key=lambda p: len(p[1]) > 1):  # stable: sequence order kept
        if budget <= 0:
            break
        feeds.append((s, list(tokens[:budget])))
        budget -= len(feeds[-1][1])
    return feeds


def record_together(seqs, conversations: Iterator[Conversation], store: SampleStore, *, eog: frozenset[int],
                    piece: Callable[[int], bytes], max_new_tokens: int, progress: Callable[[int, int], None]) -> None:
    """Greedy answers to several conversations at once, each in its own sequence (continuous
    batching: a sequence whose conversation ends takes the next one at once). Every forward feeds
    each answering sequence its last token and fills what rows are left with prompt chunks.

    The samples are the engine's (prompt and answer with its EOG token, the state of every
    position but the last); only the forward shapes differ, which moves a near-tie now and then."""
    slots: list[_Slot | None] = [None] * seqs.n_seqs
    done = tokens = 0

    def take(s: int, conv: Conversation, held: list[int], states: list[np.ndarray]) -> bool:
        """Put the conversation's next turn in sequence ``s``, reusing what it holds of the prompt."""
        prompt = conv.next_prompt()
        if prompt is None:
            return False
        common = 0
        while common < min(len(held), len(prompt) - 1) and held[common] == prompt[common]:
            common += 1
        seqs.truncate(s, common)
        common = seqs.n_past[s]
        kept = np.concatenate(states)[:common] if states and common else None
        slots[s] = _Slot(conv, list(prompt), len(prompt), common, [] if kept is None else [kept])
        return True

    def refill(s: int) -> None:
        for conv in conversations:
            seqs.truncate(s, 0)
            if take(s, conv, [], []):
                return
        slots[s] = None

    for s in range(seqs.n_seqs):
        refill(s)
    while any(slots):
        feeds = forward_feeds([(s, slot.tokens[slot.fed :]) for s, slot in enumerate(slots) if slot], seqs.n_batch)
        for (s, fed), step in zip(feeds, seqs.decode(feeds)):
            slot = slots[s]
            slot.fed += len(fed)
            slot.states.append(step.hidden)
            if slot.fed < len(slot.tokens):
                continue  # a prompt chunk: more of the prompt to come
            token = int(np.argmax(step.logits))
            slot.tokens.append(token)
            tokens += 1
            answer = slot.tokens[slot.n_prompt :]
            if token not in eog and len(answer) < max_new_tokens:
                continue
            states = np.concatenate(slot.states)  # [fed, d] = [T - 1, d]
            store.put(slot.conv.sample_number, Sample(np.array(slot.tokens, dtype=np.int32), states, slot.n_prompt))
            text = TextStream(piece)
            text.push(answer)
            text.flush()
            slot.conv.answered(text.text)
            if not take(s, slot.conv, slot.tokens[: slot.fed], slot.states):
                done += 1
                refill(s)
        progress(done, tokens)  # reported when a conversation ends and every PROGRESS_EVERY seconds


def _medusa(samples, model_path: Path, fingerprint: ModelFingerprint, eog: list[int], n_vocab: int, folder: Path,
            *, seed: int, precision: str, device: str):
    """The Medusa trainer for recorded samples, and how many positions it trains on."""
    from backends.heads.training import MedusaTrainConfig, MedusaTrainer, draft_vocabulary, medusa_examples

    config = MedusaTrainConfig(seed=seed, precision=precision)
    vocab = draft_vocabulary([s for _, s in samples], config.draft_vocab, eog, n_vocab)
    examples = medusa_examples(samples, vocab, config.n_heads, n_vocab, group=lambda n: n // TURNS)
    trainer = MedusaTrainer(examples, vocab, tensor_rows(model_path, vocab), fingerprint, config,
                            folder / f"medusa-seed{seed}.checkpoint.safetensors", device)
    return trainer, len(examples.states), int(examples.held_out.sum())


def _eagle_shape(info, draft_vocab: int):
    """A layer shaped like one of the target's (its width, heads, feed-forward); ``info`` is the
    target's ``ModelShape`` (``load_shape``: a GGUF header or a Hugging Face config.json)."""
    from backends.heads.eagle import EagleShape

    n_head = info.n_head if info.n_head and info.n_embd % info.n_head == 0 else max(1, info.n_embd // 64)
    n_head_kv = info.head_kv[0] if info.head_kv else 0
    n_kv = n_head_kv if n_head_kv and n_head % n_head_kv == 0 else n_head
    return EagleShape(d=info.n_embd, n_head=n_head, n_kv_head=n_kv, head_dim=info.n_embd // n_head,
                      d_ff=info.n_ff or 4 * info.n_embd, draft_vocab=draft_vocab)


def _eagle(samples, model_path: Path, fingerprint: ModelFingerprint, eog: list[int], n_vocab: int, folder: Path,
           *, seed: int, precision: str, device: str):
    """The EAGLE trainer: a layer shaped like one of the target's (its width, heads, feed-forward)."""
    from backends.heads.eagle_training import EagleTrainConfig, EagleTrainer, eagle_sequences
    from backends.heads.training import draft_vocabulary
    from backends.hardware.shape import load_shape
    from backends.models.weights import TokenEmbeddings

    config = EagleTrainConfig(seed=seed, precision=precision)
    info = load_shape(model_path)
    vocab = draft_vocabulary([s for _, s in samples], config.draft_vocab, eog, n_vocab)
    shape = _eagle_shape(info, len(vocab))
    data = eagle_sequences(samples, vocab, n_vocab, config.chunk, TokenEmbeddings(model_path),
                           group=lambda n: n // TURNS)
    trainer = EagleTrainer(data, vocab, tensor_rows(model_path, vocab), shape, fingerprint, config,
                           folder / f"eagle-seed{seed}.checkpoint.safetensors", device)
    held = int((data.valid & data.held_out[:, None]).sum())
    return trainer, int(data.valid.sum()), held


def _eagle3(samples, model_path: Path, fingerprint: ModelFingerprint, eog: list[int], n_vocab: int, folder: Path,
            *, seed: int, precision: str, device: str):
    """The EAGLE-3 trainer: the layer as for EAGLE, reading the recorded layers (``record_layers``)."""
    from backends.heads.eagle3 import Eagle3Shape
    from backends.heads.eagle3_training import Eagle3TrainConfig, Eagle3Trainer
    from backends.heads.eagle_training import eagle_sequences
    from backends.heads.training import draft_vocabulary
    from backends.hardware.shape import load_shape
    from backends.models.weights import TokenEmbeddings

    config = Eagle3TrainConfig(seed=seed, precision=precision)
    info = load_shape(model_path)
    base = _eagle_shape(info, 1)
    layers = record_layers("eagle3", info.n_layer)[:-1]  # the last recorded state is the final one
    vocab = draft_vocabulary([s for _, s in samples], config.draft_vocab, eog, n_vocab)
    shape = Eagle3Shape(**dict(base.__dict__, draft_vocab=len(vocab)), layers=layers, target_d=info.n_embd)
    data = eagle_sequences(samples, vocab, n_vocab, config.chunk, TokenEmbeddings(model_path),
                           group=lambda n: n // TURNS)
    trainer = Eagle3Trainer(data, vocab, tensor_rows(model_path, vocab), shape, fingerprint, config,
                            folder / f"eagle3-seed{seed}.checkpoint.safetensors", device)
    held = int((data.valid & data.held_out[:, None]).sum())
    return trainer, int(data.valid.sum()), held


def _mtp(samples, model_path: Path, fingerprint: ModelFingerprint, eog: list[int], n_vocab: int, folder: Path,
         *, seed: int, precision: str, device: str):
    """The trainer of a DeepSeek-V3-style MTP module: an EAGLE layer's sizes, the final state."""
    from backends.heads.eagle_training import eagle_sequences
    from backends.heads.mtp import MTPShape
    from backends.heads.mtp_training import MTPTrainConfig, MTPTrainer
    from backends.heads.training import draft_vocabulary
    from backends.hardware.shape import load_shape
    from backends.models.weights import TokenEmbeddings

    config = MTPTrainConfig(seed=seed, precision=precision)
    vocab = draft_vocabulary([s for _, s in samples], config.draft_vocab, eog, n_vocab)
    shape = MTPShape(**_eagle_shape(load_shape(model_path), len(vocab)).__dict__)
    data = eagle_sequences(samples, vocab, n_vocab, config.chunk, TokenEmbeddings(model_path),
                           group=lambda n: n // TURNS)
    trainer = MTPTrainer(data, vocab, tensor_rows(model_path, vocab), shape, fingerprint, config,
                         folder / f"mtp-seed{seed}.checkpoint.safetensors", device)
    return trainer, int(data.valid.sum()), int((data.valid & data.held_out[:, None]).sum())


def _eagle3_layers(n_layer: int) -> tuple[int, ...]:
    """An EAGLE-3 head's three layers, and the final state (what says the target's distribution)."""
    from backends.heads.eagle3 import default_layers

    return (*default_layers(n_layer), FINAL_STATE)


RECORDED_LAYERS = {"eagle3": _eagle3_layers}  # head kind -> the states it trains on, by layer count (else the final one)


def recording_for(fingerprint: ModelFingerprint, req: TrainRequest, needed: tuple[int, ...],
                  n_layer: int) -> tuple[Path, tuple[int, ...]]:
    """The recording to add to and train from, and the states it keeps: the head's own, or one
    that keeps more states (an EAGLE-3 recording keeps the final state too) and already holds more
    conversations. One recording serves every head whose states it holds: recording is what costs
    (an hour for a few hundred conversations on 2 cores), training from it minutes."""
    def folder(layers: tuple[int, ...]) -> Path:
        return data_folder(fingerprint, req.data, req.max_new_tokens, layers, req.follow_ups)

    def count(layers: tuple[int, ...]) -> int:
        return len(sample_numbers(folder(layers)))

    options = {record_layers(kind, n_layer) for kind in TRAINERS}
    holding = [layers for layers in options if set(needed or (FINAL_STATE,)) <= set(layers or (FINAL_STATE,))]
    best = max(holding, key=lambda layers: (count(layers), layers == needed))
    return folder(best), best


def stamped(manifest: dict, layers: tuple[int, ...]) -> dict:
    """A recording's manifest: its source, and the states it keeps unless only the final one."""
    return dict(manifest, layers=list(layers)) if layers else manifest


def richer_recording(fingerprint: ModelFingerprint, req: TrainRequest, layers: tuple[int, ...],
                     n_layer: int) -> tuple[Path, tuple[int, ...]] | None:
    """A recording of the same data that keeps other states and holds more answers than the one
    for ``layers``, with the states it keeps: its answers can be read again for these (``reread``)."""
    def folder(states: tuple[int, ...]) -> Path:
        return data_folder(fingerprint, req.data, req.max_new_tokens, states, req.follow_ups)

    others = {states for states in (record_layers(kind, n_layer) for kind in TRAINERS) if states != layers}
    counts = {states: len(sample_numbers(folder(states))) for states in others}
    best = max(counts, key=counts.__getitem__, default=None)
    if best is None or counts[best] <= len(sample_numbers(folder(layers))):
        return None
    return folder(best), best


def reread(target, donor: SampleStore, store: SampleStore, layers: tuple[int, ...], *, keys: Sequence[int],
           deadline: float, report: Callable[[dict], None]) -> None:
    """The answers another head's recording holds, for conversations ``keys``, read again for the
    states ``layers``: a prefill over each recorded answer (teacher forcing) computes what the
    model's own forwards computed while answering, up to batch rounding, without answering again.
    SmolLM2 F16 on 2 cores: 360-410 rows a second at 1200 tokens of context, where answering
    records about 175 tokens a second; a conversation's turns reuse the cache of the one before."""
    wanted = set(keys)
    numbers = [n for n in donor.indices() if n // TURNS in wanted and not store.has(n)]
    total = len({n // TURNS for n in numbers})
    start, rows, seen = time.perf_counter(), 0, set()
    for n in numbers:
        if time.time() > deadline:
            break
        sample = donor.get(n)
        tokens = [int(t) for t in sample.tokens[:-1]]  # the state of each position but the last
        reused = target.prefill(tokens, hidden=True, hidden_from=0, layers=layers)
        states = np.asarray(target.hidden_states(0, len(tokens)), dtype=np.float16)
        store.put(n, Sample(sample.tokens, states, sample.n_prompt))
        rows += len(tokens) - reused
        seen.add(n // TURNS)
        elapsed = max(time.perf_counter() - start, 1e-9)
        report({"phase": "reread", "done": len(seen), "total": total, "tokens_per_s": rows / elapsed,
                "eta_s": elapsed / len(seen) * (total - len(seen))})


def narrowed(sample: Sample, recorded: tuple[int, ...], needed: tuple[int, ...]) -> Sample:
    """``sample`` with only the states a head needs, from a recording that keeps more."""
    if recorded == needed:
        return sample
    recorded, needed = recorded or (FINAL_STATE,), needed or (FINAL_STATE,)
    states = pick_states(sample.states, tuple(recorded.index(il) for il in needed), len(recorded))
    return Sample(sample.tokens, np.ascontiguousarray(states), sample.n_prompt)


def record_layers(kind: str, n_layer: int) -> tuple[int, ...]:
    """The target states a kind of head trains on (``Target.prefill``'s ``layers``; empty: the final state)."""
    return RECORDED_LAYERS[kind](n_layer) if kind in RECORDED_LAYERS else ()


TRAINERS = {"medusa": _medusa, "eagle": _eagle, "eagle3": _eagle3, "mtp": _mtp}  # head kind -> its trainer over recorded samples


def train(req: TrainRequest, *, report: Callable[[dict], None] = lambda event: None,
          stop: Callable[[], bool] | None = None) -> Path:
    """Record, train, export; returns the head's .json path. ``report`` sees progress events:
    ``{"phase": "questions", "done", "total"}`` (``--data self``),
    ``{"phase": "record", "done", "total", "tokens_per_s", "eta_s"}`` (``"reread"`` with the same
    fields: another head's recording read again for these states), ``{"phase": "data",
    "positions", "held_out", "conversations", "device" (where it trains: "the CPU" or the GPU's
    name), "precision"}``, ``{"phase": "train", "step", "steps", "loss", "agreement" (may be
    empty), "eta_s"}`` and ``{"phase": "done", "head", "agreement"}``."""
    if req.kind not in TRAINERS:
        raise SpecDeckError(f"specdeck can train {', '.join(TRAINERS)} heads, not {req.kind!r}")
    from backends.factory import Session, SessionConfig, backend_for
    from backends.heads.training import device_name, training_device, training_precision

    training_precision(req.precision, training_device(req.device))  # before an hour of recording, not after:
    # no torch, a bad precision, a GPU asked that torch cannot use (and ``auto`` times its choice now)
    started = time.time()
    sources = data_sources(req.data)
    given = {src: with_follow_ups(conversations(src), req.follow_ups) for src in sources
             if src != OWN_QUESTIONS}  # a bad --data fails before the model loads; own questions ask no follow-ups
    record_end = started + req.minutes * 60 * req.record_share
    recorded: list[tuple[SampleStore, tuple[int, ...]]] = []
    done = 0
    with Session(SessionConfig(model=req.model, n_threads=req.n_threads, backend=backend_for(req.model))) as session:
        path = Path(session.model.path)
        fingerprint = ModelFingerprint.of(path)
        needed = record_layers(req.kind, session.model.n_layer)
        for j, src in enumerate(sources):  # source j records until its share of the time ends (unused time goes on)
            deadline = started + (record_end - started) * (j + 1) / len(sources)
            one = replace(req, data=src, follow_ups=req.follow_ups if src in given else 0)
            folder, layers = recording_for(fingerprint, one, needed, session.model.n_layer)
            manifest = {"model": fingerprint.describe(), "data": src, "max_new_tokens": req.max_new_tokens}
            if one.follow_ups:
                manifest["follow_ups"] = one.follow_ups
            store = SampleStore(folder, stamped(manifest, layers))
            donor = richer_recording(fingerprint, one, layers, session.model.n_layer)
            if donor is not None and src == OWN_QUESTIONS and not (folder / QUESTIONS).exists():
                write_atomic(folder / QUESTIONS, (donor[0] / QUESTIONS).read_text(encoding="utf-8"))  # the same seed's
            turns = given[src] if src in given else own_conversations(
                session, folder, one, deadline=time.time() + (deadline - time.time()) * QUESTIONS_SHARE, report=report)
            if donor is not None:
                reread(session.target, SampleStore(donor[0], stamped(manifest, donor[1])), store, layers,
                       keys=list(turns)[: req.prompts], deadline=deadline, report=report)
            done += record(session, turns, store, max_new_tokens=req.max_new_tokens, layers=layers,
                           deadline=deadline, limit=req.prompts, report=report)
            recorded.append((store, layers))
        eog = sorted(session.model.eog_ids)
        n_vocab = session.model.n_vocab
    samples = [(j * SOURCE_STRIDE + n, narrowed(s, layers, needed))
               for j, (store, layers) in enumerate(recorded) for n, s in store.samples()]
    checkpoints = recorded[0][0].folder
    if len(sources) > 1:  # a checkpoint of these sources together, apart from the first one's alone
        checkpoints = checkpoints / ("with-" + "+".join(data_tag(src) for src in sources[1:]))
    trainer, positions, held = TRAINERS[req.kind](samples, path, fingerprint, eog, n_vocab, checkpoints,
                                                seed=req.seed, precision=req.precision, device=req.device)
    report({"phase": "data", "positions": positions, "held_out": held, "conversations": done,
            "device": device_name(trainer.device), "precision": trainer.precision})
    steps = req.steps
    if steps is None:
        left = started + req.minutes * 60 - time.time()
        steps = max(1, int(left / trainer.measure_step()))

    def progress(p) -> None:
        report({"phase": "train", "step": p.step, "steps": p.steps, "loss": p.loss, "agreement": p.agreement,
                "eta_s": p.eta})

    result = trainer.run(steps, progress, stop)
    if result.step < trainer.steps:
        raise SpecDeckError(f"training stopped at step {result.step} of {trainer.steps}; run the same command "
                            "again to go on")
    head = trainer.export({"data": req.data, "conversations": done, "positions": positions,
                           "steps": trainer.steps, "seed": req.seed, "minutes": req.minutes,
                           "agreement": [round(a, 4) for a in result.agreement],
                           "command": command_line(req)})
    saved = head.save(req.out or head_stem(path, req.kind))
    report({"phase": "done", "head": str(saved), "agreement": result.agreement})
    return saved


def command_line(req: TrainRequest) -> str:
    """The ``specdeck train`` command that makes this head (kept in its config)."""
    words = [f"specdeck train {req.kind} --model {req.model} --data {req.data} --minutes {req.minutes:g}"]
    for flag, value in (("--prompts", req.prompts), ("--steps", req.steps), ("--seed", req.seed)):
        if value is not None:
            words.append(f"{flag} {value}")
    if req.max_new_tokens != TrainRequest.max_new_tokens:
        words.append(f"--max-new-tokens {req.max_new_tokens}")
    if req.follow_ups != TrainRequest.follow_ups:
        words.append(f"--follow-ups {req.follow_ups}")
    if req.precision != TrainRequest.precision:
        words.append(f"--precision {req.precision}")
    if req.device != TrainRequest.device:
        words.append(f"--device {req.device}")
    return " ".join(words)


def text_report(out: TextIO | None = None) -> Callable[[dict], None]:
    """Progress events as one updating terminal line per phase (on stderr, as it is at each event)."""
    def show(event: dict) -> None:
        phase = event["phase"]
        if phase == "questions":
            line = f"writing its own questions: {event['done']} of {event['total']}"
        elif phase == "record":
            line = (f"recording: {event['done']} of {event['total']} conversations, {event['tokens_per_s']:.0f} "
                    f"tokens/s, {event['eta_s'] / 60:.1f} min left for recording")
        elif phase == "reread":
            line = (f"reading recorded answers again for this head's states: {event['done']} of {event['total']} "
                    f"conversations, {event['tokens_per_s']:.0f} tokens/s, {event['eta_s'] / 60:.1f} min left")
        elif phase == "data":
            line = (f"\ntraining on {event['positions']:,} positions of {event['conversations']} conversations "
                    f"({event['held_out']:,} held out), on {event['device']} in {event['precision']}\n")
        elif phase == "train":
            agree = " ".join(f"{a:.2f}" for a in event["agreement"])
            line = (f"training: step {event['step']}/{event['steps']}, loss {event['loss']:.3f}, "
                    f"ETA {event['eta_s'] / 60:.1f} min" + (f", held-out agreement per head {agree}" if agree else ""))
        else:
            line = (f"\n{event['head']}: held-out top-1 agreement per head "
                    f"{' '.join(f'{a:.3f}' for a in event['agreement'])}\n")
        print(f"\r{line}\033[K", end="", file=out or sys.stderr, flush=True)

    return show


def json_report(out: TextIO | None = None) -> Callable[[dict], None]:
    """Progress events as JSON lines (what the window's train dialog reads), on stdout as it is."""
    def emit(event: dict) -> None:
        print(json.dumps(event), file=out or sys.stdout, flush=True)

    return emit
