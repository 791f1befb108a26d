"""Tier 1: pure functions on hand-written inputs, no model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from backends.core.acceptance import accept_greedy, accept_stochastic, try_candidates
from backends.core.controller import Ledger, Sizer, chain_tree, length_class
from backends.core.planner import could_pay, expected_speeds
from backends.core.costs import CostModel
from backends.core.sampling import apply_repeat_penalty, target_distribution
from backends.core.text import TextStream
from backends.core.tree import compile_tree, is_chain
from backends.core.types import Budget, GenerationSettings, Proposal, SamplingSettings, TargetOutput
from backends.drafters.pld import NO_MATCH, Match, NgramIndex

GREEDY = SamplingSettings()
PLAIN = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def onehot_logits(winners: list[int], vocab: int = 10) -> np.ndarray:
    rows = np.zeros((len(winners), vocab), dtype=np.float32)
    for r, w in enumerate(winners):
        rows[r, w] = 5.0
    return rows


# -- compile_tree ---------------------------------------------------------------------------------
def test_compile_tree_worked_example():
    tree = compile_tree([-1, 0, 0, 1])
    assert tree.depths.tolist() == [1, 2, 2, 3]
    assert tree.paths == ((0, 2), (0, 1, 3))  # one per leaf, leaves in index order
    assert tree.root_children == (0,)
    assert tree.children == ((1, 2), (3,), (), ())
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)
    assert (tree.mask == expected).all()


def test_compile_tree_forest_under_root_and_chain():
    tree = compile_tree([-1, -1, 1, 0])
    assert tree.root_children == (0, 1)
    assert tree.paths == ((1, 2), (0, 3))
    assert tree.depths.tolist() == [1, 1, 2, 2]
    assert not tree.mask[2, 0] and tree.mask[2, 1]
    assert is_chain([-1, 0, 1, 2]) and not is_chain([-1, 0, 0])
    assert compile_tree([]).paths == ()


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-2], [-1, 0, 5]])
def test_compile_tree_rejects_bad_parents(parents):
    with pytest.raises(ValueError):
        compile_tree(parents)


def test_proposal_pruned_keeps_a_valid_tree():
    p = Proposal(tokens=(5, 6, 7, 8, 9), parents=(-1, 0, 0, 1, 3))
    cut = p.pruned(Budget(max_nodes=10, max_depth=2))
    assert cut.tokens == (5, 6, 7) and cut.parents == (-1, 0, 0)
    cut = p.pruned(Budget(max_nodes=2, max_depth=10))
    assert cut.tokens == (5, 6) and cut.parents == (-1, 0)
    assert Proposal.chain([1, 2, 3]).pruned(Budget(max_nodes=0, max_depth=5)).size == 0


# -- greedy acceptance ----------------------------------------------------------------------------
def test_greedy_chain_worked_example():
    out = TargetOutput(onehot_logits([5, 7, 9]))
    v = accept_greedy(out, Proposal.chain([5, 8]), settings=GREEDY, history=[1])
    assert v.path == (0,) and v.tokens == (5, 7) and v.accepted == 1 and v.bonus == 7


def test_greedy_chain_all_accepted_gets_bonus():
    out = TargetOutput(onehot_logits([5, 8, 2]))
    v = accept_greedy(out, Proposal.chain([5, 8]), settings=GREEDY, history=[1])
    assert v.tokens == (5, 8, 2) and v.accepted == 2


def test_greedy_first_rejected_emits_target_token():
    out = TargetOutput(onehot_logits([3, 0, 0]))
    v = accept_greedy(out, Proposal.chain([4, 4]), settings=GREEDY, history=[1])
    assert v.tokens == (3,) and v.path == ()


def test_greedy_tree_follows_matching_branch():
    # root -> {0: tok 4, 1: tok 3}; node 1 -> node 2 (tok 6). Target: 3 then 6 then 1.
    logits = onehot_logits([3, 9, 6, 1])
    p = Proposal(tokens=(4, 3, 6), parents=(-1, -1, 1))
    v = accept_greedy(TargetOutput(logits), p, settings=GREEDY, history=[1])
    assert v.path == (1, 2) and v.tokens == (3, 6, 1) and v.draft_depth == 2


def test_greedy_respects_repetition_penalty():
    row = np.array([0.0, 3.0, 2.9, 0.0], dtype=np.float32)
    logits = np.stack([row, row])
    pen = SamplingSettings(repeat_penalty=1.5)
    # token 1 was just generated, so the penalty turns the target's choice to token 2
    v = accept_greedy(TargetOutput(logits), Proposal.chain([1]), settings=pen, history=[1])
    assert v.tokens == (2,)
    v = accept_greedy(TargetOutput(logits), Proposal.chain([2]), settings=pen, history=[1])
    assert v.tokens[0] == 2 and v.accepted == 1
    # the path history counts: after accepting 2, both 1 and 2 are penalized at the next row
    assert v.tokens[1] == int(np.argmax(apply_repeat_penalty(row, [1, 2], pen)))


# -- sampling processing -------------------------------------------------------------------------
def test_target_distribution_worked_example():
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    s = SamplingSettings(temperature=1.0, top_k=3, top_p=0.9, min_p=0.0)
    p = target_distribution(logits, [], s)
    expected = np.exp([2.0, 1.0]) / np.exp([2.0, 1.0]).sum()
    assert np.allclose(p, [expected[0], expected[1], 0, 0])


def test_target_distribution_min_p_and_temperature():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = target_distribution(logits, [], SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))
    assert p[3] == 0 and p[2] > 0  # 0.05 < 0.2 * 0.5 <= 0.15
    hot = target_distribution(logits, [], SamplingSettings(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0))
    assert hot[0] < 0.5 and np.isclose(hot.sum(), 1.0)


def _full_sort_distribution(scores: np.ndarray, s: SamplingSettings) -> np.ndarray:
    """The sampler chain by its definition, the whole vocabulary sorted (top-k off)."""
    order = np.argsort(-scores, kind="stable")
    probs = np.exp(scores[order] - scores[order[0]])
    probs /= probs.sum()
    keep = len(order)
    if s.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), s.top_p)) + 1)
    if s.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(probs >= s.min_p * probs[0]))))
    out = np.zeros(len(scores))
    kept = scores[order[:keep]] / s.temperature
    out[order[:keep]] = np.exp(kept - kept.max()) / np.exp(kept - kept.max()).sum()
    return out


@pytest.mark.parametrize("spread", [0.01, 0.5, 3.0, 12.0])
def test_top_k_off_keeps_the_full_sorts_nucleus_on_a_large_vocabulary(spread):
    """With top-k off the nucleus is looked for among the best scores first; whatever the
    logits' spread (a flat one needs the whole vocabulary, a peaked one a few tokens) and with
    tied scores, the kept tokens and their probabilities are the full sort's."""
    rng = np.random.default_rng(int(spread * 100))
    for trial in range(20):
        logits = (rng.standard_normal(49152) * spread).astype(np.float32)
        if trial % 2:
            logits = np.round(logits, 1)  # many ties, some around the cut
        for s in (SamplingSettings(temperature=1.0, top_k=0, top_p=0.95, min_p=0.0),
                  SamplingSettings(temperature=0.7, top_k=0, top_p=0.5, min_p=0.05),
                  SamplingSettings(temperature=1.3, top_k=0, top_p=1.0, min_p=0.1)):
            got, want = target_distribution(logits, [], s), _full_sort_distribution(logits.astype(np.float64), s)
            assert np.array_equal(got > 0, want > 0), (spread, trial, s)
            assert np.allclose(got, want, rtol=1e-9, atol=1e-15) and np.isclose(got.sum(), 1.0)


