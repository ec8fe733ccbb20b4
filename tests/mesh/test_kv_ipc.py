"""The ipc KV transport in a real split mesh: prefill and decode workers (each with its engine-core
process) hand the KV over through shared memory, and greedy output is token for token what the
same workers produce over TCP (and the offline engine), with MTP and with n-gram drafting."""

from __future__ import annotations

import json
import os
import time

import openai
import pytest

from services.engine.llm import LLM
from services.kv_transport.ipc_buffer import SHM_DIR, SHM_PREFIX
from services.serve import default_speculative_config
from shared.sampling_params import SamplingParams
from shared.speculative_config import SpeculativeConfig
from tests.mesh.harness import LocalMesh, child_pid, metric_value

PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:"]
MAX_TOKENS = 16
WORKER_FLAGS = ("--device", "cpu", "--max-model-len", "512", "--no-suffix-cache")


def speculative_config(method: str, model: str) -> str:
    if method == "mtp":
        return default_speculative_config(model, "cpu")  # the shipped model's MTP head, with n-grams
    return json.dumps({"method": "ngram", "num_speculative_tokens": 4})


def start_workers(mesh: LocalMesh, model: str, spec: str, transport: str) -> None:
    for role in ("prefill", "decode"):
        flags = ("--model", model, "--speculative-config", spec, "--kv-transport", transport)
        if transport == "tcp":
            flags += ("--kv-stream-layers",)
        mesh.start_role(
            f"{role}-{transport}", role, "--instance-id", f"{role}-{transport}", *flags, *WORKER_FLAGS
        )


def stop_workers(mesh: LocalMesh, transport: str) -> None:
    for role in ("prefill", "decode"):
        mesh.kill(f"{role}-{transport}", sig=15)


def completions(mesh: LocalMesh) -> list[str]:
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.gateway_port}/v1", api_key="none", max_retries=0)  # type: ignore[attr-defined]
    texts = []
    for prompt in PROMPTS:
        response = sdk.completions.create(
            model="tiny",
            prompt=prompt,
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )
        texts.append(response.choices[0].text)
    return texts


def handoffs(mesh: LocalMesh, name: str, path: str) -> float:
    return metric_value(mesh.metrics(name), "specmesh_worker_kv_handoffs_total", 0.0, path=path)


def shared_files(pid: int) -> list[str]:
    return [name for name in os.listdir(SHM_DIR) if name.startswith(f"{SHM_PREFIX}{pid}-")]


@pytest.mark.timeout(420)  # four workers start one after another on 2 shared cores
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_ipc_handoff_gives_the_tcp_paths_greedy_tokens(tmp_path, mesh_model, method) -> None:
    spec = speculative_config(method, mesh_model)
    mesh = LocalMesh(tmp_path)
    try:
        mesh.start_redis()
        mesh.start_role("scheduler", "scheduler")
        start_workers(mesh, mesh_model, spec, "tcp")
        mesh.gateway_port = mesh.start_gateway(mesh_model, "--served-model-name", "tiny")  # type: ignore[attr-defined]
        over_tcp = completions(mesh)
        assert handoffs(mesh, "prefill-tcp", "streamed") == len(PROMPTS)  # --kv-stream-layers
        stop_workers(mesh, "tcp")

        start_workers(mesh, mesh_model, spec, "ipc")
        over_ipc = completions(mesh)
        assert handoffs(mesh, "prefill-ipc", "shared") == len(PROMPTS)
        assert handoffs(mesh, "prefill-ipc", "bytes") == 0
        core = child_pid(mesh.processes["prefill-ipc"].popen.pid, "engine-core")
        deadline = time.monotonic() + 10
        while shared_files(core) and time.monotonic() < deadline:  # released once acknowledged
            time.sleep(0.1)
        assert shared_files(core) == []
    finally:
        mesh.stop()
    assert over_ipc == over_tcp
    offline = LLM(
        mesh_model, device="cpu", max_model_len=512, speculative_config=SpeculativeConfig.from_json(spec)
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert over_ipc == [offline.generate(prompt, params)[0].text for prompt in PROMPTS]
