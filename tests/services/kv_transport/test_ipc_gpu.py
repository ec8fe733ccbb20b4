"""The ipc KV transport on GPUs: a prefill process's KV in its GPU memory is opened by handle in
another process (on the same GPU, and on a second one where the host has it) and arrives bit-exact,
and the producer's memory is back at its baseline whatever the consumer did with the handle (took
it, refused it, failed after opening it, never answered); a buffer nobody opened is freed at its
release; two engine-core processes hand a request's KV over in device memory and the decode core continues
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
from services.kv_transport import ReceivedLayer
from services.kv_transport.ipc import IpcKVTransport, KVSharedUnusable
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


def expected_hidden() -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32)


PRODUCER = textwrap.dedent(
    """
    import asyncio, sys, time
    import torch
    from services.kv_transport import KVHeader, KVTransferError
    from services.kv_transport.ipc import IpcKVTransport
    from services.kv_transport.ipc_buffer import SharedBuffers
    from tests.services.kv_transport.test_ipc_gpu import SHAPE, expected_hidden, expected_kv

    async def main(address, device, ack_timeout_s):
        buffers = SharedBuffers(torch.device(device))
        baseline = torch.cuda.memory_allocated(device)
        buffer = buffers.allocate(torch.Size(SHAPE).numel() * 2)
        target = buffer.view(torch.bfloat16).view(SHAPE)
        target.copy_(expected_kv().to(device, non_blocking=True))  # no host wait: the handle's event orders it
        shared = buffers.share("r", buffer, {"target": target}, {"hidden": expected_hidden().to(device)})
        del target, buffer
        header = KVHeader(request_id="r", num_tokens=48, block_size=16, dtype="bfloat16",
                          layer_shapes=shared.layer_shapes(), tensors=shared.tensor_specs())
        transport = IpcKVTransport(ack_timeout_s=ack_timeout_s)
        session = await transport.open(address, header)
        try:  # what Worker._hand_off does
            async with session:
                refusal = await session.send_shared(shared)
                if refusal is not None:
                    print("refused:", refusal, flush=True)
                    caches, tensors = buffers.host_copy("r")
                    for index, kv in enumerate(caches["target"]):
                        await session.send_layer("target", index, kv[0], kv[1])
                    await session.send_tensor("hidden", tensors["hidden"])
                await session.close()
        except KVTransferError as exc:
            print("failed:", type(exc).__name__, flush=True)
        if session.shared_unanswered:  # the consumer may still read it: held until its deadline
            torch.cuda.ipc_collect()
            print("held", torch.cuda.memory_allocated(device) - baseline, flush=True)
            assert buffers.expire(time.monotonic() + buffers.timeout_s) == ["r"]
        else:
            assert buffers.release("r")
        torch.cuda.ipc_collect()
        await transport.close()
        print("released", torch.cuda.memory_allocated(device) - baseline, flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
    """
)

CONSUMERS = ["takes", "refuses", "opens_then_fails", "never_answers"]
"""What the consumer does with the handle: copies the KV and answers; refuses it unopened; opens it,
copies, then refuses it (the producer sends bytes); opens it and never answers (it keeps the
mapping open: the producer's deadline frees the buffer anyway)."""


class Consumer:
    """The decode side, in this process: `import_shared` does what its `behaviour` says."""

    def __init__(self, behaviour: str, device: str) -> None:
        self.behaviour = behaviour
        self.device = device
        self.copied: dict[str, torch.Tensor] = {}
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.kept: list[torch.Tensor] = []
        self.stop = asyncio.Event()

    async def import_shared(self, request_id: str, shared: SharedKV) -> dict[str, torch.Tensor]:
        if self.behaviour == "refuses":
            raise KVSharedUnusable("refused unopened")
        caches, tensors = open_shared(shared)
        assert caches["target"].is_cuda
        copies = {"target": caches["target"].to(self.device), "hidden": tensors["hidden"].to(self.device)}
        torch.cuda.synchronize(self.device)  # an answer comes only once the buffer is no longer read
        if self.behaviour == "opens_then_fails":
            raise KVSharedUnusable("opened, then failed")
        if self.behaviour == "never_answers":
            self.kept += [caches["target"], tensors["hidden"]]
            await self.stop.wait()
        self.copied = {name: copy.cpu() for name, copy in copies.items()}
        return {"hidden": self.copied["hidden"]}

    def on_layer(self, layer: ReceivedLayer) -> None:
        self.layers[layer.index] = (layer.key, layer.value)


@pytest.mark.parametrize("behaviour", CONSUMERS)
@pytest.mark.parametrize(
    ("producer", "consumer"),
    [pytest.param(*pair, marks=needs(*pair), id="->".join(pair)) for pair in DEVICE_PAIRS],
)
async def test_kv_in_one_processs_gpu_memory_is_opened_in_another(
    producer: str, consumer: str, behaviour: str
) -> None:
    """Whatever the consumer does with the handle, the producer's GPU memory is back at its baseline
    once the producer released the buffer (or its deadline passed), and the KV arrives bit-exact."""
    decode = Consumer(behaviour, consumer)
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    receiver = IpcKVTransport(import_shared=decode.import_shared)
    address = await receiver.start("127.0.0.1", 0, advertise_host="127.0.0.1")
    receiver.expect("r", decode.on_layer, done.set_result, done.set_result, timeout_s=60)
    ack_timeout_s = "2" if behaviour == "never_answers" else "60"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        PRODUCER,
        address,
        producer,
        ack_timeout_s,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), 120)
    finally:
        if process.returncode is None:
            process.kill()
        decode.stop.set()
        decode.kept.clear()
        await receiver.close()
    lines = out.decode().strip().splitlines()
    assert process.returncode == 0 and lines[-1] == "released 0", lines  # no device memory left behind
    if behaviour == "never_answers":
        assert lines[0] == "failed: KVTransferTimeout" and int(lines[1].split()[1]) > 0, lines
        return
    result = await done
    assert not isinstance(result, Exception), result
    assert torch.equal(result.tensors["hidden"], expected_hidden())
    if behaviour == "takes":
        assert decode.layers == {} and torch.equal(decode.copied["target"], expected_kv())
    else:
        assert lines[0].startswith("refused:") and decode.copied == {}
        received = torch.stack([torch.stack(decode.layers[i]) for i in range(SHAPE[0])])
        assert torch.equal(received, expected_kv())


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
