"""The static shape of a draft tree: branching factors per depth (`speculative_config.tree`).

`tree: [3, 2, 1]` drafts the 3 most likely tokens after the newest one (depth 1), the 2 most likely
after each of those (depth 2) and 1 after each of those (depth 3): 3 + 6 + 6 = 15 drafts in one
query of 16 tokens with the root, the newest accepted token. Nodes are numbered in level order
(root 0, then depth 1, depth 2, ...), so every node comes after its parent, and the tree cut at any
depth is a prefix of the numbering: a request allowed `k` drafting depths (its
num_speculative_tokens) brings the first `num_nodes(k)` nodes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kernels.attention_ref import MAX_TREE_NODES, ancestor_masks

ROOT = 0
"""Node number of the root: the newest accepted token, which the verify query starts with."""


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
