"""SpecInfer: merging several drafters' proposals into one tree, exact on the oracle, lossless
when sampling with several sampled drafts, and on a real model."""

from __future__ import annotations

import numpy as np
import pytest

from backends.core.acceptance import accept_stochastic
from backends.core.protocols import Drafter
from backends.core.types import GenerationSettings, Proposal, SamplingSettings, TargetOutput, Verdict
from backends.drafters.draft_model import DraftModelDrafter, DraftSettings
from backends.drafters.pld import PLDDrafter, PLDSettings
from backends.drafters.rest import RESTDrafter, RESTSettings
from backends.drafters.lookahead import LookaheadDrafter, LookaheadSettings
from backends.drafters.merge import merge, project, select
from backends.drafters.specinfer import SpecInferDrafter, SpecInferSettings
from tests.oracle import OracleTarget
from tests.test_engine import CHEAP_DRAFT, COSTS, drafted_matching_plain_greedy, run
from tests.test_rest import _oracle_store


def test_merge_shares_agreeing_prefixes_and_branches_where_drafts_differ():
    pld = Proposal.chain([5, 6, 7])
    draft = Proposal.chain([5, 9])
    tree = merge([pld, draft])
    assert tree.proposal.tokens == (5, 6, 7, 9) and tree.proposal.parents == (-1, 0, 1, 0)
    assert tree.maps == ((0, 1, 2), (0, 3))
    verdict = Verdict(path=(0, 3), tokens=(5, 9, 4), drafted=4, draft_depth=3)  # the target said 5 9 4
    assert project(verdict, pld, tree.maps[0]).path == (0,)
    assert project(verdict, draft, tree.maps[1]).path == (0, 1)
    assert project(verdict, draft, tree.maps[1]).tokens == (5, 9, 4)  # every drafter follows the text
    # and reads the states of every token written, through whichever drafter's nodes: rows of the verify
    assert project(verdict, pld, tree.maps[0]).state_rows == (0, 1, 4)
    lone = Proposal.chain([8])  # a head whose only guess was not verified at all
    assert project(verdict, lone, (-1,)).state_rows == (0, 1, 4)
    # a drafter that reads its own nodes' rows (lookahead's Jacobi step) finds them where the merge put them
    assert [project(verdict, draft, tree.maps[1]).row_of(i) for i in range(2)] == [1, 4]
    cut = select(tree, [0, 1, 3])  # the planner kept pld's first two nodes and draft's
    assert [project(verdict, pld, cut.maps[0]).row_of(i) for i in range(3)] == [1, 2, -1]


def test_sampled_nodes_are_never_merged():
    q = np.full(8, 1 / 8)
    sampled = Proposal.chain([3, 4], draft_probs=[q, q])
    lookup = Proposal.chain([3, 5])
    tree = merge([sampled, lookup])
    assert tree.proposal.tokens == (3, 4, 3, 5)  # the one-hot 3 does not merge into the sampled 3
    assert tree.proposal.parents == (-1, 0, -1, 2)
    twice = merge([lookup, Proposal.chain([3, 5, 6])])
    assert twice.proposal.tokens == (3, 5, 6)  # one-hot copies merge


def _drafters(oracle: OracleTarget, seed: int, sampling: SamplingSettings, store=None):
    draft_oracle = OracleTarget(oracle.n_vocab, seed=seed, perturb=1.5, perturb_seed=seed + 100, n_ctx=oracle.n_ctx)
    subs = [
        DraftModelDrafter(draft_oracle, DraftSettings(min_confidence=0.2), sampling=sampling,
                          target_vocab=oracle.n_vocab, costs=COSTS, draft_costs=CHEAP_DRAFT),
        PLDDrafter(PLDSettings(), costs=COSTS),
    ]
    if store is not None:
        subs.append(RESTDrafter(store, RESTSettings(min_match=1), costs=COSTS))
    return SpecInferDrafter(subs, costs=COSTS)


@pytest.mark.parametrize("with_rest", [False, True])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_specinfer_output_equals_plain_greedy(tmp_path, penalty, with_rest):
    def make(oracle, seed, sampling):
        store = _oracle_store(tmp_path, oracle, seed, sampling) if with_rest else None
        return _drafters(oracle, seed, sampling, store)

    assert drafted_matching_plain_greedy(make, method="specinfer", penalty=penalty) > 0


