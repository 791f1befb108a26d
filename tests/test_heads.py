"""Trained heads: hidden states from the targets, head files, the Medusa drafter, training.

The oracle tier checks losslessness exactly (a head trained on the oracle, chains and trees, with a
repetition penalty, many seeds); the real tier checks llama.cpp's hidden states and a head
trained on the real model against plain decoding, divergences only at measured near-ties.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from backends.core.engine import generate
from backends.core.errors import BackendError, ModelFileError
from backends.core.types import HIDDEN_STATES, Finished, GenerationSettings, Proposal, SamplingSettings, Verdict
from backends.drafters.medusa import MedusaDrafter, MedusaSettings, rank_medusa
from backends.heads.files import HeadFile, HeadMismatchError, ModelFingerprint
from backends.heads.medusa import MedusaHeads
from backends.heads.record import Recorder, Sample
from backends.models.weights import tensor_rows
from tests.oracle import OracleTarget
from tests.test_engine import COSTS, plain_greedy

VOCAB, WIDE = 32, 24
FAKE_MODEL = ModelFingerprint("oracle", "oracle", "F32", 1, WIDE, VOCAB, "0" * 16)


def record_oracle(oracle: OracleTarget, prompts: list[list[int]], n: int) -> list[tuple[int, Sample]]:
    samples = []
    for i, prompt in enumerate(prompts):
        recorder = Recorder()
        events = list(generate(oracle, recorder, prompt, GenerationSettings(max_new_tokens=n)))
        samples.append((i, recorder.sample(prompt, events[-1].tokens)))
    return samples


@pytest.fixture(scope="module")
def oracle_head(tmp_path_factory) -> HeadFile:
    """A Medusa head trained with torch on the oracle's own answers (the real training code)."""
    pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")
    from backends.heads.training import MedusaTrainConfig, MedusaTrainer, draft_vocabulary, medusa_examples

    oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE)
    rng = np.random.default_rng(0)
    samples = record_oracle(oracle, [rng.integers(0, VOCAB, size=12).tolist() for _ in range(60)], 40)
    config = MedusaTrainConfig(n_heads=3, draft_vocab=VOCAB, lr=3e-2, batch=128, train_lm=True, max_epochs=50, eval_every=50,
                               precision="float32")  # the same instrument on every PC
    vocab = draft_vocabulary([s for _, s in samples], VOCAB, [], VOCAB)
    examples = medusa_examples(samples, vocab, config.n_heads, VOCAB)
    trainer = MedusaTrainer(examples, vocab, rng.normal(size=(VOCAB, WIDE)).astype(np.float32) * 0.1, FAKE_MODEL,
                            config, tmp_path_factory.mktemp("ckpt") / "m.safetensors", device="cpu")
    result = trainer.run(300)
    assert result.agreement[0] > 3 / VOCAB, f"head 1 learned nothing: {result.agreement}"
    return trainer.export({"test": True})


def oracle_prompt(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, size=int(rng.integers(3, 30))).tolist()


def accepted_matching_plain_greedy(make_drafter, *, method: str, penalty: float) -> int:
    """A head drafter (``make_drafter()``, fresh per answer) on the oracle its head was trained on,
    12 prompts: output equals plain greedy decoding with one target forward per step; returns the
    guesses accepted in all (so a caller can check that the head drafted something right)."""
    sampling = SamplingSettings(repeat_penalty=penalty)
    settings = GenerationSettings(max_new_tokens=48, sampling=sampling)
    accepted = 0
    for seed in range(12):
        oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE)
        prompt = oracle_prompt(100 + seed)
        finished = list(generate(oracle, make_drafter(), prompt, settings, method=method))[-1]
        assert list(finished.tokens) == plain_greedy(oracle, prompt, 48, sampling), f"seed {seed} diverged"
        assert finished.stats.forwards == oracle.verify_calls
        accepted += finished.stats.accepted
    return accepted


@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_medusa_greedy_equals_plain_greedy_on_the_oracle(oracle_head, width, penalty):
    heads = MedusaHeads(oracle_head)
    settings = MedusaSettings(width=width, max_nodes=12, adaptive=False)
    accepted = accepted_matching_plain_greedy(lambda: MedusaDrafter(heads, settings, costs=COSTS),
                                              method="medusa", penalty=penalty)
    assert accepted > 48, f"the trained head had only {accepted} guesses accepted over 12 answers"


