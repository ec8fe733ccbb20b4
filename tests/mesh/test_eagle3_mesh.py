"""`eagle3` through real deployments (redis-server, scheduler, gateway and workers as processes):
a mixed worker, and a prefill + decode pair that hands the EAGLE-3 head's KV over with the
target's; greedy completions are the offline engine's."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from services.engine.llm import LLM
from shared.reference import EAGLE3_HEAD, reference_dir
from shared.sampling_params import SamplingParams
from tests.mesh.harness import LocalMesh

PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:"]
MAX_TOKENS = 24
SPEC = {"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module", params=["mixed", "split"])
def deployment(request, tmp_path_factory, mesh_model) -> Iterator[LocalMesh]:
    spec = json.dumps({**SPEC, "model": str(reference_dir(EAGLE3_HEAD))})
    mesh = LocalMesh(tmp_path_factory.mktemp(request.param))
    mesh.start_redis()
    mesh.start_role("scheduler", "scheduler")
    roles = ("mixed",) if request.param == "mixed" else ("prefill", "decode")
    for role in roles:
        flags = (
            "--device",
            "cpu",
            "--max-model-len",
            "1024",
            "--no-suffix-cache",
            "--speculative-config",
            spec,
        )
        mesh.start_role(role, role, "--model", mesh_model, "--instance-id", role, *flags)
    mesh.gateway_port = mesh.start_gateway(mesh_model, "--served-model-name", "tiny")  # type: ignore[attr-defined]
    yield mesh
    mesh.stop()


def test_eagle3_completions_match_the_offline_engine(deployment, mesh_model) -> None:
    offline = LLM(mesh_model, device="cpu", max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base_url = f"http://127.0.0.1:{deployment.gateway_port}/v1"  # type: ignore[attr-defined]
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0) as sdk:
        for prompt in PROMPTS:
            response = sdk.completions.create(
                model="tiny",
                prompt=prompt,
                temperature=0.0,
                max_tokens=MAX_TOKENS,
                extra_body={"ignore_eos": True},
            )
            assert response.choices[0].text == offline.generate(prompt, params)[0].text
