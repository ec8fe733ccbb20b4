"""The static shape of a draft tree: branching factors per depth (`speculative_config.tree`).

`tree: [3, 2, 1]` drafts the 3 most likely tokens after the newest one (depth 1), the 2 most likely
after each of those (depth 2) and 1 after each of those (depth 3): 3 + 6 + 6 = 15 drafts in one
query of 16 tokens with the root, the newest accepted token. Nodes are numbered in level order
(root 0, then depth 1, depth 2, ...), so every node comes after its parent, and the tree cut at any
depth is a prefix of the numbering: a request allowed `k` drafting depths (its
num_speculative_tokens) brings the first `num_nodes(k)` nodes.

With `with_ngram` a request's tree also holds an n-gram branch from the root, so its shape is its
own: the step's tail grafts the branch on the device (`kernels.graft_trees`, whose host reference is
`drafted_tree`) and keeps each draft's parent beside it (`InputBatch.draft_parents`), where a step
launched ahead builds its tree inputs from; `SpecState.draft_parents` carries it to a step the
host prepares.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kernels.attention_ref import MAX_TREE_NODES, ancestor_masks
from kernels.tree_ref import ROOT

if TYPE_CHECKING:
    from services.engine.sequence import Sequence


@dataclass(frozen=True)
class DraftTree:
    branching: tuple[int, ...]
    """Children per node at each depth (depth 1 first)."""

    def __post_init__(self) -> None:
        if not self.branching or any(b < 1 for b in self.branching):
            raise ValueError(f"tree branching factors must be >= 1 per depth, got {list(self.branching)}")
        if self.num_nodes() > MAX_TREE_NODES:
            raise ValueError(
                f"tree {list(self.branching)} has {self.num_nodes()} nodes with its root; at most {MAX_TREE_NODES}"
            )

    @property
    def depth(self) -> int:
        return len(self.branching)

    def num_nodes(self, depth: int | None = None) -> int:
        """Nodes of the tree cut at `depth` (None: whole), root included."""
        return sum(self.level_widths[: (self.depth if depth is None else depth) + 1])

    @functools.cached_property
    def level_widths(self) -> list[int]:
        """Nodes at each depth, the root's (1) first."""
        widths = [1]
        for b in self.branching:
            widths.append(widths[-1] * b)
        return widths

    @functools.cached_property
    def parents(self) -> list[int]:
        """Parent of each node in level order (-1 for the root)."""
        parents, first = [-1], 0
        for depth, b in enumerate(self.branching):
            parents += [first + i // b for i in range(self.level_widths[depth + 1])]
            first += self.level_widths[depth]
        return parents

    @functools.cached_property
    def depths(self) -> list[int]:
        return [d for d, width in enumerate(self.level_widths) for _ in range(width)]

    @functools.cached_property
    def masks(self) -> list[int]:
        """Each node's ancestor bitmask (itself included): its `AttentionMetadata.tree_mask`."""
        return ancestor_masks(self.parents)


def drafted_tree(tree: DraftTree, drafts: list[int], num_branch: int) -> tuple[list[int], list[int]]:
    """A request's draft tree from its proposer's row: (the drafts in node order past the root,
    each one's parent node; 0 is the root, draft j is node j + 1).

    The row holds `num_branch` n-gram drafts (-1 past the match; with_ngram) then the head's tree
    in level order, possibly cut (a prefix of it). The n-gram branch follows the head's nodes
    while they hold its tokens and is grafted as a chain under the last one it reached, after
    the head's nodes: no token is drafted twice under one parent, and every node comes after its
    parent (a prefix of the drafts is a tree too)."""
    branch = list(itertools.takewhile(lambda token: token >= 0, drafts[:num_branch]))
    head = drafts[num_branch:]
    parents = tree.parents[1 : len(head) + 1]
    child_of = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, head), start=1)}
    node, num_shared = ROOT, 0
    while num_shared < len(branch) and (node, branch[num_shared]) in child_of:
        node = child_of[node, branch[num_shared]]
        num_shared += 1
    grafted = branch[num_shared:]
    first = len(head) + 1  # the grafted chain's first node
    grafted_parents = [node] + list(range(first, first + len(grafted) - 1)) if grafted else []
    return head + grafted, parents + grafted_parents


def tree_shape(seq: Sequence) -> list[int]:
    """The parent array (root included, -1 at it) of the tree the request's drafts form."""
    return [-1] + seq.spec.draft_parents[: len(seq.spec.draft_token_ids)]


def node_depths(shape: list[int]) -> list[int]:
    """Each node's depth, from a parent array in which every node comes after its parent."""
    depths: list[int] = []
    for parent in shape:
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return depths


@functools.lru_cache(maxsize=4096)
def shape_arrays(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(each node's depth, its ancestor mask) of a parent array, as int64 arrays; cached, as a
    server's requests draw few distinct shapes and a step needs them per request."""
    return np.array(node_depths(list(shape))), np.array(ancestor_masks(list(shape)), dtype=np.int64)
