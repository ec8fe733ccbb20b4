"""Every Redis key specmesh uses, namespaced by the scheduler topic so deployments can share a Redis.

Streams carry control messages (msgpack, schemas in shared/protocol.py); plain keys with a TTL
carry liveness. Bulk KV data never goes through Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "specmesh"

SCHEDULER_GROUP = "scheduler"
"""Consumer group of the scheduler replicas on the requests stream."""
WORKER_GROUP = "worker"
"""Consumer group on each worker's inbox (one consumer: the worker; a restarted one reclaims)."""
SUFFIX_GROUP = "suffix-cache"
"""Consumer group of the suffix-cache replicas on the look-up stream (each look-up to one replica;
updates are read by every replica, without a group)."""


@dataclass(frozen=True)
class Keys:
    topic: str = "default"

    def _key(self, *parts: str) -> str:
        return ":".join((PREFIX, self.topic, *parts))

    # ---- streams ------------------------------------------------------------------------------------

    @property
    def requests(self) -> str:
        """Gateway -> scheduler: new requests and cancellations."""
        return self._key("requests")

    def inbox(self, instance_id: str) -> str:
        """Scheduler -> one worker: dispatched work, reservations, cancellations."""
        return self._key("inbox", instance_id)

    def reservation_replies(self, scheduler: str) -> str:
        """Workers -> one scheduler replica: answers to its block reservations."""
        return self._key("reservations", scheduler)

    @property
    def scheduler_replies(self) -> str:
        """Workers -> scheduler: block reservations answered, work finished or failed."""
        return self._key("scheduler-replies")

    def outputs(self, gateway_id: str) -> str:
        """Workers and the scheduler -> one gateway: `OutputBatch`es of its requests, in order;
        entries are kept OUTPUT_TTL_S, so a gateway that reconnects reads on from its last entry id."""
        return self._key("out", gateway_id)

    @property
    def dead_letters(self) -> str:
        """Messages that could not be decoded or handled, with the reason."""
        return self._key("dead-letters")

    @property
    def suffix_updates(self) -> str:
        """Decode workers -> every suffix-cache replica: finished requests' prompts and outputs."""
        return self._key("suffix", "updates")

    @property
    def suffix_lookups(self) -> str:
        """Decode workers -> one suffix-cache replica: batched draft look-ups."""
        return self._key("suffix", "lookups")

    def suffix_replies(self, instance_id: str) -> str:
        """Suffix-cache -> one decode worker: answers to its look-ups."""
        return self._key("suffix", "replies", instance_id)

    # ---- liveness and state -------------------------------------------------------------------------

    @property
    def instances(self) -> str:
        """Set of instance ids that have registered (live or not: liveness is the heartbeat key)."""
        return self._key("instances")

    def heartbeat(self, instance_id: str) -> str:
        """An instance's load report; expires after --scheduler-ttl unless refreshed."""
        return self._key("heartbeat", instance_id)

    def gateway_liveness(self, gateway_id: str) -> str:
        """A gateway's liveness: its incarnation (one per process start), expiring after
        --scheduler-ttl unless refreshed. The requests of an incarnation that no longer holds it
        (the key expired, or a restart with the same id replaced it) are aborted."""
        return self._key("gateway", gateway_id)

    def gateway_requests(self, gateway_id: str) -> str:
        """Hash: the admitted, unfinished requests of a gateway -> the incarnation that submitted
        each (written by admission, emptied by release)."""
        return self._key("gateway-requests", gateway_id)

    @property
    def gateways(self) -> str:
        """Set of gateway ids with requests in `gateway_requests` (the scheduler watches them)."""
        return self._key("gateways")

    def scheduler_lease(self, consumer: str) -> str:
        """A scheduler replica's lease, named by its consumer name; expires after --scheduler-ttl
        unless renewed. Messages pending with a consumer that has none are taken over at once."""
        return self._key("scheduler-lease", consumer)

    def request_state(self, request_id: str) -> str:
        """Hash: the `Submit` (`request`), its queue `slot`, `attempts`, the current placement's
        `epoch` and `instances`; once the request ended, only `ended` (for ENDED_TTL_S), which
        still fences off late publishers and late Submits."""
        return self._key("request", request_id)

    def delivered(self, request_id: str) -> str:
        """String of the int32 tokens sent to a request's gateway so far (written with them, in the
        same script), ending in OUTPUT_END once the request ended: where a re-dispatch resumes."""
        return self._key("delivered", request_id)

    def assignments(self, instance_id: str) -> str:
        """Set of request ids running on an instance (re-dispatched if it dies)."""
        return self._key("assigned", instance_id)

    @property
    def queue_depth(self) -> str:
        """Number of admitted requests not yet finished (backpressure)."""
        return self._key("queue-depth")

    @property
    def suffix_cache_heartbeat(self) -> str:
        return self._key("heartbeat", "suffix-cache")

    @property
    def pattern(self) -> str:
        """Glob matching every key of this topic (tests and cleanup)."""
        return self._key("*")
