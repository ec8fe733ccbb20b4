"""Redis ACL users per role (`shared/acl.py`) on a real redis-server: each role's user does its job
through the bus's own calls and is refused what belongs to another role; the default user is off;
wrong credentials stop a role at start-up with one clear line."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ResponseError

from services.runtime import PASSWORD_ENV
from services.serve import free_port, write_private
from shared import acl
from shared.bus import APPEND_AT_END, END_BYTES, FIRST_EPOCH, Bus, RedisSettings, connect
from shared.keys import SCHEDULER_GROUP, WORKER_GROUP, Keys
from shared.protocol import (
    TOKEN_DTYPE,
    Cancel,
    Dispatch,
    Finished,
    GenerateRequest,
    OutputBatch,
    Reserve,
    Submit,
    TokenEvent,
    encode,
)
from shared.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
TOPIC = "acl-test"


@dataclass
class AclRedis:
    port: int
    passwords: dict[str, str]

    def settings(self, role: str, topic: str = TOPIC) -> RedisSettings:
        return RedisSettings(
            port=self.port, topic=topic, username=acl.user_name(role), password=self.passwords[role]
        )


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    """A redis-server with `acl_file`'s users for TOPIC (and for "other", whose keys the users of
    TOPIC must not reach: in one deployment's Redis each topic has its own users' file lines)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    passwords = {role: secrets.token_hex(16) for role in (*acl.ROLES, acl.ADMIN)}
    hashes = {role: acl.password_hash(password) for role, password in passwords.items()}
    users = write_private(tmp_path_factory.mktemp("acl") / "users.acl", acl.acl_file(hashes, TOPIC))
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen([*argv, "--aclfile", str(users)], stdout=subprocess.DEVNULL)
    admin = redis.Redis(port=port, username=acl.user_name(acl.ADMIN), password=passwords[acl.ADMIN])
    try:
        _wait_until_up(admin)
        yield AclRedis(port, passwords)
    finally:
        admin.close()
        server.terminate()
        server.wait(timeout=10)


def _wait_until_up(client: redis.Redis) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
async def bus_as(acl_redis: AclRedis) -> AsyncIterator[Callable[[str], Awaitable[Bus]]]:
    """Buses connected as a role's user (the admin's empties the topic first)."""
    clients: list[aioredis.Redis] = []

    async def make(role: str) -> Bus:
        settings = acl_redis.settings(role)
        client = await connect(settings, attempts=1)
        clients.append(client)
        return Bus(client, settings.keys)

    admin = await make(acl.ADMIN)
    keys: Any = await admin.client.keys(admin.keys.pattern)
    if keys:
        await admin.client.delete(*keys)
    yield make
    for client in clients:
        await client.aclose()


async def refused(call: Awaitable[Any]) -> str:
    """The error text of a command the user is not allowed (NOPERM, or a script's own refusal)."""
    with pytest.raises(ResponseError) as error:
        await call
    text = str(error.value)
    assert "NOPERM" in text or "permission" in text.lower() or "can't run" in text, text
    return text


def submit(request_id: str) -> Submit:
    request = GenerateRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4)
    )
    return Submit(request=request)


def output(request_id: str) -> bytes:
    return encode(OutputBatch.of([TokenEvent(request_id=request_id, token_ids=[5])]))


async def test_the_default_user_is_off(acl_redis: AclRedis) -> None:
    anonymous = redis.Redis(port=acl_redis.port)
    with pytest.raises(AuthenticationError):
        anonymous.ping()
    anonymous.close()
    for password in ("", acl_redis.passwords[acl.ADMIN]):  # AUTH <password> is the default user's
        with pytest.raises(AuthenticationError):
            redis.Redis(port=acl_redis.port, password=password or None).ping()


async def test_a_user_with_a_wrong_password_is_refused_in_a_clear_sentence(acl_redis: AclRedis) -> None:
    settings = RedisSettings(port=acl_redis.port, topic=TOPIC, username="specmesh-gateway", password="nope")
    with pytest.raises(ConnectionError, match="refused user 'specmesh-gateway'.*--redis-password-file"):
        await connect(settings, attempts=1)


