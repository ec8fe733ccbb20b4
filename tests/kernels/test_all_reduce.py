"""The one-shot all-reduce over peer memory (kernels/all_reduce.py).

On CPU: its reference's arithmetic (float32, rank order), which messages and which groups it takes,
the source assembling for sm_90, and a gloo group (2 processes) keeping the process group's
all-reduce while the dispatch sends the messages a peer all-reduce takes to it. On 2 and 4 GPUs
(processes joined by NCCL): bit-identical to the reference and equal to NCCL's all-reduce over many
sizes and dtypes, back-to-back calls with changing inputs, and a captured CUDA graph replayed many
times with new inputs between eager calls. Run by `scripts/gpu_check.sh tp`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels import _cuda
from kernels.all_reduce import (
    DEFAULT_BLOCKS,
    DTYPES,
    MAX_BLOCKS,
    MAX_RANKS,
    SOURCE,
    TWO_SHOT_MAX_BYTES,
    PeerAllReduce,
    choose_shots,
    kernel_defines,
    message_problem,
    one_shot_max_bytes,
    open_peer_all_reduce,
    peer_problem,
)
from kernels.all_reduce_ref import all_reduce_ref
from services.engine.tensor_parallel import join_group, leave_group
from services.serve import free_port
from shared.config import EngineConfig
from shared.model.parallel import TensorParallel
from tests.kernels.helpers import assemble_sm90, needs_nvcc

HIDDEN = 3584
"""Qwen2.5-7B's hidden size: a decode step's all-reduce is [batch, HIDDEN]."""


# ---- the reference ----------------------------------------------------------------------------------


def test_reference_accumulates_in_float32_and_rounds_once() -> None:
    """1 + 2^-8 is not a bf16 (rounds back to 1), but 1 + 2 * 2^-8 is: accumulating in bf16 would
    lose both small parts."""
    parts = [torch.tensor([1.0], dtype=torch.bfloat16), *[torch.tensor([2.0**-8], dtype=torch.bfloat16)] * 2]
    assert all_reduce_ref(parts).item() == 1.0 + 2.0**-7
    assert all_reduce_ref(parts).dtype == torch.bfloat16


def test_reference_sums_in_rank_order() -> None:
    """(2^24 + 1) rounds to 2^24 in float32, so rank order gives 0 where another order gives 1."""
    parts = [torch.tensor([x], dtype=torch.float32) for x in (2.0**24, 1.0, -(2.0**24))]
    assert all_reduce_ref(parts).item() == 0.0
    assert all_reduce_ref([parts[0], parts[2], parts[1]]).item() == 1.0


def test_reference_refuses_parts_that_differ() -> None:
    with pytest.raises(ValueError, match="at least one"):
        all_reduce_ref([])
    with pytest.raises(ValueError, match="rank 1's part is \\(3,\\)"):
        all_reduce_ref([torch.zeros(4), torch.zeros(3)])
    with pytest.raises(ValueError, match="same shape and dtype"):
        all_reduce_ref([torch.zeros(4), torch.zeros(4, dtype=torch.float16)])


# ---- which messages and groups ----------------------------------------------------------------------


def test_decode_messages_take_one_shot_on_two_and_four_ranks() -> None:
    """Batch 1..64 of a 7B hidden state in bf16 (7 KiB - 448 KiB)."""
    for num_ranks in (2, 4):
        for batch in (1, 16, 64):
            assert message_problem(torch.zeros(batch, HIDDEN, dtype=torch.bfloat16), num_ranks) is None
            assert choose_shots(batch * HIDDEN * 2, num_ranks) == 1
    assert [one_shot_max_bytes(n) for n in (2, 4, 8)] == [1 << 20, 1 << 19, 1 << 18]


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_size_limits_are_inclusive_and_two_shots_need_equal_slices(num_ranks: int) -> None:
    one_shot = one_shot_max_bytes(num_ranks)
    assert choose_shots(16, num_ranks) == choose_shots(one_shot, num_ranks) == 1
    assert choose_shots(one_shot + 16 * num_ranks, num_ranks) == 2
    assert choose_shots(one_shot + 16, num_ranks) is None  # one vector over: no equal slices
    assert choose_shots(TWO_SHOT_MAX_BYTES, num_ranks) == 2
    assert choose_shots(TWO_SHOT_MAX_BYTES + 16 * num_ranks, num_ranks) is None
    too_large = message_problem(
        torch.zeros(TWO_SHOT_MAX_BYTES // 2 + 8 * num_ranks, dtype=torch.float16), num_ranks
    )
    assert too_large is not None and f"more than {one_shot} (one shot" in too_large
    assert f"up to {TWO_SHOT_MAX_BYTES} (two shots)" in too_large


def test_messages_the_kernel_does_not_take_are_named() -> None:
    x = torch.zeros(64, HIDDEN, dtype=torch.bfloat16)
    problems = {
        "dtype": message_problem(x.to(torch.int32), 2),
        "contiguous": message_problem(x.t(), 2),
        "multiple of 16": message_problem(x.flatten()[:7], 2),  # 14 bytes
    }
    for expected, problem in problems.items():
        assert problem is not None and expected in problem, problem
    assert message_problem(x.flatten()[1:9], 2) is None  # 16 bytes at an odd address: copied aligned


def test_groups_the_kernel_cannot_serve_are_named() -> None:
    uuids = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    assert peer_problem(1, uuids, lambda uuid: True) is None
    assert "1 ranks" in str(peer_problem(0, uuids[:1], lambda uuid: True))
    assert f"2 to {MAX_RANKS}" in str(
        peer_problem(0, [f"GPU-{i}" for i in range(MAX_RANKS + 1)], lambda u: True)
    )
    assert "share a device" in str(peer_problem(0, ["GPU-a", "GPU-a"], lambda uuid: True))
    no_path = peer_problem(2, uuids, lambda uuid: uuid != "GPU-b")
    assert no_path is not None and "rank 2's device has no peer access to rank 1's (GPU-b)" in no_path


@needs_nvcc
def test_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    """Where the CUDA toolkit is installed, every variant the engine launches assembles for sm_90
    without spilling registers."""
    for dtype in DTYPES:
        for num_ranks in (2, 4, 8):
            registers = assemble_sm90(SOURCE, kernel_defines(dtype, num_ranks), tmp_path)
            assert set(registers) == {"one_shot_all_reduce", "two_shot_all_reduce"}
            print(f"\n{dtype} x{num_ranks} registers: {registers}")


# ---- ranks in processes -----------------------------------------------------------------------------

Check = Callable[[int, int, torch.device], None]


def run_ranks(num_ranks: int, check: Check) -> None:
    """`check(rank, num_ranks, device)` in one process per GPU, joined by NCCL. They meet in a file,
    not on a port: a free port picked here can be taken before the first rank listens on it."""
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder, "rendezvous")
        mp.spawn(_rank, args=(num_ranks, str(store), check), nprocs=num_ranks, join=True)


def _rank(rank: int, num_ranks: int, store: str, check: Check) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=num_ranks)
    try:
        check(rank, num_ranks, device)
    finally:
        dist.destroy_process_group()


class HalvingPeer:
    """Stands in for a peer all-reduce that takes messages up to 64 elements (and halves them, which
    no sum does, so the test sees which path reduced a message)."""

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() <= 64

    closed = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(0.5)

    def close(self) -> None:
        self.closed = True


def _join_on_cpu(rank: int, num_ranks: int, port: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = EngineConfig(model="unused", device="cpu", tensor_parallel_size=num_ranks)
    assert config.peer_all_reduce  # the default: asked for, and gloo declines it
    store = dist.TCPStore("127.0.0.1", port, num_ranks, is_master=rank == 0)
    tp = join_group(config, rank, num_ranks, store)
    halving = HalvingPeer()
    try:
        assert tp.peer is None and dist.get_backend(tp.group) == "gloo"
        assert open_peer_all_reduce(tp.group, torch.device("cpu")) is None
        with pytest.raises(ValueError, match="num_blocks 0 is not in 1..128"):
            open_peer_all_reduce(tp.group, torch.device("cpu"), num_blocks=0)
        assert torch.equal(tp.all_reduce(torch.full((1000,), rank + 1.0)), torch.full((1000,), 3.0))
        dispatching = TensorParallel(rank, num_ranks, tp.group, halving)  # type: ignore[arg-type]
        assert torch.equal(dispatching.all_reduce(torch.full((64,), 4.0)), torch.full((64,), 2.0))
        assert torch.equal(dispatching.all_reduce(torch.full((65,), 4.0)), torch.full((65,), 8.0))
    finally:
        leave_group(TensorParallel(rank, num_ranks, tp.group, halving))  # type: ignore[arg-type]
    assert halving.closed and not dist.is_initialized()


@pytest.mark.timeout(120)
def test_gloo_ranks_reduce_through_the_group() -> None:
    """CPU ranks joined as the engine joins them open no peer all-reduce (without a collective: the
    answer is the same everywhere) and sum through gloo; a peer all-reduce, where present, takes
    exactly the messages it fits and the group the rest, and is closed when the rank leaves."""
    mp.spawn(_join_on_cpu, args=(2, free_port()), nprocs=2, join=True)


# ---- on GPUs ----------------------------------------------------------------------------------------


def needs_gpus(count: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(torch.cuda.device_count() < count, reason=f"needs {count} CUDA devices")


GPU_RANKS = [pytest.param(2, marks=needs_gpus(2)), pytest.param(4, marks=needs_gpus(4))]
NCCL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.125, torch.float16: 0.02}
"""NCCL's ring rounds each partial sum to the dtype (four ranks: three roundings of sums of up to
about 10 here, against one rounding of the float32 sum), so beyond two ranks the two differ."""


def agrees_with_nccl(out: torch.Tensor, nccl: torch.Tensor, num_ranks: int) -> bool:
    if num_ranks == 2:  # one addition, rounded once either way
        return torch.equal(out, nccl)
    return bool((out.float() - nccl.float()).abs().max() <= NCCL_TOLERANCE[out.dtype])


def parts_of(num_ranks: int, num_elements: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's part of one call, made alike in every process (on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(num_elements, generator=generator).to(dtype) for _ in range(num_ranks)]


def open_peer(device: torch.device) -> PeerAllReduce:
    peer = open_peer_all_reduce(dist.group.WORLD, device)
    assert peer is not None, "no peer all-reduce on GPUs of one host (see the log for the reason)"
    return peer


def message_sizes(num_ranks: int, dtype: torch.dtype) -> list[int]:
    """Element counts from one 16-byte vector to the two-shot limit: decode rows of a 7B model, odd
    vector counts (a block's last threads idle), an odd count spanning several passes of the grid
    (one shot takes it over every number of ranks: below its limit), each kernel's limit and the
    first two-shot size past one shot's."""
    per_vector = 16 // dtype.itemsize
    one_shot = one_shot_max_bytes(num_ranks) // dtype.itemsize
    return [
        per_vector,
        3 * per_vector,
        37 * per_vector,
        HIDDEN,
        16 * HIDDEN,
        64 * HIDDEN,
        (one_shot // per_vector - 1) * per_vector,
        one_shot,
        one_shot + num_ranks * per_vector,
        3 * one_shot + num_ranks * per_vector * 5,
        TWO_SHOT_MAX_BYTES // dtype.itemsize,
    ]


def shot_choices(num_elements: int, dtype: torch.dtype, num_ranks: int) -> list[int | None]:
    """The size's own choice, and each kernel forced where it can run."""
    num_bytes = num_elements * dtype.itemsize
    one_shot = [1] if num_bytes <= one_shot_max_bytes(num_ranks) else []
    two_shots = [2] if (num_bytes // 16) % num_ranks == 0 and num_bytes <= TWO_SHOT_MAX_BYTES else []
    return [None, *one_shot, *two_shots]


def _matches_reference_and_nccl(rank: int, num_ranks: int, device: torch.device) -> None:
    peer = open_peer(device)
    failures = []
    for dtype in DTYPES:
        for num_elements in message_sizes(num_ranks, dtype):
            parts = parts_of(num_ranks, num_elements, dtype, seed=num_elements)
            expected = all_reduce_ref(parts).to(device)
            x = parts[rank].to(device)
            nccl = x.clone()
            dist.all_reduce(nccl)
            for shots in shot_choices(num_elements, dtype, num_ranks):
                out = torch.full_like(x, float("nan"))
                peer.all_reduce(x, out=out, shots=shots)
                in_place = peer.all_reduce(x.clone(), shots=shots)
                name = f"{dtype} x {num_elements}, shots={shots}"
                if not torch.equal(out, expected) or not torch.equal(in_place, expected):
                    failures.append(
                        f"{name}: differs from all_reduce_ref (max {(out - expected).abs().max()})"
                    )
                if not torch.equal(parts[rank].to(device), x):
                    failures.append(f"{name}: the input changed")
                if not agrees_with_nccl(out, nccl, num_ranks):
                    failures.append(
                        f"{name}: differs from NCCL's all-reduce (max {(out.float() - nccl.float()).abs().max()})"
                    )
    parts = parts_of(num_ranks, HIDDEN, torch.bfloat16, seed=5)
    shifted = torch.empty(HIDDEN + 1, dtype=torch.bfloat16, device=device)[1:]  # 2 bytes off alignment
    shifted.copy_(parts[rank])
    if not torch.equal(peer.all_reduce(shifted).cpu(), all_reduce_ref(parts)):
        failures.append("a view 2 bytes past an aligned address")
    assert not failures, f"rank {rank}: " + "; ".join(failures)
    peer.close()


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_ranks", GPU_RANKS)
def test_kernel_matches_reference_and_nccl(num_ranks: int) -> None:
    run_ranks(num_ranks, _matches_reference_and_nccl)


def _back_to_back(rank: int, num_ranks: int, device: torch.device) -> None:
    """Calls of both kernels queued without a host wait, each with new inputs and its own output,
    on the default grid and the smallest and largest (a block looping over many vectors; every flag
    slot): any stale staged data or a flag mistaken for the next call's shows as a wrong sum."""
    past_one_shot = one_shot_max_bytes(num_ranks) // 2 + 8 * num_ranks  # bf16 elements: two shots
    cycle = [(HIDDEN, 1), (8, None), (64 * HIDDEN, 2), (3 * HIDDEN, None), (past_one_shot, None), (HIDDEN, 2)]
    calls = []
    for i in range(180):
        num_elements, shots = cycle[i % len(cycle)]
        calls.append((parts_of(num_ranks, num_elements, torch.bfloat16, seed=1000 + i), shots))
    inputs = [parts[rank].to(device) for parts, _ in calls]
    for num_blocks in (DEFAULT_BLOCKS, 1, MAX_BLOCKS):
        peer = open_peer_all_reduce(dist.group.WORLD, device, num_blocks)
        assert peer is not None and peer.num_blocks == num_blocks
        torch.cuda.synchronize()
        outputs = [
            peer.all_reduce(x, out=torch.empty_like(x), shots=shots) for x, (_, shots) in zip(inputs, calls)
        ]
        torch.cuda.synchronize()
        wrong = [
            i
            for i, ((parts, _), out) in enumerate(zip(calls, outputs))
            if not torch.equal(out.cpu(), all_reduce_ref(parts))
        ]
        assert not wrong, f"rank {rank}, {num_blocks} blocks: calls {wrong[:10]} (of {len(calls)}) differ"
        peer.close()


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_ranks", GPU_RANKS)
def test_back_to_back_calls_with_changing_inputs(num_ranks: int) -> None:
    run_ranks(num_ranks, _back_to_back)


def _graph_replays(rank: int, num_ranks: int, device: torch.device) -> None:
    """A graph of four all-reduces (two sizes, both kernels, one in place) replayed 50 times with new
    inputs, eager calls between some replays: the device-side epochs keep replays and eager calls
    in step."""
    peer = open_peer(device)
    small = torch.zeros(HIDDEN, dtype=torch.bfloat16, device=device)
    large = torch.zeros(32 * HIDDEN, dtype=torch.bfloat16, device=device)
    small_out, large_out, large_two_shots = (
        torch.empty_like(small),
        torch.empty_like(large),
        torch.empty_like(large),
    )
    peer.all_reduce(small, out=small_out)  # warm-up: compiles the kernels outside the capture
    peer.all_reduce(large, out=large_two_shots, shots=2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        peer.all_reduce(small, out=small_out)
        peer.all_reduce(large, out=large_out)
        peer.all_reduce(large, out=large_two_shots, shots=2)
        peer.all_reduce(small)
    failures = []
    for replay in range(50):
        small_parts = parts_of(num_ranks, small.numel(), torch.bfloat16, seed=2 * replay)
        large_parts = parts_of(num_ranks, large.numel(), torch.bfloat16, seed=2 * replay + 1)
        small.copy_(small_parts[rank])
        large.copy_(large_parts[rank])
        graph.replay()
        if replay % 7 == 3:
            eager_parts = parts_of(num_ranks, 24, torch.bfloat16, seed=10_000 + replay)
            eager = peer.all_reduce(eager_parts[rank].to(device))
            if not torch.equal(eager.cpu(), all_reduce_ref(eager_parts)):
                failures.append(f"eager call after replay {replay}")
        expected_small, expected_large = all_reduce_ref(small_parts), all_reduce_ref(large_parts)
        if not torch.equal(small_out.cpu(), expected_small) or not torch.equal(
            large_out.cpu(), expected_large
        ):
            failures.append(f"replay {replay}")
        if not torch.equal(large_two_shots.cpu(), expected_large):
            failures.append(f"replay {replay}: two shots")
        if not torch.equal(small.cpu(), expected_small):  # reduced in place: its parts, as small_out
            failures.append(f"replay {replay}: the in-place call")
    assert not failures, f"rank {rank}: " + ", ".join(failures)
    peer.close()


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_ranks", GPU_RANKS)
def test_graph_replays_with_new_inputs(num_ranks: int) -> None:
    run_ranks(num_ranks, _graph_replays)


def _dispatch_on_gpus(rank: int, num_ranks: int, device: torch.device) -> None:
    """TensorParallel sends decode-sized messages and those two shots take to the kernels, larger
    ones to NCCL: all sum; the kernels refuse what they cannot take."""
    peer = open_peer(device)
    tp = TensorParallel(rank, num_ranks, dist.group.WORLD, peer)
    two_shots = one_shot_max_bytes(num_ranks) // 2 + 8 * num_ranks  # bf16 elements
    too_large = TWO_SHOT_MAX_BYTES // 2 + 8 * num_ranks
    for num_elements in (16 * HIDDEN, two_shots, too_large):
        parts = parts_of(num_ranks, num_elements, torch.bfloat16, seed=num_elements)
        x = parts[rank].to(device)
        by_kernel = peer.fits(x)
        assert by_kernel == (num_elements != too_large)
        nccl = x.clone()
        dist.all_reduce(nccl)
        summed = tp.all_reduce(x)
        assert torch.equal(summed.cpu(), all_reduce_ref(parts)) if by_kernel else torch.equal(summed, nccl)
    with pytest.raises(_cuda.KernelError, match="more than"):
        peer.all_reduce(torch.zeros(too_large, dtype=torch.bfloat16, device=device))
    with pytest.raises(_cuda.KernelError, match="shots=2"):
        peer.all_reduce(torch.zeros(8 * (num_ranks + 1), dtype=torch.bfloat16, device=device), shots=2)
    peer.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_ranks", GPU_RANKS)
def test_tensor_parallel_dispatch_on_gpus(num_ranks: int) -> None:
    run_ranks(num_ranks, _dispatch_on_gpus)
