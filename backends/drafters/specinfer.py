"""``specinfer``: several drafters at once, merged into one token tree, verified in one forward.

SpecInfer (Miao et al.) verifies the guesses of several small speculators together: where they
agree the tree shares nodes, where they differ it branches, and the target keeps the longest path
it agrees with. Any drafters work; the useful pairs are complementary, e.g. a draft model (good
on free text) with prompt lookup (free, and right when the answer quotes). A draft model that
cannot pay on this machine even if every guess held is left out by the registry (see
``backends.drafters.draft_can_pay``); with one drafter left, specinfer runs it as if alone.

Merging. Each sub-drafter proposes as if it were alone (its own controller picks its length);
the proposals are inserted into a trie in order, and the merged tree is then cut to the nodes
worth verifying together (see ``SpecInferDrafter``). Two nodes merge when they have the same parent
and token and both are deterministic guesses (``q`` one-hot): a second one-hot copy of a token
the first copy did not get accepted for is rejected with certainty and leaves the residual
unchanged, so merging it loses nothing. A node sampled from a draft distribution is never merged
with another: multi-step speculative sampling needs every sampled candidate tried on its own (a
rejected sampled candidate still changes the residual), so it stays a separate sibling.

Feedback. Each sub-drafter sees the verdict projected onto its own proposal: the part of the
accepted path that runs through its nodes, and the tokens the step emitted (a draft model's cache
must follow the text, whoever guessed it). A sub-drafter that was not asked this step (a costly
one, while the free ones were confident) is told so with ``skipped``: it only follows the text,
since it has no proposal to learn from. The verify time is folded into the shared cost model
once, with the merged tree's size, not once per sub-drafter.

Example: pld proposes ``the cat sat``, draft proposes ``the dog``: the tree is
``the -> (cat -> sat, dog)``; if the target says ``the dog ran``, pld's projection accepts 1 of 3
and draft's 2 of 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from backends.core.planner import plan_nodes
from backends.core.costs import CostModel
from backends.core.protocols import Drafter, prompt_states_of
from backends.core.tree import tree_depths
from backends.core.types import EMPTY_PROPOSAL, TREE, Budget, Proposal, TargetOutput, Verdict
from backends.models.datastore import DATASTORE_FILE

_MAX_DRAFTERS = 4


@dataclass(frozen=True)
class SpecInferSettings:
    drafters: str = "draft,pld"  # comma-separated methods whose proposals are merged
    rest_datastore: str = field(default="", metadata=DATASTORE_FILE)  # the datastore when the drafters include rest
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
    """The verdict as one sub-proposal sees it: its nodes on the accepted path, all emitted tokens.

    ``mapping[i]`` is where local node ``i`` went in the verified tree, or -1 when the merged tree
    was pruned before it; ``drafted`` and ``draft_depth`` count only verified nodes, so a drafter
    never books a guess that was not checked as rejected.
    """
    if not any(m >= 0 for m in mapping):  # none of its nodes was verified
        return Verdict(path=(), tokens=verdict.tokens, drafted=0, draft_depth=0)
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
    return Verdict(path=tuple(path), tokens=verdict.tokens, drafted=len(kept), draft_depth=depth)


def select(tree: MergedTree, keep: Sequence[int]) -> MergedTree:
    """The merged tree cut down to ``keep`` (merged indices, parents included), maps updated."""
    keep = sorted(keep)
    new = {old: i for i, old in enumerate(keep)}
    proposal = tree.proposal.subset(keep)
    maps = tuple(tuple(new.get(m, -1) for m in mapping) for mapping in tree.maps)
    return MergedTree(proposal, maps)


class SpecInferDrafter(Drafter):
    """Merges the sub-drafters' proposals, then keeps the nodes worth verifying together.

    Each sub-drafter sized its proposal as if verified alone; together they cost more. So the
    merged tree, with each node's chance (see ``merge``), goes through the planner
    (``backends.core.planner``): the count of likeliest nodes that maximizes expected tokens per
    unit of measured verify cost, which is never worse than the better sub-proposal alone by the
    drafters' own estimates. There is no calibration here: each chance comes from a drafter that
    calibrates itself, also from the steps where it was not verified. When only
    one drafter proposed, its proposal goes to the target as it is: it was sized for exactly that,
    by the drafter's own controller, so specinfer then decodes as that drafter alone would.
    """

    CONFIDENT = 1.0  # expected accepted tokens from free drafters that make a model's draft unneeded

    def __init__(self, drafters: Sequence[Drafter], *, costs: CostModel | None = None, playing: str = "") -> None:
        """``playing``: which drafters run, when the registry left one out (shown in stats)."""
        self.playing = playing
        # Drafters are asked cheapest first (``ask_cost``: 0 for an n-gram lookup, more for a
        # datastore search, most for a draft model's forwards); once the free ones have a
        # confident guess the costlier ones are skipped, since their time is paid even when the
        # merged tree then leaves their nodes out.
        self.drafters = sorted(drafters, key=_ask_cost)
        self.requires = frozenset({TREE}).union(*(d.requires for d in self.drafters))
        self.prompt_states = prompt_states_of(self.drafters)
        self.costs = costs or CostModel.from_relative([1.0] * 65)
        self._last: list[Proposal] = []
        self._asked: list[bool] = []  # per sub-drafter: was it asked to propose this step?
        self._maps: tuple[tuple[int, ...], ...] = ()
        self._context_len = 0

    def begin(self, prompt: Sequence[int], hidden: np.ndarray | None = None) -> None:
        for d in self.drafters:
            d.begin(prompt, hidden)

    def propose(self, context: Sequence[int], budget: Budget) -> Proposal:
        if len(self.drafters) == 1:  # nothing to merge: it drafts, and learns, as if alone
            return self.drafters[0].propose(context, budget)
        self._context_len = len(context)
        self._last, self._asked = [], []
        confident = 0.0
        for drafter in self.drafters:
            asked = not (_ask_cost(drafter) > 0 and confident >= self.CONFIDENT)
            prop = drafter.propose(context, budget).pruned(budget) if asked else EMPTY_PROPOSAL
            self._asked.append(asked)
            self._last.append(prop)
            if prop.size and prop.chances is not None and _ask_cost(drafter) == 0:
                confident = max(confident, float(sum(prop.chances)))
        live = [prop for prop in self._last if prop.size]
        if len(live) <= 1:  # nobody drafts (the common case on a CPU), or one proposal, sized by its
            # drafter for being verified alone: nothing to merge or re-size
            self._maps = tuple(tuple(range(prop.size)) for prop in self._last)
            return live[0] if live else EMPTY_PROPOSAL
        tree = merge(self._last)
        chosen = select(tree, plan_nodes(tree.proposal, self.costs.relative(len(context)), budget))
        self._maps = chosen.maps
        return chosen.proposal

    def observe(self, out: TargetOutput, verdict: Verdict) -> None:
        if len(self.drafters) == 1:
            self.drafters[0].observe(out, verdict)  # it times the verify itself
            return
        self.costs.observe(verdict.drafted, self._context_len, out.seconds)
        quiet = replace(out, seconds=0.0)  # timed once above, with the merged size
        for drafter, prop, mapping, asked in zip(self.drafters, self._last, self._maps, self._asked):
            if asked:
                drafter.observe(quiet, project(verdict, prop, mapping))
            else:
                drafter.skipped(verdict.tokens)

    def skipped(self, tokens: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.skipped(tokens)


def _ask_cost(drafter: Drafter) -> int:
    """How dear a proposal is to make: 0 free, 1 a search, 2 model forwards."""
    return drafter.ask_cost
