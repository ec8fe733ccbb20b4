"""The static shape of a draft tree (level order, parents, depths, ancestor masks, bad shapes) and the
n-gram branch merged into it (`drafted_tree`, and its batched device twin `kernels.graft_trees`)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import graft_trees
from services.engine.spec_decode.tree import DraftTree, drafted_tree, node_depths


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


TREE = DraftTree((2, 2))  # nodes 1, 2 at depth 1; 3, 4 under 1 and 5, 6 under 2
HEAD = [10, 11, 20, 21, 22, 23]  # node n's token: HEAD[n - 1]


def branch_row(branch: list[int], num_branch: int = 4) -> list[int]:
    """A proposer's row: the n-gram branch padded with -1 to its width, then the head's tree."""
    return branch + [-1] * (num_branch - len(branch)) + HEAD


def test_the_ngram_branch_follows_the_heads_nodes_then_grafts_where_it_parts() -> None:
    drafts, parents = drafted_tree(TREE, branch_row([11, 22, 7, 8]), 4)
    assert drafts == HEAD + [7, 8]  # 11 and 22 are nodes 2 and 5: not drafted twice
    assert parents == [0, 0, 1, 1, 2, 2, 5, 7]
    assert node_depths([-1, *parents])[-2:] == [3, 4]


@pytest.mark.parametrize(
    ("branch", "grafted", "grafted_parents"),
    [
        ([], [], []),  # no match: the head's tree alone
        ([11, 22], [], []),  # wholly inside the head's tree
        ([5, 6], [5, 6], [0, 7]),  # parts at the root: a sibling of the head's depth-1 nodes
        ([10, 99], [99], [1]),  # a third child beside node 1's two
    ],
)
def test_branches_merged_into_the_heads_tree(
    branch: list[int], grafted: list[int], grafted_parents: list[int]
) -> None:
    drafts, parents = drafted_tree(TREE, branch_row(branch), 4)
    assert drafts == HEAD + grafted
    assert parents == TREE.parents[1:] + grafted_parents


def test_a_branch_beside_a_cut_tree_and_any_prefix_of_the_drafts_is_a_tree() -> None:
    """Where a request's k cut the head's tree, the branch grafts under the nodes it has; every
    node comes after its parent, and no parent has two children of one token."""
    drafts, parents = drafted_tree(TREE, branch_row([10, 20, 30], 3)[: 3 + 3], 3)
    assert drafts == [10, 11, 20, 30]
    assert parents == [0, 0, 1, 3]
    for cut in range(len(parents) + 1):
        assert all(parent <= node for node, parent in enumerate(parents[:cut]))
    assert len({(p, t) for p, t in zip(parents, drafts)}) == len(drafts)


def random_rows(tree: DraftTree, num_branch: int, num_seqs: int, rng: random.Random) -> list[list[int]]:
    """Proposers' rows over a small vocabulary (so the branch often follows the head's nodes, and
    a parent may hold one token twice): a branch -1 padded past a random match, the head's tree."""
    vocab = 4
    rows = []
    for _ in range(num_seqs):
        matched = rng.randrange(num_branch + 1)
        branch = [rng.randrange(vocab) for _ in range(matched)] + [-1] * (num_branch - matched)
        rows.append(branch + [rng.randrange(vocab) for _ in range(tree.num_nodes() - 1)])
    return rows


@pytest.mark.parametrize("branching", [(2, 2), (3, 2, 1), (1, 1, 1), (4,), (2, 1, 2, 1)])
@pytest.mark.parametrize("num_branch", [0, 1, 3, 5])
def test_the_device_graft_is_the_hosts(branching: tuple[int, ...], num_branch: int) -> None:
    """Property over random rows, each cut at a random prefix (a request's k, the room before its
    max_tokens): `graft_trees` gives `drafted_tree`'s drafts and parents, row by row."""
    tree = DraftTree(branching)
    rng = random.Random(hash((branching, num_branch)) % 1000)
    for num_seqs in (1, 7, 40):
        rows = random_rows(tree, num_branch, num_seqs, rng)
        cuts = [rng.randrange(len(rows[0]) + 1) for _ in rows]
        parents = torch.tensor(tree.parents[1:], dtype=torch.long)
        token_ids, got_parents, num_drafts = graft_trees(
            parents, torch.tensor(rows, dtype=torch.int32), torch.tensor(cuts, dtype=torch.int32), num_branch
        )
        for i, (row, cut) in enumerate(zip(rows, cuts)):
            drafts, want_parents = drafted_tree(tree, row[:cut], num_branch)
            n = int(num_drafts[i])
            assert token_ids[i, :n].tolist() == drafts, (row, cut)
            assert got_parents[i, :n].tolist() == want_parents, (row, cut)
            assert (token_ids[i, n:] == -1).all()
            assert all(0 <= p <= j for j, p in enumerate(got_parents[i].tolist()))  # a tree at every prefix