@pytest.mark.parametrize("lookahead_first", [True, False], ids=["lookahead,pld", "pld,lookahead"])
def test_lookahead_merged_with_prompt_lookup_reads_its_own_rows_of_the_verify(lookahead_first):
    """Lookahead's Jacobi step reads the target's prediction after each of its window's nodes: in a
    merged tree those rows are where the merge and the planner's cut put them (it read its own
    indices: past the end of a cut verify, or pld's rows). Every prediction it takes is checked
    against the oracle's logits after the window's guesses."""
    checked = []

    class Checked(LookaheadDrafter):
        def propose(self, context, budget):
            self.sent = (list(context), list(self._window))
            return super().propose(context, budget)

        def _predictions(self, out, verdict):
            got = super()._predictions(out, verdict)
            context, window = self.sent
            for q, token in got.items():
                history = context + window[: q - len(context)]
                assert token == int(np.argmax(self.oracle.logits_for(history))), f"prediction for {q}"
            checked.append(len(got))
            return got

    def make(oracle, seed, sampling):
        lookahead = Checked(LookaheadSettings(window=4, guesses=2, adaptive=False), costs=COSTS)
        lookahead.oracle = oracle
        pld = PLDDrafter(PLDSettings(min_ngram=1), costs=COSTS)
        return SpecInferDrafter([lookahead, pld] if lookahead_first else [pld, lookahead], costs=COSTS)

    assert drafted_matching_plain_greedy(make, method="specinfer", penalty=1.0) > 0
    assert sum(checked) > 100


def test_specinfer_drafts_at_least_what_each_drafter_would():
    oracle = OracleTarget(32, seed=4)
    prompt = list(range(20)) * 2
    sampling = SamplingSettings()
    merged = run(oracle, _drafters(oracle, 4, sampling), prompt, GenerationSettings(max_new_tokens=64)).stats
    pld = run(OracleTarget(32, seed=4), PLDDrafter(PLDSettings(), costs=COSTS), prompt,
              GenerationSettings(max_new_tokens=64)).stats
    assert merged.tau >= pld.tau * 0.95 and merged.tau > 1.2


def test_tree_sampler_with_several_sampled_drafts_keeps_the_target_distribution():
    """Multi-step speculative sampling at one node with two sampled drafts and a one-hot lookup
    guess (duplicates included): the first emitted token follows p exactly."""
    rng = np.random.default_rng(0)
    vocab = 6
    p_logits = rng.normal(size=vocab)
    p = np.exp(p_logits) / np.exp(p_logits).sum()
    q1 = np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    q2 = np.array([0.05, 0.05, 0.1, 0.1, 0.2, 0.5])
    logits = np.tile(p_logits.astype(np.float32), (5, 1))
    counts = np.zeros(vocab)
    trials = 60_000
    sampling = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    for _ in range(trials):
        x1, x2 = rng.choice(vocab, p=q1), rng.choice(vocab, p=q2)
        prop = merge([Proposal.chain([x1], draft_probs=[q1]), Proposal.chain([x2], draft_probs=[q2]),
                      Proposal.chain([2]), Proposal.chain([2])]).proposal
        out = TargetOutput(logits[: 1 + prop.size])
        verdict = accept_stochastic(out, prop, settings=sampling, history=[0], rng=rng)
        counts[verdict.tokens[0]] += 1
    freq = counts / trials
    assert np.abs(freq - p).max() < 0.01, (freq, p)


@pytest.mark.parametrize("bad", ["", "ar,pld", "pld,pld", "specinfer", "a,b,c,d,e"])
def test_bad_drafter_lists_are_refused(bad):
    with pytest.raises(ValueError):
        SpecInferSettings(drafters=bad)


