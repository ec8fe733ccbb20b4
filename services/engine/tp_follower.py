"""A tensor-parallel follower: rank 1..N-1 of an engine, running rank 0's steps on its shards.

    receive a command (services/engine/tensor_parallel.py) → run it on this rank's model runner

Started by rank 0 (`Driver.start`) as `python -m services.engine.tp_follower --fd N --parent-pid P`;
it builds the same model runner as rank 0 over its slices of the model, captures the same CUDA
graphs, then follows. It dies with rank 0 (a parent-death signal, and end of file on its socket).
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import logging
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection

import torch.distributed as dist

from services.engine.model_runner import ModelRunner
from services.engine.spec_decode.drafter import make_device_proposers, own_proposer
from services.engine.tensor_parallel import (
    CompareRows,
    ExportBlocks,
    Follower,
    FollowerSetup,
    ImportBlocks,
    StepCommand,
    Stop,
    join_group,
    leave_group,
)
from shared.model import ModelConfig

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def follow(runner: ModelRunner, ranks: Follower) -> None:
    """Runs rank 0's commands until it says stop."""
    while True:
        command = ranks.recv()
        if isinstance(command, StepCommand):
            runner.follow_step(command)
        elif isinstance(command, ImportBlocks):
            runner.import_blocks(command.cache, command.index, command.block_ids)
        elif isinstance(command, ExportBlocks):
            runner.export_blocks(command.block_ids)
        elif isinstance(command, CompareRows):
            runner.rows_agree()
        elif isinstance(command, Stop):
            return
        else:
            raise TypeError(f"unknown tensor-parallel command {type(command).__name__}")


def serve(conn: Connection) -> None:
    setup: FollowerSetup = pickle.loads(conn.recv_bytes())
    config = setup.config
    store = dist.TCPStore("127.0.0.1", setup.store_port, setup.size, is_master=False)
    ranks = Follower(join_group(config, setup.rank, setup.size, store), conn)
    spec = config.speculative_config
    runner = ModelRunner(config, ModelConfig.from_dir(config.model), setup.max_model_len, spec, ranks)
    proposers = make_device_proposers(spec, runner)
    runner.start(list(proposers.values()), own_proposer(list(proposers), spec.method))
    logger.info("tensor-parallel rank %d of %d ready on %s", setup.rank, setup.size, runner.device)
    try:
        follow(runner, ranks)
    finally:
        runner.close()  # its CUDA graphs first: they hold the group's communicator
        leave_group(ranks.tp)
    logger.info("tensor-parallel rank %d left the group", setup.rank)
    ranks.say_left()


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when rank 0 dies; named for `ps`."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(PR_SET_NAME, b"tp-follower")
    if os.getppid() != parent_pid:  # rank 0 died before the signal was armed
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.engine.tp_follower")
    parser.add_argument("--fd", type=int, required=True, help="this end of rank 0's socket")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 stops it
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-follower %(levelname)s %(message)s")
    conn = Connection(args.fd)
    try:
        serve(conn)
    except EOFError:
        logger.warning("rank 0 closed the socket; stopping")
    finally:
        conn.close()
    return 0


def exit_now(code: int) -> None:
    """Ends the process without the interpreter's teardown: a follower has nothing left to save
    once it left the group, and the teardown would destroy what native threads (the process
    group's, the CUDA runtime's) may still hold, in an order nobody chose."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    faulthandler.enable()  # a native crash prints every thread's Python stack
    exit_now(main())