def test_medusa_sampling_is_reproducible_and_stays_in_the_vocabulary(oracle_head):
    heads = MedusaHeads(oracle_head)
    sampling = SamplingSettings(temperature=0.8, seed=3)
    settings = GenerationSettings(max_new_tokens=32, sampling=sampling)
    runs = []
    for _ in range(2):
        oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE)
        drafter = MedusaDrafter(heads, MedusaSettings(width=2), costs=COSTS)
        runs.append(list(generate(oracle, drafter, oracle_prompt(5), settings))[-1].tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 32


def test_rank_medusa_puts_parents_first_and_multiplies_chances():
    ids = np.array([[5, 6], [7, 8]])
    probs = np.array([[0.6, 0.3], [0.5, 0.2]])
    tree = rank_medusa(ids, probs, max_nodes=4, max_depth=4)
    assert sorted(tree.probs.tolist(), reverse=True) == pytest.approx([0.6, 0.3, 0.3, 0.15])  # 5, 6, 5 7, 6 7
    by_path = {(int(tree.tokens[tree.parents[i]]) if tree.parents[i] >= 0 else None, int(tree.tokens[i])): p
               for i, p in enumerate(tree.probs)}
    assert by_path[(None, 5)] == pytest.approx(0.6) and by_path[(5, 7)] == pytest.approx(0.3)
    assert all(tree.parents[i] < i for i in range(len(tree.tokens)))
    assert len(rank_medusa(ids, probs, max_nodes=10, max_depth=1).tokens) == 2


def test_head_file_round_trip_and_bad_files(oracle_head, tmp_path):
    saved = oracle_head.save(tmp_path / "o.medusa")
    assert saved.name == "o.medusa.json" and (tmp_path / "o.medusa.safetensors").exists()
    again = HeadFile.load(saved)
    assert MedusaHeads(again).logits(np.ones(WIDE)).shape == (3, VOCAB)
    (tmp_path / "o.medusa.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelFileError, match="cannot be read"):
        HeadFile.load(saved)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ModelFileError, match="not a SpecDeck head"):
        HeadFile.load(tmp_path / "bad.json")
    wrong = HeadFile(oracle_head.kind, oracle_head.config, FAKE_MODEL, dict(oracle_head.tensors, **{"blocks.b": np.zeros((2, 2))}))
    with pytest.raises(ModelFileError, match="blocks.b"):
        MedusaHeads(wrong)


def test_a_head_for_gemma_is_refused_on_smollm2_naming_both(smollm_q4_path, gemma_path, oracle_head, tmp_path):
    gemma, smol = ModelFingerprint.of(gemma_path), ModelFingerprint.of(smollm_q4_path)
    head = HeadFile("medusa", oracle_head.config, gemma, oracle_head.tensors)
    with pytest.raises(HeadMismatchError) as err:
        head.check_for(smol, "medusa")
    assert gemma.name in str(err.value) and smol.name in str(err.value)
    assert "specdeck train medusa" in str(err.value)
    from backends.factory import Session, SessionConfig

    path = head.save(tmp_path / "gemma.medusa")
    with Session(SessionConfig(model=str(smollm_q4_path), heads=(str(path),), n_ctx=256)) as session:
        with pytest.raises(HeadMismatchError, match=gemma.name):
            session.drafter("medusa", SamplingSettings())


def test_llama_target_hidden_states_match_one_token_forwards(smollm_q4_path):
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget

    with LlamaModel(smollm_q4_path) as model:
        tokens = model.tokenize("The quick brown fox jumps over the lazy dog, and then it")
        whole = LlamaTarget(model, n_ctx=256)
        assert HIDDEN_STATES in whole.offers
        whole.prefill(tokens[:-1], hidden=True)
        states = whole.hidden_states(0, len(tokens) - 1)  # [T - 1, d]
        assert states.shape == (len(tokens) - 1, model.n_embd)
        stepwise = LlamaTarget(model, n_ctx=256)
        stepwise.prefill(tokens[:1], hidden=True)
        rows = [stepwise.hidden_states(0, 1)[0]]
        for token in tokens[1:-1]:
            out = stepwise.verify(token, Proposal())
            stepwise.commit(Verdict((), (0,), 0, 0))
            rows.append(out.hidden[0])
        scale = np.abs(states).max()
        assert np.abs(np.stack(rows) - states).max() < 0.01 * scale  # batch rounding only
        # a tree verify gives one state per node, and commit keeps the accepted ones
        out = whole.verify(tokens[-1], Proposal((11, 12, 13), (-1, 0, -1)))
        assert out.hidden.shape == (4, model.n_embd)
        whole.commit(Verdict((2,), (13, 99), 3, 1))
        kept = whole.hidden_states(0, whole.n_past)
        assert np.allclose(kept[-1], out.hidden[3], atol=0.01 * scale)
        # a later prompt that reuses the cache still has every state; without hidden, none
        assert whole.prefill([*tokens, 13, 99], hidden=True) == len(tokens) + 1
        assert whole.hidden_states(0, len(tokens) + 2).shape[0] == len(tokens) + 2
        whole.prefill(tokens, hidden=False)
        assert whole.verify(5, Proposal()).hidden is None
        with pytest.raises(BackendError, match="not kept"):
            whole.hidden_states(0, 3)
        whole.close()
        stepwise.close()


def test_a_prefill_computes_states_only_from_where_the_drafter_reads(smollm_q4_path):
    """``hidden_from``: the positions before it go the fast way (no per-row logits); the states
    from it on are the ones a full prefill gives, and a later prefill that needs earlier states
    computes them instead of handing out what was never kept."""
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget

    with LlamaModel(smollm_q4_path) as model:
        tokens = model.tokenize("The quick brown fox jumps over the lazy dog, and then it runs far away")
        full = LlamaTarget(model, n_ctx=256)
        full.prefill(tokens, hidden=True)
        ref = full.hidden_states(0, len(tokens))
        scale = np.abs(ref).max()
        part = LlamaTarget(model, n_ctx=256)
        k = len(tokens) - 4
        assert part.prefill(tokens, hidden=True, hidden_from=k) == 0
        assert np.abs(part.hidden_states(k, len(tokens)) - ref[k:]).max() < 0.01 * scale
        with pytest.raises(BackendError, match="not kept"):
            part.hidden_states(k - 1, len(tokens))
        longer = [*tokens, 11, 12]
        assert part.prefill(longer, hidden=True, hidden_from=k) == len(tokens)  # the states so far still serve
        assert part.hidden_states(k, len(longer)).shape == (len(longer) - k, model.n_embd)
        assert part.prefill(longer, hidden=True, hidden_from=2) == 2  # earlier states: computed from there
        assert np.abs(part.hidden_states(2, len(tokens)) - ref[2:]).max() < 0.01 * scale
        assert part.verify(13, Proposal()).hidden.shape == (1, model.n_embd)  # and every verify returns them
        full.close()
        part.close()


def test_a_step_that_wants_no_states_gets_none_and_the_kept_states_start_again_after_it(smollm_q4_path):
    """``QUIET_PROPOSAL``: llama.cpp computes the same logits without handing out the state; the
    kept states then run from the step after it, and a prefill that needs one from the gap
    computes it instead of handing out what was never kept."""
    from backends.core.types import QUIET_PROPOSAL
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget

    with LlamaModel(smollm_q4_path) as model:
        tokens = model.tokenize("The quick brown fox jumps over the lazy dog, and then it")
        target = LlamaTarget(model, n_ctx=256)
        target.prefill(tokens[:-1], hidden=True)
        n = len(tokens) - 1
        with_states = target.verify(tokens[-1], Proposal())
        logits = np.array(with_states.logits)
        target.commit(Verdict((), (7,), 0, 0))
        target.truncate(n)
        quiet = target.verify(tokens[-1], QUIET_PROPOSAL)
        assert quiet.hidden is None and np.array_equal(np.array(quiet.logits), logits)
        target.commit(Verdict((), (7,), 0, 0))
        after = target.verify(7, Proposal())
        assert after.hidden.shape == (1, model.n_embd)
        target.commit(Verdict((), (8,), 0, 0))
        assert np.allclose(target.hidden_states(n + 1, n + 2)[0], after.hidden[0], atol=1e-2)
        with pytest.raises(BackendError, match="not kept"):
            target.hidden_states(n, n + 2)  # the quiet step's position
        assert target.prefill([*tokens, 7, 8], hidden=True, hidden_from=n) == n  # recomputed from the gap
        assert target.hidden_states(n, n + 2).shape == (2, model.n_embd)
        target.close()


def test_recorder_keeps_one_state_per_position_but_the_last(smollm_q4_path):
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget

    with LlamaModel(smollm_q4_path) as model:
        target = LlamaTarget(model, n_ctx=256)
        prompt = model.chat_prompt([{"role": "user", "content": "Name three colours."}])
        recorder = Recorder()
        finished = list(generate(target, recorder, prompt, GenerationSettings(max_new_tokens=12)))[-1]
        sample = recorder.sample(prompt, finished.tokens)
        assert len(sample.tokens) == len(prompt) + len(finished.tokens)
        assert sample.states.shape == (len(sample.tokens) - 1, model.n_embd)
        target.close()


def test_recording_several_conversations_at_once_gives_the_engines_samples(smollm_q4_path, tmp_path):
    """Batched recording (``SEQUENCES``) against the engine's one-by-one recording: the same samples,
    state for state, except past a divergence at a measured near-tie (forward shapes differ)."""
    from backends.bench import logit_margin
    from backends.core.types import SEQUENCES
    from backends.factory import Session, SessionConfig
    from backends.heads.record import SampleStore
    from backends.train import TURNS, record

    turns = {0: ["Say hello.", "Now say it in French."], 1: ["Count to five."],
             2: ["Name a fruit.", "And a vegetable?"], 3: ["What is 2+2?"]}
    stores, events = {}, []
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=1024)) as session:
        assert SEQUENCES in session.target.offers
        for name in ("together", "one by one"):
            stores[name] = SampleStore(tmp_path / name, {"test": 1})
            assert record(session, turns, stores[name], max_new_tokens=24, deadline=float("inf"), limit=None,
                          report=events.append) == 4
            session.target.offers -= {SEQUENCES}  # the second pass goes through the engine
        together, one = stores["together"], stores["one by one"]
        assert together.indices() == one.indices() == [0, 1, TURNS, 2 * TURNS, 2 * TURNS + 1, 3 * TURNS]
        diverged: set[int] = set()
        for n in one.indices():
            if n // TURNS in diverged:
                continue  # an earlier turn's answer differs, so this turn's prompt does too
            a, b = one.get(n), together.get(n)
            assert b.states.shape == (len(b.tokens) - 1, session.model.n_embd) and b.n_prompt == a.n_prompt
            same = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), min(len(a.tokens), len(b.tokens)))
            scale = np.abs(a.states).max()
            assert np.abs(a.states[: same - 1].astype(np.float32) - b.states[: same - 1]).max() < 0.02 * scale
            if same < max(len(a.tokens), len(b.tokens)):
                assert a.n_prompt <= same < min(len(a.tokens), len(b.tokens)), (n, same)
                margin, _, _ = logit_margin(session, list(a.tokens[:same]), SamplingSettings())
                assert margin <= session.batch_noise().threshold, (n, same, margin)
                diverged.add(n // TURNS)
        assert len(diverged) <= 1
    assert events[-1]["phase"] == "record" and events[-1]["done"] == 4 and events[-1]["tokens_per_s"] > 0
    # each pass says it is answering as soon as it starts, not after its first conversation ends
    starts = [i for i, e in enumerate(events) if e["done"] == 0 and (i == 0 or events[i - 1]["done"] > 0)]
    assert len(starts) == 2 and starts[0] == 0
    for run in (events[: starts[1]], events[starts[1]:]):
        done = [e["done"] for e in run]
        assert done == sorted(done) and {0, 4} <= set(done) and run[0]["tokens_per_s"] == 0


def test_train_cli_records_trains_resumes_and_writes_a_head(smollm_q4_path, tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")
    from backends.cli import main
    from backends.heads.training import device_name, training_device

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in
                                 ["Say hello.", "Count to five.", "Name a fruit.", "What is 2+2?"]) + "\n")
    args = ["train", "medusa", "--model", str(smollm_q4_path), "--data", str(prompts), "--max-new-tokens", "24",
            "--steps", "20", "--out", str(tmp_path / "h.medusa")]
    assert main(args) == 0
    assert f"on {device_name(training_device())} in " in capsys.readouterr().err  # where and in what it trained
    head = HeadFile.load(tmp_path / "h.medusa.json")
    head.check_for(ModelFingerprint.of(smollm_q4_path), "medusa")
    assert 1 <= head.training["steps"] <= 20 and len(head.training["agreement"]) == 4  # capped at 8 epochs
    # the frozen output rows are the target's own: not in the file, read from the model when attached
    assert head.from_target == ("lm.weight",) and "lm.weight" not in head.tensors
    with pytest.raises(ModelFileError, match="read from the target model"):
        MedusaHeads(head)
    heads = MedusaHeads(head.attach(smollm_q4_path))
    assert np.array_equal(heads.lm_t.T, tensor_rows(smollm_q4_path, head.tensors["vocab"]).astype(np.float16))
    first = head.tensors["blocks.w"].copy()
    assert main(args) == 0  # everything recorded and trained already: the same head again
    assert np.array_equal(HeadFile.load(tmp_path / "h.medusa.json").tensors["blocks.w"], first)


