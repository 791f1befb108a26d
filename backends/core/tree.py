"""Token trees: the one shape every proposal has.

A proposal hangs under the *root* (the last emitted token, see ``backends.core``). Node ``i``
has parent ``parents[i]``; ``-1`` means the root. Parents always come before their children
(``parents[i] < i``), so a prefix of the node list is itself a valid tree.

Worked example: ``parents = [-1, 0, 0, 1]`` is

    root ── 0 ── 1 ── 3
             └── 2

depths ``[1, 2, 2, 3]``, root-to-leaf paths ``(0, 2)`` and ``(0, 1, 3)`` (leaves in index order), and node 3 sees
nodes 0, 1 and itself (plus the root and everything before it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class CompiledTree:
    """Everything a backend or an acceptance rule needs to know about a tree's shape."""

    depths: np.ndarray  # [n] int32, 1 for children of the root
    mask: np.ndarray  # [n, n] bool, mask[i, j]: node i attends to node j (ancestor or self)
    paths: tuple[tuple[int, ...], ...]  # one root-to-leaf node list per leaf, in leaf order
    children: tuple[tuple[int, ...], ...]  # children of node i, in index order
    root_children: tuple[int, ...]

    @property
    def n_nodes(self) -> int:
        return len(self.depths)

    def children_of(self, node: int) -> tuple[int, ...]:
        """Children of ``node``; ``-1`` is the root."""
        return self.root_children if node < 0 else self.children[node]


def validate_parents(parents: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``parents`` is a topologically ordered tree."""
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}; parents must satisfy -1 <= parent < index")


def tree_depths(parents: Sequence[int]) -> np.ndarray:
    """Depth of every node (1 for children of the root). [n] int32."""
    return np.array(depth_list(parents), dtype=np.int32)


def depth_list(parents: Sequence[int]) -> list[int]:
    """``tree_depths`` as a list: per-step code on a handful of nodes, where numpy's per-call
    overhead (a microsecond per operation or element) would cost more than the arithmetic."""
    depths: list[int] = []
    for parent in parents.tolist() if isinstance(parents, np.ndarray) else parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def compile_tree(parents: Sequence[int]) -> CompiledTree:
    """Attention mask, depths (positions relative to the root) and root-to-leaf paths."""
    validate_parents(parents)
    n = len(parents)
    depths = tree_depths(parents)
    mask = np.zeros((n, n), dtype=bool)
    children: list[list[int]] = [[] for _ in range(n)]
    root_children: list[int] = []
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] = mask[parent]
            children[parent].append(i)
        else:
            root_children.append(i)
        mask[i, i] = True
    paths = tuple(tuple(int(j) for j in np.flatnonzero(mask[i])) for i in range(n) if not children[i])
    return CompiledTree(
        depths=depths,
        mask=mask,
        paths=paths,
        children=tuple(tuple(c) for c in children),
        root_children=tuple(root_children),
    )


def is_chain(parents: Sequence[int]) -> bool:
    """True when every node hangs under the previous one: ``[-1, 0, 1, ...]``."""
    return all(parent == i - 1 for i, parent in enumerate(parents))


def fit_paths(parents: Sequence[int], max_paths: int, *, order: Sequence[int] | None = None,
              allowed: Sequence[bool] | None = None) -> list[int]:
    """The nodes to keep so that the tree has at most ``max_paths`` root-to-leaf paths.

    Nodes are visited in ``order`` (index order by default; parents must come before their
    children in it), skipping those not ``allowed`` and those whose parent was left out. A node
    opens a new path unless its parent is kept and still a leaf; once ``max_paths`` paths are
    open such a node is left out with its subtree, while nodes that extend a path are still kept.
    Returns the kept nodes in the order visited.

    Example: ``parents = [-1, -1, 0, 0, 2]``, ``max_paths=2``: node 0 opens a path, node 1 a
    second, node 2 extends node 0's, node 3 would open a third and goes, node 4 extends node 2's:
    ``[0, 1, 2, 4]``.
    """
    kept = [False] * len(parents)
    has_child = [False] * len(parents)
    paths = 0
    out: list[int] = []
    for i in range(len(parents)) if order is None else order:
        parent = parents[i]
        if (allowed is not None and not allowed[i]) or (parent >= 0 and not kept[parent]):
            continue
        if parent < 0 or has_child[parent]:
            if paths >= max_paths:
                continue
            paths += 1
        kept[i] = True
        if parent >= 0:
            has_child[parent] = True
        out.append(i)
    return out
