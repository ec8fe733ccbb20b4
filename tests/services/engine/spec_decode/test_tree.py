"""The static shape of a draft tree: level order, parents, depths, ancestor masks, bad shapes."""

from __future__ import annotations

import pytest

from services.engine.spec_decode.tree import DraftTree


def test_tree_shape_in_level_order() -> None:
    tree = DraftTree((3, 2, 1))
    assert tree.num_nodes() == 1 + 3 + 6 + 6
    assert tree.num_nodes(1) == 4 and tree.num_nodes(0) == 1
    assert tree.parents[:10] == [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
    assert tree.parents[10:] == [4, 5, 6, 7, 8, 9]
    assert tree.depths == [0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3]
    assert tree.masks[10] == (1 << 10) | (1 << 4) | (1 << 1) | 1


@pytest.mark.parametrize("branching", [(), (2, 0), (8, 8)])
def test_bad_tree_shapes_are_refused(branching: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="tree"):
        DraftTree(branching)
