"""Authentication of KV connections (`auth.py`, `tls.py`) over loopback: the right secret moves KV
bit-exact; a wrong secret, no secret or a replayed handshake is refused and logged, and nothing the
peer sent reaches a callback; a receiver that cannot prove the secret is sent nothing; mutual TLS
round trips with a self-signed CA made here, and refuses peers without one of its certificates."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from services.kv_transport import (
    KVAuthenticationError,
    KVHeader,
    KVTransferError,
    LayerShape,
    ReceivedLayer,
    ReceivedTransfer,
    TcpKVTransport,
)
from services.kv_transport.auth import NONCE_BYTES, SENDER_LABEL, mac
from services.kv_transport.connection import split_address
from services.kv_transport.tls import TlsFiles
from services.kv_transport.wire import (
    MAGIC,
    PREAMBLE,
    WIRE_VERSION,
    FrameKind,
    FrameReader,
    encode_frame,
    error_from_payload,
    pack,
)

SECRET = b"k" * 32
WRONG_SECRET = b"w" * 32
SHAPE = (2, 4, 2, 8)  # [num_blocks, block_size, num_kv_heads, head_dim]


class Receiving:
    """What a receiver's callbacks saw of one expected request."""

    def __init__(self, transport: TcpKVTransport, request_id: str = "req-1") -> None:
        self.layers: list[ReceivedLayer] = []
        self.done: ReceivedTransfer | None = None
        self.finished = asyncio.Event()
        transport.expect(request_id, self.layers.append, self.on_done, lambda _: None, 10.0)

    def on_done(self, transfer: ReceivedTransfer) -> None:
        self.done = transfer
        self.finished.set()


def header(request_id: str = "req-1") -> KVHeader:
    return KVHeader(
        request_id=request_id,
        num_tokens=6,
        block_size=SHAPE[1],
        dtype="float32",
        layer_shapes=[LayerShape(cache="target", index=0, shape=SHAPE)],
    )


async def send(sender: TcpKVTransport, address: str) -> tuple[torch.Tensor, torch.Tensor]:
    key, value = torch.randn(SHAPE), torch.randn(SHAPE)
    session = await sender.open(address, header())
    await session.send_layer("target", 0, key, value)
    await session.close()
    return key, value


@contextlib.asynccontextmanager
async def transports(
    receiver_secret: bytes | None,
    sender_secret: bytes | None,
    tls: tuple[TlsFiles | None, TlsFiles | None] = (None, None),
) -> AsyncIterator[tuple[TcpKVTransport, TcpKVTransport, str]]:
    receiver = TcpKVTransport(connect_timeout_s=2.0, secret=receiver_secret, tls=tls[0])
    sender = TcpKVTransport(connect_timeout_s=2.0, ack_timeout_s=5.0, secret=sender_secret, tls=tls[1])
    address = await receiver.start("127.0.0.1", 0)
    try:
        yield receiver, sender, address
    finally:
        await sender.close()
        await receiver.close()


async def read_answer(reader: asyncio.StreamReader) -> tuple[FrameKind, bytes]:
    return await asyncio.wait_for(FrameReader(reader).next_control(), 5.0)


async def answer_challenge(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes
) -> bytes:
    """Does a sender's half of the handshake by hand; the RESPONSE frame it sent."""
    kind, receiver_nonce = await read_answer(reader)
    assert kind == FrameKind.CHALLENGE and len(receiver_nonce) == NONCE_BYTES
    sender_nonce = b"s" * NONCE_BYTES
    response = encode_frame(
        FrameKind.RESPONSE, sender_nonce + mac(secret, SENDER_LABEL, receiver_nonce, sender_nonce)
    )
    writer.write(response)
    return response


def header_frame() -> bytes:
    return encode_frame(FrameKind.HEADER, PREAMBLE.pack(MAGIC, WIRE_VERSION), pack(header().model_dump()))


# ---- shared secret ----------------------------------------------------------------------------------


async def test_the_right_secret_moves_kv_bit_exact() -> None:
    async with transports(SECRET, SECRET) as (receiver, sender, address):
        receiving = Receiving(receiver)
        key, value = await send(sender, address)
        await asyncio.wait_for(receiving.finished.wait(), 5.0)
        (layer,) = receiving.layers
        assert torch.equal(layer.key, key) and torch.equal(layer.value, value)
        assert receiver.stats.refused_peers == 0 and receiver.stats.transfers_received == 1


async def test_a_wrong_secret_is_refused_logged_and_nothing_reaches_the_callbacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with transports(SECRET, WRONG_SECRET) as (receiver, sender, address):
        receiving = Receiving(receiver)
        with (
            caplog.at_level(logging.WARNING),
            pytest.raises(KVAuthenticationError, match="authentication failed"),
        ):
            await send(sender, address)
        assert receiver.stats.refused_peers == 1
        assert "refused: wrong KV secret" in caplog.text
        assert receiving.layers == [] and receiving.done is None
        assert receiver.stats.bytes_received == 0


async def test_a_sender_without_the_secret_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    async with transports(SECRET, None) as (receiver, sender, address):
        receiving = Receiving(receiver)
        with caplog.at_level(logging.WARNING), pytest.raises(KVAuthenticationError, match="lacks"):
            await send(sender, address)
        # a peer that skips the handshake and sends KV at once: its header is never read as one
        host, port = split_address(address)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(header_frame())
        kinds = [(await read_answer(reader))[0], (await read_answer(reader))[0]]
        writer.close()
        assert kinds == [FrameKind.CHALLENGE, FrameKind.ERROR]
        assert receiver.stats.refused_peers == 2 and "instead of authenticating" in caplog.text
        assert receiving.layers == [] and receiving.done is None


