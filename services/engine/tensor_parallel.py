"""The ranks of a tensor-parallel engine: rank 0, the engine's own process, drives ranks 1..N-1.

Rank 0 owns all host state (scheduling, drafting plans, host proposers, sequences, detokenization).
Each step it sends the other ranks, its *followers*, what their device work needs: the slots that
requests took since the last step (`SlotJoin`), the step's host inputs (`HostStep`) and the tail's
plan. Every rank then runs the same forward over its shards of the model (shared/model/parallel.py)
and the same tail (verify, post-step update, device drafting) over its own copy of the input batch.

Rank consistency needs no message back. The LM head's logits are all-gathered, so every rank holds
the same float32 logits and samples them with the same noise, keyed by seed and output position
(kernels/sampling_noise_ref.py): each rank accepts the same drafts and keeps the same tokens, and
the MTP head's and the draft model's drafts, sampled the same way from all-gathered (MTP) or
replicated (draft model) logits, agree too. Verification that the fused kernel cannot do runs on
rank 0's host (it needs the sequences) and its result is sent along (`Ranks.share`).

Why rank 0 drives rather than every rank running the scheduler: what the scheduler sees is not the
same in every process (commands from the worker, the suffix cache's answers, adaptive speculation's
timings), and keeping sequences, tokenizer and text N times would buy nothing.

Commands travel over a socket per follower, encoded once and sent to each (a step as one bytes
message of its arrays, services/engine/step_wire.py; anything else pickled); tensors (KV moved in or
out of the caches) over the process group. A group lives and dies together: followers die with
rank 0 (a parent-death signal, end of file on their socket), and rank 0's process exits when a
follower dies (its collectives could otherwise wait forever). Closing ends every rank's part of the
group before any rank's process ends (`Driver.close`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

import services
from kernels.all_reduce import open_peer_all_reduce
from services.engine.cuda_graph import HostStep
from services.engine.input_batch import SlotJoin
from services.engine.step_wire import pack_step, unpack_step
from services.engine.verify_update import StepPlan
from shared.config import EngineConfig
from shared.model.parallel import SINGLE, TensorParallel

logger = logging.getLogger(__name__)

T = TypeVar("T")

GROUP_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a collective may wait for the slowest rank (model loading comes before the first)."""
STOP_TIMEOUT_S = 30.0
EXIT_RANK_LOST = 70
"""Rank 0's exit code when a follower died under it."""


# ---- what rank 0 sends ------------------------------------------------------------------------------


@dataclass
class FollowerSetup:
    """A follower's first message: who it is and what to build."""

    rank: int
    size: int
    store_port: int
    """The rendezvous store's port on 127.0.0.1 (rank 0 serves it)."""
    config: EngineConfig
    max_model_len: int


@dataclass
class StepCommand:
    """One step: the slots taken since the last one, the step's host inputs, the tail's plan (its
    drafts wanted and device proposers per request are the step's `num_wanted`, `seq_methods`)."""

    joins: list[SlotJoin]
    step: HostStep
    num_steps: int
    only: int | None
    fused: bool
    """The fused kernel verifies every request (else rank 0 sends its verification)."""

    def plan(self) -> StepPlan:
        """The tail's plan, less the requests (which only rank 0 has)."""
        step = self.step
        return StepPlan([], step.num_wanted.tolist(), self.num_steps, step.seq_methods.tolist(), self.only)

    def encode(self) -> bytes:
        """One bytes message (services/engine/step_wire.py): the joins, rare, go pickled inside."""
        numbers = [self.num_steps, NO_PROPOSER if self.only is None else self.only, self.fused]
        return pack_step(self.step, numbers, self.joins or None)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> StepCommand:
        step, (num_steps, only, fused), joins = unpack_step(data)
        proposer = None if only == NO_PROPOSER else only
        return cls(joins or [], step, num_steps, proposer, bool(fused))


@dataclass
class ImportBlocks:
    """One layer of received KV into blocks `block_ids`; the heads follow over the group."""

    cache: str
    index: int
    block_ids: list[int]


@dataclass
class ExportBlocks:
    """Every layer's KV of blocks `block_ids`, gathered to rank 0 over the group."""

    block_ids: list[int]


