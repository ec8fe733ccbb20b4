"""An engine core's CPUs: parsed lists, `auto` taking free CPUs from the highest down and never two
cores the same one, a lock that goes with its holder however it exits, and the bus side off them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from services.worker import cpus
from services.worker.cpus import bus_side_cpus, claim_core_cpus, set_thread_policy
from shared.config import EngineConfig, parse_cpu_list

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def four_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "usable_cpus", lambda: [0, 1, 2, 3])


def test_cpu_lists_parse_as_taskset_takes_them() -> None:
    assert parse_cpu_list("3") == [3]
    assert parse_cpu_list("2,0") == [0, 2]
    assert parse_cpu_list("4-6, 1") == [1, 4, 5, 6]
    for bad in ("", "x", "3-1", "1-", "-2", "1,,2"):
        with pytest.raises(ValueError, match="not auto, off or a CPU list"):
            parse_cpu_list(bad)


def test_a_bad_core_cpus_setting_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="core_cpus 'half'"):
        EngineConfig(model="m", device="cpu", core_cpus="half")


@pytest.mark.usefixtures("four_cpus")
def test_auto_takes_free_cpus_from_the_highest_and_none_twice(tmp_path: Path) -> None:
    first = claim_core_cpus("auto", 1, tmp_path)
    second = claim_core_cpus("auto", 1, tmp_path)
    assert (first.cpus, second.cpus) == ([3], [2])
    wide = claim_core_cpus("auto", 8, tmp_path)  # at most all but one, and only free ones: none
    assert wide.cpus == [] and wide.locks == []
    pair = claim_core_cpus("auto", 2, tmp_path)
    assert pair.cpus == [0, 1]
    assert claim_core_cpus("auto", 1, tmp_path).cpus == []  # every CPU is held: unpinned
    first.release()
    assert claim_core_cpus("auto", 1, tmp_path).cpus == [3]
    assert bus_side_cpus(pair.cpus) == [2, 3]
    assert bus_side_cpus([]) == []


@pytest.mark.usefixtures("four_cpus")
def test_named_cpus_must_leave_one_to_the_bus_side(tmp_path: Path) -> None:
    assert claim_core_cpus("1-2", 1, tmp_path).cpus == [1, 2]
    with pytest.raises(ValueError, match=r"CPUs \[7\] are not among"):
        claim_core_cpus("3,7", 1, tmp_path)
    with pytest.raises(ValueError, match="none left for the bus side"):
        claim_core_cpus("0-3", 1, tmp_path)
    assert claim_core_cpus("off", 1, tmp_path).cpus == []


def test_auto_pins_nothing_on_a_small_host_and_a_list_nothing_on_one_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpus, "usable_cpus", lambda: [0, 1, 2])
    assert claim_core_cpus("auto", 1, tmp_path).cpus == []
    assert claim_core_cpus("2", 1, tmp_path).cpus == [2]  # named: the operator's choice
    monkeypatch.setattr(cpus, "usable_cpus", lambda: [5])
    assert claim_core_cpus("auto", 1, tmp_path).cpus == []
    assert claim_core_cpus("5", 1, tmp_path).cpus == []


HOLDER = """
import sys, time
from pathlib import Path
from services.worker import cpus
cpus.usable_cpus = lambda: [0, 1, 2, 3]
print(cpus.claim_core_cpus("auto", 1, Path(sys.argv[1])).cpus, flush=True)
time.sleep(60)
"""


@pytest.mark.usefixtures("four_cpus")
def test_a_killed_core_leaves_its_cpu(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "[3]"
        assert claim_core_cpus("auto", 1, tmp_path).cpus == [2]
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        assert claim_core_cpus("auto", 1, tmp_path).cpus == [3]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_a_batch_thread_keeps_batch_for_the_threads_it_starts_and_the_others_stay_normal() -> None:
    """The bus side's policy (`--bus-side-policy batch`): its thread and what it starts later; the
    process's other threads (and an engine core started before) keep theirs."""
    seen: dict[str, int] = {}

    def bus_side() -> None:
        set_thread_policy("batch")
        seen["bus_side"] = os.sched_getscheduler(0)
        later = threading.Thread(target=lambda: seen.update(started_later=os.sched_getscheduler(0)))
        later.start()
        later.join()
        set_thread_policy("normal")
        seen["restored"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=bus_side)
    thread.start()
    thread.join()
    assert seen == {"bus_side": os.SCHED_BATCH, "started_later": os.SCHED_BATCH, "restored": os.SCHED_OTHER}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="normal or batch"):
        set_thread_policy("fifo")
    with pytest.raises(ValueError, match="bus_side_policy"):
        EngineConfig(model="m", bus_side_policy="idle")  # type: ignore[arg-type]
