"""The live-instance registry, read from heartbeat keys, and the load-based choice of instances."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from shared.bus import Bus
from shared.protocol import InstanceInfo, ProtocolError, decode

logger = logging.getLogger(__name__)


@dataclass
class Registry:
    """Instances whose heartbeat has not expired, plus work sent to them since their last report."""

    live: dict[str, InstanceInfo] = field(default_factory=dict)
    dead: list[str] = field(default_factory=list)
    """Registered instances whose heartbeat is gone (found by the last refresh)."""
    in_flight: dict[str, int] = field(default_factory=dict)
    """Requests dispatched to an instance after its last heartbeat (not in its load report yet)."""

    async def refresh(self, bus: Bus) -> None:
        ids = sorted(
            m.decode() if isinstance(m, bytes) else str(m)
            for m in await bus.client.smembers(bus.keys.instances)
        )
        values: list[Any] = await bus.client.mget([bus.keys.heartbeat(i) for i in ids]) if ids else []
        live: dict[str, InstanceInfo] = {}
        dead = []
        for instance_id, raw in zip(ids, values):
            info = _decode_info(raw)
            if info is None:
                dead.append(instance_id)
                continue
            previous = self.live.get(instance_id)
            if previous is None or previous.updated_at != info.updated_at:
                self.in_flight[instance_id] = 0
            live[instance_id] = info
        self.live, self.dead = live, dead
        for gone in self.in_flight.keys() - live.keys():  # a restarted worker has a new id
            del self.in_flight[gone]

    def candidates(self, role: str, exclude: frozenset[str] = frozenset()) -> list[InstanceInfo]:
        return [
            i
            for i in self.live.values()
            if i.role == role and not i.draining and i.instance_id not in exclude
        ]

    def count(self, role: str) -> int:
        return len(self.candidates(role))

    def note_dispatch(self, instance_id: str) -> None:
        self.in_flight[instance_id] = self.in_flight.get(instance_id, 0) + 1

    def pick_least_loaded(self, role: str, exclude: frozenset[str] = frozenset()) -> InstanceInfo | None:
        """Fewest requests (running, waiting, just sent), then fewest queued prompt tokens, then most free blocks."""
        options = self.candidates(role, exclude)
        if not options:
            return None
        return min(options, key=self._load_key)

    def pick_decode(self, num_tokens: int, exclude: frozenset[str] = frozenset()) -> InstanceInfo | None:
        """A decode instance with room for `num_tokens` of KV, least loaded first."""
        options = [
            i for i in self.candidates("decode", exclude) if i.free_kv_blocks * i.block_size >= num_tokens
        ] or self.candidates("decode", exclude)
        return min(options, key=self._load_key) if options else None

    def _load_key(self, info: InstanceInfo) -> tuple[int, int, int]:
        requests = info.num_running + info.num_waiting + self.in_flight.get(info.instance_id, 0)
        return requests, info.queued_tokens, -info.free_kv_blocks


def _decode_info(raw: bytes | None) -> InstanceInfo | None:
    if raw is None:
        return None
    try:
        message = decode(raw)
    except ProtocolError as exc:
        logger.warning("unreadable heartbeat", extra={"error": str(exc)})
        return None
    return message if isinstance(message, InstanceInfo) else None
