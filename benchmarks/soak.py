"""Soak: N concurrent greedy streams for T seconds against `specmesh serve`, with faults on a schedule.

    python -m benchmarks.soak --streams 1000 --duration-s 600 --kill-worker-every-s 120 \\
        --kill-redis-at-s 300 --out soak.json -- --speculative-config '{"method": "ngram"}'

Starts `specmesh serve` as a user would (its own process, the flags after `--` passed on to it, its
logs beside the output file), computes each prompt's greedy text once offline (`LLM.generate`, EOS
ignored), then keeps `--streams` streams busy: each sends one streamed completion after another, cycling through the
prompts, until `--duration-s` has passed; then the open ones get `--request-timeout-s` to end.
Faults: the worker role SIGKILLed every `--kill-worker-every-s`, Redis SIGKILLed at each
`--kill-redis-at-s`; `serve` restarts both.

A request that ended with `[DONE]` is compared with its offline output, its text aligned with
the offline text and each offline token's span of characters in it (from incremental decoding):
- *tokens lost*: offline tokens with characters missing from the stream; *tokens changed*: ones
  with characters replaced; *wrong text*: requests whose text differs (a repeat counts only here).
  All three must be 0: the gateway called them whole.
- *hung*: requests with neither `[DONE]` nor an error event after `--request-timeout-s`.
- *errors by kind*: explicit failures (HTTP status, error event type/code, connection errors,
  a stream closed without `[DONE]`) — allowed under faults, never silent.

Reported: the totals, p50 / p99 TTFT and TPOT of the requests that ended in each `--window-s`
window, and the RSS of every process by role (serve's children and theirs) after `--warmup-s` and
at the end of the load, with Redis's own account of its memory beside its RSS (INFO `used_memory`:
the bytes its data holds) and its number of keys. A table on stdout, everything in the JSON file;
exit status 1 when a goal is missed (anything lost, changed or hung, or an RSS more than
`--max-rss-growth-pct` above its warm-up value).
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import redis

from benchmarks.launch import child_processes
from services.serve import ADMIN_PASSWORD_FILE, free_port
from shared import acl

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300.0
PROMPT_STEMS = ("def", "class", "async def", "for", "while", "with", "if", "return")


@dataclass(frozen=True)
class SoakConfig:
    streams: int
    duration_s: float
    warmup_s: float
    window_s: float
    num_prompts: int
    max_tokens: int
    max_model_len: int
    request_timeout_s: float
    kill_worker_every_s: float | None
    kill_redis_at_s: list[float]
    worker_role: str
    max_rss_growth_pct: float
    model: str | None
    device: str
    serve_args: list[str]
    out: Path


@dataclass(frozen=True)
class Expected:
    """A prompt's offline greedy output: its text and where each token's characters start in it."""

    text: str
    token_starts: list[int]

    def tokens_in(self, start: int, end: int) -> set[int]:
        """The tokens with characters in text[start:end]."""
        bounds = [*self.token_starts, len(self.text)]
        return {i for i in range(len(self.token_starts)) if bounds[i] < end and bounds[i + 1] > start}


@dataclass
class Record:
    """One request as the client saw it; times in seconds since the load started."""

    stream: int
    prompt: int
    sent_at: float
    first_token_at: float | None = None
    ended_at: float | None = None
    text: str = ""
    done: bool = False
    """`[DONE]` came: the gateway said the text is whole."""
    error: str | None = None
    """The kind of an explicit failure (`HTTP 429`, `event server_error/503`, ...)."""
    hung: bool = False


@dataclass(frozen=True)
class Judged:
    """A whole (`[DONE]`) request against its offline tokens."""

    num_lost: int
    num_changed: int
    wrong_text: bool


# ---- command line -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> SoakConfig:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams")
    parser.add_argument("--duration-s", type=float, default=60.0, help="how long new requests are sent")
    parser.add_argument(
        "--warmup-s", type=float, help="when the baseline RSS is taken (default: duration / 6)"
    )
    parser.add_argument("--window-s", type=float, help="latency window (default: duration / 10)")
    parser.add_argument(
        "--num-prompts", type=int, default=16, help="distinct prompts the streams cycle through"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (EOS ignored)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--request-timeout-s", type=float, default=300.0, help="a request still open after this has hung"
    )
    parser.add_argument("--kill-worker-every-s", type=float, help="SIGKILL the worker role this often")
    parser.add_argument(
        "--kill-redis-at-s", type=float, nargs="*", default=[], help="SIGKILL Redis at these seconds"
    )
    parser.add_argument(
        "--worker-role", default="mixed", help="the role SIGKILLed: mixed, or prefill / decode with --pd"
    )
    parser.add_argument("--max-rss-growth-pct", type=float, default=10.0)
    parser.add_argument("--model", help="default: serve's default model")
    parser.add_argument("--device", default="cpu", help="serve's and the offline run's --device")
    parser.add_argument("--out", type=Path, default=Path("soak.json"), help="the JSON result file")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    serve_args = argv[split + 1 :]
    for name in ("streams", "num_prompts", "max_tokens", "max_model_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("duration_s", "request_timeout_s", "max_rss_growth_pct"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    warmup_s = args.duration_s / 6 if args.warmup_s is None else args.warmup_s
    window_s = args.duration_s / 10 if args.window_s is None else args.window_s
    if not 0 <= warmup_s < args.duration_s:
        parser.error(f"--warmup-s must be in [0, --duration-s), got {warmup_s}")
    if not window_s > 0:
        parser.error(f"--window-s must be positive, got {window_s}")
    if args.kill_worker_every_s is not None and not args.kill_worker_every_s > 0:
        parser.error(f"--kill-worker-every-s must be positive, got {args.kill_worker_every_s}")
    if bad := [t for t in args.kill_redis_at_s if not 0 < t < args.duration_s]:
        parser.error(f"--kill-redis-at-s must be within (0, --duration-s), got {bad}")
    if args.max_tokens >= args.max_model_len:
        parser.error(f"--max-tokens ({args.max_tokens}) must leave room for a prompt in --max-model-len")
    return SoakConfig(
        streams=args.streams,
        duration_s=args.duration_s,
        warmup_s=warmup_s,
        window_s=window_s,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        max_model_len=args.max_model_len,
        request_timeout_s=args.request_timeout_s,
        kill_worker_every_s=args.kill_worker_every_s,
        kill_redis_at_s=sorted(args.kill_redis_at_s),
        worker_role=args.worker_role,
        max_rss_growth_pct=args.max_rss_growth_pct,
        model=args.model,
        device=args.device,
        serve_args=serve_args,
        out=args.out,
    )


def fault_schedule(config: SoakConfig) -> list[tuple[float, str]]:
    """(seconds after the load started, role to SIGKILL), in time order."""
    faults = [(t, "redis") for t in config.kill_redis_at_s]
    if config.kill_worker_every_s:
        count = int(config.duration_s // config.kill_worker_every_s)
        times = [config.kill_worker_every_s * i for i in range(1, count + 1)]
        faults += [(t, config.worker_role) for t in times if t < config.duration_s]
    return sorted(faults)


def prompts(num_prompts: int) -> list[str]:
    return [f"{PROMPT_STEMS[i % len(PROMPT_STEMS)]} item_{i}(value, count):" for i in range(num_prompts)]


# ---- the expected outputs and the judgement ---------------------------------------------------------


def expected_outputs(model: str, texts: list[str], config: SoakConfig) -> list[Expected]:
    """Each prompt's greedy output, computed once in this process with the served engine code."""
    from services.engine.llm import LLM
    from shared.sampling_params import SamplingParams

    llm = LLM(model, device=config.device, max_model_len=config.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens, ignore_eos=True)
    outputs = llm.generate(texts, params)
    decode = llm.tokenizer.decode
    return [
        Expected(o.text, [len(decode(o.token_ids[:i])) for i in range(len(o.token_ids))]) for o in outputs
    ]