async def test_the_gateway_submits_and_follows_its_stream_and_nothing_else(bus_as) -> None:
    gateway, scheduler = await bus_as("gateway"), await bus_as("scheduler")
    keys = gateway.keys
    await gateway.publish(keys.requests, submit("r1"))
    await gateway.publish(keys.requests, Cancel(request_id="r1"))
    await scheduler.publish_step([("g1", output("r1"))])
    entries: Any = await gateway.client.xread({keys.outputs("g1"): "0"})
    assert len(entries[0][1]) == 1
    await gateway.trim_read(keys.outputs("g1"), entries[0][1][0][0].decode())
    assert await gateway.client.smembers(keys.instances) == set()
    assert await gateway.client.exists(keys.heartbeat("w1")) == 0
    await gateway.client.delete(keys.outputs("g1"))
    await gateway.hold_lease(keys.gateway_liveness("g1"), 10, "incarnation")
    assert await gateway.delete_if_equal(keys.gateway_liveness("g1"), "incarnation")

    await refused(gateway.client.flushall())
    await refused(gateway.client.keys("*"))
    await refused(gateway.client.config_get("requirepass"))
    await refused(gateway.client.set(keys.heartbeat("w1"), b"alive"))
    await refused(gateway.client.hgetall(keys.request_state("r1")))
    await refused(gateway.client.get(keys.delivered("r1")))
    await refused(gateway.client.xadd(keys.inbox("w1"), {"m": "x"}))
    await refused(gateway.client.xread({keys.suffix_replies("w1"): "0"}))
    await refused(gateway.client.xadd(keys.outputs("g2"), {"m": "x"}))  # only workers write outputs
    await refused(gateway.client.xadd(Keys("other").requests, {"m": "x"}))  # another topic
    await refused(gateway.admit("r2", submit("r2"), 10))
    await refused(gateway.client.hgetall(keys.gateway_requests("g1")))
    await refused(gateway.client.smembers(keys.gateways))


async def test_the_scheduler_admits_places_and_releases_but_cannot_beat_or_flush(bus_as) -> None:
    scheduler = await bus_as("scheduler")
    keys = scheduler.keys
    await scheduler.ensure_group(keys.requests, SCHEDULER_GROUP)
    assert await scheduler.admit("r1", submit("r1"), 10) == "admitted"
    assert await scheduler.admit("r1", submit("r1"), 10) == "duplicate"
    # a new request admitted and dispatched in one script, its gateway's list included
    first = submit("r0")
    first.request.gateway_id, first.request.gateway_incarnation = "g1", "first"
    dispatch = Dispatch(role="mixed", request=first.request, epoch=FIRST_EPOCH)
    assert await scheduler.admit_and_dispatch("r0", first, 10, "w1", dispatch) == "admitted"
    await scheduler.release("r0", "w1")
    # or admitted with its decode instance's Reserve
    reserve = Reserve(request=first.request, epoch=FIRST_EPOCH, timeout_s=5, reply_to="r")
    assert await scheduler.admit_and_reserve("r9", submit("r9"), 10, "d1", reserve) == "admitted"
    await scheduler.release("r9")
    epoch = await scheduler.claim_epoch("r1")
    assert epoch == 1
    assert await scheduler.dispatch("r1", epoch, ["w1"], keys.inbox("w1"), submit("r1"))
    placement = await scheduler.placement("r1")
    assert placement is not None and placement.instance_ids == ["w1"]
    assert await scheduler.client.smembers(keys.assignments("w1")) == {b"r1"}
    assert await scheduler.client.mget([keys.heartbeat("w1")]) == [None]
    # a replica whose lease is gone leaves its pending messages to the next one to read
    await (await bus_as("gateway")).publish(keys.requests, submit("r2"))
    await scheduler.hold_lease(keys.scheduler_lease("s1"), 10)
    first = await scheduler.read_group(keys.requests, SCHEDULER_GROUP, "s1", block_ms=100)
    assert len(first) == 1
    await scheduler.forget_scheduler("s1")
    await scheduler.hold_lease(keys.scheduler_lease("s2"), 10)
    prefix = keys.scheduler_lease("")
    taken = await scheduler.read_group(
        keys.requests, SCHEDULER_GROUP, "s2", block_ms=100, lease_prefix=prefix
    )
    assert [d.entry_id for d in taken] == [d.entry_id for d in first]
    await scheduler.release("r1", "w1")
    assert await scheduler.client.get(keys.queue_depth) == b"0"
    # a request it gives up on (no instance, too many attempts) ends with an error on its
    # gateway's stream and its delivered record closed, in one script (`_fail`)
    assert await scheduler.admit("r4", submit("r4"), 10) == "admitted"
    epoch4 = await scheduler.claim_epoch("r4")
    assert epoch4 is not None
    records = [("r4", epoch4, APPEND_AT_END, END_BYTES)]
    assert await scheduler.publish_step([("g1", output("r4"))], records) == []
    assert await scheduler.delivered_tokens("r4") == ([], True)
    await scheduler.release("r4")
    # the requests of a gateway incarnation, listed at admission, off the list at release
    owned = submit("r3")
    owned.request.gateway_id, owned.request.gateway_incarnation = "g1", "first"
    assert await scheduler.admit("r3", owned, 10) == "admitted"
    assert await scheduler.gateway_owners() == {"g1": None}
    assert await scheduler.gateway_requests("g1") == {"r3": "first"}
    await scheduler.release("r3")
    assert await scheduler.forget_gateway("g1")
    # a dead instance's assignments and inbox, as it is buried
    assert await scheduler.client.delete(keys.assignments("w1"), keys.inbox("w1")) == 1

    await refused(scheduler.client.flushall())
    await refused(scheduler.client.acl_list())
    await refused(scheduler.client.set(keys.heartbeat("w1"), b"alive"))
    await refused(scheduler.client.set(keys.delivered("r1"), b"\0\0\0\0"))  # appends its end marker only
    await refused(scheduler.client.xadd(keys.suffix_updates, {"m": "x"}))


