"""One-shot all-reduce over peer memory: a small message summed over the GPUs of one host in one
kernel per rank, without the fixed latency of a NCCL collective; twin of `all_reduce_ref`.

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
HALF_BYTES = 1 << 20
"""Bytes of each half of a rank buffer: no message is larger."""
FLAGS_OFFSET = 512
"""Where the flags start in a rank buffer, after MAX_BLOCKS uint32 epochs."""
DATA_OFFSET = 16384
"""Where the halves start, after the flags: [2 halves][MAX_BLOCKS][MAX_RANKS] uint32."""
BUFFER_BYTES = DATA_OFFSET + 2 * HALF_BYTES
VECTOR_BYTES = 16
"""Each thread moves 16 bytes at a time: messages are multiples of it (a tensor whose address is not
goes through an aligned copy)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IPC_LAZY_ENABLE_PEER_ACCESS = 1
"""cudaIpcMemLazyEnablePeerAccess: opening a peer's handle enables peer access to its device."""

assert MAX_BLOCKS * 4 <= FLAGS_OFFSET and FLAGS_OFFSET + 2 * MAX_BLOCKS * MAX_RANKS * 4 <= DATA_OFFSET

SOURCE = (
    _cuda.CONVERSIONS
    + r"""
/* A rank buffer: [MAX_BLOCKS] uint32 epochs | [2][MAX_BLOCKS][MAX_RANKS] uint32 flags (at FLAGS_OFFSET)
   | [2][HALF_BYTES] staged data (at DATA_OFFSET). Epochs and staged data are written by their own
   rank only; flag [h][b][r] of a rank is written by rank r only. */

__device__ __forceinline__ void store_release_sys(unsigned int* flag, unsigned int value) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ unsigned int load_acquire_sys(const unsigned int* flag) {
    unsigned int value;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
    return value;
}

/* 16 staged bytes -> VEC floats. Not through the read-only or L1 cache: the bytes change between
   calls (written by another GPU), and `.cg` reads them where that GPU's stores land. */
__device__ __forceinline__ void load_staged(const scalar_t* p, float* out) {
    uint4 raw;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w) : "l"(p) : "memory");
#if DTYPE == DT_F32
    out[0] = __uint_as_float(raw.x); out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z); out[3] = __uint_as_float(raw.w);
#else
    const unsigned short* h = reinterpret_cast<const unsigned short*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = to_float(h[i]);
#endif
}

/* VEC floats -> 16 bytes of scalar_t, rounded to nearest even. */
__device__ __forceinline__ void store_vec(scalar_t* p, const float* v) {
    uint4 raw;
#if DTYPE == DT_F32
    raw.x = __float_as_uint(v[0]); raw.y = __float_as_uint(v[1]);
    raw.z = __float_as_uint(v[2]); raw.w = __float_as_uint(v[3]);
#else
    unsigned short* h = reinterpret_cast<unsigned short*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = from_float(v[i]);
#endif
    *reinterpret_cast<uint4*>(p) = raw;
}

extern "C" __global__ void __launch_bounds__(THREADS) one_shot_all_reduce(
    const scalar_t* input,                           /* [num_vecs * VEC] this rank's part */
    scalar_t* output,                                /* [num_vecs * VEC] the sum; may be `input` */
    const unsigned long long* __restrict__ buffers,  /* [NRANKS] every rank's buffer, mapped here */
    int rank, long long num_vecs)
{
    char* own = reinterpret_cast<char*>(buffers[rank]);
    unsigned int* epochs = reinterpret_cast<unsigned int*>(own);
    __shared__ unsigned int block_epoch;
    if (threadIdx.x == 0) block_epoch = epochs[blockIdx.x] + 1u;  /* wraps: flags compare for equality */
    __syncthreads();
    const unsigned int epoch = block_epoch;
    const unsigned int half = epoch & 1u;
    const long long half_offset = DATA_OFFSET + (long long)half * HALF_BYTES;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;

    /* 1. Stage: this thread's vectors of the input into its own rank buffer's half. The same thread
       writes the same vectors of the output in step 4, so `output` may alias `input`. */
    uint4* staged = reinterpret_cast<uint4*>(own + half_offset);
    for (long long v = first; v < num_vecs; v += stride) staged[v] = reinterpret_cast<const uint4*>(input)[v];

    /* 2. Signal. The barrier orders every thread's staging before thread r's store, and a release at
       system scope is cumulative: rank r, once it acquires the flag, sees this block's staged data.
       Thread r raises this rank's flag in rank r's buffer: [half][block][this rank] = epoch. */
    __syncthreads();
    const long long flag = ((long long)half * MAX_BLOCKS + blockIdx.x) * MAX_RANKS;
    if (threadIdx.x < NRANKS) {
        char* peer = reinterpret_cast<char*>(buffers[threadIdx.x]);
        store_release_sys(reinterpret_cast<unsigned int*>(peer + FLAGS_OFFSET) + flag + rank, epoch);

        /* 3. Wait until rank r's block has raised its flag here: its acquire, then the barrier below,
           make rank r's staged data visible to every thread of this block. Equality, not >=: a peer
           one call ahead raises its flag in the other half, and counters may wrap. */
        const unsigned int* mine = reinterpret_cast<const unsigned int*>(own + FLAGS_OFFSET) + flag + threadIdx.x;
        while (load_acquire_sys(mine) != epoch) {
        }
    }
    __syncthreads();

    /* 4. Reduce: rank 0's part plus rank 1's ... in float32, one rounding at the end, so every rank
       writes the same bits. No barrier at the end: a rank restages this half only two calls later,
       and it cannot pass the next call's wait before every rank has finished this call's kernel. */
    for (long long v = first; v < num_vecs; v += stride) {
        float sum[VEC], part[VEC];
        load_staged(reinterpret_cast<const scalar_t*>(reinterpret_cast<const char*>(buffers[0]) + half_offset) + v * VEC, sum);
#pragma unroll
        for (int r = 1; r < NRANKS; ++r) {
            load_staged(reinterpret_cast<const scalar_t*>(reinterpret_cast<const char*>(buffers[r]) + half_offset) + v * VEC, part);
#pragma unroll
            for (int i = 0; i < VEC; ++i) sum[i] += part[i];
        }
        store_vec(output + v * VEC, sum);
    }
    if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
}
"""
)