def test_specinfer_without_a_draft_model_or_a_head_says_which_drafter_needs_it(smollm_q4_path, gemma_path):
    from backends.core.errors import SpecDeckError
    from backends.factory import Session, SessionConfig

    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=512)) as alone:
        with pytest.raises(SpecDeckError, match=r"specinfer \(draft\) needs a draft model"):
            alone.drafter("specinfer", SamplingSettings())
        alone.drafter("specinfer", SamplingSettings(), drafters="pld")  # without one, other drafters work

    with Session(SessionConfig(model=str(gemma_path), n_ctx=512)) as gemma:  # no head ships for Gemma
        with pytest.raises(SpecDeckError, match=r"specinfer \(medusa, mtp-trained\) needs a Medusa head trained"):
            gemma.drafter("specinfer", SamplingSettings(), drafters="pld,medusa,mtp-trained")


def test_real_model_specinfer_matches_plain_greedy(smollm_session):
    from tests.test_real_models import check_method_matches_ar

    check_method_matches_ar(smollm_session, "specinfer", {"adaptive": False})


def _cheap_draft(session, monkeypatch, share: float = 0.05) -> None:
    """Make the session's draft model cost ``share`` of a target forward (as on a GPU), so the
    arms that include it are built on this CPU too."""
    from backends.core.costs import CostModel

    one = session.cost_model().seconds(0, 64)
    monkeypatch.setattr(session, "_draft_costs", CostModel({64: [one * share * (1 + k / 8) for k in range(65)]}))


def plain_arms(auto) -> list[str]:
    """auto's arms less those with a trained head (whether those join depends on the machine)."""
    from backends.drafters import HEAD_ARMS, head_arm

    heads = {head_arm(text, head) for text in ("pld", "rest") for head in HEAD_ARMS}
    return [a for a in auto.arms if a not in heads]


def test_auto_and_specinfer_leave_out_a_draft_model_that_cannot_pay(smollm_session, monkeypatch):
    # a draft forward that costs as much as a target one cannot pay even if every guess is right
    _cheap_draft(smollm_session, monkeypatch, share=1.0)
    assert plain_arms(smollm_session.drafter("auto", SamplingSettings())) == ["pld"]
    # chosen explicitly, specinfer leaves it out too: prompt lookup drafts alone, and the draft model
    # is not even prefilled (forced with adaptive=False, it stays)
    alone = smollm_session.drafter("specinfer", SamplingSettings())
    assert [type(d).__name__ for d in alone.drafters] == ["PLDDrafter"] and "cannot pay" in alone.playing
    assert len(smollm_session.drafter("specinfer", SamplingSettings(), adaptive=False).drafters) == 2
    smollm_session.reset()
    events = list(smollm_session.generate("specinfer", list(range(100, 140)), GenerationSettings(max_new_tokens=8)))
    assert events[-1].stats.played == alone.playing and smollm_session.draft_target.n_past == 0
    _cheap_draft(smollm_session, monkeypatch, share=0.05)
    both = smollm_session.drafter("specinfer", SamplingSettings())
    assert len(both.drafters) == 2 and not both.playing
    assert plain_arms(smollm_session.drafter("auto", SamplingSettings())) == ["pld", "specinfer:pld,draft"]
    for _ in range(50):  # decided once per pair of cost models: drift does not reshuffle auto's arms
        smollm_session.draft_cost_model().observe(0, 64, 10.0)
    assert plain_arms(smollm_session.drafter("auto", SamplingSettings())) == ["pld", "specinfer:pld,draft"]


def test_auto_arms_are_prompt_lookup_or_rest_and_a_draft_model_merged(smollm_session, smollm_q4_path, tmp_path, monkeypatch):
    from backends.drafters.auto import AutoDrafter
    from backends.factory import Session, SessionConfig
    from tests.test_rest import _text_store

    _cheap_draft(smollm_session, monkeypatch)
    auto = smollm_session.drafter("auto", SamplingSettings())
    assert isinstance(auto, AutoDrafter) and plain_arms(auto) == ["pld", "specinfer:pld,draft"]
    merged = auto.arms["specinfer:pld,draft"]
    assert [type(d).__name__ for d in merged.drafters] == ["PLDDrafter", "DraftModelDrafter"]
    store = _text_store(tmp_path, smollm_session)
    with_store = smollm_session.drafter("auto", SamplingSettings(), datastore=store)
    arms = with_store.arms
    assert plain_arms(with_store) == ["rest", "specinfer:pld,draft,rest"]  # rest in prompt lookup's place
    assert arms["rest"].conversation is not None  # REST searches the conversation before the datastore
    with_rest = arms["specinfer:pld,draft,rest"]
    assert [type(d).__name__ for d in with_rest.drafters] == ["PLDDrafter", "DraftModelDrafter", "RESTDrafter"]
    assert with_rest.drafters[2].conversation is None  # pld searches the conversation once, not twice
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=512)) as alone:
        assert plain_arms(alone.drafter("auto", SamplingSettings())) == ["pld"]
        assert plain_arms(alone.drafter("auto", SamplingSettings(), datastore=store)) == ["rest"]


