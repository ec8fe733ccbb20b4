"""The worker command's flags: how a prefill core exports KV, from --kv-transport and
--kv-stream-layers / --no-kv-stream-layers."""

from __future__ import annotations

import argparse

import pytest

from services.worker.main import add_worker_parsers, kv_export_options


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_parsers(parser.add_subparsers())
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("flags", "export"),
    [
        ((), {"share_kv": False, "stream_kv": False}),
        (("--kv-stream-layers",), {"share_kv": False, "stream_kv": True}),
        (("--no-kv-stream-layers",), {"share_kv": False, "stream_kv": False}),
        (("--kv-transport", "ipc"), {"share_kv": True, "stream_kv": False}),
    ],
)
def test_a_prefill_worker_streams_kv_over_tcp_when_told_to(flags, export) -> None:
    args = parse("prefill", *flags)
    assert kv_export_options("prefill", args.kv_transport, args.kv_stream_layers) == export


@pytest.mark.parametrize("role", ["decode", "mixed"])
def test_other_roles_export_nothing(role) -> None:
    args = parse(role)
    assert kv_export_options(role, args.kv_transport, args.kv_stream_layers) == {
        "share_kv": False,
        "stream_kv": False,
    }
