"""Several proposals as one token tree, and the verdict on it as each proposal sees it.

``merge`` inserts the proposals into one trie in order (``specinfer``'s, then cut by the
planner to the nodes worth verifying together). Two nodes merge when they have the same parent
and token and both are deterministic guesses (``q`` one-hot): a second one-hot copy of a token
the first copy did not get accepted for is rejected with certainty and leaves the residual
unchanged, so merging it loses nothing. A node sampled from a draft distribution is never merged
with another: multi-step speculative sampling needs every sampled candidate tried on its own (a
rejected sampled candidate still changes the residual), so it stays a separate sibling.

Example: ``the cat sat`` and ``the dog`` merge into ``the -> (cat -> sat, dog)``; if the target
says ``the dog ran``, ``project`` gives the first proposal 1 of 3 accepted and the second 2 of 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from backends.core.tree import tree_depths
from backends.core.types import Proposal, Verdict


@dataclass(frozen=True)
class MergedTree:
    """The merged proposal and, per sub-proposal, where each of its nodes went."""

    proposal: Proposal
    maps: tuple[tuple[int, ...], ...]  # maps[k][local node] -> merged node


def merge(proposals: Sequence[Proposal]) -> MergedTree:
    """Insert every proposal into one trie (see the module docstring for what merges). A merged
    node's chance is the highest among the proposals that hold it; a child is never rated above
    its parent, since whoever proposed the child proposed the parent too."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[np.ndarray | None] = []
    chances: list[float] = []
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> deterministic merged node
    maps = []
    for prop in proposals:
        local: list[int] = []
        for i, (token, chance) in enumerate(zip(prop.tokens, chances_of(prop))):
            parent = -1 if prop.parents[i] < 0 else local[prop.parents[i]]
            q = prop.q(i)
            node = index.get((parent, token)) if q is None else None
            if node is None:
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                probs.append(q)
                chances.append(chance)
                if q is None:
                    index[(parent, token)] = node
            chances[node] = max(chances[node], chance)
            local.append(node)
        maps.append(tuple(local))
    has_q = any(q is not None for q in probs)
    merged = Proposal(tuple(tokens), tuple(parents), tuple(probs) if has_q else None, tuple(chances))
    return MergedTree(merged, tuple(maps))


def chances_of(proposal: Proposal) -> tuple[float, ...]:
    """The proposal's own chances, or 0.5 per level for a drafter that gives none."""
    if proposal.chances is not None:
        return proposal.chances
    return tuple(0.5 ** int(d) for d in tree_depths(proposal.parents)) if proposal.size else ()


def project(verdict: Verdict, proposal: Proposal, mapping: Sequence[int]) -> Verdict:
    """The verdict as one sub-proposal sees it: its nodes on the accepted path, all emitted tokens
    and the rows of their states (``Verdict.state_rows``), and where its nodes' rows went
    (``Verdict.row_of``).

    ``mapping[i]`` is where local node ``i`` went in the verified tree, or -1 when the merged tree
    was pruned before it; ``drafted`` and ``draft_depth`` count only verified nodes, so a drafter
    never books a guess that was not checked as rejected.
    """
    if not any(m >= 0 for m in mapping):  # none of its nodes was verified
        return Verdict(path=(), tokens=verdict.tokens, drafted=0, draft_depth=0, merged_path_rows=verdict.state_rows,
                       merged_node_rows=(-1,) * len(mapping))
    owner = {merged: local for local, merged in enumerate(mapping) if merged >= 0}
    path: list[int] = []
    for merged in verdict.path:
        local = owner.get(merged)
        if local is None or proposal.parents[local] != (path[-1] if path else -1):
            break
        path.append(local)
    kept = [local for local, merged in enumerate(mapping) if merged >= 0]
    depths = tree_depths(proposal.parents) if proposal.size else np.zeros(0, dtype=np.int32)
    depth = int(max((depths[i] for i in kept), default=0))
    return Verdict(path=tuple(path), tokens=verdict.tokens, drafted=len(kept), draft_depth=depth,
                   merged_path_rows=verdict.state_rows,
                   merged_node_rows=tuple(verdict.row_of(m) if m >= 0 else -1 for m in mapping))


def select(tree: MergedTree, keep: Sequence[int]) -> MergedTree:
    """The merged tree cut down to ``keep`` (merged indices, parents included), maps updated."""
    keep = sorted(keep)
    new = {old: i for i, old in enumerate(keep)}
    proposal = tree.proposal.subset(keep)
    maps = tuple(tuple(new.get(m, -1) for m in mapping) for mapping in tree.maps)
    return MergedTree(proposal, maps)
