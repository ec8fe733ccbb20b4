"""Suffix decoding in worker processes drafts as the in-process proposer does, and never blocks a step."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.sequence import Sequence
from services.engine.spec_decode.proposer import DraftBatch, Proposer
from services.engine.spec_decode.suffix import SuffixConfig, SuffixProposer
from services.engine.spec_decode.suffix_workers import SuffixWorkers
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

PARAMS = SamplingParams(temperature=0.0, max_tokens=1000)


def propose(proposer: Proposer, seqs: list[Sequence], k: int) -> list[list[int]]:
    drafts = proposer.propose(DraftBatch.on_host(None, seqs, [k] * len(seqs)))  # type: ignore[arg-type]
    return [row[:n] for row, n in zip(drafts.token_ids.tolist(), drafts.num_drafts.tolist())]


def keep(proposers: list[Proposer], seq: Sequence, token_ids: list[int]) -> None:
    seq.token_ids += token_ids
    for proposer in proposers:
        proposer.append(seq, token_ids)


def test_workers_draft_as_one_in_process_proposer() -> None:
    """Requests run two at a time on two workers, finish, and later ones draft from their outputs
    (from either worker): with the workers flushed before each step, every draft equals the
    in-process proposer's, and some come from the global trees."""
    rng = random.Random(3)
    config = SuffixConfig(max_tree_depth=8, max_cached_requests=6)
    workers = SuffixWorkers(config, num_workers=2, deadline_s=30.0)
    try:
        in_process, own_only = SuffixProposer(config), SuffixProposer(SuffixConfig(8, max_cached_requests=0))
        proposers: list[Proposer] = [workers, in_process, own_only]
        shared_output = [rng.randrange(5) for _ in range(40)]
        num_from_global = 0
        for pair in range(4):
            seqs = [
                Sequence(f"r{pair}-{i}", [rng.randrange(5) for _ in range(6)], PARAMS, frozenset())
                for i in range(2)
            ]
            outputs = [shared_output[: rng.randint(15, 40)] + [rng.randrange(5)] for _ in seqs]
            for proposer in proposers:
                for seq in seqs:
                    proposer.start(seq)
            for step in range(max(len(out) for out in outputs)):
                running = [s for s, out in zip(seqs, outputs) if step < len(out)]
                workers.flush()
                drafted, expected, own = (propose(p, running, 4) for p in proposers)
                assert drafted == expected
                num_from_global += drafted != own
                for seq, out in zip(seqs, outputs):
                    if step < len(out):
                        keep(proposers, seq, [out[step]])
                        if step == len(out) - 1:
                            for proposer in proposers:
                                proposer.forget(seq.request_id)
        assert num_from_global > 0
    finally:
        workers.close()


def test_a_late_worker_drafts_nothing_that_step_and_catches_up() -> None:
    config = SuffixConfig(max_tree_depth=8)
    workers = SuffixWorkers(config, num_workers=2, deadline_s=0.3)
    reference = SuffixProposer(config)
    try:
        seqs = [Sequence(f"r{i}", [1, 2, 3, 4] * 3, PARAMS, frozenset()) for i in range(2)]
        for proposer in (workers, reference):
            for seq in seqs:
                proposer.start(seq)
        stopped = workers._processes[workers._worker_of["r1"]].pid
        assert stopped is not None and workers._worker_of["r0"] != workers._worker_of["r1"]
        os.kill(stopped, signal.SIGSTOP)
        try:
            assert propose(workers, seqs, 3) == [propose(reference, seqs[:1], 3)[0], []]
        finally:
            os.kill(stopped, signal.SIGCONT)
        keep([workers, reference], seqs[1], [1, 2])  # tokens sent with the late step and after it
        workers.deadline_s = 30.0
        assert propose(workers, seqs, 3) == propose(reference, seqs, 3) == [[1, 2, 3], [3, 4, 1]]
    finally:
        workers.close()


def test_a_worker_that_died_is_named_in_the_error() -> None:
    workers = SuffixWorkers(num_workers=1, deadline_s=30.0)
    try:
        seq = Sequence("r", [1, 2, 3, 1, 2], PARAMS, frozenset())
        workers.start(seq)
        workers._processes[0].kill()
        with pytest.raises(RuntimeError, match="suffix worker 0 exited"):
            propose(workers, [seq], 2)
    finally:
        workers.close()


def test_bad_settings_are_rejected_and_close_stops_the_workers() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        SuffixWorkers(num_workers=0)
    with pytest.raises(ValueError, match="deadline_s"):
        SuffixWorkers(deadline_s=0)
    workers = SuffixWorkers(num_workers=1)
    workers.close()
    assert all(process.poll() is not None for process in workers._processes)


def test_a_script_without_a_main_guard_can_use_workers(tmp_path: Path) -> None:
    """Workers do not re-run the user's main module (multiprocessing's spawn would, and a script
    that builds an engine at its top level would build one again in every worker)."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from services.engine.sequence import Sequence\n"
        "from services.engine.spec_decode.proposer import DraftBatch\n"
        "from services.engine.spec_decode.suffix_workers import SuffixWorkers\n"
        "from shared.sampling_params import SamplingParams\n"
        "print('script ran')\n"
        "workers = SuffixWorkers(num_workers=1, deadline_s=30.0)\n"
        "seq = Sequence('r', [1, 2, 3, 1, 2], SamplingParams(temperature=0.0), frozenset())\n"
        "workers.start(seq)\n"
        "print(workers.propose(DraftBatch.on_host(None, [seq], [2])).token_ids.tolist())\n"
        "workers.close()\n"
    )
    root = Path(__file__).resolve().parents[4]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["script ran", "[[3, 1]]"]