def test_the_model_writes_its_own_questions_and_training_records_their_answers(smollm_q4_path, tmp_path, monkeypatch):
    """``--data self``: questions sampled from where the chat template opens a user turn are
    distinct, finished (ended by the model, not cut off), the same for the same seed; the CLI
    writes them into the recording's folder, answers them and trains, and a rerun asks the same."""
    pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")
    from backends.cli import main
    from backends.factory import Session, SessionConfig
    from backends.train import own_questions, user_turn_prefix

    with Session(SessionConfig(model=str(smollm_q4_path), n_threads=2)) as session:
        prefix = user_turn_prefix(session.model)
        assert session.model.chat_prompt([{"role": "user", "content": "Name a fruit."}])[:len(prefix)] == prefix
        assert session.model.detokenize(prefix).rstrip().endswith("user")
        written = own_questions(session, 5, seed=3)
        questions = [q for _, q in written]
        assert len(questions) == 5 and len({q.lower() for q in questions}) == 5
        assert all(len(q) >= 12 and q == q.strip() for q in questions)
        assert [n for n, _ in written] == sorted(n for n, _ in written)  # try numbers, in order
        assert own_questions(session, 2, seed=3) == written[:2]  # a seed gives the same questions
        assert own_questions(session, 2, seed=4) != written[:2]
        monkeypatch.setattr("backends.train.QUESTION_SEQUENCES", 12)  # 12 prefixes of 24 tokens: > 256 rows
        wider = own_questions(session, 3, seed=5)
        assert len({q.lower() for _, q in wider}) == 3

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    args = ["train", "medusa", "--model", str(smollm_q4_path), "--data", "self", "--prompts", "3",
            "--max-new-tokens", "16", "--steps", "5", "--out", str(tmp_path / "h.medusa")]
    assert main(args) == 0
    [written] = list((tmp_path / "cache").rglob("questions.jsonl"))
    asked = [json.loads(line)["prompt"] for line in written.read_text().splitlines()]
    assert len(asked) == 3 and len(list(written.parent.glob("[0-9]*.safetensors"))) == 3
    head = HeadFile.load(tmp_path / "h.medusa.json")
    assert head.training["data"] == "self" and head.training["conversations"] == 3
    assert main(args) == 0 and [json.loads(line)["prompt"] for line in written.read_text().splitlines()] == asked
    args[args.index("--prompts") + 1] = "4"  # asking for more: the seed's next tries, the first three kept
    assert main(args) == 0
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert [r["prompt"] for r in rows[:3]] == asked and len(rows) == 4 and rows[3]["prompt"] not in asked
    assert rows[3]["try"] > rows[2]["try"] and len(list(written.parent.glob("[0-9]*.safetensors"))) == 4
    args[args.index("--prompts") + 1] = "3"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a fruit."}) + "\n" + json.dumps({"prompt": "Say hello."}) + "\n")
    args[args.index("self")] = f"{prompts},self"  # two sources: the file's recorded apart, the questions' reused
    assert main(args) == 0
    assert HeadFile.load(tmp_path / "h.medusa.json").training["conversations"] == 6  # all four recorded
    assert len(list(written.parent.glob("[0-9]*.safetensors"))) == 4


