"""The ipc KV transport on GPUs: a prefill process's KV in its GPU memory is opened by handle in
another process (on the same GPU, and on a second one where the host has it) and arrives bit-exact;
two engine-core processes hand a request's KV over in device memory and the decode core continues
the offline run's tokens exactly. Run by `scripts/gpu_check.sh kvipc`."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.llm import LLM
from services.kv_transport.ipc import IpcKVTransport
from services.kv_transport.ipc_buffer import SharedBuffers, SharedKV, open_shared
from services.worker.core_client import EngineCoreClient
from services.worker.core_messages import CoreOptions
from shared.config import EngineConfig
from shared.protocol import GenerateRequest
from shared.sampling_params import SamplingParams
from tests.services.worker.test_engine_core import run_to_end

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[3]
SHAPE = (4, 2, 3, 16, 2, 64)  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
DEVICE_PAIRS = [("cuda:0", "cuda:0"), ("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")]


def needs(*devices: str) -> Any:
    count = max(int(device.split(":")[1]) for device in devices) + 1
    return pytest.mark.skipif(torch.cuda.device_count() < count, reason=f"needs {count} CUDA devices")


def expected_kv() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


PRODUCER = textwrap.dedent(
    """
    import asyncio, sys
    import torch
    from services.kv_transport import KVHeader
    from services.kv_transport.ipc import IpcKVTransport
    from services.kv_transport.ipc_buffer import SharedBuffers
    from tests.services.kv_transport.test_ipc_gpu import SHAPE, expected_kv

    async def main(address, device):
        buffers = SharedBuffers(torch.device(device))
        baseline = torch.cuda.memory_allocated(device)
        buffer = buffers.allocate(torch.Size(SHAPE).numel() * 2)
        target = buffer.view(torch.bfloat16).view(SHAPE)
        target.copy_(expected_kv().to(device, non_blocking=True))  # no host wait: the handle's event orders it
        shared = buffers.share("r", buffer, {"target": target}, {})
        header = KVHeader(request_id="r", num_tokens=48, block_size=16, dtype="bfloat16",
                          layer_shapes=shared.layer_shapes())
        transport = IpcKVTransport()
        async with await transport.open(address, header) as session:
            refusal = await session.send_shared(shared)
            assert refusal is None, refusal
            await session.close()
        del target, buffer
        buffers.release("r")
        await transport.close()
        print("released", torch.cuda.memory_allocated(device) - baseline, flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.parametrize(
    ("producer", "consumer"),
    [pytest.param(*pair, marks=needs(*pair), id="->".join(pair)) for pair in DEVICE_PAIRS],
)
async def test_kv_in_one_processs_gpu_memory_is_opened_in_another(producer: str, consumer: str) -> None:
    received: dict[str, torch.Tensor] = {}
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def import_shared(request_id: str, shared: SharedKV) -> dict[str, torch.Tensor]:
        caches, _ = open_shared(shared)
        assert caches["target"].is_cuda
        copy = caches["target"].to(consumer)
        torch.cuda.synchronize(consumer)
        received["target"] = copy.cpu()
        return {}

    receiver = IpcKVTransport(import_shared=import_shared)
    address = await receiver.start("127.0.0.1", 0, advertise_host="127.0.0.1")
    receiver.expect("r", lambda _: None, done.set_result, done.set_result, timeout_s=60)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PRODUCER, address, producer, cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), 120)
    finally:
        if process.returncode is None:
            process.kill()
        await receiver.close()
    assert process.returncode == 0 and out.strip().endswith(b"released 0")  # no device memory left behind
    assert not isinstance(await done, Exception)
    assert torch.equal(received["target"].view(torch.int16), expected_kv().view(torch.int16))


def test_a_buffer_nobody_opened_is_freed_at_its_release() -> None:
    """A handle made but never opened (the decode worker was elsewhere, or refused) holds nothing
    once the buffer is released: torch's IPC reference counting does not keep it in limbo."""
    buffers = SharedBuffers(torch.device("cuda:0"))
    baseline = torch.cuda.memory_allocated(0)
    buffer = buffers.allocate(8 << 20)
    target = buffer.view(torch.bfloat16).view(-1, 2, 1, 16, 2, 64)
    buffers.share("r", buffer, {"target": target}, {"hidden": torch.ones(64, device="cuda:0")})
    del buffer, target
    assert torch.cuda.memory_allocated(0) > baseline
    assert buffers.release("r")
    assert torch.cuda.memory_allocated(0) == baseline


PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14], [7] * 40]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def request(request_id: str, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=GREEDY, gateway_id="g")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("prefill_device", "decode_device"),
    [pytest.param(*pair, marks=needs(*pair), id="->".join(pair)) for pair in DEVICE_PAIRS[:2]],
)
async def test_two_engine_cores_hand_kv_over_in_device_memory(
    make_checkpoint, prefill_device: str, decode_device: str
) -> None:
    model = str(make_checkpoint("llama"))
    settings = dict(dtype="float32", max_model_len=256, enforce_eager=True)
    with LLM(model, device=decode_device, **settings) as offline:  # type: ignore[arg-type]
        expected = offline.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    prefill = await EngineCoreClient.start(
        CoreOptions(EngineConfig(model=model, device=prefill_device, **settings), share_kv=True)  # type: ignore[arg-type]
    )
    decode = await EngineCoreClient.start(
        CoreOptions(EngineConfig(model=model, device=decode_device, **settings))
    )  # type: ignore[arg-type]
    try:
        for i, prompt in enumerate(PROMPTS):
            assert (await (await decode.reserve(request(f"r{i}", prompt), epoch=1))).error is None
            await prefill.add_request(request(f"r{i}", prompt), epoch=1, handoff=True)
        num_handed = 0
        while num_handed < len(PROMPTS):
            for batch in await asyncio.wait_for(prefill.next_batches(), 120):
                for export in batch.handoffs:
                    assert export.shared is not None and export.shared.caches[0].region.kind == "cuda"
                    reply = await (await decode.import_shared(export.request_id, export.shared))
                    assert reply.error is None, reply.error
                    await decode.activate(export.request_id, export.first_token_id)
                    await prefill.release_kv(export.request_id)
                num_handed += len(batch.handoffs)
        tokens, ends, _ = await run_to_end(decode, len(PROMPTS))
    finally:
        await decode.shutdown()
        await prefill.shutdown()
    for i, want in enumerate(expected):
        assert want.token_ids[:1] + tokens[f"r{i}"] == want.token_ids
    assert {e.finish_reason for e in ends.values()} == {"length"}
