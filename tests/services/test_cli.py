"""`specmesh`: every subcommand listed and parsed as before, and the bus roles start without torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from services import cli
from services.gateway.main import main as gateway_main

REPO_ROOT = Path(__file__).resolve().parents[2]
EVERY_SUBCOMMAND = (
    "generate",
    "train-mtp",
    "train-eagle3",
    "serve",
    "redis-acl",
    "scheduler",
    "gateway",
    "suffix-cache",
    "worker",
    "mixed",
    "prefill",
    "decode",
)
TORCH_FREE_ROLES = ("gateway", "scheduler", "suffix-cache")

# Runs `specmesh <argv>` up to where the role would start serving: aiohttp's and uvloop's run
# functions are replaced by one that reports whether torch has been imported by then.
UNTIL_SERVING = """
import inspect, sys
import aiohttp.web, uvloop

def serve(main, *args, **kwargs):
    if inspect.iscoroutine(main):
        main.close()
    if kwargs.get("loop") is not None:
        kwargs["loop"].close()
    print("serving; torch imported:", "torch" in sys.modules)

aiohttp.web.run_app = uvloop.run = serve
from services import cli
from services.gateway.main import main as gateway_main
sys.exit(cli.main(sys.argv[1:]))
"""


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [
        line.split()[0]
        for line in lines
        if line.startswith("    ") and line[4] != " " and len(line.split()) > 1
    ]
    assert listed == list(EVERY_SUBCOMMAND)  # each with its one-line help


@pytest.mark.parametrize("command", EVERY_SUBCOMMAND)
def test_a_subcommand_parsed_alone_has_the_flags_it_has_among_all(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    helps = []
    for parser in (cli.build_parser(command), cli.build_parser()):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([command, "--help"])
        assert exited.value.code == 0
        helps.append(capsys.readouterr().out)
    assert helps[0] == helps[1]


@pytest.mark.parametrize("command", EVERY_SUBCOMMAND)
def test_help_gives_every_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every flag that has a default (not None, not a switch's False) says it in `--help`."""
    parser = cli.build_parser(command)
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # the formatter wraps lines anywhere
    [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    actions = subparsers.choices[command]._actions
    with_defaults = [a for a in actions if cli.shows_default(a)]
    # the training commands' defaults live in their configs, named in each flag's help
    assert with_defaults or command in ("train-mtp", "train-eagle3")
    for action in with_defaults:
        assert f"(default: {action.default})" in text, action.option_strings


def test_standalone_gateway_help_gives_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gateway_main(["--help"])
    assert "--port PORT (default: 8000)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["gateway", "--port", "0"], "gateway"),
        (["--log-level", "DEBUG", "prefill", "--log-level", "INFO"], "prefill"),
        (["--log-level=DEBUG", "suffix-cache", "-h"], "suffix-cache"),  # the subcommand's help
        (["-h", "gateway"], None),  # the top-level help: the listing
        ([], None),
        (["gatewy"], None),
        (["--log-level"], None),
    ],
)
def test_chosen_command_is_the_one_argparse_dispatches_to(argv: list[str], command: str | None) -> None:
    assert cli.chosen_command(argv) == command


@pytest.mark.parametrize("role", TORCH_FREE_ROLES)
def test_bus_roles_start_serving_without_torch(role: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", UNTIL_SERVING, role], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "serving; torch imported: False"


def test_parsing_the_bus_roles_imports_no_other_subcommand() -> None:
    heavy = ("torch", "training.train_mtp", "services.generate", "services.serve", "services.worker.main")
    code = (
        "import sys; from services import cli\n"
        f"for role in {TORCH_FREE_ROLES!r}: cli.parse_args([role])\n"
        f"print([name for name in {heavy!r} if name in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