def test_questions_written_together_are_kept_in_try_order_whatever_order_they_finish_in():
    """Several tries run at once and finish in any order; the questions kept are the first
    ``count`` good ones by try number (cut-off, short and repeated ones skipped), and tries start
    only until the tries judged so far give them, so asking for fewer gives the first of them."""
    from backends.train import _QuestionTries

    def run(count: int, finish_order: list[int], texts: dict[int, str | None]) -> tuple[list[str], int]:
        shown: list[int] = []
        tries = _QuestionTries(count, float("inf"), shown.append)
        running = [tries.next() for _ in range(3)]  # three at once
        for attempt in finish_order:
            if attempt not in running:
                continue
            running.remove(attempt)
            tries.finished(attempt, texts[attempt])
            if (nxt := tries.next()) is not None:
                running.append(nxt)
        assert shown == list(range(1, len(tries.kept) + 1))
        assert [n for n, _ in tries.kept] == sorted(n for n, _ in tries.kept)
        return [q for _, q in tries.kept], tries.started

    texts = {0: "What is a prime number?", 1: None, 2: "Too short", 3: "what is a PRIME number?",
             4: "How do tides work on Earth?", 5: "Name three rivers of Africa.", 6: "Why is the sky blue today?",
             7: "Explain photosynthesis simply."}
    order = [2, 1, 4, 0, 3, 6, 5, 7]
    kept, started = run(3, order, texts)
    assert kept == ["What is a prime number?", "How do tides work on Earth?", "Name three rivers of Africa."]
    assert started == 9  # tries 6 to 8 started while try 5, which gave the third question, was unfinished
    assert run(2, order, texts)[0] == kept[:2]
    assert run(3, sorted(order), texts)[0] == kept  # finishing in try order: the same questions
    never = _QuestionTries(2, float("inf"), lambda done: None)
    while (attempt := never.next()) is not None:
        never.finished(attempt, None)
    assert never.kept == [] and never.started == 8  # at most 4 tries a question
    more = _QuestionTries(1, float("inf"), lambda done: None, first=5, known=["How do tides work on earth?"])
    assert more.next() == 5
    more.finished(5, "How do tides work on Earth?")  # one known before: not asked again
    more.finished(more.next(), "Name three rivers of Africa.")
    assert more.kept == [(6, "Name three rivers of Africa.")] and more.next() is None


