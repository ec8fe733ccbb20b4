"""Workers started with --tensor-parallel-size 2 serving through a real mesh: a prefill worker
whose KV is gathered from its two ranks, handed over TCP to a decode worker that scatters it to
its own two ranks; the ranks stop with their worker."""

from __future__ import annotations

import signal

from services.engine.llm import LLM
from tests.mesh.harness import child_pid, pid_alive
from tests.mesh.test_openai_mesh import GREEDY, PROMPTS, client, deploy, expected_text


def test_split_workers_of_two_ranks_each_serve_the_offline_output(tmp_path_factory, mesh_model) -> None:
    mesh = deploy(tmp_path_factory, mesh_model, True, worker_flags=("--tensor-parallel-size", "2"))
    try:
        sdk = client(mesh)
        offline = LLM(mesh_model, device="cpu", max_model_len=1024)
        for prompt in PROMPTS[:2]:
            response = sdk.completions.create(model="tiny", prompt=prompt, **GREEDY)
            assert response.choices[0].text == expected_text(offline, prompt)
        decode = mesh.processes["decode"]
        follower = child_pid(child_pid(decode.popen.pid, "engine-core"), "tp-follower")
        decode.popen.send_signal(signal.SIGTERM)
        assert decode.popen.wait(timeout=60) == 0
        assert not pid_alive(follower)
    finally:
        mesh.stop()