def test_repeat_penalty_direction():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = apply_repeat_penalty(logits, [0, 1], SamplingSettings(repeat_penalty=2.0))
    assert out.tolist() == [1.0, -4.0, 1.0]
    assert apply_repeat_penalty(logits, [0], SamplingSettings()) is logits


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(min_p=1.0), dict(repeat_penalty=0)])
def test_sampling_settings_validate(kwargs):
    with pytest.raises(ValueError):
        SamplingSettings(**kwargs)


def test_generation_settings_refuse_zero_tokens():
    with pytest.raises(ValueError, match="at least 1"):
        GenerationSettings(max_new_tokens=0)


# -- stochastic acceptance on constructed cases ----------------------------------------------------
def test_try_candidates_certain_accept_and_residual():
    rng = np.random.default_rng(0)
    p = np.array([0.0, 1.0, 0.0])
    assert try_candidates(p, [(1, None)], rng)[0] == 0
    picked, residual = try_candidates(np.array([0.5, 0.5, 0.0]), [(2, np.array([0.0, 0.0, 1.0]))], rng)
    assert picked is None and np.allclose(residual, [0.5, 0.5, 0.0])


def test_stochastic_rejects_impossible_draft_and_never_emits_it():
    logits = np.log(np.array([[0.5, 0.5, 1e-30], [0.3, 0.3, 0.4]], dtype=np.float64)).astype(np.float32)
    rng = np.random.default_rng(1)
    for _ in range(200):
        v = accept_stochastic(TargetOutput(logits), Proposal.chain([2]), settings=PLAIN, history=[0], rng=rng)
        assert v.tokens[0] in (0, 1) and v.path == ()


