"""REST: the datastore index (suffix array, lookups, continuation tries), the tree sizer, and the
drafter on the exact oracle (greedy output identical to plain decoding) and on a real model."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from backends.core.controller import Ledger, Sizer, chain_tree, length_class
from backends.core.costs import CostModel
from backends.core.errors import SpecDeckError
from backends.core.types import Budget, GenerationSettings, RankedTree, SamplingSettings, TargetOutput, Verdict
from backends.core.planner import expected_speeds
from backends.drafters.rest import RESTDrafter, RESTSettings
from backends.models.datastore import (
    Datastore,
    DatastoreError,
    source_texts,
    suffix_array,
    vocab_fingerprint,
    write_datastore,
)
from backends.models.gguf_info import VocabInfo
from tests.oracle import OracleTarget
from tests.test_engine import COSTS, drafted_matching_plain_greedy, plain_greedy, run

ORACLE_VOCAB = VocabInfo("oracle", 32, None, None, False, False, tuple(f"t{i}" for i in range(32)))


def _store(tmp_path: Path, docs: list[list[int]], name: str = "store") -> Datastore:
    out = tmp_path / f"{name}.sdstore"
    write_datastore([(f"doc{i}", d) for i, d in enumerate(docs)], out, vocab=ORACLE_VOCAB, model_name="oracle")
    return Datastore(out)


# --- the index ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_suffix_array_sorts_every_suffix(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, [2, 3, 40][seed % 3], size=int(rng.integers(1, 400))).astype(np.int32)
    tokens[rng.random(len(tokens)) < 0.05] = -1 - seed  # separators
    expected = sorted(range(len(tokens)), key=lambda i: tokens[i:].tolist())
    assert suffix_array(tokens).tolist() == expected


def _brute_continuations(docs: list[list[int]], pattern: list[int], depth: int) -> Counter:
    """Every continuation prefix after every occurrence of ``pattern``, counted."""
    counts: Counter = Counter()
    for doc in docs:
        for i in range(len(doc) - len(pattern) + 1):
            if doc[i:i + len(pattern)] == pattern:
                cont = doc[i + len(pattern):i + len(pattern) + depth]
                for d in range(1, len(cont) + 1):
                    counts[tuple(cont[:d])] += 1
    return counts


@pytest.mark.parametrize("seed", range(8))
def test_lookup_finds_the_longest_suffix_and_counts_its_continuations(tmp_path, seed):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 4, size=int(rng.integers(5, 120))).tolist() for _ in range(4)]
    store = _store(tmp_path, docs)
    context = rng.integers(0, 4, size=12).tolist()
    cont = store.continuations(context, max_len=8, min_len=1, depth=4, samples=10_000)
    occurs = lambda m: any(d[i:i + m] == context[-m:] for d in docs for i in range(len(d) - m + 1))  # noqa: E731
    longest = max((m for m in range(1, 9) if occurs(m)), default=0)
    assert cont.matched == longest
    expected = _brute_continuations(docs, context[-longest:], 4)
    got: Counter = Counter()
    paths: list[tuple[int, ...]] = []
    for i, (tok, parent) in enumerate(zip(cont.tokens.tolist(), cont.parents.tolist())):
        assert parent < i
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
        got[paths[i]] = int(cont.counts[i])
    assert got == expected
    assert all(-1 not in p for p in paths)  # nothing runs across a document boundary


@pytest.mark.parametrize("seed", range(4))
def test_lookups_bounded_by_the_previous_match_find_what_a_full_search_finds(tmp_path, seed):
    # the drafter starts each search at (previous match + tokens appended since); on a growing
    # context, with steps skipped now and then, it must find exactly the longest match
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 5, size=int(rng.integers(20, 200))).tolist() for _ in range(3)]
    store = _store(tmp_path, docs)
    drafter = RESTDrafter(store, RESTSettings(datastore="x", min_match=2, max_match=10))
    context = rng.integers(0, 5, size=3).tolist()
    drafter.begin(context)
    for _ in range(120):
        context += rng.integers(0, 5, size=int(rng.integers(1, 3))).tolist()
        if rng.random() < 0.7:
            full = store.continuations(context, max_len=10, min_len=2, depth=8, samples=256).matched
            assert length_class(full) == drafter.lookup(context).bucket
            assert drafter._match[0] == max(full, 1)


def test_rank_puts_parents_first_and_shares_never_grow_down_the_tree(tmp_path):
    docs = [[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 6, 1, 2, 3, 4]]
    tree = _store(tmp_path, docs).continuations([9, 1, 2], max_len=4, min_len=1, depth=3).ranked(max_depth=3)
    assert tree.tokens[0] == 3 and tree.probs[0] == pytest.approx(3 / 5)  # 1 2 -> 3 three times of four, smoothed
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))
    assert all(tree.probs[i] <= tree.probs[p] for i, p in enumerate(tree.parents.tolist()) if p >= 0)
    assert list(tree.probs) == sorted(tree.probs, reverse=True)


def test_a_common_suffix_reads_a_bounded_sample(tmp_path):
    store = _store(tmp_path, [[1, 2] * 5000])
    cont = store.continuations([1], max_len=4, min_len=1, depth=3, samples=64)
    assert cont.total == 64 and cont.counts[0] == 64


# --- the tree sizer ------------------------------------------------------------------------------


def star(probs) -> RankedTree:
    """Candidates that are all children of the root, ranked as given."""
    return RankedTree(np.arange(len(probs), dtype=np.int32), np.full(len(probs), -1, np.int32), np.asarray(probs))


def test_sizer_takes_the_best_tree_and_nothing_that_loses():
    flat = Sizer(CostModel.from_relative([1.0] * 17), max_nodes=16)
    assert flat.plan(star([0.9, 0.5, 0.2, 0.05]), context=10)[0] == 4  # free verification: take every node
    linear = Sizer(CostModel.from_relative([1 + 0.25 * k for k in range(17)]), max_nodes=16)
    # speeds 1.52, 1.6, 1.57: two nodes
    assert linear.plan(star([0.9, 0.5, 0.2]), context=10)[0] == 2
    cliff = Sizer(CostModel.from_relative([1.0, 1.05, 1.1, 3.0, 3.0]), max_nodes=4)
    assert cliff.plan(star([0.9, 0.9, 0.9, 0.9]), context=10)[0] == 2
    assert linear.plan(star([0.1, 0.05]), context=10)[0] == 0  # no size beats plain decoding
    for probs in ([0.3, 0.1], [0.6, 0.2, 0.2, 0.1], [0.05] * 10):
        n = linear.plan(star(probs), context=10)[0]
        assert n == 0 or expected_speeds(probs, linear.costs.relative(10))[n] > 1.0


def test_sizer_calibration_learns_from_outcomes():
    sizer = Sizer(CostModel.from_relative([1.0, 1.3, 1.5]), max_nodes=2)
    tree = RankedTree(np.array([4, 5], np.int32), np.array([-1, 0], np.int32), np.array([0.6, 0.3]))
    assert sizer.plan(tree, context=1)[0] == 2
    for _ in range(30):
        sizer.update(tree, 2, 0)  # the datastore keeps being wrong
    assert max(sizer.factors(None, 2)) < 0.2 and sizer.plan(tree, context=1)[0] == 0
    assert list(sizer.factors("long matches", 2)) == [1.0, 1.0]  # another bucket has learned nothing yet


def test_ledger_scores_a_withheld_tree_like_greedy_verification():
    ledger = Ledger()
    tree = RankedTree(np.array([7, 8, 9, 4], np.int32), np.array([-1, 0, 0, 2], np.int32), np.full(4, 0.5))  # 7 -> (8, 9 -> 4)
    ledger.add(5, tree)
    assert ledger.resolve([0] * 5 + [7, 9]) == []  # could still go deeper
    assert ledger.resolve([0] * 5 + [7, 9, 4]) == [(tree, 3)]
    one = chain_tree([1], 0.5)
    ledger.add(0, one)
    assert ledger.resolve([2]) == [(one, 0)]


# --- the drafter on the oracle ------------------------------------------------------------------


def _oracle_store(tmp_path: Path, oracle: OracleTarget, seed: int, sampling: SamplingSettings) -> Datastore:
    """A datastore of the oracle's own answers to other prompts: what a user's chats would hold."""
    rng = np.random.default_rng(1000 + seed)
    docs = []
    for _ in range(6):
        prompt = rng.integers(0, oracle.n_vocab, size=int(rng.integers(3, 12))).tolist()
        docs.append(prompt + plain_greedy(oracle, prompt, 64, sampling))
    return _store(tmp_path, docs, name=f"oracle{seed}")


@pytest.mark.parametrize("conversation", [False, True])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_rest_output_equals_plain_greedy(tmp_path, penalty, conversation):
    def make(oracle, seed, sampling):
        return RESTDrafter(_oracle_store(tmp_path, oracle, seed, sampling), RESTSettings(min_match=1, conversation=conversation),
                           costs=COSTS)

    assert drafted_matching_plain_greedy(make, method="rest", penalty=penalty, seeds=range(12), longest_prompt=30) > 0


def test_rest_speeds_up_text_the_datastore_holds(tmp_path):
    sampling = SamplingSettings()
    oracle = OracleTarget(32, seed=3)
    prompt = [5, 9, 2, 7]
    answer = plain_greedy(oracle, prompt, 64, sampling)
    store = _store(tmp_path, [[1, 1] + prompt + answer])  # an earlier chat with the same question
    drafter = RESTDrafter(store, RESTSettings(conversation=False), costs=COSTS)
    stats = run(oracle, drafter, prompt, GenerationSettings(max_new_tokens=64)).stats
    assert stats.tau > 2.0 and stats.forwards < 32


def test_the_conversation_drafts_what_the_datastore_lacks_and_learns_apart(tmp_path):
    store = _store(tmp_path, [[31, 30] * 50])  # nothing like the conversation
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7]  # the text is repeating itself
    alone = RESTDrafter(store, RESTSettings(conversation=False), costs=COSTS)
    alone.begin(context)
    assert alone.propose(context, Budget(max_nodes=16, max_depth=8)).size == 0
    drafter = RESTDrafter(store, RESTSettings(), costs=COSTS)
    drafter.begin(context)
    proposal = drafter.propose(context, Budget(max_nodes=16, max_depth=8))
    assert proposal.is_chain and proposal.tokens[:3] == (8, 9, 10)
    chain = drafter.conversation._chain  # the conversation's own estimates, not the datastore's
    assert proposal.chances == tuple(drafter.conversation.sizer.chances(chain)[: proposal.size])
    before = copy.deepcopy(drafter.sizer._sums), copy.deepcopy(drafter.conversation.sizer._sums)
    out = TargetOutput(logits=np.zeros((1 + proposal.size, 32), np.float32), seconds=0.01)
    drafter.observe(out, Verdict(path=(0, 1), tokens=(8, 9, 4), drafted=proposal.size, draft_depth=proposal.size))
    assert str(drafter.sizer._sums) == str(before[0])  # the datastore's calibration is untouched
    assert str(drafter.conversation.sizer._sums) != str(before[1])  # the conversation's learned


def test_trees_respect_the_budget(tmp_path):
    oracle = OracleTarget(32, seed=1)
    store = _oracle_store(tmp_path, oracle, 1, SamplingSettings())
    drafter = RESTDrafter(store, RESTSettings(min_match=1, adaptive=False, max_nodes=16, conversation=False), costs=COSTS)
    context = store.tokens[:10].tolist()
    assert drafter.propose(context, Budget(max_nodes=16, max_depth=8)).size > 3
    assert drafter.propose(context, Budget(max_nodes=3, max_depth=8)).size <= 3
    assert drafter.propose(context, Budget(max_nodes=0, max_depth=8)).size == 0


# --- bad input -------------------------------------------------------------------------------------


def test_datastore_for_another_tokenizer_is_refused_with_the_reason(tmp_path, smollm_q4_path, gemma_path):
    from backends.llamacpp.model import LlamaModel

    with LlamaModel(smollm_q4_path, vocab_only=True) as smol, LlamaModel(gemma_path, vocab_only=True) as gemma:
        out = tmp_path / "smol.sdstore"
        write_datastore([("a", smol.tokenize("hello world, hello world", add_special=False))], out,
                        vocab=smol.vocab_info, model_name=smol.name)
        store = Datastore(out)
        store.check_vocab(smol.vocab_info)
        with pytest.raises(DatastoreError, match="built with the tokenizer of .*gpt2.*49152.*llama"):
            store.check_vocab(gemma.vocab_info)
        assert vocab_fingerprint(smol.vocab_info) != vocab_fingerprint(gemma.vocab_info)


def test_empty_source_and_corrupt_files_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatastoreError, match="holds no text files"):
        source_texts(tmp_path / "empty")
    with pytest.raises(DatastoreError, match="no tokens"):
        write_datastore([("blank", [])], tmp_path / "x.sdstore", vocab=ORACLE_VOCAB, model_name="oracle")
    garbage = tmp_path / "garbage.sdstore"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(DatastoreError, match="corrupt"):
        Datastore(garbage)
    good = _store(tmp_path, [[1, 2, 3] * 100])
    truncated = tmp_path / "truncated.sdstore"
    truncated.write_bytes(good.path.read_bytes()[:-200])
    with pytest.raises(DatastoreError, match="truncated"):
        Datastore(truncated)
    weights = tmp_path / "weights.safetensors"
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(4, np.float32)}, str(weights))
    with pytest.raises(DatastoreError, match="not a SpecDeck datastore"):
        Datastore(weights)
    with pytest.raises(DatastoreError, match="not found"):
        Datastore(tmp_path / "missing.sdstore")


@pytest.mark.parametrize("bad", [dict(max_nodes=0), dict(max_nodes=65), dict(min_match=5, max_match=4),
                                 dict(max_depth=0), dict(samples=0)])
def test_settings_out_of_range_are_refused(bad):
    with pytest.raises(ValueError):
        RESTSettings(**bad)


def test_rest_without_a_datastore_says_how_to_make_one(smollm_session):
    with pytest.raises(SpecDeckError, match="specdeck datastore build"):
        smollm_session.drafter("rest", SamplingSettings())


# --- real models ---------------------------------------------------------------------------------


def _text_store(tmp_path: Path, session) -> str:
    """A datastore of this repository's README and engine code, tokenized by the session's model."""
    from backends.models.datastore import build_datastore, read_sources

    root = Path(__file__).resolve().parents[1]
    files = [root / "README.md", *sorted((root / "backends" / "core").glob("*.py"))]
    out = tmp_path / f"{session.model.path.stem}.sdstore"
    build_datastore(read_sources(files), out, tokenize=lambda t: session.model.tokenize(t, add_special=False),
                    vocab=session.model.vocab_info, model_name=session.model.name)
    return str(out)


@pytest.mark.parametrize("model", ["smollm_session", "gemma_session"])
def test_real_models_rest_matches_plain_greedy(tmp_path, request, model):
    """Fixed tree sizes, so every step verifies and rolls back a real tree: identical output to
    plain decoding, or a divergence at a near-tie of the target's logits."""
    from tests.test_real_models import check_method_matches_ar

    session = request.getfixturevalue(model)
    check_method_matches_ar(session, "rest", {"adaptive": False, "max_nodes": 8, "datastore": _text_store(tmp_path, session)})