def judge(record: Record, expected: Expected) -> Judged:
    """Aligns the streamed text with the offline text: offline tokens whose characters are missing
    are lost, ones whose characters were replaced are changed."""
    matcher = difflib.SequenceMatcher(a=expected.text, b=record.text, autojunk=False)
    lost: set[int] = set()
    changed: set[int] = set()
    for tag, a0, a1, _, _ in matcher.get_opcodes():
        if tag == "delete":
            lost |= expected.tokens_in(a0, a1)
        elif tag == "replace":
            changed |= expected.tokens_in(a0, a1)
    return Judged(len(lost), len(changed - lost), record.text != expected.text)


# ---- the launched mesh ------------------------------------------------------------------------------


@dataclass
class Served:
    popen: subprocess.Popen[bytes]
    url: str
    stdout: Path
    log_dir: Path

    def roles(self) -> dict[str, int]:
        """serve's children by role (redis, scheduler, suffix-cache, mixed or prefill / decode, gateway)."""
        found = {}
        for pid in child_processes(self.popen.pid).values():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"redis-server" in argv[0]:
                found["redis"] = pid
            elif b"services.cli" in argv:
                found[argv[argv.index(b"services.cli") + 1].decode()] = pid
        return found

    def output(self) -> str:
        return self.stdout.read_text(errors="replace")