# -- n-gram lookup ---------------------------------------------------------------------------------
def make_index(tokens, max_ngram=3, min_ngram=1):
    index = NgramIndex(max_ngram, min_ngram)
    index.extend(tokens)
    return index


def test_ngram_longest_match_wins():
    # suffix "2 3" appears after "9" (bigram at 4-5) and "3" alone appears at 7
    tokens = [1, 2, 3, 4, 2, 3, 5, 3, 6, 2, 3]
    match = make_index(tokens).lookup(3)
    assert match.ngram == 2 and match.tokens == [5, 3, 6]  # most recent earlier "2 3" is at 4-5


def test_ngram_worked_example_the_cat():
    the, cat, sat, on, mat, dot = range(6)
    tokens = [the, cat, sat, on, the, mat, dot, the, cat]
    match = make_index(tokens, max_ngram=2).lookup(4)
    assert match.ngram == 2 and match.tokens == [sat, on, the, mat]


def test_ngram_no_match_and_min_size():
    assert make_index([1, 2, 3, 4]).lookup(5) == NO_MATCH
    assert make_index([7, 1, 8, 1], min_ngram=2).lookup(5) == NO_MATCH
    assert make_index([7, 1, 8, 1], min_ngram=1).lookup(5) == Match([8, 1], 1, 1)


def test_ngram_index_grows_incrementally():
    index = make_index([1, 2, 3])
    assert index.lookup(2) == NO_MATCH
    index.sync([1, 2, 3, 1, 2])
    assert index.lookup(2).tokens == [3, 1]
    index.sync([1, 2, 3, 1, 2, 3])
    assert index.lookup(2) == Match([1, 2], 3, 3)


def test_ngram_span_measures_the_quoted_run():
    quote = [10, 11, 12, 13, 14, 15, 16, 17]
    tokens = [1, 2] + quote + [99, 3] + quote[:6]  # the answer quotes 6 tokens of the passage
    match = make_index(tokens).lookup(4)
    assert match.ngram == 3 and match.span == 6 and match.tokens == [16, 17, 99, 3]
    assert [length_class(s) for s in (0, 1, 3, 5, 9, 40)] == [0, 1, 3, 4, 8, 16]


# -- streaming text --------------------------------------------------------------------------------
def test_text_stream_holds_back_partial_stop_string():
    pieces = {1: b"Hi\nUs", 2: b"er:", 3: b" more"}
    stream = TextStream(pieces.__getitem__, stop=("\nUser:",))
    assert stream.push([1]) == ("Hi", False)
    assert stream.push([2]) == ("", True)
    assert stream.text == "Hi"


def test_text_stream_releases_false_alarm_and_splits_utf8():
    euro = "€".encode()
    pieces = {1: b"a\nU", 2: b"x" + euro[:1], 3: euro[1:]}
    stream = TextStream(pieces.__getitem__, stop=("\nUser:",))
    assert stream.push([1]) == ("a", False)
    assert stream.push([2]) == ("\nUx", False)
    assert stream.push([3]) == ("€", False)
    assert stream.flush() == ""


# -- the length controller -------------------------------------------------------------------------
def flat(costs):
    return CostModel.from_relative(costs)


CHAIN = chain_tree([1, 2, 3, 4], 1.0)


def test_sizer_worked_example():
    c = Sizer(flat([1.0, 1.8, 2.0, 2.1]), max_nodes=3, prior_weight=1e9)
    assert c.plan(chain_tree([1, 2, 3], 0.9), context=10)[0] == 3
    one = expected_speeds(c.chances(chain_tree([1], 0.9)), c.costs.relative(10))
    assert one[1] == pytest.approx(1.9 / 1.8)
    low = Sizer(flat([1.0, 1.8, 2.0, 2.1]), max_nodes=3, prior_weight=1e9, probe_every=1000)
    assert low.plan(chain_tree([1, 2, 3], 0.3), context=10)[0] == 0


def test_sizer_learns_and_stops_drafting():
    c = Sizer(flat([1.0, 1.5, 1.7, 1.9, 2.0]), max_nodes=4, probe_every=5, decay=0.97)
    chain = chain_tree([1, 2, 3, 4], 0.8)
    assert c.plan(chain, context=10)[0] > 0
    for _ in range(30):
        c.update(chain, 4, 0)
    choices = [c.plan(chain, context=10)[0] for _ in range(10)]
    assert choices.count(0) == 8 and choices.count(4) == 2  # idle, with a full-length probe every 5 steps


