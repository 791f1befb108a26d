"""Tier 2a: the engine with every method on the exact oracle model.

The oracle's logits do not depend on batching, so any speculative method must reproduce plain
greedy decoding token for token: chains, trees, with and without a repetition penalty, for many
seeds. Plain greedy here is a hand-written loop over the oracle, independent of the engine.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from backends.core.costs import CostModel
from backends.core.engine import generate
from backends.core.errors import PromptTooLongError
from backends.core.sampling import greedy_token
from backends.core.protocols import Drafter
from backends.core.types import Budget, Finished, GenerationSettings, Prefilled, Proposal, SamplingSettings, Step
from backends.drafters.ar import ARDrafter
from backends.drafters.draft_model import DraftModelDrafter, DraftSettings
from backends.drafters.pld import PLDDrafter, PLDSettings
from tests.oracle import OracleTarget

COSTS = CostModel.from_relative([1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4])  # GPU-like, nearly flat
CHEAP_DRAFT = CostModel.from_relative([0.1] * 9)  # a draft forward costs a tenth of a target forward


def plain_greedy(oracle: OracleTarget, prompt: list[int], n: int, sampling: SamplingSettings) -> list[int]:
    ctx = list(prompt)
    out = []
    for _ in range(n):
        tok = greedy_token(oracle.logits_for(ctx), ctx, sampling)
        out.append(tok)
        ctx.append(tok)
        if tok in oracle.eog_ids:
            break
    return out


def run(target, drafter, prompt, settings, **kw) -> Finished:
    events = list(generate(target, drafter, prompt, settings, **kw))
    assert isinstance(events[0], Prefilled) and isinstance(events[-1], Finished)
    return events[-1]


def drafted_matching_plain_greedy(make_drafter, *, method: str, penalty: float, seeds=range(10),
                                  longest_prompt: int = 40) -> int:
    """Run ``make_drafter(oracle, seed, sampling)`` on the oracle for each seed and assert the
    output equals plain greedy decoding with one target forward per step; returns how many
    tokens were drafted in all (so a caller can check that speculation happened)."""
    sampling = SamplingSettings(repeat_penalty=penalty)
    settings = GenerationSettings(max_new_tokens=48, sampling=sampling)
    drafted = 0
    for seed in seeds:
        oracle = OracleTarget(32, seed=seed)
        rng = np.random.default_rng(seed)
        prompt = rng.integers(0, 32, size=int(rng.integers(3, longest_prompt))).tolist()
        expected = plain_greedy(oracle, prompt, 48, sampling)
        finished = run(oracle, make_drafter(oracle, seed, sampling), prompt, settings, method=method)
        assert list(finished.tokens) == expected, f"{method} diverged for seed {seed}"
        assert finished.stats.forwards == oracle.verify_calls
        drafted += finished.stats.drafted
    return drafted


class OracleTreeDrafter(Drafter):
    """Random token trees that contain the true continuation only sometimes (tests tree commits)."""

    requires = frozenset()

    def __init__(self, oracle: OracleTarget, seed: int, sampling: SamplingSettings) -> None:
        self.oracle, self.rng, self.sampling = oracle, np.random.default_rng(seed), sampling

    def begin(self, prompt, hidden=None):
        pass

    def propose(self, context, budget: Budget) -> Proposal:
        tokens, parents = [], []
        frontier = [(-1, list(context))]
        while frontier and len(tokens) < min(budget.max_nodes, 12):
            parent, ctx = frontier.pop(0)
            depth = 0 if parent < 0 else len(ctx) - len(context)
            if depth >= budget.max_depth:
                continue
            truth = greedy_token(self.oracle.logits_for(ctx), ctx, self.sampling)
            width = int(self.rng.integers(1, 4))
            choices = {int(self.rng.integers(self.oracle.n_vocab)) for _ in range(width)}
            if self.rng.random() < 0.7:
                choices.add(truth)
            for tok in sorted(choices, key=lambda _: self.rng.random()):
                if len(tokens) >= min(budget.max_nodes, 12):
                    break
                tokens.append(tok)
                parents.append(parent)
                frontier.append((len(tokens) - 1, ctx + [tok]))
        return Proposal(tuple(tokens), tuple(parents))

    def observe(self, out, verdict):
        pass


def drafters_for(oracle: OracleTarget, seed: int, sampling: SamplingSettings):
    draft_oracle = OracleTarget(oracle.n_vocab, seed=seed, perturb=1.5, perturb_seed=seed + 100, n_ctx=oracle.n_ctx)
    return {
        "ar": ARDrafter(),
        "pld": PLDDrafter(PLDSettings(), costs=COSTS),
        "draft-chain": DraftModelDrafter(draft_oracle, DraftSettings(min_confidence=0.2), sampling=sampling,
                                         target_vocab=oracle.n_vocab, costs=COSTS,
                                         draft_costs=CHEAP_DRAFT),
        "draft-tree": DraftModelDrafter(draft_oracle, DraftSettings(tree_width=3, min_confidence=0.2), sampling=sampling,
                                        target_vocab=oracle.n_vocab, costs=COSTS,
                                         draft_costs=CHEAP_DRAFT),
        "random-tree": OracleTreeDrafter(oracle, seed, sampling),
    }


METHODS = ["ar", "pld", "draft-chain", "draft-tree", "random-tree"]


@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_equals_plain_greedy(method, penalty):
    sampling = SamplingSettings(repeat_penalty=penalty)
    settings = GenerationSettings(max_new_tokens=48, sampling=sampling)
    for seed in range(12):
        oracle = OracleTarget(32, seed=seed)
        rng = np.random.default_rng(seed)
        prompt = [int(t) for t in rng.integers(0, 32, size=int(rng.integers(3, 40)))]
        expected = plain_greedy(oracle, prompt, 48, sampling)
        drafter = drafters_for(oracle, seed, sampling)[method]
        finished = run(oracle, drafter, prompt, settings, method=method)
        assert list(finished.tokens) == expected, f"{method} diverged for seed {seed}"
        assert finished.stats.forwards == oracle.verify_calls  # one target forward per step
        assert finished.stats.new_tokens == len(expected)


def test_speculation_actually_happens_on_the_oracle():
    oracle = OracleTarget(32, seed=4)
    prompt = list(range(20)) * 2
    sampling = SamplingSettings()
    stats = {}
    for method in ("ar", "pld", "draft-chain", "draft-tree"):
        oracle.verify_calls = 0
        drafter = drafters_for(oracle, 4, sampling)[method]
        stats[method] = run(oracle, drafter, prompt, GenerationSettings(max_new_tokens=64)).stats
    assert stats["ar"].tau == 1.0 and stats["ar"].drafted == 0
    for method in ("pld", "draft-chain", "draft-tree"):
        assert stats[method].tau > 1.2, method
        assert stats[method].forwards < stats["ar"].forwards
        assert 0 < stats[method].acceptance_rate <= 1
        accepted_at = stats[method].accepted_at  # position d is accepted only if d - 1 was
        assert all(a >= b for a, b in zip(accepted_at, accepted_at[1:]))


@pytest.mark.parametrize("method", ["ar", "pld", "draft-chain", "draft-tree"])
def test_sampling_with_a_fixed_seed_is_reproducible(method):
    sampling = SamplingSettings(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, seed=1234)
    settings = GenerationSettings(max_new_tokens=40, sampling=sampling)
    outputs = []
    for _ in range(2):
        oracle = OracleTarget(32, seed=7)
        outputs.append(run(oracle, drafters_for(oracle, 7, sampling)[method], [1, 2, 3, 4, 5], settings).tokens)
    assert outputs[0] == outputs[1]
    other = SamplingSettings(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, seed=99)
    oracle = OracleTarget(32, seed=7)
    different = run(oracle, drafters_for(oracle, 7, other)[method], [1, 2, 3, 4, 5],
                    GenerationSettings(max_new_tokens=40, sampling=other)).tokens
    assert different != outputs[0]


def test_stops_at_eos_and_keeps_it():
    for seed in (0, 1, 5):
        oracle = OracleTarget(32, seed=seed, eos=5, eos_bias=1.0)
        expected = plain_greedy(oracle, [1, 2, 3], 400, SamplingSettings())
        assert expected[-1] == 5, "this seed should reach EOS"
        finished = run(oracle, PLDDrafter(costs=COSTS), [1, 2, 3], GenerationSettings(max_new_tokens=400))
        assert finished.reason == "eos" and list(finished.tokens) == expected


def test_stops_at_max_new_tokens_exactly():
    oracle = OracleTarget(32, seed=2)
    for n in (1, 2, 7):
        finished = run(oracle, PLDDrafter(costs=COSTS), list(range(10)) * 3, GenerationSettings(max_new_tokens=n))
        assert finished.reason == "length" and len(finished.tokens) == n


def test_stop_string_cuts_text():
    oracle = OracleTarget(32, seed=2)
    full = run(oracle, ARDrafter(), [1, 2, 3], GenerationSettings(max_new_tokens=30))
    stop = full.text[12:20]
    cut = run(oracle, ARDrafter(), [1, 2, 3], GenerationSettings(max_new_tokens=30, stop=(stop,)))
    assert cut.reason == "stop" and cut.text == full.text[: full.text.index(stop)]


def test_context_full_stops_without_overflow():
    oracle = OracleTarget(32, seed=3, n_ctx=40)
    finished = run(oracle, PLDDrafter(costs=COSTS), list(range(10)) * 3, GenerationSettings(max_new_tokens=100))
    assert finished.reason == "context_full"
    assert 30 + len(finished.tokens) == 41  # the last token is emitted but never needs a KV slot


def test_cancel_returns_within_one_step():
    oracle = OracleTarget(32, seed=3)
    cancel = threading.Event()
    steps = 0
    for event in generate(oracle, ARDrafter(), [1, 2, 3], GenerationSettings(max_new_tokens=100), cancel=cancel):
        if isinstance(event, Step):
            steps += 1
            cancel.set()
        if isinstance(event, Finished):
            assert event.reason == "cancelled"
    assert steps == 1


def test_prompt_longer_than_context_is_refused_before_any_work():
    oracle = OracleTarget(32, n_ctx=16)
    with pytest.raises(PromptTooLongError, match="context holds 16"):
        next(generate(oracle, ARDrafter(), list(range(20)), GenerationSettings()))
    assert oracle.verify_calls == 0
    with pytest.raises(PromptTooLongError, match="empty"):
        next(generate(oracle, ARDrafter(), [], GenerationSettings()))


def test_stats_are_consistent():
    oracle = OracleTarget(32, seed=4)
    stats = run(oracle, PLDDrafter(costs=COSTS), list(range(20)) * 2, GenerationSettings(max_new_tokens=64)).stats
    assert stats.new_tokens == 64 and stats.prompt_tokens == 40
    assert stats.tau == pytest.approx(64 / stats.forwards)
    assert stats.accepted == sum(stats.accepted_at)
    assert stats.ttft_s > 0 and stats.decode_s > 0 and stats.decode_tok_s > 0
    assert stats.verify_s > 0 and stats.draft_s > 0 and stats.accept_s > 0
    d = stats.to_dict()
    assert d["tau"] == stats.tau and d["acceptance_rate"] == stats.acceptance_rate


def test_draft_model_prices_its_catch_up_as_a_one_off():
    """After a stretch without drafting the draft must first decode the backlog: a prefill, not a
    single token, but paid once, and the steps after it only catch up on a token or two. Spread
    over the steps it enables it pays; an answer about to end cannot pay it back."""
    linear = CostModel.from_relative([0.1 * (k + 1) for k in range(9)])  # each caught-up token costs 0.1
    drafter = DraftModelDrafter(OracleTarget(32, seed=1), DraftSettings(), sampling=SamplingSettings(),
                                target_vocab=32, costs=COSTS, draft_costs=linear)
    drafter.begin([1, 2, 3])
    assert drafter._choose_length(8, context=3) > 0
    drafter._pending = list(range(30))  # 30 tokens the draft has not seen: 3 forwards to catch up
    assert drafter._choose_length(8, context=33, steps_left=1) == 0
    assert drafter._choose_length(8, context=33, steps_left=64) > 0


def test_a_draft_that_cannot_pay_stops_being_asked():
    """A draft model as slow as its target never pays: its gate stops it after 16 trials that lost
    to plain decoding and re-checks it only within its exploration share (asking the sizer
    costs 1% of a forward), with no skip flag of its own."""
    asked = []
    drafter = DraftModelDrafter(OracleTarget(32, seed=1), DraftSettings(), sampling=SamplingSettings(),
                                target_vocab=32, costs=COSTS, draft_costs=COSTS)
    plan = drafter.sizer.plan
    drafter.sizer.plan = lambda *a, **kw: asked.append(1) or plan(*a, **kw)
    stats = run(OracleTarget(32, seed=0), drafter, [1, 2, 3], GenerationSettings(max_new_tokens=300)).stats
    assert stats.drafted == 0 and 16 <= len(asked) <= 24, len(asked)
