"""What `specmesh serve` hands each role (`MeshSecrets`), without starting anything: its own Redis
user and password, the KV secret for workers alone, and nothing of serve's own credentials."""

from __future__ import annotations

import pytest

from services.runtime import KV_SECRET_ENV, PASSWORD_ENV, REDIS_USER_ENV
from services.serve import MeshSecrets
from shared import acl


@pytest.fixture(autouse=True)
def serve_has_credentials_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REDIS_USER_ENV, "someone")
    monkeypatch.setenv(PASSWORD_ENV, "serve's own")
    monkeypatch.setenv(KV_SECRET_ENV, "serve's own")


def test_each_role_gets_its_own_user_and_password_and_workers_alone_the_kv_secret() -> None:
    secrets = MeshSecrets.generate(acl_users=True)
    envs = {role: secrets.env(role, {}) for role in acl.ROLES}
    assert len({env[PASSWORD_ENV] for env in envs.values()}) == len(acl.ROLES)
    for role, env in envs.items():
        assert env[PASSWORD_ENV] == secrets.redis_passwords[role]
        assert REDIS_USER_ENV not in env
        assert env.get(KV_SECRET_ENV) == (secrets.kv_secret if role == "worker" else None)
        assert secrets.redis_flags(role) == ["--redis-user", acl.user_name(role)]


def test_without_acl_users_every_role_shares_the_admin_password_as_the_default_user() -> None:
    secrets = MeshSecrets.generate(acl_users=False)
    for role in acl.ROLES:
        assert secrets.env(role, {})[PASSWORD_ENV] == secrets.redis_passwords[acl.ADMIN]
        assert secrets.redis_flags(role) == []
        assert REDIS_USER_ENV not in secrets.env(role, {})


def test_serve_hands_its_quantization_to_every_worker() -> None:
    import argparse

    from services.engine.args import engine_config
    from services.serve import _engine_flags, add_serve_parser
    from services.worker.main import add_worker_parsers

    parsers = argparse.ArgumentParser().add_subparsers()
    add_serve_parser(parsers)
    add_worker_parsers(parsers)
    root = parsers._name_parser_map  # noqa: SLF001 - the subcommands' own parsers
    for quantization in ("int4", None):
        serve_args = root["serve"].parse_args(
            [] if quantization is None else ["--quantization", quantization]
        )
        flags = _engine_flags(serve_args, "models/specmesh-code-15m", "{}")
        worker_args = root["decode"].parse_args(flags)
        assert engine_config(worker_args).quantization == quantization


def test_serve_pd_puts_prefill_and_decode_on_gpus_of_their_own() -> None:
    from services.serve import place_workers

    assert place_workers(["prefill", "decode"], ["0", "1"], 1) == {
        "prefill": {"CUDA_VISIBLE_DEVICES": "0"},
        "decode": {"CUDA_VISIBLE_DEVICES": "1"},
    }
    assert place_workers(["prefill", "decode"], ["4", "5", "6", "7"], 2) == {
        "prefill": {"CUDA_VISIBLE_DEVICES": "4,5"},
        "decode": {"CUDA_VISIBLE_DEVICES": "6,7"},
    }
    # too few GPUs to split, or one mixed worker: every worker sees what serve sees
    assert place_workers(["prefill", "decode"], ["0", "1", "2"], 2) == {"prefill": {}, "decode": {}}
    assert place_workers(["prefill", "decode"], ["0"], 1) == {"prefill": {}, "decode": {}}
    assert place_workers(["mixed"], ["0", "1"], 1) == {"mixed": {}}