def test_sizer_never_drafts_when_nothing_can_pay():
    # a draft model costing 0.9 forwards per token against a steep verify curve: even perfect
    # acceptance loses, so neither drafting nor probing happens
    c = Sizer(flat([1.0, 2.0, 2.3, 2.5]), max_nodes=3, prior_weight=1e9, probe_every=1)
    chain = chain_tree([1, 2, 3], 1.0)
    assert not could_pay([1.0] * 3, c.costs.relative(10), lambda k: 0.9 * k)
    assert [c.plan(chain, context=10, per_node=0.9)[0] for _ in range(5)] == [0] * 5
    assert c.plan(chain, context=10)[0] == 3


def test_sizer_forgets_old_evidence():
    c = Sizer(flat([1.0, 1.1, 1.2]), max_nodes=2, decay=0.8)
    chain = chain_tree([1, 2], 0.5)
    for _ in range(20):
        c.update(chain, 2, 2)
    assert c.chances(chain)[0] > 0.8  # about 5 effective observations against a prior weight of 2
    for _ in range(10):
        c.update(chain, 2, 0)
    assert c.chances(chain)[0] < 0.3


def test_sizer_calibrates_each_depth_and_bucket_apart():
    c = Sizer(flat([1.0] * 5), max_nodes=4, decay=0.97)
    for _ in range(40):
        c.update(CHAIN, 4, 2)  # the first two tokens always hold, the rest never
    chances = c.chances(CHAIN)
    assert chances[1] > 0.9 and chances[2] < 0.1 and list(chances) == sorted(chances, reverse=True)
    assert list(c.chances(chain_tree([1, 2, 3, 4], 1.0, bucket="other"))) == [1.0] * 4  # nothing learned there


def test_sizer_follows_context_dependent_costs():
    # verification gets relatively dearer as the context grows: the same acceptance pays at a short
    # context and not at a long one
    costs = CostModel({64: [0.010, 0.014, 0.016], 2048: [0.020, 0.050, 0.070]})
    c = Sizer(costs, max_nodes=2, prior_weight=1e9)
    assert c.plan(chain_tree([1, 2], 0.7), context=64)[0] == 2
    assert c.plan(chain_tree([1, 2], 0.7), context=2048)[0] == 0


def test_cost_model_interpolates_and_learns():
    costs = CostModel({64: [0.010, 0.020], 1024: [0.013, 0.025]})
    assert costs.relative(544) == pytest.approx([1.0, 0.0225 / 0.0115])
    assert costs.seconds(0, 2048) == pytest.approx(0.013 + 0.003 * 1024 / 960)  # extrapolated
    for _ in range(60):
        costs.observe(1, 64, 0.040)  # batched forwards are slower than measured: all of them
    assert costs.seconds(1, 64) == pytest.approx(0.040, rel=0.05)
    assert costs.seconds(1, 1024) == pytest.approx(0.050, rel=0.05)
    assert costs.seconds(0, 64) == pytest.approx(0.010)  # single-token forwards unchanged
    costs.observe(1, 64, 10.0)  # one outlier moves the estimate little
    assert costs.seconds(1, 64) < 0.05


def test_plain_decoding_moves_the_machine_level_not_the_price_of_a_batch():
    # single-token forwards running faster than the curve say the machine is faster, not that a
    # batch got dearer relative to one token: only batched forwards teach that
    costs = CostModel({64: [0.010, 0.020]})
    for _ in range(60):
        costs.observe(0, 64, 0.006)
    assert costs.seconds(0, 64) == pytest.approx(0.006, rel=0.05)
    assert costs.seconds(1, 64) == pytest.approx(0.012, rel=0.05)  # batches follow the machine
    assert costs.relative(64) == pytest.approx([1.0, 2.0])
    for _ in range(60):
        costs.observe(1, 64, 0.018)  # now batches measure three single forwards
    assert costs.relative(64) == pytest.approx([1.0, 3.0], rel=0.05)
    assert costs.seconds(0, 64) == pytest.approx(0.006, rel=0.05)


def test_batches_seen_before_the_level_was_learned_do_not_keep_its_error():
    # live forwards run 18% slower than the curve measured at the start; an answer's first steps
    # draft, so batched forwards are seen before single ones have taught the level. Once they have,
    # a drafted token is priced at what the curve says it adds (2%), not at 1.02 times the error
    # (SmolLM2 F16 on 2 cores: 1.17-1.31 plain forwards where it cost 1.04-1.07)
    costs = CostModel({64: [0.0100, 0.0102]})
    for _ in range(10):
        costs.observe(1, 64, 0.0102 * 1.18)
    for _ in range(60):
        costs.observe(0, 64, 0.0100 * 1.18)
    assert costs.relative(64) == pytest.approx([1.0, 1.02], rel=0.01)
    assert costs.seconds(1, 64) == pytest.approx(0.0102 * 1.18, rel=0.01)