def test_auto_plays_one_arm_per_answer_and_learns_which(smollm_session, monkeypatch):
    # every answer's arm is booked with the selector when the next starts; output stays ar's
    from backends.core.engine import generate
    from tests.test_real_models import GREEDY

    _cheap_draft(smollm_session, monkeypatch)

    prompt = smollm_session.model.chat_prompt([{"role": "user", "content": "Count from 1 to 20."}])
    smollm_session.reset()
    ref = list(smollm_session.generate("ar", prompt, GREEDY))[-1]
    arms = []
    every = list(smollm_session.drafter("auto", GREEDY.sampling).arms)
    for _ in range(3 * len(every)):
        smollm_session.reset()
        drafter = smollm_session.drafter("auto", GREEDY.sampling)
        got = list(generate(smollm_session.target, drafter, prompt, GREEDY, method="auto"))[-1]
        assert got.tokens == ref.tokens
        assert got.stats.played == drafter.playing  # the footer says what was played
        arms.append(drafter.playing.split(" → ")[0])  # a tried arm that lagged handed over to the leader
    assert set(arms) == set(every)  # every arm is tried before it is judged
    speeds = {arm: row["speed"] for arm, row in drafter.selector.report()["short"].items()}
    assert speeds["ar"] == 1.0 and all(v > 0 for v in speeds.values())