async def test_a_replayed_handshake_is_refused() -> None:
    async with transports(SECRET, None) as (receiver, _, address):
        receiving = Receiving(receiver)
        host, port = split_address(address)
        reader, writer = await asyncio.open_connection(host, port)
        recorded = await answer_challenge(reader, writer, SECRET)
        kind, _ = await read_answer(reader)
        assert kind == FrameKind.PROOF  # an honest sender's handshake, as an eavesdropper sees it
        writer.close()

        reader, writer = await asyncio.open_connection(host, port)
        kind, _ = await read_answer(reader)  # a fresh challenge, which the recording does not answer
        writer.write(recorded + header_frame())
        kind, payload = await read_answer(reader)
        writer.close()
        assert kind == FrameKind.ERROR
        assert isinstance(error_from_payload(payload), KVAuthenticationError)
        assert receiver.stats.refused_peers == 1
        assert receiving.layers == [] and receiving.done is None


async def test_a_receiver_that_cannot_prove_the_secret_is_sent_nothing() -> None:
    """A listener posing as a decode worker: it challenges, but its proof is not made with the
    secret. The sender must not send the header, let alone KV."""
    received: list[bytes] = []

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = FrameReader(reader)
        writer.write(encode_frame(FrameKind.CHALLENGE, b"c" * NONCE_BYTES))
        received.append((await frames.next_control())[1])
        writer.write(encode_frame(FrameKind.PROOF, mac(WRONG_SECRET, b"receiver", b"x")))
        with contextlib.suppress(KVTransferError, ConnectionError):
            while (frame := await frames.next()) is not None:
                received.append(await frames.read_control(frame))
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    sender = TcpKVTransport(connect_timeout_s=2.0, secret=SECRET)
    try:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(KVAuthenticationError, match="could not prove"):
            await sender.open(f"127.0.0.1:{port}", header())
        await asyncio.sleep(0.1)
        assert len(received) == 1  # the handshake's response, and no header after it
    finally:
        await sender.close()
        server.close()


async def test_a_receiver_without_the_secret_is_sent_nothing() -> None:
    async with transports(None, SECRET) as (receiver, sender, address):
        receiving = Receiving(receiver)
        with pytest.raises(KVAuthenticationError, match="no challenge from the receiver"):
            await send(sender, address)
        assert receiving.layers == [] and receiver.stats.bytes_received == 0


def test_a_short_secret_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        TcpKVTransport(secret=b"short")


# ---- TLS --------------------------------------------------------------------------------------------


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


def make_worker(directory: Path, name: str, ca: tuple[Path, Path]) -> TlsFiles:
    """A worker's certificate signed by `ca`, as the worker's TLS files."""
    cert, key, request = directory / f"{name}.pem", directory / f"{name}.key", directory / f"{name}.csr"
    extensions = directory / f"{name}.ext"
    extensions.write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(request), "-subj", f"/CN={name}",
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", str(request), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
        "-out", str(cert), "-days", "1", "-extfile", str(extensions),
    )  # fmt: skip
    files = TlsFiles.from_flags(cert, key, ca[0])
    assert files is not None
    return files


def openssl(*args: str) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        pytest.skip("the openssl CLI is not installed")
    subprocess.run([binary, *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    """Two workers of the mesh's CA, and one of another CA."""
    directory = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(directory, "mesh-ca"), make_ca(directory, "other-ca")
    return {
        "prefill": make_worker(directory, "prefill", ca),
        "decode": make_worker(directory, "decode", ca),
        "stranger": make_worker(directory, "stranger", other_ca),
    }


async def test_tls_with_the_secret_round_trips(pki: dict[str, TlsFiles]) -> None:
    async with transports(SECRET, SECRET, (pki["decode"], pki["prefill"])) as (receiver, sender, address):
        receiving = Receiving(receiver)
        key, value = await send(sender, address)
        await asyncio.wait_for(receiving.finished.wait(), 5.0)
        (layer,) = receiving.layers
        assert torch.equal(layer.key, key) and torch.equal(layer.value, value)


async def test_tls_refuses_a_certificate_of_another_ca_and_a_plain_peer(pki: dict[str, TlsFiles]) -> None:
    stranger = pki["stranger"]
    trusting = TlsFiles(stranger.cert, stranger.key, pki["decode"].ca)  # trusts the mesh, unknown to it
    async with transports(None, None, (pki["decode"], stranger)) as (receiver, sender, address):
        receiving = Receiving(receiver)
        with pytest.raises(KVAuthenticationError, match="certificate verify failed"):
            await send(sender, address)
        for peer in (
            TcpKVTransport(connect_timeout_s=2.0, ack_timeout_s=2.0, tls=trusting),
            TcpKVTransport(connect_timeout_s=2.0, ack_timeout_s=2.0),
        ):
            with pytest.raises(KVTransferError):
                await send(peer, address)
            await peer.close()
        assert receiving.layers == [] and receiving.done is None
        assert receiver.stats.bytes_received == 0


def test_tls_needs_all_three_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing --kv-tls-ca"):
        TlsFiles.from_flags(tmp_path / "cert.pem", tmp_path / "key.pem", None)
    with pytest.raises(ValueError, match="KV TLS files"):
        TlsFiles.from_flags(tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem")