def test_cost_model_takes_a_curve_measured_later():
    # one curve: every context costs the same; a curve added at a long context bends the estimates
    # there, and the corrections learned against the old curve start over
    costs = CostModel({64: [0.010, 0.020, 0.030]})
    assert costs.relative(64) == costs.relative(2048) == pytest.approx([1.0, 2.0, 3.0])
    for _ in range(60):
        costs.observe(0, 2048, 0.013)
    assert costs.seconds(0, 2048) == pytest.approx(0.013, rel=0.05)
    costs.add_curve(1024, [0.013, 0.039, 0.052])
    assert costs.contexts == [64, 1024] and costs.curves[1024] == pytest.approx([0.013, 0.039, 0.052])
    assert costs.relative(1024) == pytest.approx([1.0, 3.0, 4.0])
    assert costs.relative(64) == pytest.approx([1.0, 2.0, 3.0])
    assert costs.seconds(0, 544) == pytest.approx(0.0115)  # interpolated, no stale correction on top
    with pytest.raises(ValueError, match="k = 0..2"):
        costs.add_curve(4096, [0.02, 0.05])


def test_timing_probes_leave_the_cache_as_they_found_it_and_stop_when_asked():
    from backends.core.timing import probe_sizes, time_here
    from tests.oracle import OracleTarget

    target = OracleTarget(n_ctx=128)
    target.prefill(list(range(20)))
    ticks = iter(range(10_000))
    curve = time_here(target, 40, clock=lambda: float(next(ticks)))  # every probe "takes" one tick
    assert len(curve) == 41 and curve == pytest.approx([1.0] * 41)
    assert target.tokens == list(range(20))
    calls = target.verify_calls
    asked = iter([False] * 3 + [True])
    assert time_here(target, 40, stop=lambda: next(asked)) is None
    assert target.verify_calls == calls + 1 + 3 and target.tokens == list(range(20))  # warm-up and 3 probes
    with pytest.raises(ValueError, match="no room"):
        time_here(target, 107)
    assert len(probe_sizes(40)) < 41  # not every length is timed


def test_the_ledger_scores_withheld_chains():
    ledger = Ledger()
    first, second = chain_tree([5, 6, 7], 0.5), chain_tree([6, 7], 0.5)
    ledger.add(10, first)
    ledger.add(11, second)
    context = list(range(10))
    assert ledger.resolve(context) == []
    assert ledger.resolve(context + [5]) == []  # still consistent, not yet decided
    assert ledger.resolve(context + [5, 9]) == [(first, 1), (second, 0)]
    third = chain_tree([1, 2], 0.5)
    ledger.add(12, third)
    assert ledger.resolve(context + [5, 9, 1, 2]) == [(third, 2)]


def test_cost_probes_are_chains_then_four_branch_trees():
    from backends.core.timing import interpolate, probe, probe_sizes

    assert probe_sizes(8) == [0, 1, 2, 4, 8]
    assert probe_sizes(10) == [0, 1, 2, 4, 8, 10]
    assert probe_sizes(64) == [0, 1, 2, 4, 8, 16, 32]  # 64 is extrapolated
    assert probe(7, 3).is_chain
    tree = probe(7, 30)
    assert tree.size == 30 and sum(p < 0 for p in tree.parents) == 4  # four root branches
    small = probe(7, 2, tree=True)
    assert not small.is_chain and small.size == 2 and small.parents == (-1, -1)
    assert interpolate([0, 16, 24], [1.0, 17.0, 21.0])[20] == pytest.approx(19.0)
    beyond = interpolate([0, 16, 32], [1.0, 5.0, 9.0], 64)  # the line through the last two goes on
    assert len(beyond) == 65 and beyond[48] == pytest.approx(13.0) and beyond[64] == pytest.approx(17.0)
    assert interpolate([0, 1, 2], [1.0, 2.0, 1.5], 4)[4] == pytest.approx(1.5)  # a dip does not go on down


def test_method_selector_learns_the_fastest_arm_per_kind_of_prompt_and_falls_back_to_plain():
    from backends.drafters.auto import PLAIN, MethodSelector

    # tokens per plain-forward unit of cost, per kind of prompt and arm
    truth = {"long": {"pld": 1.5, "all": 1.2}, "short": {"pld": 0.95, "all": 1.15}, "hard": {"pld": 0.9, "all": 0.8}}
    selector = MethodSelector(["pld", "all"], min_tries=2)
    played: dict[str, list[str]] = {kind: [] for kind in truth}
    for _ in range(60):
        for kind, speeds in truth.items():
            arm = selector.choose(kind)
            played[kind].append(arm)
            if arm != PLAIN:
                selector.add(100, 100 / speeds[arm])
    selector.close()
    last = {kind: arms[-30:] for kind, arms in played.items()}
    assert last["long"].count("pld") > 25 and last["short"].count("all") > 25
    assert last["hard"].count(PLAIN) > 25  # every drafting arm is slower: plain decoding
    assert selector.report()["long"]["pld"]["speed"] == pytest.approx(1.5)
    assert all(arms[:4].count(a) == 2 for arms in played.values() for a in ("pld", "all"))  # tried before judged


