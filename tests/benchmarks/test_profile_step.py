"""benchmarks.profile_step --phases: each method's steps timed phase by phase, the engine left as it was."""

from __future__ import annotations

import pytest

from benchmarks import profile_step
from services.engine import model_runner
from shared.reference import default_model


@pytest.mark.parametrize("clock", [[], ["--cpu-time"]], ids=["wall", "cpu"])
def test_phases_are_timed_for_each_method(capsys: pytest.CaptureFixture[str], clock: list[str]) -> None:
    profile_step.main(
        ["--model", default_model(), "--dtype", "float32", "--device", "cpu", "--num-requests", "2",
         "--max-tokens", "6", "--phases", "--methods", "ngram", *clock]
    )  # fmt: skip
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if " steps, " in line]
    assert [h.split(":")[0] for h in headers] == ["naive", "ngram"]  # naive first, as the baseline
    for header in headers:
        assert int(header.split(": ")[1].split()[0]) >= 6  # at least one step a token of a request
    phases = {line.split()[0] for line in out.splitlines() if line.endswith("us a step")}
    assert {"engine.step", "result(wait)", "runner.launch", "drafter.plan", "scheduler.schedule"} <= phases
    assert not hasattr(model_runner.LaunchedStep.result, "__wrapped__")  # the timing is undone


def test_kernels_without_a_gpu_is_refused_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """--kernels reads the CUDA profiler: on a CPU it says why it cannot run, before loading a model."""
    with pytest.raises(SystemExit) as exit_info:
        profile_step.main(["--device", "cpu", "--kernels"])
    assert exit_info.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err
