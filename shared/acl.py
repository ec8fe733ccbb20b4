"""Redis ACL users, one per role, each allowed only the commands and keys its code uses.

Every grant is a Redis 7 selector: its commands may touch its keys and no others, so the gateway,
which may XADD to the requests stream, cannot XADD to a worker's inbox. A command with several keys
needs one grant that covers them all. Keys come from `Keys`, so a new key or command in a role's
code needs its grant here (the role's user is refused otherwise, and tests/shared/test_acl.py says
which). Scripts run with their caller's rights: EVALSHA needs the
script's declared KEYS, and every command inside the script is checked again. The default user is
disabled; `specmesh-admin` may do anything (operators, and `specmesh serve` itself).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from shared.keys import Keys

DEFAULT_USER = "user default off resetpass resetchannels ~* &* +@all"
"""Off: no connection can log in as it, so every client must AUTH as a user below. Its grants are
still all: Redis replays the MULTI/EXEC blocks of its append-only file (transactions, and every
script's writes) as the default user, and refuses those it may not run, so a restart would lose
them."""
ROLES = ("gateway", "scheduler", "worker", "suffix-cache")
"""ACL roles; prefill, decode and mixed workers share the worker's."""
ADMIN = "admin"
USER_PREFIX = "specmesh-"
MIN_REDIS_VERSION = (7, 0)
"""Selectors (a grant's commands tied to its keys) came with Redis 7.0."""

GROUP_CONSUMER = ("xgroup|create", "xreadgroup", "xautoclaim", "xack", "xdel")
"""A consumer of a stream through its group (`Bus.read_group`, `Bus.ensure_group`, `Bus.ack`)."""
SCRIPTS = "script|load"
"""Loads a script before its first EVALSHA (and after Redis lost its script cache)."""


@dataclass(frozen=True)
class Grant:
    """`commands` allowed on `keys` (glob patterns) and on nothing else."""

    commands: tuple[str, ...]
    keys: tuple[str, ...]

    @property
    def rule(self) -> str:
        return "(" + " ".join([*(f"~{key}" for key in self.keys), *(f"+{c}" for c in self.commands)]) + ")"


@dataclass(frozen=True)
class RoleAcl:
    """What a role may do: keyless commands, and grants on keys."""

    keyless: tuple[str, ...]
    grants: tuple[Grant, ...]

    @property
    def rules(self) -> list[str]:
        return ["resetkeys", "resetchannels", "-@all", *(f"+{c}" for c in self.keyless)] + [
            grant.rule for grant in self.grants
        ]


def user_name(role: str) -> str:
    """The ACL user of an ACL role (`ROLES` or `ADMIN`)."""
    if role not in (*ROLES, ADMIN):
        raise ValueError(f"unknown ACL role {role!r}; known: {', '.join([*ROLES, ADMIN])}")
    return USER_PREFIX + role


def role_acl(role: str, topic: str) -> RoleAcl:
    """The commands and keys of `role` on deployment `topic`."""
    keys = Keys(_glob_escape(topic))
    acls = {
        "gateway": _gateway,
        "scheduler": _scheduler,
        "worker": _worker,
        "suffix-cache": _suffix_cache,
    }
    if role not in acls:
        raise ValueError(f"unknown ACL role {role!r}; known: {', '.join(ROLES)}")
    return acls[role](keys)


def _gateway(keys: Keys) -> RoleAcl:
    """Submits and cancels; follows, trims and finally deletes its output stream; counts live workers;
    renews its liveness and drops it as it stops (`delete_if_equal`)."""
    return RoleAcl(
        ("ping", SCRIPTS),
        (
            Grant(("xadd",), (keys.requests, keys.dead_letters)),
            Grant(("set", "evalsha", "get", "del"), (keys.gateway_liveness("*"),)),
            Grant(("xread", "xtrim", "del"), (keys.outputs("*"),)),
            Grant(("smembers",), (keys.instances,)),
            Grant(("exists",), (keys.heartbeat("*"),)),
        ),
    )


def _scheduler(keys: Keys) -> RoleAcl:
    """Admits (`Bus.admit` / `release`), places (`claim_epoch`, `dispatch`), re-dispatches from
    delivered records, holds its lease and takes over a dead replica's pending messages, reads the
    registry, answers refusals on a gateway's stream (`publish_step`), and aborts the requests of
    gateways whose liveness lapsed (`gateway_owners`, `gateway_requests`, `forget_gateway`)."""
    request, delivered, assigned = keys.request_state("*"), keys.delivered("*"), keys.assignments("*")
    owned = keys.gateway_requests("*")
    return RoleAcl(
        ("ping", SCRIPTS, "multi", "exec", "discard"),
        (
            Grant(GROUP_CONSUMER, (keys.requests, keys.scheduler_replies)),
            # taking over the pending messages of a replica whose lease is gone (`read_group`), on
            # both streams it consumes
            Grant(
                ("xinfo|consumers", "xgroup|delconsumer", "xpending", "xclaim"),
                (keys.requests, keys.scheduler_replies),
            ),
            Grant(("set", "exists", "del"), (keys.scheduler_lease("*"),)),
            Grant(("xread",), (keys.reservation_replies("*"),)),
            Grant(("xadd",), (keys.inbox("*"), keys.dead_letters)),
            Grant(
                ("evalsha",),
                (
                    request,
                    keys.queue_depth,
                    delivered,
                    assigned,
                    keys.outputs("*"),
                    keys.inbox("*"),
                    keys.requests,
                    keys.scheduler_replies,
                    owned,
                    keys.gateways,
                ),
            ),
            Grant(("hset", "hdel", "hgetall", "exists"), (owned,)),
            Grant(("sadd", "srem", "smembers"), (keys.gateways,)),
            Grant(("mget",), (keys.gateway_liveness("*"),)),
            Grant(
                ("hsetnx", "hset", "hget", "hmget", "hexists", "hincrby", "hdel", "exists", "set", "expire"),
                (request,),
            ),
            Grant(("incr", "decr", "get"), (keys.queue_depth,)),
            Grant(("get",), (delivered,)),
            # a request the scheduler fails ends its delivered record (`publish_step` from `_fail`)
            Grant(("append", "expire"), (delivered,)),
            Grant(("del",), (request, delivered)),  # `release` deletes both in one DEL
            Grant(("sadd", "srem", "smembers"), (assigned,)),
            Grant(("del",), (assigned, keys.inbox("*"))),  # a dead instance's both, in one DEL
            Grant(("smembers", "srem"), (keys.instances,)),
            Grant(("mget",), (keys.heartbeat("*"),)),
            Grant(("xadd", "expire"), (keys.outputs("*"),)),
        ),
    )


def _worker(keys: Keys) -> RoleAcl:
    """Reads its inbox, beats, publishes steps (`publish_step`: output streams, delivered records,
    reports, each request's epoch read), answers reservations; its engine core talks to the suffix
    cache."""
    return RoleAcl(
        ("ping", SCRIPTS),
        (
            Grant(GROUP_CONSUMER, (keys.inbox("*"),)),
            Grant(("set", "del"), (keys.heartbeat("*"),)),
            Grant(("sadd",), (keys.instances,)),
            Grant(("evalsha",), (keys.outputs("*"), keys.scheduler_replies)),
            Grant(("xadd", "expire"), (keys.outputs("*"),)),
            # `publish_step` undoes an append that did not start at the record's end (a repeat)
            Grant(("append", "expire", "getrange", "set", "del"), (keys.delivered("*"),)),
            Grant(("hget", "exists"), (keys.request_state("*"),)),  # the epoch fence in `publish_step`
            Grant(
                ("xadd",),
                (
                    keys.scheduler_replies,
                    keys.reservation_replies("*"),
                    keys.dead_letters,
                    keys.suffix_updates,
                    keys.suffix_lookups,
                ),
            ),
            Grant(("xread", "xrevrange"), (keys.suffix_replies("*"),)),
            Grant(("exists",), (keys.suffix_cache_heartbeat,)),
        ),
    )


def _suffix_cache(keys: Keys) -> RoleAcl:
    """Consumes updates and look-ups, re-indexes the newest updates, replies, beats."""
    streams = (keys.suffix_updates, keys.suffix_lookups)
    return RoleAcl(
        ("ping",),
        (
            Grant((*GROUP_CONSUMER, "xgroup|delconsumer"), streams),
            Grant(("xrevrange",), (keys.suffix_updates,)),
            Grant(("xadd", "expire"), (keys.suffix_replies("*"),)),
            Grant(("set", "del"), (keys.suffix_cache_heartbeat,)),
            Grant(("xadd",), (keys.dead_letters,)),
        ),
    )


def password_hash(password: str) -> str:
    """How an ACL file holds a password (`#<sha256 hex>`): the password itself is never written."""
    return hashlib.sha256(password.encode()).hexdigest()


def acl_file(password_hashes: Mapping[str, str], topic: str) -> str:
    """An ACL file (Redis `aclfile`): the default user off, then each role's user and the admin with
    the SHA-256 of its password from `password_hashes` (by ACL role)."""
    lines = [DEFAULT_USER]
    for role in ROLES:
        rules = role_acl(role, topic).rules
        lines.append(" ".join(["user", user_name(role), "reset", "on", f"#{password_hashes[role]}", *rules]))
    lines.append(f"user {user_name(ADMIN)} reset on #{password_hashes[ADMIN]} ~* &* +@all")
    return "\n".join(lines) + "\n"


def acl_template(topic: str) -> str:
    """`acl_file` with `@role@` where each hash goes, for a deployment (k8s/base/redis.yaml) that fills
    in the hashes of its own Secret's passwords."""
    return acl_file({role: placeholder(role) for role in (*ROLES, ADMIN)}, topic)


def placeholder(role: str) -> str:
    return f"@{role}@"


def _glob_escape(topic: str) -> str:
    """The topic as a literal inside a key pattern; a topic with whitespace cannot be one."""
    if re.search(r"\s", topic) or not topic:
        raise ValueError(f"topic {topic!r} cannot be written into ACL rules (empty or has whitespace)")
    return re.sub(r"([*?\[\]\\])", r"\\\1", topic)