def test_an_answer_played_to_try_a_losing_arm_hands_over_to_the_leader_after_its_probe():
    from backends.drafters.auto import MethodSelector

    selector = MethodSelector(["pld", "head"], min_tries=1, probe_steps=4)
    for arm, speed in (("pld", 1.5), ("head", 1.0)):  # one full answer each: pld leads
        assert selector.choose("short") == arm
        for _ in range(25):
            selector.add(4, 4 / speed)
    assert selector.choose("short") == "pld" and selector.lagging() is None  # the leader's own answer
    for _ in range(10):
        selector.add(3, 2.0)
        assert selector.lagging() is None
    selector.close()
    selector.bandits["short"]._last["head"] = -100  # make the loser due for a re-check now
    assert selector.choose("short") == "head"
    for step in range(1, 6):
        selector.add(1, 1.0)  # 1.0x: slower than pld's 1.5x
        assert selector.lagging() == ("pld" if step >= 4 else None)  # judged only after its probe
    before = selector.bandits["short"].chosen.copy()
    selector.hand_over()
    assert selector.lagging() is None and selector.handed == {"short": {"head": 1}}
    for _ in range(50):
        selector.add(9, 1.0)  # the leader's rest of the answer is not booked as anyone's play
    assert selector.report()["short"]["pld"]["speed"] == pytest.approx(1.5)
    assert selector.report()["short"]["head"]["handed_over"] == 1
    assert selector.bandits["short"].chosen == before
    # a tried arm that keeps up plays its whole answer
    selector.bandits["short"]._last["head"] = -100
    assert selector.choose("short") == "head"
    for _ in range(30):
        selector.add(2, 1.0)
        assert selector.lagging() is None


def test_the_state_window_keeps_the_last_positions_without_a_gap():
    from backends.drafters.auto import StateWindow

    window = StateWindow(5)
    assert window.rows() is None
    window.add(np.arange(3, dtype=np.float32)[:, None])  # positions 0-2
    for start in range(3, 30, 3):
        window.add(np.arange(start, start + 3, dtype=np.float32)[:, None])
        assert window.rows()[:, 0].tolist() == list(range(max(0, start + 3 - 5), start + 3))
    window.add(None)  # a step without states: what came before is not next to what follows
    assert window.rows() is None
    window.add(np.array([[40.0]]))
    assert window.rows()[:, 0].tolist() == [40.0]


def test_bandit_margin_gives_near_ties_to_the_simpler_arm():
    from backends.core.controller import Bandit

    def best(a: float, b: float):
        bandit = Bandit(["a", "b"], baseline="ar", min_tries=1, margin=0.03)
        bandit.update("a", a * 100, 100)
        bandit.update("b", b * 100, 100)
        return bandit.best()

    assert best(1.10, 1.12) == "a"  # within 3%: the arm listed first
    assert best(1.10, 1.15) == "b"
    assert best(0.98, 0.90) == "a"  # slightly slower than plain decoding is a tie too
    assert best(0.96, 0.95) == "ar"


def test_bandit_probes_a_losing_arm_within_the_exploration_share():
    """A loser is re-checked no sooner than its share allows, and each re-check it loses doubles
    its gap (32 rounds up to 2,048), each it wins resets it: one that starts winning then plays."""
    from backends.core.controller import Bandit

    def probes(share: float, bad: tuple[float, float] = (1.0, 2.0), *, rounds: int = 4000,
               better_from: int | None = None) -> list[int]:
        bandit = Bandit(["good", "bad"], baseline="ar", min_tries=1, explore_share=share)
        played = []
        for r in range(rounds):
            arm = bandit.choose()
            won = bad if better_from is None or r < better_from else (3.0, 1.0)
            bandit.update(arm, *{"good": (2.0, 1.0), "bad": won, "ar": (1.0, 1.0)}[arm])
            if arm == "bad":
                played.append(r)
        return played

    def gaps(rounds: list[int]) -> list[int]:
        return [b - a for a, b in zip(rounds, rounds[1:])]

    budgeted = probes(0.02)  # after its trial, each probe of "bad" costs 3 rounds: >= 150 apart
    assert gaps(budgeted) == [150, 150, 150, 256, 512, 1024]
    near = probes(0.02, (1.9, 1.0))  # 5% behind: a probe costs 0.05 rounds, so only the gap spaces them
    assert gaps(near) == [32, 64, 128, 256, 512, 1024]
    assert max(gaps(probes(0.02, rounds=20000))[-3:]) == 2048  # never further apart than max_gap
    assert len(probes(0.0)) == 1  # no share: its one trial, then never again
    found = gaps(probes(0.02, better_from=1300))  # the re-check due at 2,243 finds it faster: each
    assert found[:6] == gaps(budgeted) and found[6] > found[7] > found[8]  # one it wins comes sooner,
    assert found[-50:] == [1] * 50  # and then it plays on


