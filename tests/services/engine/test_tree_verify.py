"""Draft-tree verification: the acceptance rule (greedy and sampled) and the KV compaction."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from kernels import compact_path_kv
from services.engine.input_batch import GatheredParams
from services.engine.spec_decode.tree import DraftTree, drafted_tree, node_depths
from services.engine.tree_verify import target_tokens, tree_parents, verify_tree


def test_a_chain_among_trees_verifies_as_a_chain() -> None:
    tree = DraftTree((2, 2))
    draft_ids, cu = rows_of([[5, 6, 7], [5, 6, 7, 8, 9, 10]])
    # the chain: 5, 6 accepted, 7 rejected (the target says 4 after 6); the tree: node 2 (6), its
    # child node 6 (10), then the target's 0
    target_ids = torch.tensor([5, 6, 4, 0] + [6, 0, 10, 0, 0, 0, 0])
    verdict = verify_tree(target_ids, draft_ids, cu, tree_parents([None, tree.parents], [4, 7], 7))
    assert verdict.num_accepted.tolist() == [2, 2]
    assert verdict.token_ids[0, :4].tolist() == [5, 6, 4, -1]
    assert verdict.token_ids[1, :4].tolist() == [6, 10, 0, -1]


def rows_of(drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft_ids [num_rows] as the step lays them out: row j holds node j + 1's token, cu_num_rows)."""
    draft_ids, cu = [], [0]
    for nodes in drafts:
        draft_ids += nodes + [-1]
        cu.append(cu[-1] + len(nodes) + 1)
    return torch.tensor(draft_ids, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32)


def test_greedy_takes_the_longest_matching_path() -> None:
    tree = DraftTree((3, 2))  # nodes: root, 1..3 (depth 1), 4..9 (4, 5 under 1; 6, 7 under 2; 8, 9 under 3)
    nodes = [10, 11, 12, 20, 21, 22, 23, 24, 25]  # node n's token: nodes[n - 1]
    # request 0: the target says 12 at the root (node 3), then 25 at node 3 (node 9), then 7 at node 9
    targets0 = [12, 0, 0, 0, 0, 0, 0, 0, 0, 7]
    targets0[3] = 25
    # request 1: the target says 11 (node 2), then 99 (no child of node 2): recovered 99
    targets1 = [11, 0, 99, 0, 0, 0, 0, 0, 0, 0]
    # request 2: only the root and depth 1 (its k cut the tree); the target agrees with node 1, bonus 5
    targets2 = [10, 5, 0, 0]
    draft_ids, cu = rows_of([nodes, nodes, nodes[:3]])
    target_ids = torch.tensor(targets0 + targets1 + targets2)
    parents = tree_parents([tree.parents] * 3, [10, 10, 4], 10)
    verdict = verify_tree(target_ids, draft_ids, cu, parents)
    assert verdict.num_accepted.tolist() == [2, 1, 1]
    assert verdict.path[:, :4].tolist() == [[0, 3, 9, 9], [0, 2, 2, 2], [0, 1, 1, 1]]
    assert verdict.token_ids[0, :4].tolist() == [12, 25, 7, -1]
    assert verdict.token_ids[1, :3].tolist() == [11, 99, -1]
    assert verdict.token_ids[2, :3].tolist() == [10, 5, -1]


VOCAB = 6
BRANCHING = (3, 2)


class TargetLaw(NamedTuple):
    """A Markov target: its distribution after the root (`root` [VOCAB]) and after each token
    (`after` [VOCAB, VOCAB]), and a draft model unlike it (`draft_root`, `draft_after`)."""

    root: torch.Tensor
    after: torch.Tensor
    draft_root: torch.Tensor
    draft_after: torch.Tensor


def target_law() -> TargetLaw:
    generator = torch.Generator().manual_seed(0)
    root = torch.softmax(torch.randn(VOCAB, generator=generator) * 1.5, 0)
    after = torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator) * 1.5, 1)
    draft_root = torch.softmax(torch.randn(VOCAB, generator=generator), 0)
    draft_after = torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator), 1)
    return TargetLaw(root, after, draft_root, draft_after)


def head_nodes(law: TargetLaw) -> list[int]:
    """The head's tree in level order: the draft model's top-k (deterministic drafts)."""
    depth1 = law.draft_root.topk(BRANCHING[0]).indices.tolist()
    return depth1 + [t for x in depth1 for t in law.draft_after[x].topk(BRANCHING[1]).indices.tolist()]