def max_message_bytes(num_ranks: int) -> int:
    """The largest message the kernel takes over `num_ranks` ranks: each rank reads every rank's
    copy, so the limit halves as the ranks double (larger messages go to NCCL's ring)."""
    return min(HALF_BYTES, 2 * HALF_BYTES // num_ranks)


def message_problem(x: torch.Tensor, num_ranks: int) -> str | None:
    """Why the kernel cannot all-reduce `x` over `num_ranks` ranks; None: it can. It depends on the
    dtype and shape only, never on an address, so that every rank makes the same choice (a rank
    taking the kernel while another took NCCL would wait for ever)."""
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} is not one of {[str(d) for d in DTYPES]}"
    if not x.is_contiguous():
        return "the tensor is not contiguous"
    num_bytes = x.numel() * x.element_size()
    if num_bytes % VECTOR_BYTES:
        return f"{num_bytes} bytes is not a multiple of {VECTOR_BYTES}"
    if num_bytes > max_message_bytes(num_ranks):
        return f"{num_bytes} bytes is more than {max_message_bytes(num_ranks)} over {num_ranks} ranks"
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
    """One rank's side: its rank buffer, the peers' buffers mapped here, the kernel's launches."""

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
        self.max_bytes = max_message_bytes(self.num_ranks)

    def fits(self, x: torch.Tensor) -> bool:
        """True when the kernel takes `x` (else the caller's process group reduces it)."""
        return x.device == self.device and message_problem(x, self.num_ranks) is None

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of every rank's `x` (all ranks call it, same shape and dtype) into `out` (default:
        `x` itself); returns it. Capturable in a CUDA graph."""
        out = x if out is None else out
        _cuda.check(x.device == self.device, f"x is on {x.device}, this rank's all-reduce on {self.device}")
        problem = message_problem(x, self.num_ranks)
        _cuda.check(problem is None, f"the peer all-reduce cannot take x: {problem}")
        _cuda.check(
            out.shape == x.shape and out.dtype == x.dtype and out.device == x.device and out.is_contiguous(),
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}, x {tuple(x.shape)} {x.dtype} on {x.device}: "
            "out must be a contiguous tensor like x",
        )
        num_vecs = x.numel() * x.element_size() // VECTOR_BYTES
        if num_vecs == 0:
            return out
        if x.data_ptr() % VECTOR_BYTES or out.data_ptr() % VECTOR_BYTES:  # views: through aligned copies
            return out.copy_(self.all_reduce(x.clone()))
        kernel = _cuda.function(
            SOURCE,
            "one_shot_all_reduce",
            self.device,
            **kernel_defines(x.dtype, self.num_ranks),
        )
        args = (x, out, self.buffers, np.int32(self.rank), np.int64(num_vecs))
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
        "tensor-parallel rank %d: peer all-reduce up to %d bytes over %d ranks",
        rank,
        max_message_bytes(num_ranks),
        num_ranks,
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