def test_fruitless_lookups_are_spaced_out_and_a_match_resets_them(tmp_path):
    oracle = OracleTarget(32, seed=5)
    store = _store(tmp_path, [[31, 30] * 50])  # text the oracle never produces after this prompt
    calls = []

    class Counting(Datastore):
        def continuations(self, context, **kw):
            calls.append(len(context))
            return super().continuations(context, **kw)

    drafter = RESTDrafter(Counting(store.path), RESTSettings(conversation=False), costs=COSTS)
    prompt = list(range(5, 25))
    finished = run(oracle, drafter, prompt, GenerationSettings(max_new_tokens=96))
    assert finished.stats.forwards > 60 and len(calls) < finished.stats.forwards / 2


def test_the_gate_stops_consulting_a_datastore_that_does_not_pay_and_keeps_one_that_does(tmp_path):
    from backends.core.controller import RUN

    oracle = OracleTarget(32, seed=5)
    store = _store(tmp_path, [[31, 30] * 50])  # text the oracle never produces after this prompt
    now = [0.0]
    calls = []

    class Slow(Datastore):  # every lookup takes half a forward's time
        def continuations(self, context, **kw):
            calls.append(len(context))
            now[0] += COSTS.seconds(0, len(context)) / 2
            return super().continuations(context, **kw)

    drafter = RESTDrafter(Slow(store.path), RESTSettings(conversation=False), costs=COSTS, clock=lambda: now[0])
    finished = run(oracle, drafter, list(range(5, 25)), GenerationSettings(max_new_tokens=400))
    assert drafter.gate.best() == "off" and drafter.gate.speed(RUN) < 0.7
    # 16 trials, then probes no sooner than 32, 64, 128 ... rounds apart
    assert len(calls) <= 24 < finished.stats.forwards / 16

    sampling = SamplingSettings()
    prompt = [5, 9, 2, 7]
    answer = plain_greedy(oracle, prompt, 64, sampling)
    paying = RESTDrafter(_store(tmp_path, [[1, 1] + prompt + answer], name="paying"), RESTSettings(conversation=False),
                         costs=COSTS)
    run(oracle, paying, prompt, GenerationSettings(max_new_tokens=64))
    assert paying.gate.best() == RUN and paying.gate.speed(RUN) > 2.0
