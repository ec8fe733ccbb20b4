"""Owns the model, the paged KV cache and the sampler; runs one scheduled batch forward.

This is the one place where attention (through the model), the LM head, sampling and the
post-step update (stop checks at token level) are called for a step, so the fused GPU kernels
replace the torch references here and nowhere else.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

import kernels
from kernels import AttentionMetadata
from kernels.attention import MAX_KERNEL_QUERY_LEN
from kernels.ngram import TokenHistory
from kernels.verify_ref import POLICIES, STRATEGIES
from services.engine.cuda_graph import (
    DecodeGraphs,
    HostBatch,
    StopInputs,
    TailInputs,
    TailOutput,
    TailSpec,
    eager_post_step,
)
from services.engine.rejection_sampler import RejectionSampler, RowSampling, VerifyRequest
from services.engine.sampler import SamplingBatch
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence
from shared.config import EngineConfig
from shared.model import LlamaForCausalLM, ModelConfig, ModelConfigError, load_model
from shared.model.llama import KVCache
from shared.model.mtp import MTPHead, load_mtp_head
from shared.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass
class StepInputs:
    host: HostBatch
    sampled_seqs: list[Sequence]
    """Sequences that get a token this step (their last real token and drafts are all in the batch)."""


@dataclass
class StepOutput:
    inputs: StepInputs
    results: list[TailOutput]
    """One per sampled sequence: accepted drafts plus the recovered / bonus token, cut after the
    token that ends the request, and the post-step update's verdict (finish reason, stop token)."""
    hidden: torch.Tensor  # [num_tokens, hidden_size] final-normed target hidden states of the step


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, spec: SpeculativeConfig
    ):
        self.config = config
        self.spec = spec
        self.model_config = model_config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.model: LlamaForCausalLM = load_model(config.model, self.dtype, self.device, max_model_len)
        self.draft_model = self._load_draft_model() if spec.method == "draft_model" else None
        self.mtp_head: MTPHead | None = None
        if spec.method == "mtp":
            assert spec.model is not None
            self.mtp_head = load_mtp_head(spec.model, self.model, self.dtype, self.device).eval()
        self.num_kv_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_kv_blocks, model_config)
        self.draft_kv_caches = (
            self._allocate_kv_cache(self.num_kv_blocks, self.draft_model.config) if self.draft_model else []
        )
        self.mtp_kv_caches = (
            self._allocate_kv_cache(self.num_kv_blocks, self.mtp_head.config) if self.mtp_head else []
        )
        self.verifier = RejectionSampler(spec.verify_strategy, spec.accept_policy, config.logprobs_mode)
        self.token_history: TokenHistory | None = None
        """Device token rows of n-gram requests, shared by the CUDA-graph step and the proposer."""
        if self.device.type == "cuda":
            self._warm_up_kernels()
        self.graphs = self._capture_graphs() if self._use_graphs() else None

    def _use_graphs(self) -> bool:
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and kernels.cuda_available(torch.empty(0, device=self.device))
        )

    def _capture_graphs(self) -> DecodeGraphs:
        max_query_len = 1 + self.spec.k if self.spec.enabled else 1
        max_tokens = min(
            self.config.cuda_graph_max_tokens,
            self.config.max_num_seqs * max_query_len,
            self.config.resolved_max_num_batched_tokens(self.max_model_len),
        )
        if self.spec.method == "ngram":
            self.token_history = TokenHistory(
                self.device, self.config.max_num_seqs + 1, self.max_model_len + max_query_len, fixed=True
            )
        tail = TailSpec(
            STRATEGIES[self.spec.verify_strategy],
            POLICIES[self.spec.accept_policy],
            self.token_history,
            self.spec.prompt_lookup_min,
            self.spec.prompt_lookup_max,
            self.spec.k if self.token_history is not None else 0,
        )
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            max_tokens,
            [1, max_query_len],
            self.max_model_len,
            self.block_size,
            tail,
        )
        graphs.capture()
        return graphs

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes in every cache that shares the block tables (target, draft, MTP)."""
        configs = [self.model_config]
        configs += [self.draft_model.config] if self.draft_model else []
        configs += [self.mtp_head.config] if self.mtp_head else []
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return sum(
            2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * elem
            for c in configs
        )

    def _load_draft_model(self) -> LlamaForCausalLM:
        assert self.spec.model is not None
        draft = load_model(self.spec.model, self.dtype, self.device, self.max_model_len)
        if draft.config.vocab_size != self.model_config.vocab_size:
            raise ModelConfigError(
                f"draft model {self.spec.model} has vocab_size {draft.config.vocab_size}, the target "
                f"{self.model_config.vocab_size}; a draft model must share the target's tokenizer"
            )
        return draft

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """One target forward over every scheduled token (prefill chunks, decode tokens and drafts);
        only the last real token and the drafts of each finishing sequence reach the LM head, and
        the rejection sampler turns those rows into tokens (partial prefill chunks get none)."""
        inputs = self.prepare_inputs(batch)
        host = inputs.host
        seqs = inputs.sampled_seqs
        key = None
        if self.graphs is not None and host.is_decode:
            key = self.graphs.lookup(host.num_tokens, max(host.query_lens))
        if key is not None:
            assert self.graphs is not None
            hidden, logits = self.graphs.replay(host, key)
        else:
            positions, meta = self._device_metadata(host)
            hidden = self.model(self._tensor(host.input_ids, torch.long), positions, self.kv_caches, meta)
            if not seqs:  # only partial prefill chunks: no token to sample
                return StepOutput(inputs, [], hidden)
            logits = self.model.compute_logits(hidden[self._tensor(host.logits_indices, torch.long)])
        rows = row_batch(seqs)
        requests = [verify_request(seq) for seq in seqs]
        stops = StopInputs.of(seqs)
        if key is not None and self._tail_fits(logits, rows, requests, stops):
            return StepOutput(inputs, self._replay_tail(inputs, key, rows, requests, stops), hidden)
        return StepOutput(
            inputs, eager_post_step(self.verifier(logits, rows, requests), stops, self.device), hidden
        )

    def _tail_fits(
        self, logits: torch.Tensor, rows: SamplingBatch, requests: list[VerifyRequest], stops: StopInputs
    ) -> bool:
        """Whether the tail graph can verify this step and apply its post-step update."""
        assert self.graphs is not None
        return self.verifier.fusable(logits, rows, requests) and self.graphs.fits(stops)

    def _replay_tail(
        self,
        inputs: StepInputs,
        key: tuple[int, int],
        rows: SamplingBatch,
        requests: list[VerifyRequest],
        stops: StopInputs,
    ) -> list[TailOutput]:
        """Verify, sample, apply the post-step update and (n-gram) draft the next step in the tail
        graph; the drafts wait in the token history for the proposer."""
        assert self.graphs is not None
        seqs = inputs.sampled_seqs
        row_of = self._history_rows([seq for seq in seqs if seq.spec.method == "ngram"])
        tail = self._tail_inputs(seqs, rows, requests, stops, row_of)
        outputs = self.graphs.replay_tail(inputs.host, key, tail)
        history = self.token_history
        for seq, out in zip(seqs, outputs):
            row = row_of.get(seq.request_id)
            if row is not None and history is not None:  # the device row now ends with the kept tokens
                num_tokens = seq.num_tokens + len(out.token_ids)
                history.synced[row] = num_tokens
                history.precomputed[seq.request_id] = (num_tokens, out.drafts)
        return outputs

    def _history_rows(self, seqs: list[Sequence]) -> dict[str, int]:
        """The device token-history row of each n-gram request, synced up to its last token."""
        if self.token_history is None or not seqs:
            return {}
        rows = self.token_history.sync([(seq.request_id, seq.token_ids) for seq in seqs])
        return {seq.request_id: row for seq, row in zip(seqs, rows)}

    def _tail_inputs(
        self,
        seqs: list[Sequence],
        rows: SamplingBatch,
        requests: list[VerifyRequest],
        stops: StopInputs,
        row_of: dict[str, int],
    ) -> TailInputs:
        """Per logit row its sampling inputs; per sequence its stop inputs and history row (the
        scratch row and no drafts for requests that do not use n-gram)."""
        assert self.graphs is not None
        scratch = self.graphs.scratch_row
        tail = TailInputs(RowSampling.of(rows.params, requests), stops, [], [], [])
        for seq in seqs:
            row = row_of.get(seq.request_id)
            tail.history_rows.append(scratch if row is None else row)
            tail.history_lens.append(0 if row is None else seq.num_tokens)
            tail.num_drafts.append(0 if row is None else seq.spec.max_k)
        return tail

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        host = self.host_batch(batch.seqs, starts, batch.num_new_tokens)
        sampled: list[Sequence] = []
        row = 0
        for seq, start, num_new in zip(batch.seqs, starts, batch.num_new_tokens):
            end = start + num_new
            host.input_ids += token_span(seq, start, end)
            if end >= seq.num_tokens:  # the last real token is in: its row and every draft row are scored
                host.logits_indices += range(row + seq.num_tokens - 1 - start, row + num_new)
                sampled.append(seq)
            row += num_new
        return StepInputs(host, sampled)

    def caches(self, name: str) -> list[KVCache]:
        """The per-layer KV caches that share the block tables: target, draft or mtp."""
        caches = {"target": self.kv_caches, "draft": self.draft_kv_caches, "mtp": self.mtp_kv_caches}
        if name not in caches:
            raise ValueError(f"unknown KV cache {name!r}; known: {', '.join(caches)}")
        return caches[name]

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end) of `seq`."""
        size = self.block_size
        return [seq.block_table[p // size] * size + p % size for p in range(start, end)]

    def host_batch(self, seqs: list[Sequence], starts: list[int], lens: list[int]) -> HostBatch:
        """Positions, slots and block tables of `lens[i]` new tokens of `seqs[i]` from position
        `starts[i]` (input ids and logit rows are left for the caller)."""
        positions: list[int] = []
        slots: list[int] = []
        for seq, start, n in zip(seqs, starts, lens):
            positions += range(start, start + n)
            slots += self.slots(seq, start, start + n)
        return HostBatch(
            input_ids=[],
            positions=positions,
            slots=slots,
            query_lens=list(lens),
            seq_lens=[start + n for start, n in zip(starts, lens)],
            block_tables=[seq.block_table for seq in seqs],
            logits_indices=[],
        )

    def metadata(
        self, seqs: list[Sequence], starts: list[int], lens: list[int]
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions [sum(lens)] and attention metadata for `lens[i]` new tokens of `seqs[i]` from
        position `starts[i]`, over the shared block tables (drafting models use this)."""
        return self._device_metadata(self.host_batch(seqs, starts, lens))

    def _device_metadata(self, host: HostBatch) -> tuple[torch.Tensor, AttentionMetadata]:
        max_blocks = max(len(table) for table in host.block_tables)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(host.slots, torch.long),
            query_start_loc=self._tensor([0, *itertools.accumulate(host.query_lens)], torch.int32),
            seq_lens=self._tensor(host.seq_lens, torch.int32),
            block_tables=self._tensor(
                [table + [0] * (max_blocks - len(table)) for table in host.block_tables], torch.int32
            ),
            query_lens_cpu=host.query_lens,
            seq_lens_cpu=host.seq_lens,
        )
        return self._tensor(host.positions, torch.long), meta

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

    def _one_sequence(
        self, query_len: int, context: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, metadata) of one dummy sequence whose last `query_len` of
        `context` tokens are new, in blocks 0, 1, ... (start-up forwards: warm-up, memory profile)."""
        num_blocks = -(-context // self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(context - query_len, context, device=self.device),
            query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([context], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            query_lens_cpu=[query_len],
            seq_lens_cpu=[context],
        )
        ids = torch.zeros(query_len, dtype=torch.long, device=self.device)
        return ids, torch.arange(context - query_len, context, device=self.device), meta

    @torch.inference_mode()
    def _warm_up_kernels(self) -> None:
        """Compiles every attention kernel variant a prefill chunk can pick (they differ by query
        rows per tile) for the target and the draft model, so the first requests do not wait for
        NVRTC; a few seconds at start-up, less once CuPy's on-disk cache has them."""
        started = time.perf_counter()
        models = [(self.model, self.model_config)]
        if self.draft_model is not None:
            models.append((self.draft_model, self.draft_model.config))
        context = min(self.max_model_len, 1024)  # long enough to split the context across blocks
        for model, config in models:
            kv_caches = self._allocate_kv_cache(-(-context // self.block_size), config)
            query_len = 1
            while query_len <= min(context, 2 * MAX_KERNEL_QUERY_LEN):
                ids, positions, meta = self._one_sequence(query_len, context)
                model(ids, positions, kv_caches, meta)
                query_len *= 2
            del kv_caches
        torch.cuda.synchronize(self.device)
        logger.info("kernels warmed up in %.1f s", time.perf_counter() - started)

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        num_tokens = min(self.config.resolved_max_num_batched_tokens(self.max_model_len), self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        kv_caches = self._allocate_kv_cache(num_blocks, self.model_config)
        ids, positions, meta = self._one_sequence(num_tokens, num_tokens)
        hidden = self.model(ids, positions, kv_caches, meta)
        rows = min(num_tokens, self.config.max_num_seqs)
        self.model.compute_logits(hidden[:rows]).softmax(dim=-1)
        del kv_caches, hidden
        torch.cuda.synchronize(self.device)

    def _allocate_kv_cache(self, num_blocks: int, c: ModelConfig) -> list[KVCache]:
        shape = (num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(c.num_hidden_layers)
        ]


def verify_request(seq: Sequence) -> VerifyRequest:
    return VerifyRequest(
        seq.params, seq.seed, seq.num_output_tokens, list(seq.spec.draft_token_ids), seq.spec.draft_probs
    )


def token_span(seq: Sequence, start: int, end: int) -> list[int]:
    """Tokens `start:end` of the sequence followed by its drafts, without copying its whole history
    (a step would otherwise cost time growing with every request's length)."""
    tokens, drafts = seq.token_ids, seq.spec.draft_token_ids
    num_tokens = len(tokens)
    if end <= num_tokens:
        return tokens[start:end]
    return tokens[start:] + drafts[max(0, start - num_tokens) : end - num_tokens]


def row_batch(seqs: list[Sequence]) -> SamplingBatch:
    """Sampling inputs per logit row: row j of a sequence sees its output plus its first j drafts,
    so penalties and min_tokens apply to each draft position as they would in plain decoding."""
    batch = SamplingBatch(params=[], prompt_token_ids=[], output_token_ids=[], suppressed_token_ids=[])
    for seq in seqs:
        drafts = seq.spec.draft_token_ids
        penalties = seq.params.has_penalties
        for j in range(len(drafts) + 1):
            batch.params.append(seq.params)
            batch.prompt_token_ids.append(seq.prompt_token_ids if penalties else [])
            batch.output_token_ids.append(seq.output_token_ids + drafts[:j] if penalties else [])
            batch.suppressed_token_ids.append(_suppressed(seq, seq.num_output_tokens + j))
    return batch


def _suppressed(seq: Sequence, num_output_tokens: int) -> list[int]:
    if num_output_tokens >= seq.params.min_tokens:
        return []
    eos = [] if seq.params.ignore_eos else list(seq.eos_token_ids)
    return eos + list(seq.params.stop_token_ids)