async def test_the_scheduler_reads_its_replies_as_its_loop_does(bus_as) -> None:
    """`scheduler-replies` is consumed with the lease prefix like `requests`: a refused take-over
    left every `Finished` unread, so no request ever gave its queue slot back."""
    scheduler, worker = await bus_as("scheduler"), await bus_as("worker")
    keys = scheduler.keys
    await scheduler.ensure_group(keys.scheduler_replies, SCHEDULER_GROUP)
    assert await scheduler.admit("f1", submit("f1"), 10) == "admitted"
    epoch = await scheduler.claim_epoch("f1")
    assert epoch is not None
    finished = Finished(request_id="f1", instance_id="w1", outcome="done", epoch=epoch)
    assert await worker.publish_step([], [], [(keys.scheduler_replies, finished)]) == []
    prefix = keys.scheduler_lease("")
    await scheduler.hold_lease(keys.scheduler_lease("s1"), 10)
    first = await scheduler.read_group(
        keys.scheduler_replies, SCHEDULER_GROUP, "s1", block_ms=100, lease_prefix=prefix
    )
    assert [d.message for d in first] == [finished]
    # s1 dies before acknowledging it: the next replica takes it over on its first read
    await scheduler.forget_scheduler("s1")
    await scheduler.hold_lease(keys.scheduler_lease("s2"), 10)
    taken = await scheduler.read_group(
        keys.scheduler_replies, SCHEDULER_GROUP, "s2", block_ms=100, lease_prefix=prefix
    )
    assert [d.entry_id for d in taken] == [d.entry_id for d in first]
    await scheduler.ack(keys.scheduler_replies, SCHEDULER_GROUP, taken[0].entry_id)
    await scheduler.release("f1")


async def test_a_worker_publishes_its_steps_but_cannot_touch_admission_state(bus_as) -> None:
    scheduler, worker = await bus_as("scheduler"), await bus_as("worker")
    keys = worker.keys
    assert await scheduler.admit("r1", submit("r1"), 10) == "admitted"
    await worker.ensure_group(keys.inbox("w1"), WORKER_GROUP)
    await scheduler.publish(keys.inbox("w1"), submit("r1"))
    deliveries = await worker.read_group(keys.inbox("w1"), WORKER_GROUP, "w1", count=10, block_ms=100)
    await worker.ack(keys.inbox("w1"), WORKER_GROUP, *(d.entry_id for d in deliveries))
    async with worker.client.pipeline(transaction=False) as pipe:
        pipe.set(keys.heartbeat("w1"), b"load", px=5000)
        pipe.sadd(keys.instances, "w1")
        await pipe.execute()
    tokens = np.asarray([5], TOKEN_DTYPE).tobytes()
    epoch = await scheduler.claim_epoch("r1")
    assert epoch is not None
    finished = Finished(request_id="r1", instance_id="w1", outcome="done", epoch=epoch)
    fenced = await worker.publish_step(
        [("g1", output("r1"))], [("r1", epoch, 0, tokens)], [(keys.scheduler_replies, finished)]
    )
    assert fenced == []
    assert await scheduler.delivered_tokens("r1") == ([5], False)
    await worker.publish_step([], [("r1", epoch, 0, tokens)])  # a repeat: its append is undone
    assert await scheduler.delivered_tokens("r1") == ([5], False)
    await worker.publish_step([], [("r2", epoch, 1, tokens)])  # past a lost record: none is made
    assert await scheduler.delivered_tokens("r2") == ([], False)
    assert await worker.publish_step([("g1", output("r1"))], [("r1", epoch - 1, 1, tokens)]) == ["r1"]

    await refused(worker.admit("r2", submit("r2"), 10))
    await refused(worker.release("r1"))
    await refused(worker.client.hset(keys.request_state("r1"), "slot", 0))
    await refused(worker.client.incr(keys.queue_depth))
    await refused(worker.client.xadd(keys.requests, {"m": "x"}))
    await refused(worker.client.xadd(keys.inbox("w2"), {"m": "x"}))
    await refused(worker.client.srem(keys.instances, "w2"))
    await refused(worker.client.flushall())
    assert await scheduler.client.hget(keys.request_state("r1"), "slot") == b"1"


