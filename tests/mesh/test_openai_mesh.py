"""The official OpenAI SDK against real deployments: a mixed worker; one prefill + one decode; and
one prefill + one decode, with the shared suffix cache, where every role is its own Redis ACL user
(the default user off) and the KV transport is authenticated."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator

import aiohttp
import jsonschema
import openai
import pytest

from services.engine.llm import LLM
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutput
from tests.mesh.harness import LocalMesh, metric_value

WORKER_FLAGS = ("--device", "cpu", "--max-model-len", "1024", "--no-suffix-cache")
PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:", "import os", "The quick brown fox"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def offline(mesh_model) -> LLM:
    return LLM(mesh_model, device="cpu", max_model_len=1024)


def expected_text(llm: LLM, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompt, params)[0].text


def expected_chat(llm: LLM, content: str) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.chat([{"role": "user", "content": content}], params).text


SECURE_WORKER_FLAGS = (
    "--device",
    "cpu",
    "--max-model-len",
    "1024",
    "--speculative-config",
    json.dumps({"method": "suffix"}),
)
"""Drafting from the shared suffix cache, so that its service and the decode worker's client run
as their users too (drafts never change greedy output)."""


def deploy(
    tmp_path_factory, mesh_model: str, split: bool, secure: bool = False, worker_flags: tuple[str, ...] = ()
) -> LocalMesh:
    """`worker_flags`: added to every worker's command line."""
    mesh = LocalMesh(
        tmp_path_factory.mktemp("split" if split else "mixed"),
        acl_users=secure,
        kv_secret=secrets.token_hex(32) if secure else None,
    )
    mesh.start_redis()
    mesh.start_role("scheduler", "scheduler")
    if secure:
        mesh.start_role("suffix-cache", "suffix-cache")
    roles = ("prefill", "decode") if split else ("mixed",)
    for role in roles:
        flags = SECURE_WORKER_FLAGS if secure else WORKER_FLAGS
        mesh.start_role(role, role, "--model", mesh_model, "--instance-id", role, *flags, *worker_flags)
    mesh.gateway_port = mesh.start_gateway(mesh_model, "--served-model-name", "tiny")  # type: ignore[attr-defined]
    return mesh


@pytest.fixture(scope="module", params=["mixed", "split", "split-acl"])
def deployment(request, tmp_path_factory, mesh_model) -> Iterator[LocalMesh]:
    mesh = deploy(tmp_path_factory, mesh_model, request.param != "mixed", request.param == "split-acl")
    yield mesh
    mesh.stop()


def client(mesh: LocalMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.gateway_port}/v1", api_key="none", max_retries=0)  # type: ignore[attr-defined]


def async_client(mesh: LocalMesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{mesh.gateway_port}/v1", api_key="none", max_retries=0, timeout=120
    )  # type: ignore[attr-defined]


GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})


def test_completions_match_the_offline_engine(deployment, offline) -> None:
    sdk = client(deployment)
    for prompt in PROMPTS[:3]:
        response = sdk.completions.create(model="tiny", prompt=prompt, **GREEDY)
        assert response.choices[0].text == expected_text(offline, prompt)
        assert response.usage.completion_tokens == MAX_TOKENS
        stream = sdk.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected_text(
            offline, prompt
        )


def test_chat_matches_the_offline_engine(deployment, offline) -> None:
    sdk = client(deployment)
    messages = [{"role": "user", "content": "hi there"}]
    response = sdk.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert response.choices[0].message.content == expected_chat(offline, "hi there")
    stream = sdk.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected_chat(offline, "hi there")