def test_a_damaged_questions_file_is_named_with_what_to_do(tmp_path):
    from backends.core.errors import SpecDeckError
    from backends.train import _question_rows

    path = tmp_path / "questions.jsonl"
    assert _question_rows(path) == []  # none written yet
    path.write_text('{"prompt": "Why is the sky blue?", "try": 3}\n\n{"prompt": "Name a river."}\n')
    assert _question_rows(path) == [{"prompt": "Why is the sky blue?", "try": 3}, {"prompt": "Name a river."}]
    for damaged in ('{"prompt": "cut off', '{"question": "x"}', '["x"]', '{"prompt": "x", "try": "y"}'):
        path.write_text(damaged + "\n")
        with pytest.raises(SpecDeckError, match="questions.jsonl is damaged .*delete it"):
            _question_rows(path)


def test_the_fit_estimator_counts_the_head_and_the_kept_states(oracle_head, tmp_path, monkeypatch, smollm_q4_path):
    from backends.drafters import method_spec
    from backends.hardware.fit import method_extra, trained_head_bytes

    spec = method_spec("medusa")
    extra = method_extra(spec, 4096, hidden_size=576, heads_bytes=1000)
    assert extra.heads_bytes == 1000
    assert [t.bytes for t in extra.terms if "hidden states" in t.name] == [4096 * 576 * 2]
    assert not [t for t in method_extra(method_spec("pld"), 4096, hidden_size=576).terms if "hidden" in t.name]
    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path))
    monkeypatch.setattr("backends.heads.files.SHIPPED", tmp_path / "none")
    assert trained_head_bytes(spec, smollm_q4_path) == 0  # none trained yet
    head = HeadFile("medusa", oracle_head.config, ModelFingerprint.of(smollm_q4_path), oracle_head.tensors)
    head.save(tmp_path / "heads" / "smol.medusa")
    assert trained_head_bytes(spec, smollm_q4_path) == 2 * (tmp_path / "heads" / "smol.medusa.safetensors").stat().st_size


