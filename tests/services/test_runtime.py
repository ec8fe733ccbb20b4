"""Every role's Redis credentials (`services/runtime.py`): the user and password from flags, a file
or the environment, never required on a command line; one shared password without ACL users (a
mesh started by hand) still connects."""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from services.runtime import PASSWORD_ENV, add_redis_args, bound_port, redis_settings, start_status_server
from services.serve import free_port
from shared.bus import connect


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_redis_args(parser)
    return parser.parse_args(argv)


def secret_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "password"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_password_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    path = secret_file(tmp_path, "from-file\nignored\n")
    from_file = redis_settings(parse("--redis-user", "u", "--redis-password-file", str(path)), {})
    assert (from_file.username, from_file.password) == ("u", "from-file")
    from_env = redis_settings(parse(), {PASSWORD_ENV: "from-env"})
    assert (from_env.username, from_env.password) == (None, "from-env")
    assert redis_settings(parse(), {}).password is None


def test_bad_password_sources_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read it"):
        redis_settings(parse("--redis-password-file", str(tmp_path / "missing")), {})
    with pytest.raises(ValueError, match="is empty"):
        redis_settings(parse("--redis-password-file", str(secret_file(tmp_path, "\n"))), {})
    path = secret_file(tmp_path, "pw")
    with pytest.raises(ValueError, match="give the Redis password once"):
        redis_settings(parse("--redis-password-file", str(path), "--scheduler-password", "pw"), {})


def test_a_password_file_every_user_may_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = secret_file(tmp_path, "pw", mode=0o644)
    assert redis_settings(parse("--redis-password-file", str(path)), {}).password == "pw"
    assert "readable by every user" in caplog.text


async def test_one_shared_password_without_acl_users_still_connects(tmp_path: Path) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--requirepass", "shared"]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        probe = redis.Redis(port=port, password="shared")
        deadline = time.monotonic() + 10
        while True:
            try:
                probe.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        probe.close()
        path = secret_file(tmp_path, "shared\n")
        for args, environ in [(("--redis-password-file", str(path)), {}), ((), {PASSWORD_ENV: "shared"})]:
            client = await connect(redis_settings(parse("--scheduler-port", str(port), *args), environ))
            assert await client.ping()
            await client.aclose()
        with pytest.raises(ConnectionError, match="refused the default user"):
            await connect(redis_settings(parse("--scheduler-port", str(port)), {PASSWORD_ENV: "wrong"}))
    finally:
        server.terminate()
        server.wait(timeout=10)


async def test_the_status_server_logs_the_port_it_took(caplog: pytest.LogCaptureFixture) -> None:
    """A worker's metrics port is 0 (a free one) by default: its log is where an operator finds it."""

    async def healthy() -> tuple[bool, str]:
        return True, "ok"

    with caplog.at_level(logging.INFO, logger="services.runtime"):
        runner = await start_status_server("127.0.0.1", 0, CollectorRegistry(), healthy)
    try:
        port = bound_port(runner)
        [record] = [r for r in caplog.records if "/metrics" in r.getMessage()]
        assert record.levelno == logging.INFO
        assert record.getMessage() == f"/health and /metrics on http://127.0.0.1:{port}"
        assert record.__dict__["metrics_port"] == port
    finally:
        await runner.cleanup()
