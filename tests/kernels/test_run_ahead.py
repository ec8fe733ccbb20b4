"""Completion of a step launched ahead: the reference against the rules token by token, the CUDA
kernel against the reference bit for bit (eagerly and replayed from a CUDA graph); with chains of
drafts and with draft trees (each token's tree mask, depth and parent from its slot's parents)."""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

import pytest
import torch

from kernels.run_ahead import DEFINES, SOURCE, THREADS, launch_arguments
from kernels.run_ahead_ref import NO_DRAFT, PLACEHOLDER_TOKEN_ID, fill_ahead_ref
from tests.kernels.helpers import assemble_sm90, needs_cuda, needs_gxx, needs_nvcc, run_on_host

I32, I64 = torch.int32, torch.int64
UNSET = -7
"""What the written tensors hold before the fill (a value no rule writes)."""


@dataclass
class Slots:
    """`SlotState`: per slot, what the last step's tail left."""

    token_rows: torch.Tensor
    num_tokens: torch.Tensor
    num_output: torch.Tensor
    drafts: torch.Tensor
    num_drafts: torch.Tensor
    draft_parents: torch.Tensor

    def to(self, device: str) -> Slots:
        return Slots(*(getattr(self, f.name).to(device) for f in fields(self)))


@dataclass
class Case:
    """A step as the host describes it (padded to `capacity` tokens, `num_tokens` of them real) and
    the tensors the fill writes."""

    num_tokens: int
    token_slots: torch.Tensor  # [capacity] int64
    request_of_token: torch.Tensor  # [capacity] int32
    query_start_loc: torch.Tensor  # [num_seqs + padding + 1] int32
    block_tables: torch.Tensor  # [num_seqs + padding, max_blocks] int32
    slots: Slots
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    row_positions: torch.Tensor
    draft_ids: torch.Tensor
    block_size: int
    tree_mask: torch.Tensor | None = None  # [capacity] int64, where the step verifies trees
    tree_parents: torch.Tensor | None = None  # [num_seqs + padding, width + 1] int64

    CHAIN = ("input_ids", "positions", "slot_mapping", "seq_lens", "row_positions", "draft_ids")

    @property
    def written_names(self) -> tuple[str, ...]:
        """What the fill writes: the chain's tensors, and the tree's where it lays trees out."""
        return self.CHAIN + (("tree_mask", "tree_parents") if self.tree_mask is not None else ())

    def to(self, device: str) -> Case:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        moved["slots"] = self.slots.to(device)
        return Case(**moved)

    def args(self, num_filled: torch.Tensor | None) -> tuple:
        return (
            num_filled,
            self.token_slots,
            self.request_of_token,
            self.query_start_loc,
            self.block_tables,
            self.slots,
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.seq_lens,
            self.row_positions,
            self.draft_ids,
            self.block_size,
            self.tree_mask,
            self.tree_parents,
        )

    def written(self) -> list[torch.Tensor]:
        return [getattr(self, name).cpu() for name in self.written_names]


def random_parents(width: int, rng: random.Random) -> list[int]:
    """A slot's draft parents: a random tree (draft j under a node before it), a chain, or a row
    with parents outside [0, j] (read as their nearest end)."""
    kind = rng.randrange(4)
    if kind == 0:
        return list(range(width))
    if kind == 1:
        return [rng.randrange(-3, width + 3) for _ in range(width)]
    return [rng.randrange(j + 1) for j in range(width)]


