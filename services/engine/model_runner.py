"""Owns the model, the paged KV cache and the sampler; runs one scheduled batch forward.

This is the one place where attention (through the model), the LM head and sampling are called
for a step, so the fused GPU kernels replace the torch references here and nowhere else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels import AttentionMetadata
from services.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence
from shared.config import EngineConfig
from shared.model import LlamaForCausalLM, ModelConfig, load_model
from shared.model.llama import KVCache

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] rows of the flat batch whose next token is sampled
    sampled_seqs: list[Sequence]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.model: LlamaForCausalLM = load_model(config.model, self.dtype, self.device, max_model_len)
        self.num_kv_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_kv_blocks)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator, config.logprobs_mode)

    @property
    def kv_bytes_per_block(self) -> int:
        c = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * elem

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SamplerOutput | None:
        """Runs the batch forward; samples the next token of every sequence whose tokens are all
        computed after this step (partial prefill chunks sample nothing)."""
        inputs = self.prepare_inputs(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampled_seqs:
            return None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return self.sampler(logits, sampling_batch(inputs.sampled_seqs))

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Sequence] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [
                seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if end == seq.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                sampled.append(seq)
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in batch.seqs]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.long),
            query_start_loc=self._tensor(query_start_loc, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(tables, torch.int32),
            query_lens_cpu=list(batch.num_new_tokens),
            seq_lens_cpu=seq_lens,
        )
        return StepInputs(
            input_ids=self._tensor(input_ids, torch.long),
            positions=self._tensor(positions, torch.long),
            meta=meta,
            logits_indices=self._tensor(logits_indices, torch.long),
            sampled_seqs=sampled,
        )

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    # ---- KV-cache sizing -------------------------------------------------------------------------

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        if self.device.type == "cuda":
            budget = self._gpu_kv_budget_bytes()
        else:
            budget = int(self.config.cpu_kv_cache_space_gib * GIB)
        return max(1, min(useful, budget // self.kv_bytes_per_block))

    def _gpu_kv_budget_bytes(self) -> int:
        """What gpu_memory_utilization leaves after weights and the activation peak of a full step."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_forward()
        peak = torch.cuda.max_memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak
        if budget <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: weights and activations need {peak / GIB:.1f} GiB of "
                f"{total * self.config.gpu_memory_utilization / GIB:.1f} GiB allowed; "
                "raise --gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        return budget

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        num_tokens = min(self.config.resolved_max_num_batched_tokens(self.max_model_len), self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        kv_caches = self._allocate_kv_cache(num_blocks)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            query_lens_cpu=[num_tokens],
            seq_lens_cpu=[num_tokens],
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), kv_caches, meta)
        rows = min(num_tokens, self.config.max_num_seqs)
        self.model.compute_logits(hidden[:rows]).softmax(dim=-1)
        del kv_caches, hidden
        torch.cuda.synchronize(self.device)

    def _allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        c = self.model_config
        shape = (num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(c.num_hidden_layers)
        ]


def sampling_batch(seqs: list[Sequence]) -> SamplingBatch:
    return SamplingBatch(
        params=[seq.params for seq in seqs],
        generators=[seq.generator for seq in seqs],
        prompt_token_ids=[seq.prompt_token_ids if seq.params.has_penalties else [] for seq in seqs],
        output_token_ids=[seq.output_token_ids if seq.params.has_penalties else [] for seq in seqs],
        suppressed_token_ids=[_suppressed(seq) for seq in seqs],
    )


def _suppressed(seq: Sequence) -> list[int]:
    if seq.num_output_tokens >= seq.params.min_tokens:
        return []
    eos = [] if seq.params.ignore_eos else list(seq.eos_token_ids)
    return eos + list(seq.params.stop_token_ids)