def ngram_branch(name: str, law: TargetLaw) -> list[int]:
    """The n-gram branch (point-mass drafts) of each sampled test's tree."""
    first = head_nodes(law)[0]
    return {
        "head-tree-alone": [],
        # beside the head's top-3 at the root, with a child of its own
        "branch-beside-the-heads-children": [int(law.draft_root.argmin()), 0],
        # follows the head's first node, then a third child beside its top-2, then one more below
        "branch-grafted-under-a-head-node": [first, int(law.draft_after[first].argmin()), 1],
    }[name]


NGRAM_BRANCHES = ["head-tree-alone", "branch-beside-the-heads-children", "branch-grafted-under-a-head-node"]


def sampled_batch(
    num_requests: int, branch: list[int]
) -> tuple[TargetLaw, list[int], torch.Tensor, torch.Tensor]:
    """Every request's tree: the head's top-k tree with the n-gram `branch` merged in
    (`drafted_tree`), and the target's logits at its nodes (after token x: law.after[x]).
    (the law, the tree's parent array with its root, draft_ids, logits [num_rows, VOCAB])."""
    law = target_law()
    nodes, parents = drafted_tree(DraftTree(BRANCHING), branch + head_nodes(law), len(branch))
    rows = [law.root] + [law.after[x] for x in nodes]
    logits = torch.stack(rows).log().repeat(num_requests, 1)
    draft_ids, _ = rows_of([nodes] * num_requests)
    return law, [-1, *parents], draft_ids, logits


def sampling_params(seeds: torch.Tensor) -> GatheredParams:
    n = seeds.shape[0]
    floats = torch.stack([torch.ones(n), torch.ones(n), torch.zeros(n)])  # temperature 1, top_p 1, min_p 0
    ints = torch.zeros(4, n, dtype=torch.int32)
    return GatheredParams(floats, ints, seeds)


def emitted_pairs(num_requests: int, branch: list[int]) -> tuple[list[tuple[int, int]], TargetLaw]:
    """The first two tokens of each seeded request under tree verification (a second target
    sample at output position 1 where the step emitted one token), and the target's law."""
    law, shape, draft_ids, logits = sampled_batch(num_requests, branch)
    num_nodes = len(shape)
    seeds = torch.arange(num_requests).repeat_interleave(num_nodes) + 1000
    positions = torch.tensor(node_depths(shape)).repeat(num_requests)
    targets = target_tokens(logits, sampling_params(seeds), positions)
    cu = torch.arange(num_requests + 1, dtype=torch.int32) * num_nodes
    parents = tree_parents([shape] * num_requests, [num_nodes] * num_requests, num_nodes)
    verdict = verify_tree(targets, draft_ids, cu, parents)
    first = verdict.token_ids[:, 0].long()
    # a request that emitted one token samples its second at the next step, after `first`
    next_step = target_tokens(
        law.after[first].log(),
        sampling_params(torch.arange(num_requests) + 1000),
        torch.ones(num_requests).long(),
    )
    second = torch.where(verdict.num_accepted >= 1, verdict.token_ids[:, 1].long(), next_step)
    return list(zip(first.tolist(), second.tolist())), law


def test_the_ngram_branches_shape_the_trees_they_claim() -> None:
    """The sampled tests' n-gram branches: a sibling of the head's depth-1 nodes, and a third
    child under the head's first node, each one more node than it shares with the head."""
    law = target_law()
    head = len(head_nodes(law))
    _, beside, _, _ = sampled_batch(1, ngram_branch("branch-beside-the-heads-children", law))
    _, grafted, _, _ = sampled_batch(1, ngram_branch("branch-grafted-under-a-head-node", law))
    assert beside[head + 1 :] == [0, head + 1]
    assert grafted[head + 1 :] == [1, head + 1]


@pytest.mark.parametrize("branch", NGRAM_BRANCHES)
def test_tree_sampling_emits_the_target_distribution(branch: str) -> None:
    """The joint law of the first two emitted tokens is the target's, p(y1) p(y2 | y1), although
    the drafts are a different model's top-k, with an n-gram branch of point-mass drafts beside
    them where there is one."""
    num_requests = 10000
    pairs, law = emitted_pairs(num_requests, ngram_branch(branch, target_law()))
    expected = law.root[:, None] * law.after  # [VOCAB, VOCAB]
    counts = torch.zeros(VOCAB, VOCAB)
    for y1, y2 in pairs:
        counts[y1, y2] += 1
    chi2 = float(((counts - num_requests * expected) ** 2 / (num_requests * expected)).sum())
    assert chi2 < 80.0  # 35 degrees of freedom: p < 1e-4 under the target law
    tree_first = {y1 for y1, _ in pairs}
    assert len(tree_first) == VOCAB  # tokens outside the tree are emitted too (recovered)


