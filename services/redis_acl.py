"""`specmesh redis-acl`: the Redis ACL file of a deployment, a user per role (`shared/acl.py`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from services.runtime import read_secret_file
from shared import acl


def add_redis_acl_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("redis-acl", help="print Redis 7 ACL users: one per role, default off")
    parser.add_argument("--scheduler-topic", default="default", help="the deployment's topic")
    parser.add_argument(
        "--password-dir",
        type=Path,
        help=f"a file per user ({', '.join([*acl.ROLES, acl.ADMIN])}) holding its password; "
        "without it, @<user>@ marks where each password's SHA-256 goes",
    )
    parser.set_defaults(handler=cmd_redis_acl)


def cmd_redis_acl(args: argparse.Namespace) -> int:
    if args.password_dir is None:
        sys.stdout.write(acl.acl_template(args.scheduler_topic))
        return 0
    hashes = {
        role: acl.password_hash(read_secret_file(args.password_dir / role, "--password-dir"))
        for role in (*acl.ROLES, acl.ADMIN)
    }
    sys.stdout.write(acl.acl_file(hashes, args.scheduler_topic))
    return 0