def test_64_concurrent_streams_arrive_intact_and_in_order(deployment, offline) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    want = {p: expected_text(offline, p, 12) for p in prompts}

    async def one(sdk: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await sdk.completions.create(
            model="tiny",
            prompt=prompt,
            stream=True,
            temperature=0.0,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def all_of_them() -> list[str]:
        sdk = async_client(deployment)
        try:
            return await asyncio.gather(*(one(sdk, p) for p in prompts))
        finally:
            await sdk.close()

    got = asyncio.run(all_of_them())
    assert got == [want[p] for p in prompts]


def test_bad_requests_get_openai_errors(deployment) -> None:
    sdk = client(deployment)
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model="tiny", prompt="x", temperature=-1)
    assert "temperature" in bad.value.message
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        sdk.completions.create(model="tiny", prompt="x " * 1100, max_tokens=10)
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="not-served", prompt="x")

    async def post_garbage() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{deployment.gateway_port}/v1/completions"  # type: ignore[attr-defined]
            async with http.post(
                url, data=b"{not json", headers={"Content-Type": "application/json"}
            ) as response:
                return response.status, await response.json()

    status, body = asyncio.run(post_garbage())
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_client_disconnect_frees_the_blocks(deployment) -> None:
    worker = "decode" if "decode" in deployment.processes else "mixed"
    total = metric_value(deployment.metrics(worker), "specmesh_worker_kv_free_blocks")
    url = f"http://127.0.0.1:{deployment.gateway_port}/v1/completions"  # type: ignore[attr-defined]
    body = {
        "model": "tiny",
        "prompt": "def add(a, b):",
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
    }

    async def leave_mid_stream() -> None:
        async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
            lines = 0
            async for _ in response.content:
                lines += 1
                if lines >= 6:
                    break  # leave mid-stream: the connection closes with the session

    asyncio.run(leave_mid_stream())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = deployment.metrics(worker)
        if metric_value(text, "specmesh_worker_requests_finished_total", default=0.0, reason="abort") >= 1:
            break
        time.sleep(0.2)
    assert metric_value(text, "specmesh_worker_requests_finished_total", reason="abort") >= 1
    assert metric_value(deployment.metrics(worker), "specmesh_worker_kv_free_blocks") >= total


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def test_structured_output_matches_the_offline_engine(deployment, offline) -> None:
    """The grammar travels with the request to the workers (and from prefill to decode): the mesh's
    constrained output is the offline engine's, and it follows its grammar."""
    with client(deployment) as sdk:
        check_structured_output(sdk, offline)


def check_structured_output(sdk: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": STRUCTURED_SCHEMA}}
    chat = sdk.chat.completions.create(
        model="tiny", messages=messages, temperature=0.0, max_tokens=48, response_format=schema_format
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=48, structured=StructuredOutput.json_schema(STRUCTURED_SCHEMA)
    )
    assert chat.choices[0].message.content == offline.chat(messages, params).text
    if chat.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(chat.choices[0].message.content), STRUCTURED_SCHEMA)
    choices = ["def add", "class Point", "import os"]
    with sdk.completions.create(
        model="tiny",
        prompt=PROMPTS[1],
        temperature=0.0,
        max_tokens=16,
        stream=True,
        extra_body={"guided_choice": choices},
    ) as stream:
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    choice_params = SamplingParams(
        temperature=0.0, max_tokens=16, structured=StructuredOutput.choice(choices)
    )
    assert text == offline.generate(PROMPTS[1], choice_params)[0].text
    assert text in choices
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        sdk.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_regex": "(a"})


@pytest.mark.parametrize("deployment", ["split"], indirect=True)
def test_echo_with_logprobs_through_prefill_and_decode(deployment, offline) -> None:
    """The prefill worker scores the prompt and its logprobs ride with the first token to the
    gateway, the decode worker's tokens follow: the offline engine's prompt logprobs, whole and
    streamed. (Only the prefill worker's values are compared: the decode worker's output logprobs
    are one token off in a split deployment, a fault of their own.)"""
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    [want] = offline.generate(PROMPTS[0], params)
    assert want.prompt_logprobs is not None and want.logprobs is not None
    # the prompt's positions 1.., then the first token (sampled by the prefill worker)
    want_logprobs = [e.logprob for e in want.prompt_logprobs[1:]] + [want.logprobs[0].logprob]
    num_prompt = len(want.prompt_token_ids)
    with client(deployment) as sdk:
        response = sdk.completions.create(model="tiny", prompt=PROMPTS[0], echo=True, logprobs=2, **GREEDY)
        with sdk.completions.create(
            model="tiny", prompt=PROMPTS[0], echo=True, logprobs=2, stream=True, **GREEDY
        ) as stream:
            chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    [choice] = response.choices
    assert choice.text == PROMPTS[0] + want.text
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == num_prompt + MAX_TOKENS
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1 : num_prompt + 1] == pytest.approx(want_logprobs, abs=1e-3)
    assert choice.logprobs.top_logprobs[1] == {
        offline.tokenizer.token_to_text(t): pytest.approx(v, abs=1e-3)
        for t, v in want.prompt_logprobs[1].top.items()
    }
    assert chunks[0].text == PROMPTS[0] and len(chunks[0].logprobs.tokens) == num_prompt
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1 : num_prompt + 1] == pytest.approx(want_logprobs, abs=1e-3)
    assert "".join(c.text for c in chunks) == PROMPTS[0] + want.text