def test_an_arm_whose_tries_lose_much_is_tried_fewer_times():
    """A try that lost more than ``try_loss`` rounds counts as several: a drafter whose every
    try costs 2.5 forwards for one token (a head on a slow CPU) is not tried 16 times; one whose
    tries cost little, or win, is."""
    from backends.core.controller import Bandit

    def tries(gain: float, cost: float, rounds: int = 20) -> int:
        bandit, n = Bandit(["run"], baseline="off", min_tries=16, try_loss=0.5), 0
        for _ in range(rounds):
            if bandit.choose() == "run":
                bandit.update("run", gain, cost)
                n += 1
        return n

    assert tries(1.0, 2.5) == 6  # 1.5 rounds lost a try, counted 3: the sixth passes 16
    assert tries(1.0, 1.05) == 16  # 5% slower: all 16, then spaced out by the share
    assert tries(2.0, 1.2, 100) == 100  # a winner is tried, then plays
    assert Bandit(["run"], baseline="off", min_tries=16).try_loss == float("inf")  # by default a try counts one


def test_a_closed_gate_answers_its_quiet_rounds_as_the_full_choice_would():
    """The bandit remembers until which round no loser is due while plain decoding is best (a
    closed gate's every step, answered without recomputing); each update forgets it. The choices
    must be exactly those of a bandit that recomputes every round."""
    from backends.core.controller import Bandit

    def plays(recompute: bool) -> tuple[list[str], int]:
        bandit, played, quiet = Bandit(["run"], baseline="off", min_tries=4), [], 0
        for r in range(6000):
            if recompute:
                bandit._quiet = (bandit.baseline, 0)
            quiet += bandit._round + 1 < bandit._quiet[1]
            arm = bandit.choose()
            played.append(arm)
            if arm == "run":  # loses (0.7 tokens a forward), then wins from round 3000 (1.5)
                bandit.update("run", 1.5 if r >= 3000 else 0.7, 1.0)
        return played, quiet

    cached, quiet = plays(False)
    assert cached == plays(True)[0]
    assert quiet > 2500  # the quiet path answered most rounds of the losing stretch
    assert 4 < cached[:3000].count("run") < 100 and cached[-100:] == ["run"] * 100


def test_bench_compares_each_method_with_the_fastest_other_one():
    from backends.bench import against_fastest

    def rows(method: str, factor: float) -> list[dict]:
        return [{"method": method, "question_id": q, "category": "qa", "new_tokens": 100,
                 "decode_tok_s": (50.0 + q) * factor * (1.02 if q % 2 else 0.98)} for q in range(10)]

    records = rows("ar", 1.0) + rows("pld", 1.2) + rows("draft", 0.9) + rows("auto", 1.2 * 0.99)
    table = against_fastest(records, ["ar", "pld", "draft", "auto"])
    assert table["auto"]["rival"] == "pld" and table["auto"]["ratio"] == pytest.approx(0.99)
    assert table["auto"]["low"] == pytest.approx(0.99) == pytest.approx(table["auto"]["high"])  # same scatter: paired away
    assert table["pld"]["rival"] == "auto" and table["pld"]["ratio"] > 1.0
    assert table["ar"]["rival"] == "pld" and "ar" not in {v["rival"] for v in table.values()}


def test_bench_speedup_interval_pairs_prompts_and_brackets_the_figure():
    from backends.bench import speedup_interval

    def row(qid: int, tokens: int, rate: float) -> dict:
        return {"question_id": qid, "category": "qa", "new_tokens": tokens, "decode_tok_s": rate}

    ar = [row(q, 100, 50.0 + q) for q in range(10)]
    twice = [row(q, 100, 2 * (50.0 + q)) for q in range(10)]
    assert speedup_interval(twice, ar) == pytest.approx((2.0, 2.0))  # paired by prompt: no spread at all
    mixed = [row(q, 100, (50.0 + q) * (1.3 if q % 2 else 0.9)) for q in range(10)]
    low, high = speedup_interval(mixed, ar)
    assert 0.9 < low < 1.1 < high < 1.3
    assert all(math.isnan(x) for x in speedup_interval(mixed[:1], ar))  # one prompt: no interval