@dataclass
class CompareRows:
    """Every rank checks its input batch's token rows against the others' (a diagnostic)."""


@dataclass
class Stop:
    pass


STEP, PICKLED = b"s", b"p"
"""The first byte of a message to a follower: a `StepCommand` (every step, encoded), anything else."""
LEFT = b"left"
"""A follower's only message to rank 0: it left the group (after `Stop`); it exits once rank 0 closes
its socket."""
NO_PROPOSER = -1
"""`StepCommand.only` of None in its encoding."""


def encode(command: object) -> bytes:
    if isinstance(command, StepCommand):
        return STEP + command.encode()
    return PICKLED + pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    body = memoryview(data)[1:]
    if data[:1] == STEP:
        return StepCommand.decode(body)
    return pickle.loads(body)


# ---- a rank's view of the others --------------------------------------------------------------------


class Ranks:
    """The group of one rank: nothing to send, nobody to wait for."""

    tp: TensorParallel = SINGLE
    is_driver = True

    def send(self, command: object) -> None:
        """Sends `command` to every follower (rank 0 only)."""

    def share(self, make: Callable[[], T]) -> T:
        """`make()` on rank 0, sent to the followers, which receive it instead of calling it."""
        return make()

    def close(self) -> None:
        """Stops the followers and leaves the group."""


class Driver(Ranks):
    """Rank 0: starts the followers, sends them commands, watches them."""

    def __init__(self) -> None:
        self.tp = SINGLE
        self.followers: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self._closing = threading.Event()

    @classmethod
    def start(cls, config: EngineConfig, max_model_len: int) -> Driver:
        """Starts ranks 1..N-1 (each loads its shards while this process loads its own) and joins
        the group with them; watched from the start, so a rank that dies while the group forms or
        loads exits this process rather than leave it waiting on a collective."""
        if dist.is_initialized():
            raise RuntimeError(
                "this process already holds a torch.distributed group (a tensor-parallel engine is "
                "running here); close it first: one tensor-parallel engine per process"
            )
        size = config.tensor_parallel_size
        store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT
        )
        driver = cls()
        try:
            for rank in range(1, size):
                driver._spawn(rank, FollowerSetup(rank, size, store.port, config, max_model_len))
            driver.tp = join_group(config, 0, size, store)
        except BaseException:
            driver._kill()
            raise
        logger.info("tensor-parallel group of %d ranks joined (%s)", size, dist.get_backend())
        return driver

    def _spawn(self, rank: int, setup: FollowerSetup) -> None:
        follower, conn = _spawn_follower()
        self.followers.append(follower)
        self.conns.append(conn)
        threading.Thread(
            target=self._watch, args=(rank, follower), name=f"tp-rank-{rank}", daemon=True
        ).start()
        conn.send_bytes(pickle.dumps(setup))

    def _kill(self) -> None:
        self._closing.set()
        for follower in self.followers:
            follower.kill()
            follower.wait()

    def send(self, command: object) -> None:
        data = encode(command)
        for conn in self.conns:
            conn.send_bytes(data)

    def share(self, make: Callable[[], T]) -> T:
        value = make()
        self.send(value)
        return value

    def close(self) -> None:
        """Tells the followers to stop, leaves the group with them, then lets them exit once every
        rank left it (no rank tears its part of the group down after another rank's process
        ended), waits for them and kills those that do not stop. A dead follower costs no wait;
        one that hangs, STOP_TIMEOUT_S."""
        if self._closing.is_set():
            return
        for rank, follower in enumerate(self.followers, start=1):
            if (code := follower.poll()) is not None:  # died before: as if the watcher saw it first
                self._exit_rank_lost(rank, code)
        self._closing.set()
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a follower that died already
                conn.send_bytes(encode(Stop()))
        self._leave_group(self.tp)
        self._wait_left(time.monotonic() + STOP_TIMEOUT_S)
        for conn in self.conns:
            conn.close()  # the followers exit on its end of file
        for follower in self.followers:
            try:
                follower.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.error("tensor-parallel rank (pid %d) did not stop; killing it", follower.pid)
                follower.kill()
                follower.wait()

    def _wait_left(self, deadline: float) -> None:
        """Waits until every follower said it left the group, died (end of file) or `deadline`."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())) and conn.recv_bytes() == LEFT:
                    continue
            except (EOFError, OSError):  # it died: nothing to wait for
                continue
            logger.error("tensor-parallel rank %d did not leave the group in time; going on", rank)

    @staticmethod
    def _leave_group(tp: TensorParallel) -> None:
        """Leaves the process group while the followers leave theirs: with NCCL each rank's
        destroy waits for the others', so rank 0 must not wait for its followers to exit first. A
        destroy that does not return (a follower died) is left behind after STOP_TIMEOUT_S."""
        if not dist.is_initialized():
            return
        leaving = threading.Thread(target=leave_group, args=(tp,), name="tp-leave-group", daemon=True)
        leaving.start()
        leaving.join(STOP_TIMEOUT_S)
        if leaving.is_alive():
            logger.error(
                "leaving the tensor-parallel group did not finish in %.0f s; going on", STOP_TIMEOUT_S
            )

    def _watch(self, rank: int, follower: subprocess.Popen[bytes]) -> None:
        code = follower.wait()
        if not self._closing.is_set():
            self._exit_rank_lost(rank, code)

    @staticmethod
    def _exit_rank_lost(rank: int, code: int) -> NoReturn:
        logger.critical(
            "tensor-parallel rank %d exited with code %s: its group cannot go on; exiting", rank, code
        )
        logging.shutdown()
        os._exit(EXIT_RANK_LOST)


class Follower(Ranks):
    """Ranks 1..N-1: receive rank 0's commands and what it shares."""

    is_driver = False

    def __init__(self, tp: TensorParallel, conn: Connection):
        self.tp = tp
        self.conn = conn

    def recv(self) -> Any:
        return decode(self.conn.recv_bytes())

    def share(self, make: Callable[[], T]) -> T:
        value: T = self.recv()
        return value

    def say_left(self) -> None:
        """Tells rank 0 this rank left the group, then waits until rank 0 lets it go (closes the
        socket: every rank left, or rank 0 died)."""
        with contextlib.suppress(OSError):
            self.conn.send_bytes(LEFT)
        with contextlib.suppress(EOFError, OSError):
            while True:
                self.conn.recv_bytes()


