"""The KV transport's data model and wire pieces, without sockets."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from services.kv_transport import (
    DTYPES,
    CacheLayout,
    KVExpectation,
    KVHeader,
    KVIntegrityError,
    KVTransferRefused,
    LayerShape,
    TcpKVTransport,
    TensorSpec,
    dtype_name,
    make_transport,
)
from services.kv_transport.connection import join_address, split_address
from services.kv_transport.wire import (
    MAGIC,
    PREAMBLE,
    WIRE_VERSION,
    decode_header,
    encode_header,
    pack,
    tensor_bytes,
    tensor_from_bytes,
)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def header(**overrides: object) -> KVHeader:
    fields: dict[str, object] = dict(
        request_id="req-1",
        num_tokens=10,
        block_size=4,
        dtype="bfloat16",
        layer_shapes=[
            LayerShape(cache="target", index=0, shape=(3, 4, 2, 8)),
            LayerShape(cache="target", index=1, shape=(3, 4, 2, 8)),
            LayerShape(cache="mtp", index=0, shape=(2, 4, 4, 16)),
        ],
        extras={"first_token_id": 7},
        tensors=[TensorSpec(name="mtp_hidden", shape=(64,), dtype="float32")],
    )
    fields.update(overrides)
    return KVHeader.model_validate(fields)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_tensor_bytes_round_trip_is_bit_exact(dtype: str) -> None:
    source = torch.randn(3, 5, 7).mul(4).to(DTYPES[dtype])
    received = tensor_from_bytes(bytearray(tensor_bytes(source)), dtype, source.shape)
    assert received.dtype == source.dtype and received.shape == source.shape
    assert torch.equal(bits(received), bits(source))


def test_tensor_bytes_handles_views_scalars_and_empty_tensors() -> None:
    strided = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # not contiguous
    assert torch.equal(tensor_from_bytes(bytearray(tensor_bytes(strided)), "float32", (6, 4)), strided)
    scalar = torch.tensor(2.5, dtype=torch.bfloat16)
    assert tensor_from_bytes(bytearray(tensor_bytes(scalar)), "bfloat16", ()).item() == 2.5
    empty = torch.empty(0, 4, 2, 8)
    assert len(tensor_bytes(empty)) == 0
    assert tensor_from_bytes(bytearray(), "float32", (0, 4, 2, 8)).shape == (0, 4, 2, 8)


def test_tensor_bytes_does_not_copy_a_contiguous_cpu_tensor() -> None:
    source = torch.zeros(16, dtype=torch.float16)
    view = tensor_bytes(source)
    source[0] = 1.0
    assert bytes(view[:2]) == bytes(tensor_bytes(torch.tensor([1.0], dtype=torch.float16)))


def test_dtype_names() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="cannot be sent"):
        dtype_name(torch.complex64)


def test_header_round_trips_through_the_wire() -> None:
    sent = header()
    received = decode_header(encode_header(sent))
    assert received == sent
    assert sent.num_bytes == 2 * 2 * (3 * 4 * 2 * 8) * 2 + 2 * (2 * 4 * 4 * 16) * 2 + 64 * 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dtype": "float24"}, "unknown dtype 'float24'"),
        ({"tensors": [{"name": "h", "shape": [4], "dtype": "complex"}]}, "unknown dtype 'complex'"),
        ({"layer_shapes": [{"cache": "target", "index": 0, "shape": [3, 8, 2, 8]}]}, "block size 8"),
        ({"layer_shapes": [{"cache": "target", "index": 0, "shape": [4, 4, 2, 8]}]}, "at most 3"),
        ({"layer_shapes": [{"cache": "target", "index": 0, "shape": [1, 4, -2, 8]}]}, "negative"),
        (
            {"layer_shapes": [{"cache": "draft", "index": 1, "shape": [1, 4, 2, 8]}] * 2},
            r"draft\[1\] listed twice",
        ),
        ({"tensors": [{"name": "h", "shape": [1], "dtype": "int64"}] * 2}, "names repeat"),
    ],
)
def test_header_validation(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        header(**overrides)


def test_decode_header_refuses_bad_magic_version_and_fields() -> None:
    payload = encode_header(header())
    with pytest.raises(KVIntegrityError, match="not a specmesh KV stream"):
        decode_header(b"HTTP" + payload[4:])
    with pytest.raises(KVTransferRefused, match="version 99"):
        decode_header(PREAMBLE.pack(MAGIC, 99) + payload[PREAMBLE.size :])
    fields = header().model_dump()
    fields["dtype"] = "float24"
    with pytest.raises(KVTransferRefused, match="unknown dtype") as refused:
        decode_header(PREAMBLE.pack(MAGIC, WIRE_VERSION) + pack(fields))
    assert refused.value.request_id == "req-1"


def test_expectation_problems() -> None:
    sent = header()
    fits = KVExpectation(
        block_size=4,
        dtype="bfloat16",
        max_num_blocks=3,
        caches={"target": CacheLayout(2, 2, 8), "mtp": CacheLayout(1, 4, 16)},
    )
    assert fits.problems(sent) == []
    assert KVExpectation(block_size=16).problems(sent) == ["block_size 4 != expected 16"]
    assert KVExpectation(dtype="float16").problems(sent) == ["dtype bfloat16 != expected float16"]
    assert KVExpectation(max_num_blocks=2).problems(sent) == ["3 blocks > 2 reserved"]
    problems = KVExpectation(caches={"target": CacheLayout(3, 2, 4)}).problems(sent)
    assert "unexpected cache 'mtp'" in problems
    assert any("[num_kv_heads, head_dim] [2, 8], expected [2, 4]" in p for p in problems)
    assert any("has layers [0, 1], expected 0..2" in p for p in problems)
    stale = header(extras={"first_token_id": 7, "epoch": 1})  # KV of an earlier placement
    assert KVExpectation(extras={"epoch": 2}).problems(stale) == ["extras 'epoch' is 1, expected 2"]
    assert KVExpectation(extras={"epoch": 2}).problems(sent) == ["extras 'epoch' is None, expected 2"]
    assert KVExpectation(extras={"epoch": 1}).problems(stale) == []


def test_addresses() -> None:
    assert split_address("decode-0:7400") == ("decode-0", 7400)
    assert split_address("[::1]:7400") == ("::1", 7400)
    assert join_address("::1", 7400) == "[::1]:7400"
    for bad in ("decode-0", ":7400", "host:port"):
        with pytest.raises(ValueError, match="not host:port"):
            split_address(bad)


def test_make_transport() -> None:
    assert isinstance(make_transport("tcp", connect_timeout_s=1.0), TcpKVTransport)
    assert make_transport("ipc", connect_timeout_s=1.0).name == "ipc"
    with pytest.raises(ValueError, match=r"unknown KV transport 'nccl'; known: ipc, tcp"):
        make_transport("nccl")
