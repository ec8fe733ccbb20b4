"""All-reduce over peer memory: a message summed over the GPUs of one host in one kernel per rank,
without the fixed latency of a NCCL collective; twin of `all_reduce_ref`. *One shot* (every rank
sums every rank's copy) for small messages, *two shots* (reduce-scatter, then all-gather) for
larger ones.

Terms:
- *rank buffer*: one device allocation per rank that every other rank maps through its CUDA IPC
  handle (exchanged once, in `open_peer_all_reduce`): the rank's block epochs, its flags (written by
  the peers) and two *halves* of staged data.
- *epoch*: the number of calls a block has run, kept in the rank buffer, so that CUDA-graph replays
  advance it as eager calls do. A communicator's grid never changes, so every block of every rank
  counts the same calls and block b covers the same elements on every rank.

The ordering protocol is in the CUDA source's comments. Calls on a rank must be ordered (one stream,
or graphs replayed on it), every rank making the same calls in the same order, as with NCCL.
Messages this kernel does not take (`message_problem`) and groups it cannot serve
(`peer_problem`) go through the process group (`TensorParallel.all_reduce`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kernels import _cuda

logger = logging.getLogger(__name__)

THREADS = 512
MAX_BLOCKS = 128
DEFAULT_BLOCKS = 64
"""The grid of every call of a `PeerAllReduce` (fixed: see the module docstring): its threads move
512 KiB in one pass."""
MAX_RANKS = 8
HALF_BYTES = 8 << 20
"""Bytes of each half of a rank buffer: no message is larger."""
ONE_SHOT_READ_BYTES = 2 << 20
"""One shot reads every rank's copy of the message: it takes messages up to this over the ranks
(`one_shot_max_bytes`), two shots the larger ones up to TWO_SHOT_MAX_BYTES, NCCL the rest."""
TWO_SHOT_MAX_BYTES = HALF_BYTES
FLAGS_OFFSET = 512
"""Where the flags start in a rank buffer, after MAX_BLOCKS uint32 epochs: [2 halves][MAX_BLOCKS][MAX_RANKS] uint32."""
GATHER_FLAGS_OFFSET = FLAGS_OFFSET + 2 * MAX_BLOCKS * MAX_RANKS * 4
"""The two-shot kernel's second flags, laid out as the first."""
DATA_OFFSET = 32768
"""Where the halves start, after the flags."""
BUFFER_BYTES = DATA_OFFSET + 2 * HALF_BYTES
VECTOR_BYTES = 16
"""Each thread moves 16 bytes at a time: messages are multiples of it (a tensor whose address is not
goes through an aligned copy)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IPC_LAZY_ENABLE_PEER_ACCESS = 1
"""cudaIpcMemLazyEnablePeerAccess: opening a peer's handle enables peer access to its device."""

assert MAX_BLOCKS * 4 <= FLAGS_OFFSET and GATHER_FLAGS_OFFSET + 2 * MAX_BLOCKS * MAX_RANKS * 4 <= DATA_OFFSET