def test_widest_paying_batch_reads_the_measured_curve():
    from backends.core.costs import CostModel
    from backends.train import widest_paying_batch

    flat = CostModel.from_relative([1.0, 1.86, 1.9, 1.95, 1.98, 2.5, 3.0])  # k = 0..6 drafted: 1..7 rows
    assert widest_paying_batch(flat, 0, 7) == 5  # 5 / 1.98 = 2.53 rows per unit; 7 / 3.0 = 2.33
    assert widest_paying_batch(flat, 0, 3) == 3
    steep = CostModel.from_relative([1.0, 2.0, 3.0, 4.0])  # a row costs as much as the last: one at a time
    assert widest_paying_batch(steep, 0, 4) == 1


def test_the_planner_verifies_what_pays_on_this_curve_and_fits_one_forward():
    from backends.core.planner import best_size, plan_nodes

    amd = [1.0, 1.86, 1.90, 1.95]  # the worked example of backends/core/planner.py
    assert best_size([0.9, 0.81, 0.73], amd) == 3
    assert best_size([0.3, 0.09, 0.03], amd) == 0
    assert best_size([0.9], [1.0, 1.24]) == 1
    assert best_size([0.9, 0.81], amd, per_node=0.8) == 0  # a draft token as dear as 0.8 forwards
    tree = Proposal((5, 6, 7, 8), (-1, 0, -1, 2), chances=(0.9, 0.8, 0.2, 0.1))  # 5 -> 6, 7 -> 8
    flat = [1.0] * 8
    assert plan_nodes(tree, flat, Budget(max_nodes=8, max_depth=8)) == [0, 1, 2, 3]
    assert plan_nodes(tree, flat, Budget(max_nodes=3, max_depth=8)) == [0, 1, 2]  # likeliest first
    assert plan_nodes(tree, flat, Budget(max_nodes=8, max_depth=1)) == [0, 2]
    assert plan_nodes(tree, flat, Budget(max_nodes=8, max_depth=8, max_paths=1)) == [0, 1]
    assert plan_nodes(tree, [1.0, 1.3, 1.6, 1.9, 2.2], Budget(max_nodes=8, max_depth=8)) == [0, 1]


def test_kept_states_follow_the_cache_as_the_docstring_says():
    """Both backends keep states with ``KeptStates``: its worked example, and its refusals."""
    import numpy as np
    import pytest

    from backends.core.errors import BackendError
    from backends.core.kept_states import KeptStates

    kept = KeptStates(32, 2)
    kept.begin_at(4)  # a prefill of 10 tokens asking for states from position 4
    kept.store(4, np.arange(12, dtype=np.float32).reshape(6, 2))
    kept.store(10, np.full((2, 2), 7, np.float32))  # the root and one accepted node of a verify
    assert (kept.start, kept.end) == (4, 12) and kept.read(10, 12).tolist() == [[7, 7], [7, 7]]
    kept.forget(8)
    assert (kept.start, kept.end) == (4, 8) and kept.read(4, 5).tolist() == [[0, 1]]
    assert kept.reusable(6) == 8 and kept.reusable(9) == 9  # a run reaching back to 6 is kept, one to 9 is not
    kept.store(20, np.zeros((1, 2), np.float32))  # does not continue the run: ignored
    assert kept.end == 8 and kept.read(3, 3).shape == (0, 2)
    with pytest.raises(BackendError, match="positions 4..7 have one"):
        kept.read(2, 6)
    kept.begin_at(9)  # states asked for from 9 on, past the run's end: a new run starts there
    assert (kept.start, kept.end) == (9, 9)


def test_settings_bounds_are_declared_once_and_refused_with_the_field_name():
    from backends.drafters.draft_model import DraftSettings
    from backends.drafters.rest import RESTSettings

    with pytest.raises(ValueError, match=r"max_nodes must be in 1\.\.64, got 0"):
        RESTSettings(max_nodes=0)
    with pytest.raises(ValueError, match=r"min_match \(5\) is above max_match \(3\)"):
        RESTSettings(min_match=5, max_match=3)
    with pytest.raises(ValueError, match=r"min_confidence must be in \[0\.0, 1\.0\), got 1\.0"):
        DraftSettings(min_confidence=1.0)
    assert DraftSettings(min_confidence=0.0).min_confidence == 0.0 and RESTSettings(samples=65536).samples == 65536


def test_a_missing_head_is_named_in_words_with_the_command_that_trains_it():
    from backends.drafters import HEAD_PREFIX, describe

    assert describe(frozenset({HEAD_PREFIX + "eagle3"})) == (
        "an EAGLE-3 head trained for this model (`specdeck train eagle3 --model MODEL`)")
    assert describe(frozenset({HEAD_PREFIX + "medusa"})).startswith("a Medusa head")
    assert describe(frozenset({HEAD_PREFIX + "newkind"})).startswith("a newkind head")