@pytest.mark.parametrize("branch", NGRAM_BRANCHES)
def test_tree_sampling_emits_the_targets_own_samples(branch: str) -> None:
    """Every emitted token is the target's keyed sample at its position: a seeded request's output
    is the one it gets without drafts."""
    num_requests = 500
    pairs, law = emitted_pairs(num_requests, ngram_branch(branch, target_law()))
    seeds = torch.arange(num_requests) + 1000
    plain_first = target_tokens(
        law.root.log().repeat(num_requests, 1), sampling_params(seeds), torch.zeros(num_requests).long()
    )
    plain_second = target_tokens(
        law.after[plain_first].log(), sampling_params(seeds), torch.ones(num_requests).long()
    )
    assert pairs == list(zip(plain_first.tolist(), plain_second.tolist()))


def test_compaction_moves_the_accepted_path_into_consecutive_slots() -> None:
    block_size, num_blocks = 4, 8
    key_cache = torch.arange(num_blocks * block_size, dtype=torch.float32).view(num_blocks, block_size, 1, 1)
    value_cache = -key_cache.clone()
    before = key_cache.clone()
    tables = torch.tensor([[5, 2, 7], [1, 3, 0]], dtype=torch.int32)
    path = torch.tensor([[0, 2, 5, 9], [0, 1, 3, 3]])  # request 1 accepted 2 nodes
    roots = torch.tensor([2, 5])

    def slot(seq: int, position: int) -> int:
        return int(tables[seq, position // block_size]) * block_size + position % block_size

    compact_path_kv(
        [(key_cache, value_cache)], path, torch.tensor([3, 2], dtype=torch.int32), roots, tables, block_size
    )
    flat, flat_before = key_cache.flatten(), before.flatten()
    for seq, depth, node in [(0, 1, 2), (0, 2, 5), (0, 3, 9), (1, 1, 1), (1, 2, 3)]:
        assert flat[slot(seq, int(roots[seq]) + depth)] == flat_before[slot(seq, int(roots[seq]) + node)]
    assert torch.equal(value_cache, -key_cache)
    moved = {slot(0, 3), slot(0, 4), slot(0, 5), slot(1, 7)}  # request 1's depth 1 stays where it was
    untouched = [s for s in range(num_blocks * block_size) if s not in moved]
    assert torch.equal(flat[untouched], flat_before[untouched])


def test_compaction_beside_padding_requests_moves_only_the_accepted_path() -> None:
    """A CUDA graph's compaction has a pair per (request, depth): a padding request after a real
    one (root 0 over block 0, which the real request also holds) and a request whose depths reach
    past its block table move nothing, and do not undo the real request's moves."""
    block_size, num_blocks = 4, 6
    key_cache = torch.arange(num_blocks * block_size, dtype=torch.float32).view(num_blocks, block_size, 1, 1)
    value_cache = -key_cache.clone()
    before = key_cache.flatten().clone()
    tables = torch.tensor([[3, 0], [5, 5], [0, 0]], dtype=torch.int32)
    path = torch.tensor([[0, 2, 3, 3], [0, 1, 2, 3], [0, 0, 0, 0]])
    roots = torch.tensor([3, 2, 0])  # request 0's depths 1-3 sit in block 0, slots 0-2
    compact_path_kv(
        [(key_cache, value_cache)],
        path,
        torch.tensor([2, 3, 0], dtype=torch.int32),
        roots,
        tables,
        block_size,
    )
    expected = before.clone()
    expected[0], expected[1] = before[1], before[2]  # depth 1 <- node 2, depth 2 <- node 3
    assert torch.equal(key_cache.flatten(), expected)
    assert torch.equal(value_cache, -key_cache)


def test_compaction_with_nothing_accepted_changes_nothing() -> None:
    key_cache = torch.randn(4, 4, 1, 2)
    value_cache = torch.randn(4, 4, 1, 2)
    before = key_cache.clone(), value_cache.clone()
    path = torch.tensor([[0, 0, 0], [0, 1, 1]])
    tables = torch.tensor([[2, 1], [3, 0]], dtype=torch.int32)
    num_accepted = torch.tensor([0, 1], dtype=torch.int32)  # request 1's node 1 is already at depth 1
    compact_path_kv([(key_cache, value_cache)], path, num_accepted, torch.tensor([5, 1]), tables, 4)
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])
