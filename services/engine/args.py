"""Engine flags shared by every command that runs an engine (generate, worker roles, serve)."""

from __future__ import annotations

import argparse

from shared.config import EngineConfig
from shared.reference import default_model
from shared.speculative_config import SpeculativeConfig


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = False) -> None:
    """Flags that size and shape a worker's engine; names follow vLLM / FastDeploy."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        required=model_required,
        help="Hugging Face model directory (default: the shipped reference model)",
    )
    group.add_argument(
        "--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16"
    )
    group.add_argument(
        "--quantization",
        "-q",
        choices=["fp8", "int8", "int4"],
        help="quantize the linear layers at load: fp8 (per-channel scales), int8 (weight-only, per channel), "
        "int4 (weight-only, groups of 128); default: as the checkpoint is (compressed-tensors checkpoints "
        "load quantized)",
    )
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many devices (cuda:N onwards; on CPU, processes joined by gloo)",
    )
    group.add_argument(
        "--no-peer-all-reduce",
        dest="peer_all_reduce",
        action="store_false",
        help="tensor parallelism on GPUs: every all-reduce through NCCL (default: small ones as one "
        "kernel over the GPUs' peer memory where every GPU can reach the others)",
    )
    group.add_argument(
        "--kv-transport",
        choices=["tcp", "ipc"],
        default="tcp",
        help="prefill -> decode KV hand-off: tcp (host memory, any hosts), or ipc (the KV stays in device "
        "memory between workers on one host; TCP where the peer is elsewhere or cannot open it)",
    )
    group.add_argument(
        "--kv-stream-layers",
        dest="kv_stream_layers",
        action="store_true",
        default=False,
        help="prefill workers with --kv-transport tcp send each layer's KV as the prompt's forward "
        "passes it, overlapping the copy and the send with the later layers (off by default: on a GPU "
        "it shortened a 2000-token prompt's hand-off but lengthened short prompts' TTFT; BENCHMARKS.md)",
    )
    group.add_argument(
        "--no-kv-stream-layers",
        dest="kv_stream_layers",
        action="store_false",
        help="send a prompt's KV whole after its prefill step (the default)",
    )
    group.add_argument("--max-model-len", type=int, help="longest prompt + output in tokens")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    group.add_argument("--num-kv-blocks", type=int, help="fixed KV-cache size in blocks")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--cpu-kv-cache-space-gib", type=float, default=2.0)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int)
    group.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    group.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs: run every GPU step eagerly"
    )
    group.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="wait for each step's result before launching the next (by default a decode step is "
        "launched while the previous one runs)",
    )
    group.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=2048,
        help="largest step (tokens: prefill chunks, decode tokens and drafts; capped by the step's "
        "token budget) replayed from a CUDA graph",
    )
    group.add_argument(
        "--cpu-threads",
        type=int,
        help="torch CPU threads of the engine's process (default in a worker: half the cores on CPU, "
        "one with a GPU; in-process: torch's default)",
    )
    group.add_argument(
        "--core-cpus",
        help="a worker's engine-core CPUs: off (default), auto, or a list such as 3 or 2,4-5; its bus "
        "side runs on the others (every thread of the core runs on these, the grammar fill's too)",
    )
    group.add_argument(
        "--bus-side-policy",
        choices=("normal", "batch"),
        help="a worker's bus side's Linux scheduling policy: normal (default), or batch (SCHED_BATCH: "
        "a step batch waking it never preempts its engine core)",
    )
    group.add_argument(
        "--speculative-config",
        help='draft method and verification as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'',
    )


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags that give another command the engine settings of `args` (serve and the
    benchmark launcher hand them to their workers): every flag of `add_engine_args` that is set,
    so a flag added there is forwarded without a change here."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    argv: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its flags nowhere public
        flag, value = max(action.option_strings, key=len), getattr(args, action.dest)
        if action.nargs == 0:  # store_true / store_false: given only where it changes the default
            argv += [flag] if value == action.const else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model or default_model(),
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        peer_all_reduce=args.peer_all_reduce,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_space_gib=args.cpu_kv_cache_space_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        cpu_threads=args.cpu_threads,
        **({"core_cpus": args.core_cpus} if args.core_cpus is not None else {}),
        **({"bus_side_policy": args.bus_side_policy} if args.bus_side_policy is not None else {}),
        speculative_config=SpeculativeConfig.from_json(args.speculative_config),
    )