async def test_the_suffix_cache_serves_look_ups_but_reads_no_outputs(bus_as) -> None:
    cache = await bus_as("suffix-cache")
    keys = cache.keys
    await cache.ensure_group(keys.suffix_lookups, "suffix-cache")
    await cache.client.xadd(keys.suffix_replies("w1"), {"m": "x"})
    await cache.client.set(keys.suffix_cache_heartbeat, b"up", px=5000)
    await refused(cache.client.xread({keys.outputs("g1"): "0"}))
    await refused(cache.client.xadd(keys.requests, {"m": "x"}))
    await refused(cache.client.set(keys.heartbeat("w1"), b"alive"))
    await refused(cache.client.flushall())


async def test_a_restart_from_the_append_only_file_keeps_what_scripts_and_transactions_wrote(
    tmp_path: Path,
) -> None:
    """Redis replays the file's scripts and MULTI/EXEC blocks as the default user: off, it must keep its grants."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    passwords = {role: secrets.token_hex(16) for role in (*acl.ROLES, acl.ADMIN)}
    hashes = {role: acl.password_hash(password) for role, password in passwords.items()}
    users = write_private(tmp_path / "users.acl", acl.acl_file(hashes, TOPIC))
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)]
    argv += ["--appendonly", "yes", "--appendfsync", "always", "--aclfile", str(users)]
    redis_at = AclRedis(port, passwords)
    admin = redis.Redis(port=port, username=acl.user_name(acl.ADMIN), password=passwords[acl.ADMIN])
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        _wait_until_up(admin)
        settings = redis_at.settings("scheduler")
        scheduler = Bus(await connect(settings, attempts=1), settings.keys)
        assert await scheduler.admit("r1", submit("r1"), 10) == "admitted"  # a script
        epoch = await scheduler.claim_epoch("r1")  # scripts, each replayed as the default user
        assert epoch is not None
        assert await scheduler.dispatch("r1", epoch, ["w1"], scheduler.keys.inbox("w1"), submit("r1"))
        await scheduler.client.aclose()
        written = sorted(admin.keys("*"))
        server.kill()
        server.wait(timeout=10)
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        _wait_until_up(admin)
        assert sorted(admin.keys("*")) == written and len(written) == 4
        with pytest.raises(AuthenticationError):
            redis.Redis(port=port).ping()
    finally:
        admin.close()
        server.terminate()
        server.wait(timeout=10)


def test_acl_rules_need_a_topic_that_fits_in_a_key_pattern() -> None:
    hashes = {role: "0" * 64 for role in (*acl.ROLES, acl.ADMIN)}
    with pytest.raises(ValueError, match="whitespace"):
        acl.acl_file(hashes, "two words")
    assert "~specmesh:a\\*b:requests" in acl.acl_file(hashes, "a*b")


@pytest.mark.parametrize(
    ("role", "flags"),
    [("scheduler", ()), ("suffix-cache", ()), ("gateway", ("--port", "0"))],
)
def test_wrong_credentials_stop_a_role_at_start_up_with_one_line(
    acl_redis: AclRedis, tmp_path: Path, role: str, flags: tuple[str, ...]
) -> None:
    bus = ["--scheduler-port", str(acl_redis.port), "--scheduler-topic", TOPIC]
    argv = [sys.executable, "-m", "services.cli", role, *flags, *bus, "--redis-user", acl.user_name(role)]
    env = {**os.environ, PASSWORD_ENV: "wrong"}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stderr
    assert f"refused user {acl.user_name(role)!r}" in done.stderr
    assert "Traceback" not in done.stderr

    missing = tmp_path / "no-such-file"
    done = subprocess.run(
        [*argv, "--redis-password-file", str(missing)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"--redis-password-file {missing}: cannot read it" in done.stderr
