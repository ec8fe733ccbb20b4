"""Mutual authentication of a KV connection by a shared secret, before any KV moves: HMAC-SHA256
(RFC 2104) challenge-response with a fresh nonce from each side.

    receiver -> sender   CHALLENGE  receiver_nonce
    sender -> receiver   RESPONSE   sender_nonce | HMAC(secret, "sender" | receiver_nonce | sender_nonce)
    receiver -> sender   PROOF      HMAC(secret, "receiver" | sender_nonce | receiver_nonce)
                         (or ERROR "unauthenticated", and the connection closes)

Each side proves that it holds the secret over a nonce the other has just drawn, so an answer
recorded on one connection is worth nothing on the next (no replay), and the labels keep one
side's answer from passing for the other's (no reflection). The secret never crosses the wire.
The frames after the handshake are not authenticated one by one: against a network that can
inject into a TCP connection, add TLS (`tls.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets

from services.kv_transport.base import KVAuthenticationError, KVTransferError
from services.kv_transport.connection import Connection
from services.kv_transport.wire import FrameKind, error_from_payload

NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
MIN_SECRET_BYTES = 16
SENDER_LABEL = b"specmesh-kv sender"
RECEIVER_LABEL = b"specmesh-kv receiver"


def check_secret(secret: bytes) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the KV secret must be at least {MIN_SECRET_BYTES} bytes long, not {len(secret)}")
    return secret


def mac(secret: bytes, label: bytes, *nonces: bytes) -> bytes:
    return hmac.new(secret, b"".join([label, *nonces]), hashlib.sha256).digest()


async def authenticate_sender(connection: Connection, secret: bytes, timeout_s: float) -> None:
    """Receiver side: challenges the peer, checks its answer, proves itself. KVAuthenticationError
    if the peer does not answer in time or answers wrong (the caller refuses the connection)."""
    receiver_nonce = secrets.token_bytes(NONCE_BYTES)
    await connection.writer.write_control(FrameKind.CHALLENGE, receiver_nonce)
    kind, payload = await _next_control(connection, timeout_s, "response from the sender")
    if kind != FrameKind.RESPONSE:
        raise KVAuthenticationError(f"the peer sent {kind.name} instead of authenticating")
    if len(payload) != NONCE_BYTES + MAC_BYTES:
        raise KVAuthenticationError(f"malformed authentication response ({len(payload)} bytes)")
    sender_nonce, answer = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
    if not hmac.compare_digest(answer, mac(secret, SENDER_LABEL, receiver_nonce, sender_nonce)):
        raise KVAuthenticationError("wrong KV secret")
    await connection.writer.write_control(
        FrameKind.PROOF, mac(secret, RECEIVER_LABEL, sender_nonce, receiver_nonce)
    )


async def authenticate_receiver(connection: Connection, secret: bytes, timeout_s: float) -> None:
    """Sender side: answers the receiver's challenge and checks its proof. KVAuthenticationError
    if the receiver does not challenge (it has no secret), refuses us, or proves nothing."""
    kind, payload = await _next_control(
        connection, timeout_s, "challenge from the receiver (has it the KV secret?)"
    )
    if kind != FrameKind.CHALLENGE or len(payload) != NONCE_BYTES:
        raise KVAuthenticationError(f"the receiver sent {kind.name} where a challenge was due")
    sender_nonce = secrets.token_bytes(NONCE_BYTES)
    answer = mac(secret, SENDER_LABEL, payload, sender_nonce)
    await connection.writer.write_control(FrameKind.RESPONSE, sender_nonce + answer)
    kind, proof = await _next_control(connection, timeout_s, "proof from the receiver")
    if kind == FrameKind.ERROR:
        raise error_from_payload(proof)
    if kind != FrameKind.PROOF or not hmac.compare_digest(
        proof, mac(secret, RECEIVER_LABEL, sender_nonce, payload)
    ):
        raise KVAuthenticationError("the receiver could not prove it holds the KV secret")


async def _next_control(connection: Connection, timeout_s: float, what: str) -> tuple[FrameKind, bytes]:
    try:
        return await asyncio.wait_for(connection.reader.next_control(), timeout_s)
    except asyncio.TimeoutError:
        raise KVAuthenticationError(f"no {what} within {timeout_s:g} s") from None
    except (ConnectionError, OSError) as exc:
        raise KVAuthenticationError(f"the connection closed while waiting for a {what}: {exc}") from None
    except KVTransferError as exc:
        raise KVAuthenticationError(f"while waiting for a {what}: {exc}") from None