SOURCE = (
    _cuda.CONVERSIONS
    + r"""
/* A rank buffer: [MAX_BLOCKS] uint32 epochs | [2][MAX_BLOCKS][MAX_RANKS] uint32 flags (at FLAGS_OFFSET)
   | the same again (at GATHER_FLAGS_OFFSET) | [2][HALF_BYTES] staged data (at DATA_OFFSET). Epochs
   and staged data are written by their own rank only; flag [h][b][r] of a rank by rank r only. */

__device__ __forceinline__ void store_release_sys(unsigned int* flag, unsigned int value) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ unsigned int load_acquire_sys(const unsigned int* flag) {
    unsigned int value;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
    return value;
}

/* 16 bytes a peer wrote, not through the read-only or L1 cache: they change between calls (written
   by another GPU), and `.cg` reads them where that GPU's stores land. */
__device__ __forceinline__ uint4 load_cg(const void* p) {
    uint4 raw;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w) : "l"(p) : "memory");
    return raw;
}

/* The staged half of rank r's buffer for this call. */
__device__ __forceinline__ char* staged_half(const unsigned long long* buffers, int r, unsigned int epoch) {
    return reinterpret_cast<char*>(buffers[r]) + DATA_OFFSET + (long long)(epoch & 1u) * HALF_BYTES;
}

/* One block's share of a call: this rank's buffer (`own`), the block's epoch, and the vectors of
   a grid-stride loop its thread handles (first, first + stride, ...), the same on every rank. */
struct BlockCall {
    char* own;
    unsigned int epoch;
    long long first;
    long long stride;
};

/* Opens a call: this block's epoch is one more than its last call's (kept in this rank's buffer). */
__device__ __forceinline__ BlockCall begin_call(const unsigned long long* buffers, int rank) {
    __shared__ unsigned int block_epoch;
    char* own = reinterpret_cast<char*>(buffers[rank]);
    if (threadIdx.x == 0) block_epoch = reinterpret_cast<unsigned int*>(own)[blockIdx.x] + 1u;  /* wraps */
    __syncthreads();
    return BlockCall{own, block_epoch, (long long)blockIdx.x * blockDim.x + threadIdx.x,
                     (long long)gridDim.x * blockDim.x};
}

/* Closes a call: keeps this block's epoch for its next call. */
__device__ __forceinline__ void end_call(const BlockCall& call) {
    if (threadIdx.x == 0) reinterpret_cast<unsigned int*>(call.own)[blockIdx.x] = call.epoch;
}

/* Copies this rank's input, SLICES slices of `slice_vecs` vectors, into its staged half: the
   thread handling position j copies position j of every slice, so the block that stages a vector
   is the block that reads it on every rank after the exchange of its flags. */
template <int SLICES>
__device__ __forceinline__ void stage_input(
    const BlockCall& call, const unsigned long long* buffers, int rank, const scalar_t* input, long long slice_vecs)
{
    uint4* staged = reinterpret_cast<uint4*>(staged_half(buffers, rank, call.epoch));
    const uint4* in = reinterpret_cast<const uint4*>(input);
    for (long long j = call.first; j < slice_vecs; j += call.stride) {
#pragma unroll
        for (int s = 0; s < SLICES; ++s) staged[s * slice_vecs + j] = in[s * slice_vecs + j];
    }
}

/* Signal, then wait. The first barrier orders every thread's stores before thread r's release,
   which is cumulative at system scope: rank r, once it acquires the flag, sees them. Thread r
   raises this rank's flag in rank r's flag array (`flags_offset`): [half][block][this rank] = epoch,
   then spins until rank r has raised its flag here; its acquire and the second barrier make rank
   r's stores visible to every thread of this block. Flags compare for equality, not >=: a peer one
   call ahead raises its flag in the other half, and counters may wrap. */
__device__ __forceinline__ void exchange_flags(
    const unsigned long long* buffers, const BlockCall& call, int rank, int flags_offset)
{
    __syncthreads();
    const long long flag = ((long long)(call.epoch & 1u) * MAX_BLOCKS + blockIdx.x) * MAX_RANKS;
    if (threadIdx.x < NRANKS) {
        char* peer = reinterpret_cast<char*>(buffers[threadIdx.x]);
        store_release_sys(reinterpret_cast<unsigned int*>(peer + flags_offset) + flag + rank, call.epoch);
        const unsigned int* mine = reinterpret_cast<const unsigned int*>(call.own + flags_offset) + flag + threadIdx.x;
        while (load_acquire_sys(mine) != call.epoch) {
        }
    }
    __syncthreads();
}

/* Vector v of the message summed over the ranks' staged halves, rank 0 first, in float32, so that
   every rank that sums it gets the same bits once it rounds. */
__device__ __forceinline__ void sum_staged(const unsigned long long* buffers, unsigned int epoch, long long v, float* sum) {
    unpack_vec(load_cg(reinterpret_cast<const uint4*>(staged_half(buffers, 0, epoch)) + v), sum);
#pragma unroll
    for (int r = 1; r < NRANKS; ++r) {
        float part[VEC];
        unpack_vec(load_cg(reinterpret_cast<const uint4*>(staged_half(buffers, r, epoch)) + v), part);
#pragma unroll
        for (int i = 0; i < VEC; ++i) sum[i] += part[i];
    }
}

/* Why no barrier at the end of a call: a rank restages a half only two calls later, and it cannot
   pass that next call's first wait before every rank has begun it, that is, finished this call's
   kernel (calls on a rank are ordered). Both kernels count calls in the same epochs. */

/* One shot: every rank stages its whole input, then sums every rank's copy.
   1. stage this thread's vectors of the input in this rank's half; 2. exchange flags;
   3. sum vector v over the ranks' halves (`sum_staged`), rounding once, so every rank writes the
   same bits. The thread that reads input vector v writes output vector v: `output` may be `input`. */
extern "C" __global__ void __launch_bounds__(THREADS) one_shot_all_reduce(
    const scalar_t* input,                           /* [num_vecs * VEC] this rank's part */
    scalar_t* output,                                /* [num_vecs * VEC] the sum; may be `input` */
    const unsigned long long* __restrict__ buffers,  /* [NRANKS] every rank's buffer, mapped here */
    int rank, long long num_vecs)
{
    const BlockCall call = begin_call(buffers, rank);
    stage_input<1>(call, buffers, rank, input, num_vecs);
    exchange_flags(buffers, call, rank, FLAGS_OFFSET);
    for (long long v = call.first; v < num_vecs; v += call.stride) {
        float sum[VEC];
        sum_staged(buffers, call.epoch, v, sum);
        store_vec(output + v * VEC, sum);
    }
    end_call(call);
}

/* Two shots (reduce-scatter, then all-gather): the message is NRANKS slices of `slice_vecs`
   vectors, and rank r sums slice r only, so each rank reads the message once, not NRANKS times.
   A thread handles position j of every slice, so each exchange needs only this block's flags.
   1. stage position j of every slice in this rank's half; 2. exchange flags;
   3. sum position j of slice `rank` over the ranks' halves (as one shot does) and write the sum
      over this rank's own staged copy of it, which no other rank reads in this step;
   4. exchange the second flags; 5. copy position j of slice s from rank s's half into the output. */
extern "C" __global__ void __launch_bounds__(THREADS) two_shot_all_reduce(
    const scalar_t* input,                           /* [NRANKS * slice_vecs * VEC] this rank's part */
    scalar_t* output,                                /* [NRANKS * slice_vecs * VEC] the sum; may be `input` */
    const unsigned long long* __restrict__ buffers,  /* [NRANKS] every rank's buffer, mapped here */
    int rank, long long slice_vecs)
{
    const BlockCall call = begin_call(buffers, rank);
    stage_input<NRANKS>(call, buffers, rank, input, slice_vecs);
    exchange_flags(buffers, call, rank, FLAGS_OFFSET);

    const long long mine = rank * slice_vecs;
    uint4* staged = reinterpret_cast<uint4*>(staged_half(buffers, rank, call.epoch));
    for (long long j = call.first; j < slice_vecs; j += call.stride) {
        float sum[VEC];
        sum_staged(buffers, call.epoch, mine + j, sum);
        staged[mine + j] = pack_vec(sum);
    }
    exchange_flags(buffers, call, rank, GATHER_FLAGS_OFFSET);

    for (long long j = call.first; j < slice_vecs; j += call.stride) {
#pragma unroll
        for (int s = 0; s < NRANKS; ++s) {
            const uint4* summed = reinterpret_cast<const uint4*>(staged_half(buffers, s, call.epoch));
            reinterpret_cast<uint4*>(output)[s * slice_vecs + j] = load_cg(summed + s * slice_vecs + j);
        }
    }
    end_call(call);
}
"""
)


