"""Lookahead decoding: the n-gram pool, the shape bandit, exact greedy output on the oracle,
bad settings, and a real model."""

from __future__ import annotations

import numpy as np
import pytest

from backends.core.costs import CostModel
from backends.core.types import GenerationSettings
from backends.drafters.lookahead import LookaheadDrafter, LookaheadSettings, NgramPool, ShapeBandit, default_shapes
from tests.oracle import OracleTarget
from tests.test_engine import COSTS, drafted_matching_plain_greedy, run


def test_pool_keeps_the_newest_continuations_per_token():
    pool = NgramPool(3, per_token=2)
    pool.add_text([1, 2, 3, 1, 4, 5, 1, 2, 3, 1, 6, 7], 0)
    assert pool.candidates(1, 5) == [(6, 7), (2, 3)]  # (4, 5) was pushed out; (2, 3) refreshed
    assert pool.candidates(9, 5) == []


def test_bandit_settles_on_the_fastest_shape_and_never_on_a_losing_one():
    bandit = ShapeBandit([(4, 0), (0, 3)], min_tries=2, explore_share=0)
    outcome = {(4, 0): (1.2, 2.0), (0, 3): (2.5, 1.5)}  # tokens, relative cost per step
    for _ in range(40):
        shape = bandit.choose()
        if shape != (0, 0):
            bandit.update(shape, *outcome[shape])
    assert bandit.settled() == (0, 3) and bandit.speed((0, 3)) == pytest.approx(2.5 / 1.5)
    slow = ShapeBandit([(4, 3)], min_tries=2, explore_share=0)
    for _ in range(20):
        shape = slow.choose()
        if shape != (0, 0):
            slow.update(shape, 1.3, 2.4)  # wide verification on a CPU: more tokens, far more cost
    assert slow.settled() == (0, 0)  # plain decoding


def test_default_shapes_cover_window_and_pool_alone_and_together():
    assert default_shapes(LookaheadSettings(window=4, guesses=3)) == [(0, 3), (2, 0), (2, 3), (4, 0), (4, 3)]


@pytest.mark.parametrize("settings", [LookaheadSettings(adaptive=False), LookaheadSettings(window=7, ngram=4, guesses=2),
                                      LookaheadSettings(window=0, guesses=4, adaptive=False),
                                      LookaheadSettings(window=5, guesses=0, adaptive=False)],
                         ids=["fixed", "adaptive-w7n4g2", "pool-only", "window-only"])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_lookahead_output_equals_plain_greedy(settings, penalty):
    def make(oracle, seed, sampling):
        return LookaheadDrafter(settings, costs=COSTS)

    assert drafted_matching_plain_greedy(make, method="lookahead", penalty=penalty) > 0


def test_pool_and_jacobi_trajectories_draft_accepted_tokens():
    oracle = OracleTarget(32, seed=4)
    prompt = list(range(20)) * 2
    gen = GenerationSettings(max_new_tokens=64)
    both = LookaheadDrafter(LookaheadSettings(window=6, guesses=3, adaptive=False), costs=COSTS)
    stats = run(oracle, both, prompt, gen).stats
    assert stats.tau > 1.2  # the prompt's n-grams are in the pool: repeats are drafted
    text_only = LookaheadDrafter(LookaheadSettings(window=0, guesses=3, adaptive=False), costs=COSTS)
    run(OracleTarget(32, seed=4), text_only, prompt, gen)
    assert len(both._pool) > len(text_only._pool)  # Jacobi trajectories added n-grams of their own


def test_on_expensive_verification_the_bandit_falls_back_to_plain_decoding():
    cpu_like = CostModel.from_relative([1.0] + [1.0 + 0.6 * k for k in range(1, 17)])
    oracle = OracleTarget(32, seed=2)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 32, size=30).tolist()
    drafter = LookaheadDrafter(LookaheadSettings(), costs=cpu_like)
    run(oracle, drafter, prompt, GenerationSettings(max_new_tokens=200))
    assert drafter.bandit.settled() == (0, 0)


@pytest.mark.parametrize("bad", [dict(window=17), dict(ngram=1), dict(ngram=9), dict(guesses=-1),
                                 dict(window=0, guesses=0), dict(pool_per_token=0)])
def test_out_of_range_settings_are_refused(bad):
    with pytest.raises(ValueError):
        LookaheadSettings(**bad)


def test_real_model_lookahead_matches_plain_greedy(smollm_session):
    from tests.test_real_models import check_method_matches_ar

    check_method_matches_ar(smollm_session, "lookahead", {"adaptive": False})