@contextmanager
def serve(config: SoakConfig, log_dir: Path) -> Iterator[Served]:
    """`specmesh serve` with the soak's flags, once it says it is serving; SIGTERMed after."""
    port, stdout = free_port(), log_dir / "serve.out"
    argv = [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--log-dir", str(log_dir)]
    argv += ["--device", config.device, "--max-model-len", str(config.max_model_len)]
    argv += ["--model", config.model] if config.model else []
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(stdout, "wb") as handle:
        popen = subprocess.Popen(
            [*argv, *config.serve_args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    served = Served(popen, f"http://127.0.0.1:{port}", stdout, log_dir)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "specmesh is serving" not in served.output():
            if popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"specmesh serve did not start:\n{served.output()[-3000:]}")
            time.sleep(0.2)
        yield served
    finally:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()


def process_rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process from /proc (Linux); None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def redis_memory(served: Served) -> dict[str, int] | None:
    """Redis's own account (INFO memory): `used_memory`, the bytes its data and buffers hold, beside
    `used_memory_rss`, what the process holds from the system; and its number of keys. Read as
    serve's admin user (its password under the log dir); None while Redis does not answer."""
    conf = (served.log_dir / "redis.conf").read_text()
    port = int(next(line.split()[1] for line in conf.splitlines() if line.startswith("port ")))
    password = (served.log_dir / ADMIN_PASSWORD_FILE).read_text().strip()
    user = acl.user_name(acl.ADMIN) if "aclfile" in conf else None
    client = redis.Redis(port=port, username=user, password=password, socket_timeout=5)
    try:
        info = client.info("memory")
        return {
            "used_memory": int(info["used_memory"]),
            "used_memory_rss": int(info["used_memory_rss"]),
            "keys": int(client.dbsize()),
        }
    except redis.RedisError:
        return None
    finally:
        client.close()


def rss_by_role(served: Served) -> dict[str, int]:
    """RSS of each role's process and of its children ("mixed/engine-core", "gateway/gateway-0")."""
    rss = {}
    for role, pid in served.roles().items():
        for name, each in [(role, pid), *((f"{role}/{c}", p) for c, p in child_processes(pid).items())]:
            if (size := process_rss_bytes(each)) is not None:
                rss[name] = size
    return rss


# ---- the load ---------------------------------------------------------------------------------------


class Load:
    """The streams, the fault injector and the RSS samples of one soak."""

    def __init__(self, config: SoakConfig, served: Served, texts: list[str]):
        self.config = config
        self.served = served
        self.texts = texts
        self.records: list[Record] = []
        self.faults: list[dict[str, Any]] = []
        self.rss: list[dict[str, Any]] = []
        """{at_s, bytes: {process: RSS}, redis: `redis_memory`} samples in time order."""
        self.started = 0.0

    def now(self) -> float:
        return time.monotonic() - self.started

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)  # one connection per stream, however many
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self.started = time.monotonic()
            streams = [asyncio.create_task(self._stream(session, i)) for i in range(self.config.streams)]
            side = [asyncio.create_task(self._inject_faults()), asyncio.create_task(self._sample_rss())]
            await asyncio.gather(*streams)
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)

    async def _stream(self, session: aiohttp.ClientSession, stream: int) -> None:
        """Requests one after another until the duration is over; prompts staggered across streams."""
        turn = 0
        while self.now() < self.config.duration_s:
            record = Record(stream, (stream + turn) % len(self.texts), sent_at=self.now())
            self.records.append(record)
            try:
                await asyncio.wait_for(self._request(session, record), self.config.request_timeout_s)
            except asyncio.TimeoutError:
                record.hung = True
            except (aiohttp.ClientError, OSError) as exc:
                record.error = f"client {type(exc).__name__}"
            if record.ended_at is None and not record.hung:
                record.ended_at = self.now()
            turn += 1

    async def _request(self, session: aiohttp.ClientSession, record: Record) -> None:
        body = {
            "prompt": self.texts[record.prompt],
            "max_tokens": self.config.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        async with session.post(f"{self.served.url}/v1/completions", json=body) as response:
            if response.status != 200:
                await response.read()
                record.error = f"HTTP {response.status}"
                return
            async for line in response.content:
                if line.startswith(b"data: ") and self._take(record, line[6:].strip()):
                    return
        record.error = "closed without [DONE]"

    def _take(self, record: Record, data: bytes) -> bool:
        """Adds one SSE event to the record; True at its end."""
        if data == b"[DONE]":
            record.done, record.ended_at = True, self.now()
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            record.error = f"event {error.get('type')}/{error.get('code')}"
            record.ended_at = self.now()
            return True
        for choice in chunk.get("choices") or []:
            if record.first_token_at is None and choice.get("text"):
                record.first_token_at = self.now()
            record.text += choice.get("text") or ""
        return False

    async def _inject_faults(self) -> None:
        for at_s, role in fault_schedule(self.config):
            await asyncio.sleep(max(0.0, at_s - self.now()))
            pid = self.served.roles().get(role)
            fault: dict[str, Any] = {"at_s": round(self.now(), 1), "role": role, "pid": pid}
            if pid is None:
                fault["skipped"] = f"no {role} running"
            else:
                os.kill(pid, signal.SIGKILL)
            self.faults.append(fault)

    async def _sample_rss(self) -> None:
        """RSS by role, and Redis's own account of its memory, after the warm-up, at every window
        boundary, and at the end of the load."""
        window_marks = np.arange(self.config.window_s, self.config.duration_s, self.config.window_s)
        marks = sorted({self.config.warmup_s, *(float(m) for m in window_marks), self.config.duration_s})
        for mark in marks:
            await asyncio.sleep(max(0.0, mark - self.now()))
            rss = await asyncio.to_thread(rss_by_role, self.served)
            redis_now = await asyncio.to_thread(redis_memory, self.served)
            self.rss.append({"at_s": mark, "bytes": rss, "redis": redis_now})

    def rss_at(self, at_s: float) -> dict[str, int]:
        return next((sample["bytes"] for sample in self.rss if sample["at_s"] == at_s), {})

    def redis_at(self, at_s: float) -> dict[str, int] | None:
        return next((sample.get("redis") for sample in self.rss if sample["at_s"] == at_s), None)


# ---- the report -------------------------------------------------------------------------------------


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.array(values) * 1000, [50, 99])
    return {"p50": round(float(p50), 1), "p99": round(float(p99), 1)}