def one_shot_max_bytes(num_ranks: int) -> int:
    """The largest message one shot takes over `num_ranks` ranks (each rank reads every rank's
    copy, so the limit halves as the ranks double)."""
    return min(HALF_BYTES, ONE_SHOT_READ_BYTES // num_ranks)


def choose_shots(num_bytes: int, num_ranks: int) -> int | None:
    """1 or 2 (which kernel reduces a message of `num_bytes` over `num_ranks` ranks), None: NCCL.
    Two shots need the message's 16-byte vectors to split into `num_ranks` equal slices."""
    if num_bytes <= one_shot_max_bytes(num_ranks):
        return 1
    if num_bytes <= TWO_SHOT_MAX_BYTES and (num_bytes // VECTOR_BYTES) % num_ranks == 0:
        return 2
    return None


def message_problem(x: torch.Tensor, num_ranks: int) -> str | None:
    """Why the kernels cannot all-reduce `x` over `num_ranks` ranks; None: they can. It depends on
    the dtype and shape only, never on an address, so that every rank makes the same choice (a rank
    taking a kernel while another took NCCL would wait for ever)."""
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} is not one of {[str(d) for d in DTYPES]}"
    if not x.is_contiguous():
        return "the tensor is not contiguous"
    num_bytes = x.numel() * x.element_size()
    if num_bytes % VECTOR_BYTES:
        return f"{num_bytes} bytes is not a multiple of {VECTOR_BYTES}"
    if choose_shots(num_bytes, num_ranks) is None:
        return (
            f"{num_bytes} bytes is more than {one_shot_max_bytes(num_ranks)} (one shot over {num_ranks} ranks) "
            f"and not {num_ranks} equal slices of {VECTOR_BYTES}-byte vectors up to {TWO_SHOT_MAX_BYTES} (two shots)"
        )
    return None


def peer_problem(rank: int, device_uuids: list[str], can_access: Callable[[str], bool]) -> str | None:
    """Why rank `rank` cannot join a peer all-reduce with the ranks on `device_uuids` (one per rank,
    rank order); `can_access(uuid)`: this rank's device can map that device's memory. None: it can."""
    num_ranks = len(device_uuids)
    if not 2 <= num_ranks <= MAX_RANKS:
        return f"{num_ranks} ranks (the kernel takes 2 to {MAX_RANKS})"
    if len(set(device_uuids)) < num_ranks:
        return "two ranks share a device"
    for other, uuid in enumerate(device_uuids):
        if other != rank and not can_access(uuid):
            return (
                f"rank {rank}'s device has no peer access to rank {other}'s ({uuid}): "
                "not visible here, on another host, or no NVLink / PCIe peer path"
            )
    return None


class PeerAllReduce:
    """One rank's side: its rank buffer, the peers' buffers mapped here, the kernels' launches."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        own_ptr: int,
        peer_ptrs: list[int],
        num_blocks: int = DEFAULT_BLOCKS,
    ):
        """`peer_ptrs`: every rank's buffer as mapped in this process (this rank's is `own_ptr`);
        `num_blocks`: the grid, the same on every rank."""
        if not 1 <= num_blocks <= MAX_BLOCKS:
            raise ValueError(f"num_blocks {num_blocks} is not in 1..{MAX_BLOCKS}")
        self.rank = rank
        self.num_blocks = num_blocks
        self.num_ranks = len(peer_ptrs)
        self.device = device
        self._own_ptr = own_ptr
        self._opened = [ptr for r, ptr in enumerate(peer_ptrs) if r != rank]
        self.buffers = torch.tensor(peer_ptrs, dtype=torch.int64, device=device)  # [num_ranks]

    def fits(self, x: torch.Tensor) -> bool:
        """True when a kernel takes `x` (else the caller's process group reduces it)."""
        return x.device == self.device and message_problem(x, self.num_ranks) is None

    def all_reduce(
        self, x: torch.Tensor, out: torch.Tensor | None = None, shots: int | None = None
    ) -> torch.Tensor:
        """The sum of every rank's `x` (all ranks call it, same shape and dtype) into `out` (default:
        `x` itself); returns it. Capturable in a CUDA graph. `shots`: 1 or 2 (the same on every rank)
        forces a kernel where it can run, None: `choose_shots`."""
        out = x if out is None else out
        _cuda.check(x.device == self.device, f"x is on {x.device}, this rank's all-reduce on {self.device}")
        problem = message_problem(x, self.num_ranks)
        _cuda.check(problem is None, f"the peer all-reduce cannot take x: {problem}")
        num_bytes = x.numel() * x.element_size()
        shots = choose_shots(num_bytes, self.num_ranks) if shots is None else shots
        _cuda.check(
            shots == 1 or (shots == 2 and (num_bytes // VECTOR_BYTES) % self.num_ranks == 0),
            f"shots={shots}: one shot takes any message up to {HALF_BYTES} bytes, two shots one of "
            f"{self.num_ranks} equal slices of {VECTOR_BYTES}-byte vectors ({num_bytes} bytes here)",
        )
        _cuda.check(
            out.shape == x.shape and out.dtype == x.dtype and out.device == x.device and out.is_contiguous(),
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}, x {tuple(x.shape)} {x.dtype} on {x.device}: "
            "out must be a contiguous tensor like x",
        )
        num_vecs = num_bytes // VECTOR_BYTES
        if num_vecs == 0:
            return out
        if x.data_ptr() % VECTOR_BYTES or out.data_ptr() % VECTOR_BYTES:  # views: through aligned copies
            return out.copy_(self.all_reduce(x.clone(), shots=shots))
        name = "one_shot_all_reduce" if shots == 1 else "two_shot_all_reduce"
        kernel = _cuda.function(SOURCE, name, self.device, **kernel_defines(x.dtype, self.num_ranks))
        count = num_vecs if shots == 1 else num_vecs // self.num_ranks  # vectors, or vectors a slice
        args = (x, out, self.buffers, np.int32(self.rank), np.int64(count))
        _cuda.launch(kernel, (self.num_blocks,), (THREADS,), args, self.device)
        return out

    def close(self) -> None:
        """Unmaps the peers' buffers and frees this rank's (no call may be in flight on any rank)."""
        cupy = _cuda.cupy_module()
        if cupy is None or self._own_ptr == 0:
            return
        torch.cuda.synchronize(self.device)
        _release(cupy, self.device, self._own_ptr, self._opened)
        self._opened, self._own_ptr = [], 0


def kernel_defines(dtype: torch.dtype, num_ranks: int) -> dict[str, int]:
    """The -D macros of one compiled variant."""
    return dict(
        DTYPE=_cuda.DTYPE_IDS[dtype],
        NRANKS=num_ranks,
        THREADS=THREADS,
        MAX_BLOCKS=MAX_BLOCKS,
        MAX_RANKS=MAX_RANKS,
        FLAGS_OFFSET=FLAGS_OFFSET,
        GATHER_FLAGS_OFFSET=GATHER_FLAGS_OFFSET,
        DATA_OFFSET=DATA_OFFSET,
        HALF_BYTES=HALF_BYTES,
    )


def open_peer_all_reduce(
    group: dist.ProcessGroup | None, device: torch.device, num_blocks: int = DEFAULT_BLOCKS
) -> PeerAllReduce | None:
    """Every rank of `group` calls it at start-up (it runs collectives on the group): a `PeerAllReduce`
    of `num_blocks` blocks where every rank's device can map every other's memory, else None on
    every rank (the reason is logged) and the group's own all-reduce serves."""
    if not 1 <= num_blocks <= MAX_BLOCKS:
        raise ValueError(f"num_blocks {num_blocks} is not in 1..{MAX_BLOCKS}")
    if device.type != "cuda" or dist.get_backend(group) != "nccl":
        return None  # the same answer on every rank: nothing to agree on
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    cupy = _cuda.cupy_module()
    ranks: list[tuple[str, int]] = [("", 0)] * num_ranks
    dist.all_gather_object(ranks, (_device_uuid(device.index), num_blocks), group=group)
    problem = (
        f"the CUDA kernels are off here ({_cuda.DISABLE_ENV}=ref) or CuPy is missing"
        if cupy is None
        else None
    )
    if len({blocks for _, blocks in ranks}) > 1:
        problem = problem or f"the ranks asked for different grids: {[blocks for _, blocks in ranks]} blocks"
    problem = problem or peer_problem(
        rank, [uuid for uuid, _ in ranks], lambda uuid: _can_access(device, uuid)
    )
    if not _agree(problem, group, rank, num_ranks):
        return None
    peer, problem = _map_buffers(cupy, group, rank, num_ranks, device, num_blocks)
    if not _agree(problem, group, rank, num_ranks):
        if peer is not None:
            peer.close()
        return None
    logger.info(
        "tensor-parallel rank %d: peer all-reduce over %d ranks: one shot up to %d bytes, two up to %d",
        rank,
        num_ranks,
        one_shot_max_bytes(num_ranks),
        TWO_SHOT_MAX_BYTES,
    )
    return peer


def _agree(problem: str | None, group: dist.ProcessGroup | None, rank: int, num_ranks: int) -> bool:
    """True when no rank has a problem (every rank gets the same answer); rank 0 logs the first."""
    problems: list[str | None] = [None] * num_ranks
    dist.all_gather_object(problems, problem, group=group)
    blocking = next((f"rank {r}: {p}" for r, p in enumerate(problems) if p), None)
    if blocking is not None and rank == 0:
        logger.warning("tensor-parallel all-reduce through NCCL only (%s)", blocking)
    return blocking is None


def _map_buffers(
    cupy: Any,
    group: dist.ProcessGroup | None,
    rank: int,
    num_ranks: int,
    device: torch.device,
    num_blocks: int,
) -> tuple[PeerAllReduce | None, str | None]:
    """Allocates and zeroes this rank's buffer, exchanges the handles, maps the peers' buffers: the
    rank's side, or what failed here (the exchange runs on every rank either way)."""
    runtime = cupy.cuda.runtime
    own, handle, opened, problem = 0, b"", {}, None
    with cupy.cuda.Device(device.index):
        try:
            own = runtime.malloc(BUFFER_BYTES)
            runtime.memset(own, 0, BUFFER_BYTES)
            runtime.deviceSynchronize()  # zeroed before any peer can raise a flag in it
            handle = bytes(runtime.ipcGetMemHandle(own))
        except runtime.CUDARuntimeError as error:
            problem = f"allocating or exporting the buffer failed: {error}"
        handles: list[bytes] = [b""] * num_ranks
        dist.all_gather_object(handles, handle, group=group)
        for other, peer_handle in enumerate(handles):
            if other == rank or problem is not None:
                continue
            if not peer_handle:
                problem = f"rank {other} has no buffer to share"
                continue
            try:
                opened[other] = runtime.ipcOpenMemHandle(peer_handle, IPC_LAZY_ENABLE_PEER_ACCESS)
            except runtime.CUDARuntimeError as error:
                problem = f"opening rank {other}'s buffer failed: {error}"
    if problem is not None:
        _release(cupy, device, own, list(opened.values()))
        return None, problem
    ptrs = [own if r == rank else opened[r] for r in range(num_ranks)]
    return PeerAllReduce(rank, device, own, ptrs, num_blocks), None


def _release(cupy: Any, device: torch.device, own: int, opened: list[int]) -> None:
    """Unmaps the peers' buffers `opened` and frees this rank's `own` (0: none)."""
    with cupy.cuda.Device(device.index):
        for ptr in opened:
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        if own:
            cupy.cuda.runtime.free(own)


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _can_access(device: torch.device, uuid: str) -> bool:
    """This process's `device` can map the memory of the device with `uuid` (visible here)."""
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index != device.index and torch.cuda.can_device_access_peer(device.index, index)
    return False
