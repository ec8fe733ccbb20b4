"""Worker-to-worker KV-cache transport: prefill sends a request's KV layer by layer, decode receives it.

    transport = make_transport("tcp")
    # decode worker
    address = await transport.start("0.0.0.0", 0)
    transport.expect(request_id, on_layer, on_done, on_error, timeout_s=30.0)
    # prefill worker
    session = await transport.open(address, KVHeader(...))
    await session.send_layer("target", 0, key, value)   # as soon as layer 0 is computed
    ...
    await session.close(extras={"first_token_id": token_id})

See `base.py` for the data model and interface, `wire.py` for the frame format, `tcp.py` for TCP,
`ipc.py` and `ipc_buffer.py` for the ipc transport (on one host the KV stays in device memory and
only a handle travels: `session.send_shared(handle)` in place of the layers).
"""

from services.kv_transport.base import (
    DTYPES,
    CacheLayout,
    KVAuthenticationError,
    KVCallbackError,
    KVConnectionError,
    KVExpectation,
    KVHeader,
    KVIntegrityError,
    KVSendSession,
    KVTransferCancelled,
    KVTransferError,
    KVTransferRefused,
    KVTransferTimeout,
    KVTransport,
    LayerShape,
    OnDone,
    OnError,
    OnLayer,
    ReceivedLayer,
    ReceivedTransfer,
    TensorSpec,
    TransferStats,
    TransportStats,
    dtype_name,
)
from services.kv_transport.registry import TRANSPORTS, make_transport, register_transport
from services.kv_transport.tcp import TcpKVTransport, TcpSendSession

__all__ = [
    "DTYPES",
    "TRANSPORTS",
    "CacheLayout",
    "KVAuthenticationError",
    "KVCallbackError",
    "KVConnectionError",
    "KVExpectation",
    "KVHeader",
    "KVIntegrityError",
    "KVSendSession",
    "KVTransferCancelled",
    "KVTransferError",
    "KVTransferRefused",
    "KVTransferTimeout",
    "KVTransport",
    "LayerShape",
    "OnDone",
    "OnError",
    "OnLayer",
    "ReceivedLayer",
    "ReceivedTransfer",
    "TcpKVTransport",
    "TcpSendSession",
    "TensorSpec",
    "TransferStats",
    "TransportStats",
    "dtype_name",
    "make_transport",
    "register_transport",
]