class Recording(Drafter):
    """A drafter as it is, noting what each ``begin`` handed it."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.begun = inner, []
        self.requires, self.prompt_states, self.state_layers = inner.requires, inner.prompt_states, inner.state_layers

    def begin(self, prompt, hidden=None) -> None:
        self.begun.append((list(prompt), None if hidden is None else hidden.copy()))
        self.inner.begin(prompt, hidden)

    def propose(self, context, budget):
        return self.inner.propose(context, budget)

    def observe(self, out, verdict) -> None:
        self.inner.observe(out, verdict)


@pytest.mark.parametrize("tried, leader", [("eagle2", "pld"), ("pld", "eagle2"), ("eagle2", "medusa")])
def test_auto_hands_a_tried_arm_that_lags_over_to_the_leader_mid_answer(smollm_session, tried, leader):
    # the leader begins where the answer stands, a reader of states with those of the positions
    # before its root (kept by auto from every verify); output stays ar's
    from backends.core.engine import generate
    from backends.drafters.auto import AutoDrafter, MethodSelector
    from tests.test_real_models import GREEDY

    prompt = smollm_session.model.chat_prompt([{"role": "user", "content": "Count from 1 to 20."}])
    smollm_session.reset()
    ref = list(smollm_session.generate("ar", prompt, GREEDY))[-1]
    arms = {"pld": Recording(smollm_session.drafter("pld", GREEDY.sampling)),
            "eagle2": Recording(smollm_session.drafter("eagle2", GREEDY.sampling, adaptive=False)),
            "medusa": Recording(smollm_session.drafter("medusa", GREEDY.sampling, adaptive=False))}
    selector = MethodSelector([tried, leader], min_tries=1, probe_steps=3)
    selector.bandits["short"] = selector._make()
    selector.bandits["short"].update(leader, 1000.0, 1.0)  # the leader measured 1000x: any tried arm lags
    auto = AutoDrafter({a: arms[a] for a in (tried, leader)}, costs=smollm_session.cost_model(), selector=selector)
    smollm_session.reset()
    events = list(generate(smollm_session.target, auto, prompt, GREEDY, method="auto"))
    assert events[-1].tokens == ref.tokens and events[-1].stats.played == f"{tried} → {leader}" == auto.playing
    assert auto.arm == leader and selector.handed == {"short": {tried: 1}}
    assert [len(p) for p, _ in arms[tried].begun] == [len(prompt)]
    ((context, hidden),) = arms[leader].begun
    steps = [e for e in events if type(e).__name__ == "Step"]
    assert len(context) == len(prompt) + sum(len(e.tokens) for e in steps[:3])  # after the tried arm's 3 steps
    if leader == "pld":
        assert hidden is None
        return
    n = len(hidden)
    assert n == min(len(context) - 1, auto.prompt_states)
    kept = smollm_session.target.hidden_states(len(context) - 1 - n, len(context) - 1)  # float16 copies
    assert np.abs(hidden - kept).max() <= 2e-3 * np.abs(kept).max()
    assert np.abs(hidden[1:] - kept[:-1]).max() > 0.1 * np.abs(kept).max()  # one position off would show
    assert sum(e.accepted for e in steps[3:]) > 0  # the head drafted from them and was right
    if tried == "eagle2":
        assert sum(e.accepted for e in steps[:3]) > 0  # the window holds the accepted rows too


def test_merged_tree_is_cut_to_what_pays_and_drafters_only_book_verified_nodes():
    from backends.drafters.merge import select

    sure = Proposal.chain([5, 6, 7, 8], chances=[0.9, 0.8, 0.05, 0.01])  # confident in its first two tokens only
    unsure = Proposal.chain([5, 9], chances=[0.1, 0.02])
    props = [sure, unsure]
    tree = merge(props)
    assert tree.proposal.chances == (0.9, 0.8, 0.05, 0.01, 0.02)  # the shared first node takes the higher estimate
    assert merge([Proposal.chain([5, 6])]).proposal.chances == (0.5, 0.25)  # a drafter without estimates
    cut = select(tree, [0, 1])
    assert cut.proposal.tokens == (5, 6) and cut.maps == ((0, 1, -1, -1), (0, -1))
    assert cut.proposal.chances == (0.9, 0.8)
    verdict = Verdict(path=(0, 1), tokens=(5, 6, 3), drafted=2, draft_depth=2)
    seen = project(verdict, props[0], cut.maps[0])
    assert seen.path == (0, 1) and seen.drafted == 2 and seen.draft_depth == 2  # 7 and 8 were never checked
    other = project(verdict, props[1], cut.maps[1])
    assert other.path == (0,) and other.drafted == 1


class _Fixed(Drafter):
    """A drafter that always proposes the same chain with the same estimates."""

    requires = frozenset()

    def __init__(self, tokens, probs):
        self.tokens, self.probs = tokens, probs

    def propose(self, context, budget):
        return Proposal.chain(self.tokens, chances=self.probs)

    def observe(self, out, verdict):
        self.seen = verdict

    def begin(self, prompt, hidden=None):
        pass


def test_a_sizer_that_sees_expensive_verification_keeps_only_the_likely_nodes():
    from backends.core.costs import CostModel
    from backends.core.types import Budget

    cpu = CostModel.from_relative([1.0, 1.3, 1.5, 2.4, 2.6, 3.0, 3.2, 3.4, 3.6])
    sure, unsure = _Fixed([5, 6, 7, 8], [0.95, 0.9, 0.1, 0.05]), _Fixed([4, 9], [0.05, 0.01])
    merged = SpecInferDrafter([sure, unsure], costs=cpu)
    assert merged.propose([1, 2, 3], Budget(max_nodes=64, max_depth=64)).tokens == (5, 6)


def test_a_lone_proposal_is_verified_as_its_drafter_sized_it():
    """With one proposal there is nothing to merge: specinfer decodes as that drafter would alone."""
    from backends.core.costs import CostModel
    from backends.core.types import Budget

    cpu = CostModel.from_relative([1.0, 1.3, 1.5, 2.4, 2.6, 3.0, 3.2, 3.4, 3.6])
    sure, silent = _Fixed([5, 6, 7, 8], [0.95, 0.9, 0.1, 0.05]), _Fixed([], [])
    merged = SpecInferDrafter([silent, sure], costs=cpu)
    proposal = merged.propose([1, 2, 3], Budget(max_nodes=64, max_depth=64))
    assert proposal.tokens == (5, 6, 7, 8)
    merged.observe(TargetOutput(logits=np.zeros((5, 16), np.float32), seconds=0.01),
                   Verdict(path=(0, 1), tokens=(5, 6, 3), drafted=4, draft_depth=4))
    assert sure.seen.path == (0, 1) and sure.seen.drafted == 4
    assert silent.seen.drafted == 0 and silent.seen.tokens == (5, 6, 3)


def test_a_cascade_lets_the_first_drafter_with_a_guess_draft_alone_and_the_rest_wait():
    """``cascade``: the first drafter in order that has a guess drafts the step alone, sized as it
    sized it; those after it are asked with room for nothing (they keep their place in the text
    but spend nothing); where the first has nothing, the next gets the whole budget. Each observes
    the verdict as its own proposal saw it."""
    from backends.core.costs import CostModel
    from backends.core.types import Budget

    class Heard(_Fixed):
        def propose(self, context, budget):
            self.budget = budget
            return super().propose(context, budget) if budget.max_nodes else Proposal()

    cpu = CostModel.from_relative([1.0, 1.3, 1.5, 2.4, 2.6, 3.0, 3.2, 3.4, 3.6])
    full = Budget(max_nodes=64, max_depth=64)
    lookup, head = Heard([5, 6, 7, 8], [0.95, 0.9, 0.1, 0.05]), Heard([5, 9], [0.6, 0.3])
    cascade = SpecInferDrafter([lookup, head], costs=cpu, cascade=True)
    assert cascade.propose([1, 2, 3], full).tokens == (5, 6, 7, 8)  # not merged with the head's 5 -> 9
    assert lookup.budget == full and head.budget.max_nodes == 0 and head.budget.max_depth == 0
    cascade.observe(TargetOutput(logits=np.zeros((5, 16), np.float32), seconds=0.01),
                    Verdict(path=(0,), tokens=(5, 9), drafted=4, draft_depth=4))
    assert lookup.seen.path == (0,) and head.seen.drafted == 0 and head.seen.tokens == (5, 9)

    lookup.tokens, lookup.probs = [], []  # the lookup finds nothing: the head drafts with the whole budget
    assert cascade.propose([1, 2, 3, 5, 9], full).tokens == (5, 9) and head.budget == full
    merged = SpecInferDrafter([Heard([5, 6], [0.95, 0.9]), Heard([5, 9], [0.9, 0.8])], costs=cpu)
    assert merged.propose([1, 2, 3], full).tokens == (5, 6, 9)  # without cascade: one tree of both


def test_auto_plays_a_trained_head_only_where_it_could_pay(smollm_session, monkeypatch):
    """The shipped heads join auto's arms where verifying more rows costs little next to a
    forward (a GPU), and stay out where it costs nearly double (these 2 CPU cores)."""
    from backends.core.costs import CostModel

    def arms_with(relative: list[float], forward_s: float) -> list[str]:
        monkeypatch.setattr(smollm_session, "_costs", CostModel({16: [forward_s * r for r in relative]}))
        return list(smollm_session.drafter("auto", SamplingSettings()).arms)

    gpu_like = arms_with([1.0 + 0.01 * k for k in range(65)], forward_s=1.0)
    assert "pld then eagle2" in gpu_like and "pld then medusa" in gpu_like
    steep = arms_with([1.0] + [2.0 + 0.3 * k for k in range(64)], forward_s=1.0)
    assert not [a for a in steep if " then " in a]  # no head joins
    drafter = smollm_session.drafter("auto", SamplingSettings())
    assert drafter.requires == frozenset().union(*(d.requires for d in drafter.arms.values()))
    monkeypatch.setattr(smollm_session, "_costs", CostModel({16: [1.0 + 0.01 * k for k in range(65)]}))
    behind = smollm_session.drafter("auto", SamplingSettings()).arms["pld then eagle2"]
    # the head drafts behind prompt lookup, only where the lookup has no guess
    assert behind.cascade and [type(d).__name__ for d in behind.drafters] == ["PLDDrafter", "EagleDrafter"]
