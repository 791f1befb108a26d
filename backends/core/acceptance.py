"""Acceptance rules: pure functions of the target's logits, the proposal and a random source.

- ``accept_greedy``: walk down the tree while a child carries the target's greedy token.
  Output identical to plain greedy decoding, by construction.
- ``accept_stochastic``: SpecInfer's multi-step speculative sampling over a tree. At a node with
  target distribution ``p`` the children are tried in order; child ``x`` drawn from ``q`` is
  accepted with probability ``min(1, p(x) / q(x))``; after a rejection ``p`` becomes the residual
  ``norm(max(0, p - q))`` and the next child is tried against it. When no child is accepted the
  bonus token is drawn from the last residual. Each candidate reproduces the current residual
  exactly (P(out = x) = min(p, q)(x) + (1 - sum min(p, q)) * residual(x) = p(x)), so the emitted
  tokens follow the target distribution. A chain is the one-child case: Leviathan et al.'s
  rejection sampling, with a bonus token from ``p`` when every draft is accepted. A
  deterministic draft (``q`` one-hot) is accepted with probability ``p(x)`` and rejected into
  ``p`` with ``x`` removed, which covers top-k siblings and lookup drafts.

Worked example (chain, greedy): logits argmax per row ``[5, 7, 9]`` for root, node 0, node 1 and
proposal tokens ``[5, 8]``: node 0 (token 5) is accepted, node 1 (token 8) is not the target's 7,
so the verdict is path ``(0,)`` and tokens ``(5, 7)``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from backends.core.sampling import greedy_token, sample_token, target_distribution
from backends.core.tree import compile_tree
from backends.core.types import Proposal, SamplingSettings, TargetOutput, Verdict


def _path_history(history: Sequence[int], proposal: Proposal, path: Sequence[int], last_n: int) -> list[int]:
    """The tokens a position on ``path`` would have seen (only the penalty window matters)."""
    return list(history[-last_n:]) + [proposal.tokens[i] for i in path] if last_n else []


def _verdict(proposal: Proposal, path: list[int], bonus: int, depth: int) -> Verdict:
    tokens = tuple(proposal.tokens[i] for i in path) + (bonus,)
    return Verdict(path=tuple(path), tokens=tokens, drafted=proposal.size, draft_depth=depth)


def _chain_greedy(out: TargetOutput, proposal: Proposal) -> Verdict:
    """Fast path: a chain without penalties needs one argmax per row it reaches (the root's and
    each accepted node's), read from the target's buffer without copying it."""
    n = 0
    while True:
        want = out.top(n)
        if n == proposal.size or proposal.tokens[n] != want:
            return _verdict(proposal, list(range(n)), want, proposal.size)
        n += 1


def accept_greedy(
    out: TargetOutput, proposal: Proposal, *, settings: SamplingSettings, history: Sequence[int]
) -> Verdict:
    """Keep the longest path whose every token is the target's greedy choice."""
    if proposal.is_chain and not settings.penalized:
        return _chain_greedy(out, proposal)
    tree = compile_tree(proposal.parents)
    depth = int(tree.depths.max()) if proposal.size else 0
    last_n = settings.repeat_last_n if settings.penalized else 0
    path: list[int] = []
    node = -1
    while True:
        if last_n:
            want = greedy_token(out.row(node + 1), _path_history(history, proposal, path, last_n), settings)
        else:
            want = out.top(node + 1)
        child = next((c for c in tree.children_of(node) if proposal.tokens[c] == want), None)
        if child is None:
            return _verdict(proposal, path, want, depth)
        path.append(child)
        node = child


def try_candidates(
    p: np.ndarray, candidates: Sequence[tuple[int, np.ndarray | None]], rng: np.random.Generator
) -> tuple[int | None, np.ndarray]:
    """One node of multi-step speculative sampling.

    ``candidates`` are ``(token, q)`` pairs in the order they are tried (``q is None``: one-hot).
    Returns the index of the accepted candidate (or ``None``) and the distribution the bonus
    token must come from when none is accepted (the last residual).
    """
    for index, (token, q) in enumerate(candidates):
        q_x = 1.0 if q is None else float(q[token])
        if q_x > 0.0 and rng.random() * q_x < p[token]:
            return index, p
        if q is None:
            residual = p.copy()
            residual[token] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        if total <= 0.0:  # p <= q everywhere means p == q: acceptance was certain barring rounding
            return None, p
        p = residual / total
    return None, p


def accept_stochastic(
    out: TargetOutput,
    proposal: Proposal,
    *,
    settings: SamplingSettings,
    history: Sequence[int],
    rng: np.random.Generator,
) -> Verdict:
    """Lossless acceptance for sampling (see the module docstring); chains and trees alike."""
    tree = compile_tree(proposal.parents)
    depth = int(tree.depths.max()) if proposal.size else 0
    last_n = settings.repeat_last_n if settings.penalized else 0
    path: list[int] = []
    node = -1
    while True:
        p = target_distribution(out.row(node + 1), _path_history(history, proposal, path, last_n), settings)
        children = tree.children_of(node)
        picked, residual = try_candidates(p, [(proposal.tokens[c], proposal.q(c)) for c in children], rng)
        if picked is None:
            return _verdict(proposal, path, sample_token(residual, rng), depth)
        node = children[picked]
        path.append(node)


def accept(
    out: TargetOutput,
    proposal: Proposal,
    *,
    settings: SamplingSettings,
    history: Sequence[int],
    rng: np.random.Generator,
) -> Verdict:
    """The rule plain decoding with these settings calls for: greedy at temperature 0."""
    if settings.greedy:
        return accept_greedy(out, proposal, settings=settings, history=history)
    return accept_stochastic(out, proposal, settings=settings, history=history, rng=rng)
