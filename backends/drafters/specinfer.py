"""``specinfer``: several drafters at once, merged into one token tree, verified in one forward.

SpecInfer (Miao et al.) verifies the guesses of several small speculators together: where they
agree the tree shares nodes, where they differ it branches, and the target keeps the longest path
it agrees with. Any drafters work; the useful pairs are complementary, e.g. a draft model (good
on free text) with prompt lookup (free, and right when the answer quotes).

Merging. Each sub-drafter proposes as if it were alone (its own controller picks its length);
the proposals are inserted into a trie in order. Two nodes merge when they have the same parent
and token and both are deterministic guesses (``q`` one-hot): a second one-hot copy of a token
the first copy did not get accepted for is rejected with certainty and leaves the residual
unchanged, so merging it loses nothing. A node sampled from a draft distribution is never merged
with another: multi-step speculative sampling needs every sampled candidate tried on its own (a
rejected sampled candidate still changes the residual), so it stays a separate sibling.

Feedback. Each sub-drafter sees the verdict projected onto its own proposal: the part of the
accepted path that runs through its nodes, and the tokens the step emitted (a draft model's cache
must follow the text, whoever guessed it). The verify time is folded into the shared cost model
once, with the merged tree's size, not once per sub-drafter.

Example: pld proposes ``the cat sat``, draft proposes ``the dog``: the tree is
``the -> (cat -> sat, dog)``; if the target says ``the dog ran``, pld's projection accepts 1 of 3
and draft's 2 of 2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from backends.core.costs import CostModel
from backends.core.protocols import Drafter
from backends.core.tree import tree_depths
from backends.core.types import TREE, Budget, Proposal, TargetOutput, Verdict

_MAX_DRAFTERS = 4


@dataclass(frozen=True)
class SpecInferSettings:
    drafters: str = "draft,pld"  # comma-separated methods whose proposals are merged
    rest_datastore: str = ""  # the datastore when the drafters include rest
    adaptive: bool = True  # passed on: False makes every drafter propose its full length

    def __post_init__(self) -> None:
        names = self.names
        if not 1 <= len(names) <= _MAX_DRAFTERS:
            raise ValueError(f"specinfer merges 1..{_MAX_DRAFTERS} drafters, got {len(names)} ({self.drafters!r})")
        if len(set(names)) != len(names):
            raise ValueError(f"specinfer drafters repeat a method: {self.drafters!r}")
        if any(n in ("specinfer", "ar") for n in names):
            raise ValueError("specinfer merges drafting methods (not ar or specinfer itself)")

    @property
    def names(self) -> list[str]:
        return [n.strip() for n in self.drafters.split(",") if n.strip()]


@dataclass(frozen=True)
class MergedTree:
    """The merged proposal and, per sub-proposal, where each of its nodes went."""

    proposal: Proposal
    maps: tuple[tuple[int, ...], ...]  # maps[k][local node] -> merged node


def merge(proposals: Sequence[Proposal]) -> MergedTree:
    """Insert every proposal into one trie (see the module docstring for what merges)."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[np.ndarray | None] = []
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> deterministic merged node
    maps = []
    for prop in proposals:
        local: list[int] = []
        for i, token in enumerate(prop.tokens):
            parent = -1 if prop.parents[i] < 0 else local[prop.parents[i]]
            q = prop.q(i)
            node = index.get((parent, token)) if q is None else None
            if node is None:
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                probs.append(q)
                if q is None:
                    index[(parent, token)] = node
            local.append(node)
        maps.append(tuple(local))
    has_q = any(q is not None for q in probs)
    merged = Proposal(tuple(tokens), tuple(parents), tuple(probs) if has_q else None)
    return MergedTree(merged, tuple(maps))


def project(verdict: Verdict, proposal: Proposal, mapping: Sequence[int]) -> Verdict:
    """The verdict as one sub-proposal sees it: its nodes on the accepted path, all emitted tokens."""
    owner = {merged: local for local, merged in enumerate(mapping)}
    path: list[int] = []
    for merged in verdict.path:
        local = owner.get(merged)
        if local is None or proposal.parents[local] != (path[-1] if path else -1):
            break
        path.append(local)
    depth = int(tree_depths(proposal.parents).max()) if proposal.size else 0
    return Verdict(path=tuple(path), tokens=verdict.tokens, drafted=proposal.size, draft_depth=depth)


class SpecInferDrafter:
    def __init__(self, drafters: Sequence[Drafter], *, costs: CostModel | None = None) -> None:
        self.drafters = list(drafters)
        self.requires = frozenset({TREE}).union(*(d.requires for d in self.drafters))
        self.costs = costs
        self._last: list[Proposal] = []
        self._maps: tuple[tuple[int, ...], ...] = ()
        self._context_len = 0

    def begin(self, prompt: Sequence[int]) -> None:
        for d in self.drafters:
            d.begin(prompt)

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        self._context_len = len(context)
        self._last = [d.propose(context, budget).pruned(budget) for d in self.drafters]
        tree = merge(self._last)
        self._maps = tree.maps
        n = min(tree.proposal.size, budget.max_nodes)  # a prefix keeps every kept node's index
        p = tree.proposal
        if n == p.size:
            return p
        return Proposal(p.tokens[:n], p.parents[:n], None if p.draft_probs is None else p.draft_probs[:n])

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        if self.costs is not None:
            self.costs.observe(verdict.drafted, self._context_len, out.seconds)
        quiet = replace(out, seconds=0.0)  # timed once above, with the merged size
        for drafter, prop, mapping in zip(self.drafters, self._last, self._maps):
            drafter.observe(quiet, project(verdict, prop, mapping))
