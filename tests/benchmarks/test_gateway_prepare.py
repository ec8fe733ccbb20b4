"""The gateway-prepare benchmark times every piece and both paths, in-process and through HTTP, for
completions and chat."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from benchmarks.gateway_prepare import main


def test_times_each_piece_and_both_paths_of_both_endpoints(
    make_checkpoint: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    main(
        [
            "--model",
            str(make_checkpoint("llama")),
            "--num-requests",
            "3",
            "--max-tokens",
            "2",
            "--max-model-len",
            "65536",
        ]
    )
    out = capsys.readouterr().out
    for line in ("completion_job (whole)", "chat_job (whole)", "chat template", "stamp + msgpack Submit"):
        assert line in out
    assert out.count("inline / pooled median") == 4
    assert out.count("through HTTP, client send to encoded Submit") == 2


def test_refuses_no_requests(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--num-requests", "0"])
    assert "--num-requests must be at least 1" in capsys.readouterr().err
