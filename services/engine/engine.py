"""The engine every worker runs: schedule a batch, run it, turn sampled tokens into outputs.

batch = scheduler.schedule()
sampled = model_runner.execute(batch)
outputs = postprocess(batch, sampled)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from services.engine.block_manager import BlockManager
from services.engine.model_runner import ModelRunner
from services.engine.output_processor import OutputProcessor
from services.engine.sampler import SamplerOutput
from services.engine.scheduler import ScheduledBatch, Scheduler
from services.engine.sequence import FinishReason, Sequence, TokenLogprobs
from shared.config import EngineConfig
from shared.model import ModelConfig
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses, with a message meant for the client."""


@dataclass
class RequestOutput:
    """What a request produced so far. `new_*` fields hold only this step's delta (for streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_prompt_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer(config.model)
        requested_len = config.max_model_len or self.model_config.max_position_embeddings
        self.runner = ModelRunner(config, self.model_config, requested_len)
        self.max_model_len = self._fit_max_model_len(requested_len)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.resolved_max_num_batched_tokens(self.max_model_len),
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.sequences: dict[str, Sequence] = {}
        self.eos_token_ids = self.tokenizer.eos_token_ids | frozenset(self.model_config.eos_token_ids)
        logger.info(
            "engine ready: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d",
            self.model_config.architecture,
            self.runner.device,
            self.runner.dtype,
            self.runner.num_kv_blocks,
            config.block_size,
            self.max_model_len,
        )

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.sequences:
            raise RequestError(f"request id {request_id!r} is already running")
        token_ids = self._prompt_ids(prompt, prompt_token_ids)
        self._validate(token_ids, params)
        seq = Sequence(request_id, token_ids, params, self.eos_token_ids)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device)
            seq.generator.manual_seed(params.seed)
        self.sequences[request_id] = seq
        self.outputs.start(seq)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        return self._finish(seq, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        sampled = self.runner.execute(batch)
        return self._postprocess(batch, sampled)

    def _postprocess(self, batch: ScheduledBatch, sampled: SamplerOutput | None) -> list[RequestOutput]:
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq)
        if sampled is None:
            return []
        sampled_seqs = [seq for seq in batch.seqs if seq.num_computed_tokens == seq.num_tokens]
        outputs = []
        for seq, token_id, logprobs in zip(sampled_seqs, sampled.token_ids, sampled.logprobs):
            self.outputs.append(seq, [token_id])
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            if seq.finish_reason is not None:
                outputs.append(self._finish(seq, [token_id]))
            else:
                outputs.append(self._output(seq, [token_id]))
        return outputs

    def _finish(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        assert seq.finish_reason is not None
        self.scheduler.finish(seq, seq.finish_reason)
        output = self._output(seq, new_token_ids)
        self.outputs.release(seq.request_id)
        del self.sequences[seq.request_id]
        return output

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        finished = seq.finish_reason is not None
        metrics = {"arrival_time": seq.arrival_time, "num_preemptions": float(seq.num_preemptions)}
        if seq.first_token_time is not None:
            metrics["ttft_s"] = seq.first_token_time - seq.arrival_time
        if finished:
            metrics["e2e_s"] = time.monotonic() - seq.arrival_time
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=self.outputs.text(seq.request_id),
            new_token_ids=new_token_ids,
            new_text=self.outputs.take_delta(seq),
            finished=finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
            metrics=metrics,
        )

    # ---- validation -------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompt or prompt_token_ids")
        token_ids = self.tokenizer.encode(prompt) if prompt is not None else list(prompt_token_ids or [])
        if not token_ids:
            raise RequestError("the prompt is empty")
        return token_ids

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        vocab_size = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad_stop:
            raise RequestError(f"stop_token_ids out of range [0, {vocab_size}): {bad_stop[:5]}")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"needs {total} ({len(token_ids)} in the prompt, {params.max_tokens} to generate); "
                "shorten the prompt or lower max_tokens"
            )

    def _fit_max_model_len(self, requested: int) -> int:
        capacity = self.runner.num_kv_blocks * self.config.block_size
        if capacity >= requested:
            return requested
        if self.config.max_model_len is not None:
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len {requested}; raise "
                "--num-kv-blocks / --gpu-memory-utilization / --cpu-kv-cache-space-gib or lower --max-model-len"
            )
        logger.warning("max_model_len lowered from %d to the KV cache capacity %d", requested, capacity)
        return capacity
