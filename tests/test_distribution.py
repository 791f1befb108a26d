"""Tier 1: lossless sampling, checked statistically on a 10-token vocabulary.

A two-token "language" has a target distribution p0 for the first token and p1(. | x0) for the
second; the draft has its own q0 and q1. Each trial drafts (a chain, or a tree of several
candidates), runs the acceptance rule once, and if that step emitted only one token draws the
second from p1 the way the next plain-decoding step would. The empirical joint distribution of
(x0, x1) must converge to p0(x0) p1(x1 | x0): its distance to the target shrinks as samples grow
and stays far below the distance between the target and random distributions.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.core.acceptance import accept_stochastic
from backends.core.sampling import sample_token
from backends.core.types import Proposal, SamplingSettings, TargetOutput

V = 10
PLAIN = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def random_dist(rng: np.random.Generator, sharp: float = 1.5) -> np.ndarray:
    x = np.exp(rng.normal(size=V) * sharp)
    return x / x.sum()


class TwoTokenWorld:
    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.p0 = random_dist(rng)
        self.p1 = np.stack([random_dist(rng) for _ in range(V)])
        self.q0 = 0.5 * self.p0 + 0.5 * random_dist(rng)  # a decent but imperfect draft
        self.q1 = np.stack([0.5 * self.p1[i] + 0.5 * random_dist(rng) for i in range(V)])
        self.joint = self.p0[:, None] * self.p1

    def logits(self, rows: list[np.ndarray]) -> TargetOutput:
        return TargetOutput(np.log(np.stack(rows)).astype(np.float32))


def chain_trial(world: TwoTokenWorld, rng: np.random.Generator) -> tuple[int, int]:
    d0 = sample_token(world.q0, rng)
    d1 = sample_token(world.q1[d0], rng)
    out = world.logits([world.p0, world.p1[d0], np.full(V, 1.0 / V)])
    proposal = Proposal.chain([d0, d1], [world.q0, world.q1[d0]])
    tokens = accept_stochastic(out, proposal, settings=PLAIN, history=[0], rng=rng).tokens
    return tokens[0], tokens[1] if len(tokens) > 1 else sample_token(world.p1[tokens[0]], rng)


def tree_trial(world: TwoTokenWorld, rng: np.random.Generator) -> tuple[int, int]:
    """Two i.i.d. drafts from q0 plus the deterministic top-1 of q0, each with a drafted child."""
    a = sample_token(world.q0, rng)
    b = sample_token(world.q0, rng)
    top = int(np.argmax(world.q0))
    firsts = [(a, world.q0), (b, world.q0), (top, None)]
    tokens, parents, probs, rows = [], [], [], [world.p0]
    for tok, q in firsts:
        tokens.append(tok)
        parents.append(-1)
        probs.append(q)
        rows.append(world.p1[tok])
    for i, (tok, _) in enumerate(firsts):
        child = sample_token(world.q1[tok], rng)
        tokens.append(child)
        parents.append(i)
        probs.append(world.q1[tok])
        rows.append(np.full(V, 1.0 / V))
    proposal = Proposal(tuple(tokens), tuple(parents), tuple(probs))
    out = world.logits(rows)
    emitted = accept_stochastic(out, proposal, settings=PLAIN, history=[0], rng=rng).tokens
    return emitted[0], emitted[1] if len(emitted) > 1 else sample_token(world.p1[emitted[0]], rng)


def empirical_tv(trial, world: TwoTokenWorld, n: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for _ in range(n):
        x0, x1 = trial(world, rng)
        counts[x0, x1] += 1
    return 0.5 * np.abs(counts / n - world.joint).sum()


@pytest.mark.parametrize("trial", [chain_trial, tree_trial], ids=["chain", "tree"])
def test_speculative_sampling_reproduces_target_distribution(trial):
    world = TwoTokenWorld(seed=3)
    rng = np.random.default_rng(99)
    random_tv = min(
        0.5 * np.abs((random_dist(rng)[:, None] * np.stack([random_dist(rng) for _ in range(V)])) - world.joint).sum()
        for _ in range(20)
    )
    tv_small = empirical_tv(trial, world, 2_000, seed=1)
    tv_large = empirical_tv(trial, world, 100_000 if trial is chain_trial else 40_000, seed=2)
    assert tv_large < tv_small
    assert tv_large < 0.03  # sampling noise for 100 cells at this n is ~0.01-0.02
    assert tv_large < random_tv / 10


def test_draft_distribution_alone_is_detectably_wrong():
    """Sanity check of the test's power: emitting the draft's own tokens would fail it."""
    world = TwoTokenWorld(seed=3)
    rng = np.random.default_rng(5)
    counts = np.zeros((V, V))
    n = 40_000
    for _ in range(n):
        d0 = sample_token(world.q0, rng)
        counts[d0, sample_token(world.q1[d0], rng)] += 1
    assert 0.5 * np.abs(counts / n - world.joint).sum() > 0.1