def test_training_stopped_halfway_resumes_to_the_same_head(tmp_path):
    pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")
    from backends.heads.training import MedusaTrainConfig, MedusaTrainer, draft_vocabulary, medusa_examples

    oracle = OracleTarget(VOCAB, seed=3, hidden_size=WIDE)
    rng = np.random.default_rng(1)
    samples = record_oracle(oracle, [rng.integers(0, VOCAB, size=10).tolist() for _ in range(30)], 30)
    config = MedusaTrainConfig(n_heads=2, draft_vocab=VOCAB, lr=1e-2, batch=64, max_epochs=100, eval_every=10)
    vocab = draft_vocabulary([s for _, s in samples], VOCAB, [], VOCAB)
    examples = medusa_examples(samples, vocab, config.n_heads, VOCAB)
    lm = rng.normal(size=(VOCAB, WIDE)).astype(np.float32)

    def trainer(name: str) -> MedusaTrainer:
        return MedusaTrainer(examples, vocab, lm, FAKE_MODEL, config, tmp_path / name)

    straight = trainer("a.safetensors")
    straight.run(40)
    halfway = trainer("b.safetensors")
    calls = iter(range(1000))
    halfway.run(40, stop=lambda: next(calls) >= 25)  # stopped after 25 steps, checkpoint written
    assert halfway.step == 25
    resumed = trainer("b.safetensors")  # a new process would start here
    assert resumed.step == 25
    resumed.run(40)
    a, b = straight.export({}), resumed.export({})
    for name in a.tensors:
        assert np.array_equal(a.tensors[name], b.tensors[name]), name


def test_training_that_runs_out_of_memory_says_so_and_goes_on_from_its_last_checkpoint(tmp_path, monkeypatch):
    """A step whose allocation is refused (here: the allocator asked for 4 PiB at step 13, which
    every machine refuses, as a GPU refuses a batch too big for it) ends the run with an error
    that says where, what to do and what is kept, not a traceback; no checkpoint is written from
    the broken step, and the same command goes on to the head an unbroken run makes."""
    torch = pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")
    from backends.core.errors import SpecDeckError
    from backends.heads.training import MedusaTrainConfig, MedusaTrainer, draft_vocabulary, medusa_examples

    oracle = OracleTarget(VOCAB, seed=3, hidden_size=WIDE)
    rng = np.random.default_rng(1)
    samples = record_oracle(oracle, [rng.integers(0, VOCAB, size=10).tolist() for _ in range(30)], 30)
    config = MedusaTrainConfig(n_heads=2, draft_vocab=VOCAB, lr=1e-2, batch=64, max_epochs=100, eval_every=10,
                               precision="float32")
    vocab = draft_vocabulary([s for _, s in samples], VOCAB, [], VOCAB)
    examples = medusa_examples(samples, vocab, config.n_heads, VOCAB)
    lm = rng.normal(size=(VOCAB, WIDE)).astype(np.float32)

    def trainer(name: str) -> MedusaTrainer:
        return MedusaTrainer(examples, vocab, lm, FAKE_MODEL, config, tmp_path / name, device="cpu")

    straight = trainer("a.safetensors")
    straight.run(30)
    monkeypatch.setattr("backends.heads.training.CHECKPOINT_S", 0.0)  # a checkpoint after every whole step
    broken = trainer("b.safetensors")
    loss = broken.recipe.loss

    def too_big_at_13(items, step):
        if step == 12:
            torch.empty(2**50)  # 4 PiB: refused by the allocator
        return loss(items, step)

    broken.recipe.loss = too_big_at_13
    with pytest.raises(SpecDeckError, match=r"out of memory on the CPU at step 13 of 30: close other programs "
                                            r"and try again; the same command goes on from step 12"):
        broken.run(30)
    resumed = trainer("b.safetensors")
    assert resumed.step == 12
    resumed.run(30)
    a, b = straight.export({}), resumed.export({})
    for name in a.tensors:
        assert np.array_equal(a.tensors[name], b.tensors[name]), name


