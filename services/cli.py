"""The `specmesh` command: one subcommand per job.

Each subcommand's flags are defined in its own module, next to its handler, and `specmesh <command>`
imports only that module: a gateway, scheduler or suffix-cache pod starts without torch (about
1.5 s and 200 MB). Listing the subcommands (`specmesh --help`, or none named) imports them all.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from redis.exceptions import NoPermissionError

from shared.errors import ModelConfigError, describe_validation_error

Command = Callable[[argparse.Namespace], int]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` gives every flag's default, flags without a help text included; a default of None,
    an empty list or a switch's False (nothing set) is left unsaid."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return super()._get_help_string(action) if shows_default(action) else action.help


def shows_default(action: argparse.Action) -> bool:
    """Whether `--help` names this flag's default."""
    unset = action.default in (None, argparse.SUPPRESS, []) or action.nargs == 0
    return bool(action.option_strings) and not unset


class CliParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose help shows defaults; its subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


@dataclass(frozen=True)
class Subcommand:
    """A subcommand, with its shorthands (the worker's roles), and the function that adds them to
    `add_subparsers()`'s result, as `module:function`; the module is imported only to call it."""

    names: tuple[str, ...]
    defined_by: str

    def define(self, subparsers: Any) -> None:
        module, _, function = self.defined_by.partition(":")
        getattr(importlib.import_module(module), function)(subparsers)


SUBCOMMANDS = (
    Subcommand(("generate",), "services.generate:add_generate_parser"),
    Subcommand(("train-mtp",), "training.train_mtp:add_train_mtp_parser"),
    Subcommand(("train-eagle3",), "training.train_eagle3:add_train_eagle3_parser"),
    Subcommand(("serve",), "services.serve:add_serve_parser"),
    Subcommand(("redis-acl",), "services.redis_acl:add_redis_acl_parser"),
    Subcommand(("scheduler",), "services.scheduler.main:add_scheduler_parser"),
    Subcommand(("gateway",), "services.gateway.main:add_gateway_parser"),
    Subcommand(("suffix-cache",), "services.suffix_cache.service:add_suffix_cache_parser"),
    Subcommand(("worker", "mixed", "prefill", "decode"), "services.worker.main:add_worker_parsers"),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `specmesh` parser with `command`'s flags, or with every subcommand's when it is None.

    The other subcommands are bare placeholders, so usage lines and errors still name them all.
    """
    parser = _top_level_parser()
    sub = parser.add_subparsers(dest="command", required=True)
    for subcommand in SUBCOMMANDS:
        if command is None or command in subcommand.names:
            subcommand.define(sub)
        else:
            for name in subcommand.names:
                sub.add_parser(name)
    return parser


def chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` names, found as argparse finds it (the first positional after the
    top-level flags); None where it names none or asks for the top-level help, the listing."""
    parser = _top_level_parser(add_help=False, exit_on_error=False)
    parser.add_argument("-h", "--help", action="store_true")
    sub = parser.add_subparsers(dest="command")
    for subcommand in SUBCOMMANDS:
        for name in subcommand.names:
            sub.add_parser(name, add_help=False)  # its flags are left unparsed, in the extras
    try:
        known, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError:  # a bad --log-level or an unknown subcommand: the full parser says
        return None
    return None if known.help else known.command


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`argv` (default: the process's) parsed, having imported only its subcommand's module."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return build_parser(chosen_command(argv)).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    handler: Command = args.handler
    try:
        return handler(args)
    except ValidationError as exc:
        print(f"specmesh {args.command}: error: {describe_validation_error(exc)}", file=sys.stderr)
        return 2
    except (ModelConfigError, ValueError, FileNotFoundError, ConnectionError) as exc:
        print(f"specmesh {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except NoPermissionError as exc:  # the Redis user lacks a grant this role's code needs
        print(
            f"specmesh {args.command}: error: Redis refused a command: {exc} (see shared/acl.py)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


def _top_level_parser(**options: Any) -> argparse.ArgumentParser:
    parser = CliParser(prog="specmesh", description="Speculative-decoding LLM serving mesh", **options)
    parser.add_argument("--log-level", default="WARNING")
    return parser


if __name__ == "__main__":
    sys.exit(main())