def window_stats(records: list[Record], window_s: float, num_tokens: int) -> list[dict[str, Any]]:
    """TTFT and TPOT percentiles of the whole requests (`num_tokens` each) that ended in each window."""
    by_window: dict[int, list[Record]] = {}
    for r in records:
        if r.done and r.ended_at is not None and r.first_token_at is not None:
            by_window.setdefault(int(r.ended_at // window_s), []).append(r)
    windows = []
    for index in sorted(by_window):
        done = by_window[index]
        ttft = [r.first_token_at - r.sent_at for r in done if r.first_token_at is not None]
        tpot = [
            (r.ended_at - r.first_token_at) / (num_tokens - 1)
            for r in done
            if r.ended_at is not None and r.first_token_at is not None and num_tokens > 1
        ]
        windows.append(
            {
                "from_s": index * window_s,
                "to_s": (index + 1) * window_s,
                "completed": len(done),
                "ttft_ms": percentiles_ms(ttft),
                "tpot_ms": percentiles_ms(tpot),
            }
        )
    return windows


def rss_growth_pct(warmup: dict[str, int], end: dict[str, int]) -> dict[str, float]:
    """Per process present at both marks: the end's RSS over the warm-up's, in percent."""
    return {name: round(100 * (end[name] / warmup[name] - 1), 1) for name in warmup if name in end}


def summarize(config: SoakConfig, load: Load, expected: list[Expected]) -> dict[str, Any]:
    judged = [(r, judge(r, expected[r.prompt])) for r in load.records if r.done]
    errors = Counter(r.error for r in load.records if r.error is not None)
    warmup, end = load.rss_at(config.warmup_s), load.rss_at(config.duration_s)
    growth = rss_growth_pct(warmup, end)
    totals = {
        "requests": len(load.records),
        "completed": sum(r.done for r in load.records),
        "errors": sum(errors.values()),
        "tokens_lost": sum(j.num_lost for _, j in judged),
        "tokens_changed": sum(j.num_changed for _, j in judged),
        "wrong_text": sum(j.wrong_text for _, j in judged),
        "hung": sum(r.hung for r in load.records),
    }
    goals = {
        "nothing_lost": totals["tokens_lost"] == 0
        and totals["tokens_changed"] == 0
        and totals["wrong_text"] == 0,
        "none_hung": totals["hung"] == 0,
        "memory_flat": all(g <= config.max_rss_growth_pct for g in growth.values()),
    }
    return {
        "config": {**asdict(config), "out": str(config.out)},
        "faults": load.faults,
        "totals": totals,
        "errors_by_kind": dict(errors.most_common()),
        "windows": window_stats(load.records, config.window_s, config.max_tokens),
        "rss_bytes": {"warmup": warmup, "end": end, "samples": load.rss},
        "rss_growth_pct": growth,
        "redis_memory": {"warmup": load.redis_at(config.warmup_s), "end": load.redis_at(config.duration_s)},
        "goals": goals,
    }


def table(report: dict[str, Any]) -> str:
    t, config = report["totals"], report["config"]
    lines = [
        f"soak: {config['streams']} streams, {config['duration_s']:g} s, faults "
        + (", ".join(f"{f['role']}@{f['at_s']}s" for f in report["faults"]) or "none"),
        "",
        "| requests | completed | errors | tokens lost | tokens changed | wrong text | hung |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {t['requests']} | {t['completed']} | {t['errors']} | {t['tokens_lost']} | "
        f"{t['tokens_changed']} | {t['wrong_text']} | {t['hung']} |",
        "",
        "errors by kind: " + (", ".join(f"{k}: {n}" for k, n in report["errors_by_kind"].items()) or "none"),
        "",
        "| window (s) | completed | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |",
        "|---|---:|---:|---:|",
    ]
    for w in report["windows"]:
        ttft, tpot = w["ttft_ms"], w["tpot_ms"]
        lines.append(
            f"| {w['from_s']:g}-{w['to_s']:g} | {w['completed']} | {ttft['p50']} / {ttft['p99']} "
            f"| {tpot['p50']} / {tpot['p99']} |"
        )
    lines += ["", "| process | RSS after warm-up (MiB) | RSS at end (MiB) | growth |", "|---|---:|---:|---:|"]
    warmup, end = report["rss_bytes"].get("warmup", {}), report["rss_bytes"].get("end", {})
    for name in sorted({*warmup, *end}):
        before, after = warmup.get(name), end.get(name)
        growth = report["rss_growth_pct"].get(name)
        lines.append(
            f"| {name} | {_mib(before)} | {_mib(after)} | {'-' if growth is None else f'{growth:+.1f}%'} |"
        )
    redis_warmup, redis_end = report["redis_memory"]["warmup"], report["redis_memory"]["end"]
    if redis_warmup and redis_end:
        lines += [
            "",
            f"Redis used_memory (its data): {_mib(redis_warmup['used_memory'])} -> "
            f"{_mib(redis_end['used_memory'])} MiB, keys {redis_warmup['keys']} -> {redis_end['keys']}",
        ]
    missed = [goal for goal, met in report["goals"].items() if not met]
    lines += ["", "goals: " + ("all met" if not missed else "MISSED " + ", ".join(missed))]
    return "\n".join(lines)


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:.1f}"


# ---- main -------------------------------------------------------------------------------------------


def run_soak(config: SoakConfig, log_dir: Path | None = None) -> dict[str, Any]:
    """Launches serve, soaks it and returns the report (also written to `config.out`)."""
    from shared.reference import default_model

    model = config.model or default_model()
    texts = prompts(config.num_prompts)
    expected = expected_outputs(model, texts, config)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="specmesh-soak-"))
    with serve(config, log_dir) as served:
        if config.kill_worker_every_s and config.worker_role not in served.roles():
            raise ValueError(f"--worker-role {config.worker_role!r} is not running: {sorted(served.roles())}")
        load = Load(config, served, texts)
        asyncio.run(load.run())
        restarts = [line for line in served.output().splitlines() if "restarting it" in line]
    report = summarize(config, load, expected)
    report["serve"] = {"log_dir": str(log_dir), "restarts": restarts, "model": model}
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    report = run_soak(config, config.out.parent / f"{config.out.stem}-logs")
    print(table(report))
    print(f"\nwritten: {config.out}; serve's logs: {report['serve']['log_dir']}")
    return 0 if all(report["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
