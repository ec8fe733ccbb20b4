"""`--bus-side-policy batch`: a real mixed worker's bus side runs under SCHED_BATCH (a step batch
waking it preempts nobody) while its engine core, started before, keeps the normal policy."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.mesh.harness import LocalMesh, child_pid
from tests.mesh.test_bus_recovery import WORKER_FLAGS

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")


@pytest.mark.parametrize("policy", ["batch", "normal"])
def test_only_the_bus_side_takes_the_batch_policy(mesh_factory: Any, mesh_model: str, policy: str) -> None:
    mesh: LocalMesh = mesh_factory(f"policy-{policy}")
    worker = mesh.start_role(
        "w1",
        "mixed",
        "--model",
        mesh_model,
        "--instance-id",
        "w1",
        "--bus-side-policy",
        policy,
        *WORKER_FLAGS,
    )  # returns once the worker serves its status port: its policy is set by then
    core = child_pid(worker.popen.pid, "engine-core")
    expected = os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER
    assert os.sched_getscheduler(worker.popen.pid) == expected
    assert os.sched_getscheduler(core) == os.SCHED_OTHER
