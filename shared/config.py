"""Engine configuration shared by every worker role (mixed, prefill, decode) and the offline API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.speculative_config import SpeculativeConfig

if TYPE_CHECKING:  # torch is imported where a device is resolved: parsing engine flags needs none
    import torch

DEFAULT_CHUNKED_PREFILL_TOKENS = 2048


class EngineConfig(BaseModel):
    """What a worker loads and how it batches. Unset sizes are derived from the model and device."""

    model_config = ConfigDict(extra="forbid")

    model: str
    """Hugging Face model directory (config.json, safetensors, tokenizer.json)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and KV cache dtype; auto is float32 on CPU, bfloat16 on GPU."""
    quantization: Literal["fp8", "int8", "int4"] | None = None
    """Quantize every linear layer of the target, its MTP head and the draft model at load (LM head
    and embeddings stay in `dtype`): fp8 (e4m3, per-channel scales), int8 (weight-only, per channel)
    or int4 (weight-only, groups of 128). None: as the checkpoint is (a compressed-tensors checkpoint
    loads quantized)."""
    device: str = "auto"
    """`cpu`, `cuda`, `cuda:N`, or auto (cuda when available)."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=8)
    """Ranks the model is split over, one process per device of one host (`cuda:N` .. `cuda:N+size-1`,
    NCCL; on CPU, processes joined by gloo); the engine's process is rank 0."""
    peer_all_reduce: bool = True
    """Tensor parallelism on GPUs of one host with peer access: all-reduces small enough
    (`kernels.all_reduce.choose_shots`) run as one kernel over peer memory, the rest through NCCL;
    false: NCCL for every all-reduce. CPU ranks (gloo) always use the process group."""
    max_model_len: int | None = Field(default=None, ge=2)
    """Longest prompt + output in tokens; defaults to the model's max_position_embeddings."""
    block_size: int = Field(default=16, ge=1, le=256)
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = Field(default=None, ge=1)
    """Fixed number of KV-cache blocks; overrides the memory-based sizing."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """Fraction of GPU memory the worker may use for weights, activations and KV cache."""
    cpu_kv_cache_space_gib: float = Field(default=2.0, gt=0.0)
    """KV-cache budget on CPU in GiB (the CPU analogue of gpu_memory_utilization)."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Most sequences decoded together in one step."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Most tokens (prefill chunks + decodes) in one forward; defaults to 2048 with chunked prefill."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps, mixed with decodes."""
    enable_prefix_caching: bool = True
    """Share KV blocks of equal prompt prefixes across requests."""
    seed: int = Field(default=0, ge=0)
    """Seed for requests that do not set their own."""
    speculative_config: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    """Draft method and verification; the default, naive, runs the speculative path with no drafts."""
    enforce_eager: bool = False
    """Run every step eagerly; by default a GPU replays decode steps from CUDA graphs."""
    async_scheduling: bool = True
    """Launch a decode step before the previous step's result is read, its inputs taken from the
    device (services/engine/engine.py says which steps can); False: every step waits for the last."""
    cuda_graph_max_tokens: int = Field(default=2048, ge=1, le=8192)
    """Largest step (tokens: prefill chunks, decode tokens and drafts) captured in a CUDA graph,
    capped by the step's token budget; larger steps run eagerly. Graphs are captured for token
    counts up to it at start-up."""
    cpu_threads: int | None = Field(default=None, ge=1)
    """Torch CPU (intra-op) threads of the process that runs the engine. None: in a worker's engine
    core on CPU, half the cores the process may run on (at least one), leaving the rest to the
    mesh's other processes, since threads of one op that wait on each other for a busy core stall
    the whole step; on a GPU the core keeps one; in-process (`LLM`), torch's default."""
    core_cpus: str = "off"
    """CPUs of a worker's engine core: `off` (the default), `auto`, or a list as `taskset -c` takes
    it (`3`, `2,4-5`); the worker's bus side then runs on the others, so that it never preempts a
    step on the core's CPU. Every thread of the core runs on them, the grammar fill's and the
    grammar compiler's too. `auto`: as many as the core has torch threads, the highest-numbered the
    process may use that no other engine core on the host holds, on a host of four CPUs or more (on
    fewer, nothing is pinned). An engine in-process (`LLM`) is not pinned."""
    bus_side_policy: Literal["normal", "batch"] = "normal"
    """Linux scheduling policy of a worker's bus side (its event loop's thread, set once its engine
    core runs: the core keeps `normal`). `batch` (SCHED_BATCH): its wake-ups never preempt the task
    running where it lands, so a step batch arriving does not preempt the core that sent it; it
    runs on an idle CPU, or when the running task's turn ends. `normal`: it may preempt the core."""
    logprobs_mode: Literal["processed", "raw"] = "processed"
    """`processed`: log-probabilities after penalties and temperature (the distribution sampled
    from, before top-k/top-p/min-p truncation); `raw`: of the model's logits."""

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} requested but no CUDA device is available")
        if self.core_cpus not in ("auto", "off"):
            parse_cpu_list(self.core_cpus)
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        return self

    def _check_tensor_parallel(self) -> None:
        """Enough devices, a torch build with the collectives the device needs."""
        import torch
        import torch.distributed as dist

        size = self.tensor_parallel_size
        if not dist.is_available():
            raise ValueError(
                f"tensor_parallel_size {size} needs torch.distributed, which this torch build lacks"
            )
        if self.torch_device.type != "cuda":
            if not dist.is_gloo_available():
                raise ValueError(f"tensor_parallel_size {size} on CPU needs the gloo backend, missing here")
            return
        if not dist.is_nccl_available():
            raise ValueError(f"tensor_parallel_size {size} on CUDA needs NCCL, which this torch build lacks")
        first = self.torch_device.index or 0
        count = torch.cuda.device_count()
        if first + size > count:
            raise ValueError(
                f"tensor_parallel_size {size} from {self.torch_device} needs cuda:{first}..cuda:{first + size - 1}, "
                f"but {count} CUDA device(s) are visible; lower --tensor-parallel-size or pick another --device"
            )

    def rank_device(self, rank: int) -> torch.device:
        """The device of tensor-parallel rank `rank`: the next devices after this config's own."""
        import torch

        device = self.torch_device
        if device.type != "cuda":
            return device
        return torch.device("cuda", (device.index or 0) + rank)

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        """The per-step token budget; without chunked prefill it must hold a whole prompt."""
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                    f"({max_model_len}) with chunked prefill off; raise it, lower max_model_len, "
                    "or enable chunked prefill"
                )
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return DEFAULT_CHUNKED_PREFILL_TOKENS
        return max(max_model_len, DEFAULT_CHUNKED_PREFILL_TOKENS)


def parse_cpu_list(text: str) -> list[int]:
    """A CPU list as `taskset -c` takes it ("3", "0,2", "4-7"), sorted; a clear error if it is none."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"core_cpus {text!r} is not auto, off or a CPU list such as '3', '0,2' or '4-7'")
        cpus.update(range(int(first), int(last if dash else first) + 1))
    return sorted(cpus)
