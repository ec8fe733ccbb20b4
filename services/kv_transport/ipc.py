"""The ipc KV transport: between workers on one host the KV never leaves device memory.

It is the TCP transport (same connection, authentication and frames) with one more way to carry a
transfer's body: instead of the layers' bytes, one SHARED frame with the handle of the buffer the
prefill engine core gathered them into (`ipc_buffer.py`). The receiver checks the handle against the
header and passes it to `import_shared` (the decode worker's: its engine core opens the buffer and
copies the blocks into its cache), answers SHARED_TAKEN, and acknowledges END as over TCP. The
receiver answers (SHARED_TAKEN or SHARED_REFUSED) only once it no longer reads the buffer, so the
sender may free it then; a sender whose handle got no answer (a timeout, a cancellation, a receiver
that died) cannot know that, and keeps the buffer until its deadline (`shared_unanswered`).

The receiver's ACCEPT names its host (`host_identity`). A sender whose receiver is on another host,
runs the tcp transport, or answers SHARED_REFUSED (it could not open the handle) sends the layers as
bytes on the same connection instead: the TCP path, for that transfer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from pydantic import ValidationError

from services.kv_transport.base import (
    KVCallbackError,
    KVHeader,
    KVIntegrityError,
    KVTransferError,
    KVTransferRefused,
    KVTransferTimeout,
    TransferStats,
)
from services.kv_transport.connection import Connection
from services.kv_transport.ipc_buffer import SharedKV, SharedKVError, host_identity
from services.kv_transport.tcp import TcpKVTransport
from services.kv_transport.tcp_sender import TcpSendSession
from services.kv_transport.wire import FrameKind, pack, unpack
from shared.errors import describe_validation_error

logger = logging.getLogger(__name__)

ImportShared = Callable[[str, SharedKV], Awaitable[dict[str, torch.Tensor]]]
"""(request id, handle) -> the extra tensors, on the host, once every layer is copied into the
receiver's cache; raises `KVSharedUnusable` if the handle cannot be opened or copied there. It
returns or raises only once nothing reads the shared buffer any more."""


class KVSharedUnusable(KVTransferError):
    """The receiver could not open a shared buffer: the sender sends the bytes instead."""

    code = "shared_unusable"


class IpcSendSession(TcpSendSession):
    """A TCP session that can hand over the whole body by handle (`send_shared`)."""

    def __init__(self, *args: Any, host: str, peer_host: str | None, **kwargs: Any):
        self._answer: asyncio.Future[str | None] | None = None
        super().__init__(*args, **kwargs)
        self.host = host
        self.peer_host = peer_host
        """The receiver's host identity; None if it takes no shared KV."""

    async def send_shared(self, shared: Any) -> str | None:
        if self.peer_host is None:
            return "the receiver takes no shared KV (its KV transport is tcp)"
        if self.peer_host != self.host:
            return f"the receiver is on another host ({self.peer_host}; this one is {self.host})"
        if not isinstance(shared, SharedKV):
            raise TypeError(f"send_shared takes a SharedKV, not {type(shared).__name__}")
        answer: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._answer = answer
        self.shared_unanswered = True
        await self._send(FrameKind.SHARED, [pack(shared.model_dump(mode="python"))])
        waiting: set[asyncio.Future[Any]] = {answer, self._watcher}
        done, _ = await asyncio.wait(
            waiting, timeout=self._ack_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if answer.done():
            self.shared_unanswered = False
            refusal = answer.result()
            if refusal is None:  # every layer and tensor is in: close() sends END
                self._sent_layers.update(range(len(self.header.layer_shapes)))
                self._sent_tensors.update(range(len(self.header.tensors)))
            return refusal
        if self._error is not None:
            await self._fail(self._error)
        if not done:
            await self._fail(KVTransferTimeout(f"the shared KV was not taken within {self._ack_timeout_s} s"))
        await self._fail(KVIntegrityError("the receiver ended the transfer without answering the shared KV"))
        return None  # unreachable: _fail raises

    def _interim(self, kind: FrameKind, payload: bytes) -> bool:
        answer = self._answer
        if kind not in (FrameKind.SHARED_TAKEN, FrameKind.SHARED_REFUSED) or answer is None or answer.done():
            return False
        if kind == FrameKind.SHARED_TAKEN:
            answer.set_result(None)
        else:
            answer.set_result(str(unpack(payload).get("message") or "refused by the receiver"))
        return True


class IpcKVTransport(TcpKVTransport):
    """KV transport that moves KV by handle between workers of one host, else over TCP."""

    name = "ipc"

    def __init__(self, *, import_shared: ImportShared | None = None, host: str | None = None, **options: Any):
        """
        import_shared: the receiver's way to take a transfer's shared KV (None: it takes none and
            says so, so that its senders send bytes).
        host: this host's identity (default `host_identity()`): shared KV moves only between equals.
        options: those of `TcpKVTransport`.
        """
        super().__init__(**options)
        self.import_shared = import_shared
        self.host = host or host_identity()

    def _accept_fields(self, header: KVHeader) -> dict[str, Any]:
        fields = super()._accept_fields(header)
        return fields if self.import_shared is None else {**fields, "host": self.host}

    def _new_session(
        self,
        address: str,
        connection: Connection,
        header: KVHeader,
        stats: TransferStats,
        bytes_before: int,
        accepted: dict[str, Any],
    ) -> TcpSendSession:
        peer_host = accepted.get("host")
        return IpcSendSession(
            address,
            connection,
            header,
            stats,
            bytes_before,
            self.ack_timeout_s,
            self._finish_send,
            host=self.host,
            peer_host=peer_host if isinstance(peer_host, str) else None,
        )

    async def _other_frame(
        self,
        connection: Connection,
        frame: tuple[FrameKind, int],
        header: KVHeader,
        stats: TransferStats,
        received_layers: set[int],
        tensors: dict[str, torch.Tensor],
    ) -> None:
        if frame[0] != FrameKind.SHARED or self.import_shared is None:
            await super()._other_frame(connection, frame, header, stats, received_layers, tensors)
            return
        shared = _decode_shared(await connection.reader.read_control(frame), header)
        if received_layers or tensors:
            raise KVIntegrityError("shared KV after layers or tensors were sent as bytes")
        try:
            taken = await self.import_shared(header.request_id, shared)
        except KVSharedUnusable as exc:
            await connection.writer.write_control(FrameKind.SHARED_REFUSED, pack({"message": str(exc)}))
            return
        except KVTransferError:
            raise
        except Exception as exc:
            logger.exception("importing the shared KV of %s failed", header.request_id)
            raise KVCallbackError(f"importing the shared KV failed: {exc!r}") from None
        received_layers.update(range(len(header.layer_shapes)))
        tensors.update(taken)
        stats.num_layers += len(header.layer_shapes)
        await connection.writer.write_control(FrameKind.SHARED_TAKEN, pack({}))


def _decode_shared(payload: bytes, header: KVHeader) -> SharedKV:
    """The handle of a SHARED frame; KVTransferRefused saying why if it is malformed or does not
    describe the header's layers and tensors."""
    try:
        shared = SharedKV.model_validate(unpack(payload))
    except ValidationError as exc:
        raise KVTransferRefused(f"invalid shared-KV handle: {describe_validation_error(exc)}") from None
    except SharedKVError as exc:
        raise KVTransferRefused(f"invalid shared-KV handle: {exc}") from None
    problems = shared.problems(header)
    if problems:
        raise KVTransferRefused(f"the shared-KV handle does not match the header: {'; '.join(problems)}")
    return shared