def test_training_runs_in_the_precision_asked_and_a_resumed_run_keeps_its_own(tmp_path, monkeypatch):
    """bfloat16 autocast changes the step's products (the loss moves, a little), the weights stay
    float32; a run stopped halfway goes on in the precision it began in even where ``auto`` would
    pick the other, and the head file says which it was trained in."""
    torch = pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")
    from backends.core.errors import SpecDeckError
    from backends.heads.training import (MedusaTrainConfig, MedusaTrainer, draft_vocabulary, medusa_examples,
                                         training_precision)

    assert training_precision("auto") in ("float32", "bfloat16")
    with pytest.raises(SpecDeckError, match="float16.*auto, float32, bfloat16"):
        training_precision("float16")
    oracle = OracleTarget(VOCAB, seed=3, hidden_size=WIDE)
    rng = np.random.default_rng(1)
    samples = record_oracle(oracle, [rng.integers(0, VOCAB, size=10).tolist() for _ in range(30)], 30)
    vocab = draft_vocabulary([s for _, s in samples], VOCAB, [], VOCAB)
    examples = medusa_examples(samples, vocab, 2, VOCAB)
    lm = rng.normal(size=(VOCAB, WIDE)).astype(np.float32)

    def trainer(name: str, precision: str) -> MedusaTrainer:
        config = MedusaTrainConfig(n_heads=2, draft_vocab=VOCAB, lr=1e-2, batch=64, max_epochs=100, eval_every=10,
                                   precision=precision)
        return MedusaTrainer(examples, vocab, lm, FAKE_MODEL, config, tmp_path / name, device="cpu")

    f32, bf16 = trainer("a.safetensors", "float32"), trainer("b.safetensors", "bfloat16")
    assert (f32.precision, bf16.precision) == ("float32", "bfloat16")
    items = np.arange(64)
    exact, rounded = f32._loss(items).item(), bf16._loss(items).item()
    assert exact != rounded and abs(exact - rounded) < 0.05 * abs(exact)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    weights = {k: v.clone() for k, v in f32.model.state_dict().items()}
    assert f32.measure_step() > 0 and f32.step == 0  # timing a step trains nothing
    assert all(torch.equal(v, f32.model.state_dict()[k]) for k, v in weights.items())
    monkeypatch.setattr("backends.heads.training._faster_precision", lambda device: "bfloat16")  # a machine where it pays
    first = trainer("c.safetensors", "auto")
    calls = iter(range(1000))
    first.run(40, stop=lambda: next(calls) >= 15)
    assert (first.step, first.precision) == (15, "bfloat16")
    assert trainer("c.safetensors", "float32").step == 0  # another precision asked: it starts over
    monkeypatch.setattr("backends.heads.training._faster_precision", lambda device: "float32")  # it no longer pays
    resumed = trainer("c.safetensors", "auto")
    assert (resumed.step, resumed.precision) == (15, "bfloat16")
    resumed.run(40)
    assert resumed.export({}).training["precision"] == "bfloat16"


def test_heads_that_cannot_pay_stop_running(oracle_head):
    """Where verifying a guess costs as much as a forward, the gate learns to leave the heads off."""
    from backends.core.controller import RUN
    from backends.core.costs import CostModel

    dear = CostModel.from_relative([1.0 + i for i in range(25)])  # every node costs a whole forward
    oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE, n_ctx=1024)
    drafter = MedusaDrafter(MedusaHeads(oracle_head), MedusaSettings(width=2), costs=dear)
    finished = list(generate(oracle, drafter, oracle_prompt(9), GenerationSettings(max_new_tokens=400)))[-1]
    assert finished.stats.new_tokens == 400
    chosen = drafter.gate.chosen
    assert chosen.get("off", 0) > 4 * chosen.get(RUN, 0), chosen


def test_saved_chats_give_their_user_turns_by_conversation(tmp_path, monkeypatch):
    from backends.core.errors import SpecDeckError
    from backends.train import conversations
    from desktop.store import ConversationStore, StoredMessage

    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path))
    with pytest.raises(SpecDeckError, match="no saved chats"):
        conversations("chats")
    store = ConversationStore()
    first, second = store.create(), store.create()
    store.replace_messages(first, [StoredMessage("user", "Hi"), StoredMessage("assistant", "Hello!"),
                                   StoredMessage("user", "And you?")])
    store.replace_messages(second, [StoredMessage("user", "Name a fruit.")])
    store.delete(first)
    third = store.create()
    store.replace_messages(third, [StoredMessage("user", "Count to three.")])
    store.close()
    assert conversations("chats") == {second: ["Name a fruit."], third: ["Count to three."]}