def test_with_the_ipc_transport_each_pd_worker_also_sees_the_others_gpus_after_its_own() -> None:
    from services.serve import place_workers

    assert place_workers(["prefill", "decode"], ["0", "1"], 1, see_peers=True) == {
        "prefill": {"CUDA_VISIBLE_DEVICES": "0,1"},
        "decode": {"CUDA_VISIBLE_DEVICES": "1,0"},
    }
    assert place_workers(["prefill", "decode"], ["4", "5", "6", "7"], 2, see_peers=True) == {
        "prefill": {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
        "decode": {"CUDA_VISIBLE_DEVICES": "6,7,4,5"},
    }
    assert place_workers(["prefill", "decode"], ["0"], 1, see_peers=True) == {"prefill": {}, "decode": {}}


def test_serve_takes_the_gpus_cuda_visible_devices_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.serve import visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus("auto") == ["2", "3"]
    assert visible_gpus("cuda") == ["2", "3"]
    assert visible_gpus("cuda:1") == []  # the user placed the workers
    assert visible_gpus("cpu") == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus("auto") == []  # this machine has no GPU


NON_DEFAULT_ENGINE_FLAGS = {
    "model": ["--model", "models/elsewhere"],
    "dtype": ["--dtype", "bfloat16"],
    "quantization": ["--quantization", "int8"],
    "device": ["--device", "cuda:1"],
    "tensor_parallel_size": ["--tensor-parallel-size", "2"],
    "peer_all_reduce": ["--no-peer-all-reduce"],
    "max_model_len": ["--max-model-len", "777"],
    "kv_transport": ["--kv-transport", "ipc"],
    "kv_stream_layers": ["--kv-stream-layers"],
    "block_size": ["--block-size", "32"],
    "num_kv_blocks": ["--num-kv-blocks", "99"],
    "gpu_memory_utilization": ["--gpu-memory-utilization", "0.5"],
    "cpu_kv_cache_space_gib": ["--cpu-kv-cache-space-gib", "0.25"],
    "max_num_seqs": ["--max-num-seqs", "7"],
    "max_num_batched_tokens": ["--max-num-batched-tokens", "333"],
    "enable_chunked_prefill": ["--no-enable-chunked-prefill"],
    "enable_prefix_caching": ["--no-enable-prefix-caching"],
    "seed": ["--seed", "5"],
    "enforce_eager": ["--enforce-eager"],
    "async_scheduling": ["--no-async-scheduling"],
    "cuda_graph_max_tokens": ["--cuda-graph-max-tokens", "64"],
    "cpu_threads": ["--cpu-threads", "3"],
    "core_cpus": ["--core-cpus", "2-3"],
    "bus_side_policy": ["--bus-side-policy", "batch"],
    "speculative_config": ["--speculative-config", '{"method": "suffix"}'],
}
"""A value unlike the default for every engine flag (a new flag must be added here)."""


def test_serve_hands_every_engine_flag_the_user_gives_to_its_workers() -> None:
    import argparse

    from services.engine.args import add_engine_args
    from services.serve import _engine_flags, add_serve_parser
    from services.worker.main import add_worker_parsers

    parsers = argparse.ArgumentParser().add_subparsers()
    add_serve_parser(parsers)
    add_worker_parsers(parsers)
    root = parsers._name_parser_map  # noqa: SLF001 - the subcommands' own parsers
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    dests = {action.dest for action in engine._actions}  # noqa: SLF001
    assert dests == set(NON_DEFAULT_ENGINE_FLAGS), "every engine flag needs a value in this test"
    defaults = root["serve"].parse_args([])
    for dest, flag in NON_DEFAULT_ENGINE_FLAGS.items():
        serve_args = root["serve"].parse_args(flag)
        assert getattr(serve_args, dest) != getattr(defaults, dest), flag
        model = serve_args.model or "models/specmesh-code-15m"
        spec = serve_args.speculative_config or "{}"
        for role in ("mixed", "prefill", "decode"):
            worker_args = root[role].parse_args(_engine_flags(serve_args, model, spec))
            assert {d: getattr(worker_args, d) for d in dests} == {
                **{d: getattr(serve_args, d) for d in dests},
                "model": model,
                "speculative_config": spec,
            }, flag