def start_ranks(config: EngineConfig, max_model_len: int) -> Ranks:
    """The group this engine runs on: itself alone, or rank 0 of `tensor_parallel_size`."""
    if config.tensor_parallel_size == 1:
        return Ranks()
    return Driver.start(config, max_model_len)


def join_group(config: EngineConfig, rank: int, size: int, store: dist.Store) -> TensorParallel:
    """Joins the ranks' process group: NCCL between CUDA devices (rank r on the r-th device from
    the config's), gloo on CPU."""
    device = config.rank_device(rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=GROUP_TIMEOUT)
    if device.type == "cpu":  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    peer = open_peer_all_reduce(dist.group.WORLD, device) if config.peer_all_reduce else None
    # the default group, not a reference to it: nothing then keeps the group's threads and sockets
    # alive past `leave_group`, to be torn down at interpreter exit, after the other ranks left
    return TensorParallel(rank, size, None, peer)


def leave_group(tp: TensorParallel) -> None:
    """Frees what the group holds on this rank (the peer all-reduce's buffers), then leaves it."""
    if tp.peer is not None:
        tp.peer.close()
    dist.destroy_process_group()


def _spawn_follower() -> tuple[subprocess.Popen[bytes], Connection]:
    """A follower process running this same code (`services.engine.tp_follower`), and its socket."""
    ours, theirs = socket.socketpair()
    repo = str(Path(services.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    # not the working directory first on the path (what `-m` does; Python 3.11 on), so the follower
    # imports rank 0's code even where the working directory holds another copy of the project
    env["PYTHONSAFEPATH"] = "1"
    argv = [sys.executable, "-m", "services.engine.tp_follower", "--fd", str(theirs.fileno())]
    follower = subprocess.Popen(
        [*argv, "--parent-pid", str(os.getpid())], pass_fds=(theirs.fileno(),), env=env
    )
    theirs.close()
    return follower, Connection(ours.detach())