def test_follow_ups_extend_each_conversation_and_are_recorded_apart():
    """Follow-up turns come after a conversation's own, a different run of them per conversation,
    the same every time; a recording with them lives apart from one without."""
    from backends.heads.files import ModelFingerprint
    from backends.train import FOLLOW_UPS, TURNS, data_folder, with_follow_ups

    own = {0: ["Name a fruit."], 1: ["Hi", "And you?"], 2: ["x"] * (TURNS - 1)}
    turns = with_follow_ups(own, 3)
    assert turns[0][:1] == own[0] and len(turns[0]) == 4 and set(turns[0][1:]) <= set(FOLLOW_UPS)
    assert turns[1][:2] == own[1] and len(turns[1]) == 5
    assert turns[0][1:] != turns[1][2:]  # not every conversation asks the same follow-ups
    assert len(turns[2]) == TURNS  # never more turns than a sample number holds
    assert with_follow_ups(own, 3) == turns and with_follow_ups(own, 0) == own
    fp = ModelFingerprint("m", "llama", "F16", 2, 8, 16, "0" * 16)
    assert data_folder(fp, "spec-bench", 256, (), 3) != data_folder(fp, "spec-bench", 256, (), 0)


def test_models_of_one_family_record_apart_and_an_older_folder_of_the_model_is_taken_over(tmp_path, monkeypatch):
    """SmolLM2 135M and 360M share a vocabulary and a weight type, not their states: each records
    into its own folder (the second was refused as "another recording" when folders went by
    vocabulary alone). A folder of that older layout holding only this model's recordings is taken
    over, one holding another model's is left alone."""
    from backends.heads.record import SampleStore
    from backends.train import data_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    small = ModelFingerprint("SmolLM2 135M", "llama", "F16", 30, 576, 49152, "d" * 16)
    large = ModelFingerprint("SmolLM2 360M", "llama", "F16", 32, 960, 49152, "d" * 16)
    older = tmp_path / "cache" / "specdeck" / "train" / f"{'d' * 16}-F16"
    store = SampleStore(older / "self-256", {"model": small.describe(), "data": "self", "max_new_tokens": 256})
    store.put(0, Sample(np.arange(3, dtype=np.int32), np.zeros((2, 576), np.float16), 1))
    assert data_folder(large, "self", 256).parent != older and older.exists()  # another model's: left alone
    taken = data_folder(small, "self", 256)
    assert not older.exists() and SampleStore(taken, {"model": small.describe(), "data": "self",
                                                      "max_new_tokens": 256}).indices() == [0]
    assert data_folder(large, "self", 256) != taken
    SampleStore(data_folder(large, "self", 256), {"model": large.describe(), "data": "self", "max_new_tokens": 256})


def test_the_recording_with_more_samples_is_trained_from_and_checkpoints_are_not_samples(tmp_path, monkeypatch):
    """An EAGLE head may train from an EAGLE-3 recording (it keeps the final state too) when that
    one holds more conversations; a trainer's checkpoint kept in a folder is no conversation."""
    from backends.heads.record import SampleStore, sample_numbers
    from backends.train import TrainRequest, data_folder, record_layers, recording_for

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fp = ModelFingerprint("m", "llama", "F16", 30, 8, 16, "0" * 16)
    req = TrainRequest(kind="eagle", model="m", max_new_tokens=64, follow_ups=0)
    wide = record_layers("eagle3", fp.n_layer)
    sample = Sample(np.arange(4, dtype=np.int32), np.zeros((3, 8 * len(wide)), np.float16), 2)
    own, other = (SampleStore(data_folder(fp, req.data, 64, layers), {"layers": list(layers)}) for layers in ((), wide))
    for n in (0, 1):
        own.put(n, sample)
    for n in (0, 1, 2):
        other.put(n, sample)
    assert recording_for(fp, req, (), fp.n_layer) == (other.folder, wide)
    for name in ("eagle-seed0.checkpoint.safetensors", "medusa-seed0.checkpoint.safetensors"):
        (own.folder / name).write_bytes(b"not a sample")
    assert sample_numbers(own.folder) == own.indices() == [0, 1]
    assert recording_for(fp, req, (), fp.n_layer) == (other.folder, wide)  # 2 samples, not 4 files
    own.put(2, sample)
    own.put(3, sample)
    assert recording_for(fp, req, (), fp.n_layer) == (own.folder, ())


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_both_bundled_files_find_their_own_shipped_head_first(kind, smollm_q4_path, smollm_f16_path, monkeypatch, tmp_path):
    """Heads ship for the bundled Q4_1 file and its F16 derivative; each finds its own weight
    type's head first (the other still fits, as a close match)."""
    from backends.heads.files import find_heads

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # no user heads
    for path, ftype, other in ((smollm_q4_path, "q4_1", "f16"), (smollm_f16_path, "f16", "q4_1")):
        found = find_heads(path, kind)
        assert [p.name for p in found] == [f"smollm2-135m-{ftype}.{kind}.json", f"smollm2-135m-{other}.{kind}.json"]
        HeadFile.load(found[0]).check_for(ModelFingerprint.of(path), kind)