def random_case(
    num_seqs: int, rng: random.Random, block_size: int, padding: int = 0, trees: bool = False
) -> Case:
    """`num_seqs` requests in distinct slots of a larger batch, each with a random length, output
    count and drafts found (0 to the width), asking for 0 to `width` drafts (placeholders where it
    found fewer); contexts cross block boundaries; in half the cases the block tables are one
    block narrower than the longest request needs (its last positions write no KV). `padding` tokens and requests follow, as in a
    CUDA graph's bucket (one-token requests on the scratch slot)."""
    width, capacity = 5, 80
    num_slots = num_seqs + 4
    lengths = [rng.randrange(1, capacity - width - 1) for _ in range(num_slots)]
    num_drafts = [rng.randrange(0, width + 1) for _ in range(num_slots)]
    drafts = torch.randint(1, 500, (num_slots, width), dtype=I32)
    for slot, found in enumerate(num_drafts):
        drafts[slot, found:] = -1
    slots = Slots(
        token_rows=torch.randint(1, 500, (num_slots, capacity), dtype=I32),
        num_tokens=torch.tensor(lengths, dtype=I32),
        num_output=torch.tensor([rng.randrange(0, n + 1) for n in lengths], dtype=I32),
        drafts=drafts,
        num_drafts=torch.tensor(num_drafts, dtype=I32),
        draft_parents=torch.tensor([random_parents(width, rng) for _ in range(num_slots)], dtype=I32),
    )
    chosen = rng.sample(range(num_slots - 1), num_seqs)
    query_lens = [1 + rng.randrange(0, width + 1) for _ in chosen] + [1] * padding
    request_slots = chosen + [num_slots - 1] * padding
    needed = [-(-(lengths[s] - 1 + q) // block_size) for s, q in zip(request_slots, query_lens)]
    max_blocks = max(needed) - (max(needed) > 1 and rng.random() < 0.5)
    tables = torch.zeros(len(request_slots), max_blocks, dtype=I32)
    for r, n in enumerate(needed):
        n = min(n, max_blocks)
        tables[r, :n] = torch.tensor(rng.sample(range(1000), n), dtype=I32)
    starts = torch.zeros(len(query_lens) + 1, dtype=I32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    total = int(starts[-1])
    lens = torch.tensor(query_lens)
    return Case(
        num_tokens=int(starts[num_seqs]),
        token_slots=torch.tensor(request_slots).repeat_interleave(lens),
        request_of_token=torch.arange(len(query_lens), dtype=I32).repeat_interleave(lens),
        query_start_loc=starts,
        block_tables=tables,
        slots=slots,
        input_ids=torch.full((total,), UNSET, dtype=I64),
        positions=torch.full((total,), UNSET, dtype=I64),
        slot_mapping=torch.full((total,), UNSET, dtype=I64),
        seq_lens=torch.full((len(query_lens),), UNSET, dtype=I32),
        row_positions=torch.full((total,), UNSET, dtype=I64),
        draft_ids=torch.full((total,), UNSET, dtype=I32),
        block_size=block_size,
        tree_mask=torch.full((total,), UNSET, dtype=I64) if trees else None,
        tree_parents=torch.full((len(query_lens), width + 1), UNSET, dtype=I64) if trees else None,
    )


def tree_node(parents: list[int], found: int, j: int) -> tuple[int, int, int]:
    """(depth, tree mask, parent) of node j by the rules: its parent is the slot's parents[j - 1]
    (a draft found) or j - 1 (a placeholder), clamped to [0, j - 1]."""

    def parent_of(node: int) -> int:
        return min(max(parents[node - 1] if node <= found else node - 1, 0), node - 1)

    depth, mask, node = 0, 1, j
    while node > 0:
        mask |= 1 << node
        node, depth = parent_of(node), depth + 1
    mask = mask - (1 << 64) if mask >= 1 << 63 else mask  # as an int64
    return depth, mask, parent_of(j) if j else -1


def expected_fill(case: Case) -> list[list]:
    """The written tensors by the rules of kernels/run_ahead_ref.py, token by token in Python."""
    out = [getattr(case, name).tolist() for name in case.written_names]
    input_ids, positions, slot_mapping, seq_lens, row_positions, draft_ids = out[:6]
    s, starts = case.slots, case.query_start_loc.tolist()
    for i in range(case.num_tokens):
        slot, request = int(case.token_slots[i]), int(case.request_of_token[i])
        first, query_len = starts[request], starts[request + 1] - starts[request]
        j = i - first
        newest = int(s.num_tokens[slot]) - 1
        found = min(int(s.num_drafts[slot]), query_len - 1)
        if j == 0:
            input_ids[i] = int(s.token_rows[slot, newest])
            seq_lens[request] = newest + query_len
        else:
            input_ids[i] = int(s.drafts[slot, j - 1]) if j <= found else PLACEHOLDER_TOKEN_ID
        depth = j
        if case.tree_mask is not None:
            depth, out[6][i], parent = tree_node(s.draft_parents[slot].tolist(), found, j)
            if j < len(out[7][request]):
                out[7][request][j] = parent
        positions[i] = newest + depth
        kv_position = newest + j
        block, table = kv_position // case.block_size, case.block_tables[request].tolist()
        inside = block < len(table)
        slot_mapping[i] = table[block] * case.block_size + kv_position % case.block_size if inside else -1
        row_positions[i] = int(s.num_output[slot]) + depth
        draft_ids[i] = int(s.drafts[slot, j]) if j < found else NO_DRAFT
    return out


SIZES = (1, 2, 7, 16, 33, 64)
"""Requests per step: batch 1 to 64."""


@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("padding", [0, 5])
def test_reference_follows_the_rules(block_size: int, padding: int, trees: bool) -> None:
    """Property over random steps (mixed draft counts, placeholders, block boundaries, a table too
    narrow; trees, chains and bad parents in the slots): each written value is what the rules give
    for its token; padding past the step's tokens and requests is left as it was."""
    rng = random.Random(block_size * 10 + padding)
    for num_seqs in SIZES:
        case = random_case(num_seqs, rng, block_size, padding, trees)
        expected = expected_fill(case)
        num_filled = torch.tensor([case.num_tokens], dtype=I32) if padding else None
        fill_ahead_ref(*case.args(num_filled))
        assert [t.tolist() for t in case.written()] == expected


def test_a_chain_laid_out_as_a_tree_is_the_chains_step() -> None:
    """Slots whose parents are chains give, laid out as trees, the chain's step: the same
    positions and rows, each token's mask its causal prefix, parents j - 1."""
    rng = random.Random(3)
    chains = random_case(16, rng, 4)
    chains.slots.draft_parents = torch.arange(5, dtype=I32).repeat(chains.slots.draft_parents.shape[0], 1)
    trees = Case(**{**vars(chains), **{name: getattr(chains, name).clone() for name in Case.CHAIN}})
    trees.tree_mask = torch.full_like(chains.input_ids, UNSET)
    trees.tree_parents = torch.full((chains.block_tables.shape[0], 6), UNSET, dtype=I64)
    fill_ahead_ref(*chains.args(None))
    fill_ahead_ref(*trees.args(None))
    for name in Case.CHAIN:
        assert torch.equal(getattr(trees, name), getattr(chains, name)), name
    offsets = torch.arange(chains.num_tokens) - chains.query_start_loc[chains.request_of_token.long()]
    assert torch.equal(trees.tree_mask, (1 << (offsets + 1)) - 1)
    starts = chains.query_start_loc.tolist()
    for request, parents in enumerate(trees.tree_parents.tolist()):
        query_len = starts[request + 1] - starts[request]
        assert parents[:query_len] == list(range(-1, query_len - 1))


def test_trees_are_laid_out_as_the_host_lays_them_out() -> None:
    """Where every request brings exactly the drafts its slot holds (no placeholders), the tree
    masks, positions, rows' output positions and parent arrays are those the host builds from the
    same parents for a step it prepares (`spec_decode.tree.shape_arrays`, `tree_verify.tree_parents`)."""
    from services.engine.spec_decode.tree import shape_arrays
    from services.engine.tree_verify import tree_parents

    rng = random.Random(11)
    for num_seqs in SIZES:
        case = random_case(num_seqs, rng, 4, trees=True)
        starts = case.query_start_loc.tolist()
        slots = case.token_slots[case.query_start_loc[:num_seqs].long()].tolist()
        for request, slot in enumerate(slots):  # valid trees, as many drafts as the query has places
            query_len = starts[request + 1] - starts[request]
            case.slots.num_drafts[slot] = query_len - 1
            case.slots.draft_parents[slot] = torch.tensor([rng.randrange(j + 1) for j in range(5)])
        assert case.tree_mask is not None and case.tree_parents is not None
        case.tree_parents.fill_(-1)  # as the host leaves them (run_ahead.ahead_step)
        fill_ahead_ref(*case.args(None))
        shapes = [
            [-1, *case.slots.draft_parents[slot, : starts[r + 1] - starts[r] - 1].tolist()]
            for r, slot in enumerate(slots)
        ]
        for request, (slot, shape) in enumerate(zip(slots, shapes)):
            depths, masks = shape_arrays(tuple(shape))
            tokens = slice(starts[request], starts[request + 1])
            newest = int(case.slots.num_tokens[slot]) - 1
            assert case.tree_mask[tokens].tolist() == masks.tolist()
            assert case.positions[tokens].tolist() == (newest + depths).tolist()
            assert case.row_positions[tokens].tolist() == (int(case.slots.num_output[slot]) + depths).tolist()
        query_lens = [b - a for a, b in zip(starts, starts[1:])]
        host = tree_parents([*shapes], query_lens, case.tree_parents.shape[1])
        assert torch.equal(case.tree_parents, host)


def test_reference_cases_cover_every_rule() -> None:
    """The random steps above reach each rule: drafts, placeholders, bonus rows, no-KV positions
    and positions in a request's second block or later."""
    rng = random.Random(4 * 10)  # the cases of test_reference_follows_the_rules[0-4]
    seen: set[str] = set()
    for num_seqs in SIZES:
        case = random_case(num_seqs, rng, 4)
        fill_ahead_ref(*case.args(None))
        offsets = torch.arange(case.num_tokens) - case.query_start_loc[case.request_of_token.long()]
        rules = {
            "draft": (offsets > 0) & (case.input_ids != PLACEHOLDER_TOKEN_ID),
            "placeholder": (offsets > 0) & (case.input_ids == PLACEHOLDER_TOKEN_ID),
            "checks a draft": case.draft_ids >= 0,
            "bonus row": case.draft_ids == NO_DRAFT,
            "no KV": case.slot_mapping == -1,
            "later block": case.positions >= 4,
        }
        seen |= {rule for rule, hits in rules.items() if hits.any()}
    assert seen == set(rules)


def test_nothing_to_fill_leaves_the_step() -> None:
    """A step the host described whole (a count of 0) is left as it is, and completing a step twice
    gives what completing it once does (nothing read is written)."""
    case = random_case(9, random.Random(1), 4, padding=3)
    before = case.written()
    fill_ahead_ref(*case.args(torch.zeros(1, dtype=I32)))
    assert all(torch.equal(a, b) for a, b in zip(case.written(), before))
    count = torch.tensor([case.num_tokens], dtype=I32)
    fill_ahead_ref(*case.args(count))
    once = case.written()
    fill_ahead_ref(*case.args(count))
    assert all(torch.equal(a, b) for a, b in zip(case.written(), once))


@needs_nvcc
def test_cuda_source_assembles_for_sm90(tmp_path) -> None:
    """Where the CUDA toolkit is installed, the kernel assembles for sm_90 as the wrapper compiles
    it, without spilling registers."""
    assert set(assemble_sm90(SOURCE, DEFINES, tmp_path)) == {"fill_ahead"}


@needs_gxx
@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("padding", [0, 5])
def test_cuda_source_run_on_the_host_matches_reference(
    block_size: int, padding: int, trees: bool, tmp_path
) -> None:
    """Without a GPU: the kernel's CUDA source, built for the host by g++ and run thread by thread
    with the launch arguments the wrapper builds, writes what the reference writes, bit for bit."""
    rng = random.Random(200 + block_size * 10 + padding)
    for num_seqs in SIZES:
        expected = random_case(num_seqs, rng, block_size, padding, trees)
        case = Case(
            **{**vars(expected), **{name: getattr(expected, name).clone() for name in expected.written_names}}
        )
        count = torch.tensor([expected.num_tokens], dtype=I32) if padding else None
        fill_ahead_ref(*expected.args(count))
        grid, args = launch_arguments(*case.args(count))
        run_on_host(SOURCE, "fill_ahead", DEFINES, grid, (THREADS,), args, tmp_path)
        for name, got, want in zip(case.written_names, case.written(), expected.written()):
            assert torch.equal(got, want), (num_seqs, name)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("padding", [0, 5])
def test_cuda_fill_matches_reference(block_size: int, padding: int, trees: bool) -> None:
    from kernels.run_ahead import fill_ahead_cuda

    rng = random.Random(100 + block_size * 10 + padding)
    for num_seqs in SIZES:
        for _ in range(3):
            cpu = random_case(num_seqs, rng, block_size, padding, trees)
            gpu = cpu.to("cuda")
            count = torch.tensor([cpu.num_tokens], dtype=I32) if padding else None
            fill_ahead_ref(*cpu.args(count))
            fill_ahead_cuda(*gpu.args(None if count is None else count.cuda()))
            for name, got, want in zip(cpu.written_names, gpu.written(), cpu.written()):
                assert torch.equal(got, want), (num_seqs, name)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
def test_cuda_fill_replayed_from_a_graph_completes_each_step_copied_in(trees: bool) -> None:
    """Captured once over a padded bucket's static tensors, the fill completes whatever step and
    slot state are copied in before each replay (the count read on the device) as the reference
    does on the same tensors; a count of 0 leaves the step."""
    from kernels.run_ahead import fill_ahead_cuda

    rng = random.Random(7)
    host = random_case(64, rng, 4, padding=8, trees=trees)  # the bucket, large enough for every step below
    host.block_tables = torch.zeros(host.block_tables.shape[0], 64, dtype=I32)
    bucket = host.to("cuda")
    count = torch.zeros(1, dtype=I32, device="cuda")
    fill_ahead_cuda(*bucket.args(count))  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fill_ahead_cuda(*bucket.args(count))
    for num_seqs in (1, 5, 16, 40, 0):
        step = random_case(max(num_seqs, 1), rng, 4, trees=trees)
        _copy_into(host, step)
        _copy_into(bucket, host)
        filled = step.num_tokens if num_seqs else 0
        count.fill_(filled)
        graph.replay()
        fill_ahead_ref(*host.args(torch.tensor([filled], dtype=I32)))
        for name, got, want in zip(host.written_names, bucket.written(), host.written()):
            assert torch.equal(got, want), (num_seqs, name)


def _copy_into(target: Case, source: Case) -> None:
    """`source`'s tensors into the leading entries of `target`'s (block tables zero padded)."""
    for name in ("token_slots", "request_of_token", "query_start_loc", *source.written_names):
        values = getattr(source, name)
        getattr(target, name)[: len(values)].copy_(values)
    tables = target.block_tables
    tables.zero_()
    tables[: source.block_tables.shape[0], : source.block_tables.shape[1]].copy_(source.block_tables)
    for f in fields(Slots):
        values = getattr(source.slots, f.name)
        getattr(target.slots, f.name)[: values.shape[0]].copy_(values)
