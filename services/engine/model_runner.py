"""Owns the models, the paged KV caches, the input batch and the step's tail; runs one step.

This is the one place where the target forward, the LM head and the tail (verify, post-step
update, device drafting: services/engine/verify_update.py) are called for a step, replayed from
CUDA graphs where the step allows it, so the fused GPU kernels replace the torch references here
and nowhere else. Under tensor parallelism every rank has a model runner over its shards; rank 0's
sends each step to the others (services/engine/tensor_parallel.py), which run it in `follow_step`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

import kernels
from kernels import AttentionMetadata
from kernels.attention_ref import CAUSAL_MASK, MAX_TREE_NODES
from kernels.post_step_ref import LENGTH, STOP
from kernels.verify_ref import POLICIES, STRATEGIES
from services.engine.cuda_graph import DecodeGraphs, HostStep
from services.engine.grammar import StepMasks, allocate_bitmask
from services.engine.input_batch import InputBatch
from services.engine.kv_export import KVLayers
from services.engine.kv_stream import LayerStreamer
from services.engine.prompt_logprobs import PromptRows, PromptScores, score_prompt_rows
from services.engine.rejection_sampler import RejectionSampler, VerifyRequest
from services.engine.run_ahead import ahead_step
from services.engine.sampler import SamplingBatch
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import FinishReason, Sequence, TokenLogprobs
from services.engine.spec_decode.proposer import ForwardContext, Proposer
from services.engine.spec_decode.tree import DraftTree, shape_arrays, tree_shape
from services.engine.tensor_parallel import (
    CompareRows,
    ExportBlocks,
    ImportBlocks,
    Ranks,
    StepCommand,
    start_ranks,
)
from services.engine.tree_verify import tree_parents
from services.engine.verify_update import (
    ACCEPTED,
    FINISH,
    KEPT,
    NUM_DRAFTS,
    STOP_TOKEN,
    TOKENS,
    StepPlan,
    StepTensors,
    VerifyAndUpdate,
)
from shared.config import EngineConfig
from shared.model import LlamaForCausalLM, ModelConfig, ModelConfigError, load_model
from shared.model.eagle3 import Eagle3Head, load_eagle3_head
from shared.model.llama import KVCache
from shared.model.mtp import MTPHead, load_mtp_head
from shared.model.parallel import SINGLE, TensorParallel, check_divisible, kv_head_owners, kv_head_range
from shared.model.quant_config import resolve_quantization
from shared.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

GIB = 1 << 30
WARM_UP_QUERY_LEN = 512
"""Start-up forwards compile the attention kernel for queries of 1, 2, 4, ... up to this many tokens:
past it every query takes the widest tile already compiled."""


EXPORTED_CACHES = ("target", "mtp", "eagle3", "draft")
"""The caches a hand-off exports, in the order their layers go."""
FINISH_REASONS = {STOP: FinishReason.STOP, LENGTH: FinishReason.LENGTH}
"""The post-step update's finish codes (kernels/post_step_ref.py) that end a request."""


class SeqResult(NamedTuple):
    """One request's share of a verified step, after the post-step update and drafting (a tuple:
    one is made per request and step, on the host's critical path)."""

    token_ids: list[int]
    """Accepted drafts and the recovered / bonus token, cut after the token that ends the request."""
    num_accepted: int
    """Drafts that verification accepted (a stop may keep fewer of them)."""
    finish_reason: FinishReason | None
    """STOP (EOS or a stop id) or LENGTH (max_tokens) at the last kept token; None: running."""
    stop_token_id: int | None
    """The stop id that ended the request (None for an EOS, max_tokens or running)."""
    drafts: list[int]
    """The next step's drafts from a device proposer."""
    draft_parents: list[int]
    """Each draft's parent node where the server drafts trees (empty otherwise)."""
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    """Per kept token, when the request asked for them."""

    @classmethod
    def unpack(cls, row: list[int], max_rows: int, tree_width: int = 0) -> SeqResult:
        """One row of the tail's packed result (verify_update's columns); `tree_width`: the drafts'
        columns where their parents follow them (0: no parents)."""
        drafts_at = TOKENS + max_rows
        parents_at = drafts_at + tree_width
        stop_token_id = row[STOP_TOKEN]
        num_drafts = row[NUM_DRAFTS]
        return cls(
            row[TOKENS : TOKENS + row[KEPT]],
            row[ACCEPTED],
            FINISH_REASONS.get(row[FINISH]),
            stop_token_id if stop_token_id >= 0 else None,
            row[drafts_at : drafts_at + num_drafts],
            row[parents_at : parents_at + num_drafts] if tree_width else [],
        )


@dataclass
class LaunchedStep:
    """A step whose kernels and result copy are queued; `result` waits for them."""

    packed: torch.Tensor  # [num_seqs, width] int32 on the host once `done` completed
    done: torch.cuda.Event | None
    max_rows: int
    """Token columns of the packed result (the query class of a CUDA-graph step)."""
    num_tokens: int
    is_decode: bool
    logprobs: list[list[TokenLogprobs | None]]
    """Per request, when the torch verifier returned them."""
    prompt: tuple[PromptRows, PromptScores] | None = None
    """The step's scored prompt rows, when a request asked for prompt logprobs."""
    device_only: bool = False
    """A decode step the fused kernels verified whole (no prompt rows): the next step of its
    requests can be launched before this one's result is read (`launch_ahead`). Grammar rows do
    not stop it: the next step's masks are filled once this one lands, before that step's tail is
    launched (`launch_tail`); nor do draft trees: their parents stay on the device beside them."""
    tree_width: int = 0
    """Where the packed result carries the drafts' parents: the drafts' columns (0: none)."""

    def running(self) -> bool:
        """Whether the device is still at the step (never on the CPU, where `launch` ran it)."""
        return self.done is not None and not self.done.query()

    def result(self) -> StepOutput:
        if self.done is not None:
            self.done.synchronize()
        results = [SeqResult.unpack(row, self.max_rows, self.tree_width) for row in self.packed.tolist()]
        if self.logprobs:
            results = [
                result._replace(logprobs=tuple(token_logprobs[: len(result.token_ids)]))
                for result, token_logprobs in zip(results, self.logprobs)
            ]
        return StepOutput(results, self.num_tokens, self.is_decode, self.prompt)


@dataclass
class PendingTail:
    """A step whose target forward is queued and whose tail is not launched yet: a step launched
    ahead with grammar rows waits here for its masks, which follow the tokens of the step before
    it, read back while this forward runs (`ModelRunner.launch_tail`)."""

    step: HostStep
    plan: StepPlan
    fused: bool
    key: tuple[int, int] | None
    """The graphs' key where the tail replays from a graph too (None: an eager tail)."""
    logits: torch.Tensor | None = None  # [num_rows, vocab_size] an eager tail's input
    tensors: StepTensors | None = None
    """An eager tail's device tensors."""


class ResultBuffer:
    """Pinned host memory a step's packed result is copied to without waiting, and the event that
    marks the copy done; kept across steps (a pinned allocation and an event cost the host more
    than the copy). `blocking`: a host waiting on the event sleeps instead of spinning on a CPU for
    the whole step; for hosts that launch steps ahead, whose wake-up is then off the device's path
    (the next step is queued already)."""

    def __init__(self, blocking: bool) -> None:
        self._host = torch.empty(0, dtype=torch.int32)
        self._done = torch.cuda.Event(blocking=blocking)

    def read(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Starts the copy of `packed` ([num_seqs, width] int32 on the device); (its host view,
        the event recorded after it)."""
        if self._host.numel() < packed.numel():
            self._host = torch.empty(2 * packed.numel(), dtype=torch.int32, pin_memory=True)
        host = self._host[: packed.numel()].view(packed.shape)
        host.copy_(packed, non_blocking=True)
        self._done.record()
        return host, self._done


@dataclass
class StepOutput:
    results: list[SeqResult]
    """One per request that got a token (StepPlan.seqs)."""
    num_tokens: int
    """Tokens in the target forward."""
    is_decode: bool
    """Every request brought only its last token and its drafts (no prefill chunk)."""
    prompt: tuple[PromptRows, PromptScores] | None = None
    """Scored prompt rows (on the host once the step is done), when a request asked for them."""


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        spec: SpeculativeConfig,
        ranks: Ranks | None = None,
    ):
        """`ranks`: this runner's tensor-parallel group; None starts one (rank 0 of
        `config.tensor_parallel_size`, or a group of one)."""
        if ranks is None:
            check_divisible(model_config, config.tensor_parallel_size)
            ranks = start_ranks(config, max_model_len)
        self.ranks = ranks
        try:
            self._build(config, model_config, max_model_len, spec)
        except BaseException:
            ranks.close()
            raise
        if self.tp.size > 1 and ranks.is_driver:  # a group left open would be torn down at exit
            atexit.register(self.close)

    def _build(
        self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, spec: SpeculativeConfig
    ) -> None:
        self.config = config
        self.spec = spec
        self.model_config = model_config
        self.tp = self.ranks.tp
        self.device = config.rank_device(self.tp.rank)
        self.dtype = config.torch_dtype
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        _check_kernels_support(model_config, self.device)
        self._load_models()
        self.num_kv_blocks = self._agree_min(self._num_kv_blocks())
        caches = {
            name: self._allocate_kv_cache(self.num_kv_blocks, cache_config, tp)
            for name, (cache_config, tp) in self._cache_layouts().items()
        }
        self.kv_caches = caches["target"]
        self.draft_kv_caches = caches.get("draft", [])
        self.mtp_kv_caches = caches.get("mtp", [])
        self.eagle3_kv_caches = caches.get("eagle3", [])
        self.max_num_drafts = spec.max_num_drafts
        self.tree = DraftTree(spec.tree) if spec.tree else None
        """The draft tree the server's head drafts, or None: chains."""
        if self.tree is not None and self.tp.size > 1:
            raise ValueError("tree drafting runs with tensor_parallel_size 1")
        if self.tree is not None and any(w is not None for w in model_config.sliding_windows):
            raise ValueError("tree drafting does not support models with sliding-window attention")
        # a row holds the longest request, the tokens a step may keep past it and drafts written
        # after its end (with_ngram)
        row_capacity = max_model_len + 2 * (self.max_num_drafts + 1)
        self.inputs = InputBatch(config.max_num_seqs, row_capacity, self.max_num_drafts, self.device)
        if self.tp.size > 1 and self.ranks.is_driver:
            self.inputs.record_joins()
        self.verifier = RejectionSampler(spec.verify_strategy, spec.accept_policy, config.logprobs_mode)
        self.step_masks = StepMasks(model_config.vocab_size, self.device)
        self.tail: VerifyAndUpdate | None = None
        self.graphs: DecodeGraphs | None = None
        self.kv_stream: LayerStreamer | None = None
        """Where the KV of requests to hand off streams as their prefill runs (`stream_kv`)."""
        self.num_steps_ahead = 0
        """Steps launched ahead (`launch_ahead`) so far: a benchmark's check that they ran."""
        sleeps = config.async_scheduling and self.can_run_ahead  # else every step waits for the host
        self._results = [ResultBuffer(sleeps), ResultBuffer(sleeps)] if self.device.type == "cuda" else []
        """Where packed results are read back to, alternately (a step's stays readable while the
        next one launches)."""
        if self.device.type == "cuda":
            self._warm_up_kernels()

    def _load_models(self) -> None:
        """The target and the drafting model its speculative method runs (draft model, MTP or
        EAGLE-3 head)."""
        config, spec = self.config, self.spec
        # the target's scheme (asked for, or its checkpoint's) quantizes the drafting models too
        self.quantization = resolve_quantization(
            config.quantization, self.model_config.quantization, config.model
        )
        method = self.quantization.method if self.quantization else None
        self.model: LlamaForCausalLM = load_model(
            config.model, self.dtype, self.device, self.max_model_len, self.tp, method
        )
        # replicated: small, latency-bound chains, and its heads need not split like the target's
        self.draft_model = self._load_draft_model() if spec.method == "draft_model" else None
        self.mtp_head: MTPHead | None = None
        if spec.method == "mtp":
            assert spec.model is not None
            self.mtp_head = load_mtp_head(spec.model, self.model, self.dtype, self.device, method).eval()
        self.eagle3_head: Eagle3Head | None = None
        if spec.method == "eagle3":
            assert spec.model is not None
            self.eagle3_head = load_eagle3_head(
                spec.model, self.model, self.dtype, self.device, spec.eagle3_layers
            )
        self.aux_layers: tuple[int, ...] = self.eagle3_head.aux_layers if self.eagle3_head else ()
        """Target layers whose entering streams the forward keeps (the EAGLE-3 head's; none otherwise)."""

    def _cache_layouts(self) -> dict[str, tuple[ModelConfig, TensorParallel]]:
        """Each KV cache that shares the block tables (`caches`), by name: its model's config and
        the ranks its heads split over (the draft model and the EAGLE-3 head are replicated, and
        so are their caches)."""
        layouts = {"target": (self.model_config, self.tp)}
        if self.draft_model is not None:
            layouts["draft"] = (self.draft_model.config, SINGLE)
        if self.mtp_head is not None:
            layouts["mtp"] = (self.mtp_head.config, self.tp)
        if self.eagle3_head is not None:
            layouts["eagle3"] = (self.eagle3_head.config, SINGLE)
        return layouts

    def start(self, proposers: list[Proposer], own: int | None = None) -> None:
        """Sets the step's tail over the device proposers and captures the CUDA graphs; `own`: the
        proposer steps may run alone (`StepPlan.only`), whose tails get graphs of their own."""
        self.tail = VerifyAndUpdate(
            self.inputs,
            proposers,
            STRATEGIES[self.spec.verify_strategy],
            POLICIES[self.spec.accept_policy],
            self.max_num_drafts,
            self.kv_caches,
            self.block_size,
            trees=self.tree is not None,
        )
        if self._use_graphs():
            self.graphs = self._capture_graphs(self.chain_lengths(), [None] if own is None else [None, own])

    def chain_lengths(self) -> list[int]:
        """Every drafting-model chain length a step may run: 0 (nobody drafts) to k with a drafting
        model loaded, else only 0. A head drafting a tree drafts all of it whatever the depth a
        request asks (its requests take the nodes to that depth): 0 and its depth."""
        if self.tree is not None:
            return [0, self.tree.depth]
        has_model = any(m is not None for m in (self.mtp_head, self.eagle3_head, self.draft_model))
        return list(range(self.spec.k + 1)) if has_model else [0]

    def close(self) -> None:
        """Destroys the CUDA graphs (steps then run eagerly), then leaves the tensor-parallel group
        (rank 0 stops the other ranks; nothing with one rank), then stops the grammar fill's
        threads. The graphs go first: they hold the group's NCCL communicator (`DecodeGraphs.release`).
        Rank 0 of a group calls it at exit if nobody did."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.kv_stream is not None:
            self.kv_stream.close()
        self.ranks.close()
        self.step_masks.close()
        atexit.unregister(self.close)

    def stream_kv(self, sink: Callable[[KVLayers], None]) -> bool:
        """Streams the KV of requests to hand off layer by layer to `sink` as their prefill runs
        (services/engine/kv_stream.py); False where it cannot (several ranks: each holds only its
        heads, which the whole export gathers)."""
        if self.tp.size > 1:
            return False
        self.kv_stream = LayerStreamer(self.kv_caches, self.block_size, sink)
        return True

    def kv_layer_shapes(self, num_tokens: int) -> list[tuple[str, int, tuple[int, int, int, int]]]:
        """(cache, layer, [num_blocks, block_size, kv_heads, head_dim]) of every layer `export_blocks`
        gives for a request of `num_tokens` tokens, in its order (one rank)."""
        num_blocks = -(-num_tokens // self.block_size)
        return [
            (cache, index, (num_blocks, *key_cache.shape[1:]))
            for cache in EXPORTED_CACHES
            for index, (key_cache, _) in enumerate(self.caches(cache))
        ]

    def _use_graphs(self) -> bool:
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and kernels.cuda_available(torch.empty(0, device=self.device))
        )

    def _capture_graphs(self, chain_lengths: list[int], onlys: list[int | None]) -> DecodeGraphs:
        assert self.tail is not None
        max_tokens = min(
            self.config.cuda_graph_max_tokens, self.config.resolved_max_num_batched_tokens(self.max_model_len)
        )
        verify_lens = self.verify_query_lens()
        prefill_len = max_tokens  # steps that carry prefill chunks, any length that fits
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.tail,
            self.inputs,
            max_tokens,
            [1, *verify_lens, max(prefill_len, *verify_lens)],
            chain_lengths,
            onlys,
            self.max_model_len,
            self.block_size,
            self.config.max_num_seqs,
            self.aux_layers,
            trees=self.tree is not None,
        )
        graphs.capture()
        return graphs

    def verify_query_lens(self) -> list[int]:
        """The query classes of decode steps: 1 + k (a chain of k drafts), and with a draft tree one
        per depth it can be cut at (its node count there; a request's smaller k cuts it)."""
        chain = 1 + self.spec.k if self.spec.enabled else 1
        if self.tree is None:
            return [chain]
        branch = self.spec.ngram_branch_drafts
        return sorted(
            {chain, *(self.tree.num_nodes(depth) + branch for depth in range(1, self.tree.depth + 1))}
        )

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes on this rank in every cache that shares the block tables (target,
        draft, MTP, EAGLE-3)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return sum(
            2
            * c.num_hidden_layers
            * self.block_size
            * len(kv_head_range(c.num_key_value_heads, tp))
            * c.head_dim
            * elem
            for c, tp in self._cache_layouts().values()
        )

    def _load_draft_model(self) -> LlamaForCausalLM:
        assert self.spec.model is not None
        method = self.quantization.method if self.quantization else None
        draft = load_model(self.spec.model, self.dtype, self.device, self.max_model_len, quantization=method)
        if draft.config.vocab_size != self.model_config.vocab_size:
            raise ModelConfigError(
                f"draft model {self.spec.model} has vocab_size {draft.config.vocab_size}, the target "
                f"{self.model_config.vocab_size}; a draft model must share the target's tokenizer"
            )
        return draft

    # ---- the step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, plan: StepPlan) -> LaunchedStep:
        """Launches one step without waiting for it: a target forward over every scheduled token
        (prefill chunks, decode tokens and drafts), then the tail: only the last real token and the
        drafts of each request in `plan` reach the LM head and are verified; every request of the
        plan drafts its next step. A step that fits a CUDA graph replays the forward from one, and
        the tail too when the fused kernel verifies every request. Its results come back in one
        copy (`LaunchedStep.result`)."""
        step = self.prepare(batch, plan)
        fused = self._fusable(step)
        self._send_step(step, plan, fused)
        packed, logprobs, prompt = self._run(step, plan, fused)
        return self._read_back(packed, step, logprobs, prompt, device_only=fused and step.is_decode)

    @property
    def can_run_ahead(self) -> bool:
        """Whether decode steps may be launched ahead here: always (a step's drafts, chains or
        trees with their parents, stay on the device for the next)."""
        return True

    @torch.inference_mode()
    def launch_ahead(self, batch: ScheduledBatch, plan: StepPlan) -> LaunchedStep | PendingTail:
        """`launch` for the next decode step of requests whose last step is still in flight: what the
        host does not know yet of it (each request's newest tokens, positions, drafts) comes from the
        input batch, which that step's tail writes first (services/engine/run_ahead.py). A step
        with grammar rows launches only its forward: its masks need the tokens of the step in
        flight, so its tail waits for `launch_tail`, once that step has landed."""
        self.num_steps_ahead += 1
        step = ahead_step(
            batch, plan, self.inputs, self.block_size, self.max_model_len, self.tree is not None
        )
        self._send_step(step, plan, fused=True)
        pending = self._run_forward(step, plan, fused=True)
        return pending if step.has_grammar else self.launch_tail(pending)

    @torch.inference_mode()
    def launch_tail(self, pending: PendingTail) -> LaunchedStep:
        """The tail of a step whose forward is queued: its grammar masks filled from the host's
        grammar states now (while the forward runs) and copied in, then verify, update and draft."""
        packed, logprobs, prompt = self._run_tail(pending)
        device_only = pending.fused and pending.step.is_decode
        return self._read_back(packed, pending.step, logprobs, prompt, device_only)

    def _send_step(self, step: HostStep, plan: StepPlan, fused: bool) -> None:
        """Rank 0: the step to the other ranks, with the slots taken since the last one (nothing
        to do on one rank)."""
        if self.tp.size > 1:
            joins = self.inputs.take_joins()
            self.ranks.send(StepCommand(joins, step, plan.num_steps, plan.only, fused))

    @torch.inference_mode()
    def follow_step(self, command: StepCommand) -> None:
        """Rank 0's step on this rank (1..N-1): the same slots, forward and tail; nothing is read
        back. A step launched ahead is completed from this rank's own input batch, as on rank 0."""
        for join in command.joins:
            self.inputs.write(join)
        self.inputs.flush()
        self._run(command.step, command.plan(), command.fused)

    def _run(
        self, step: HostStep, plan: StepPlan, fused: bool
    ) -> tuple[torch.Tensor, list[list[TokenLogprobs | None]], PromptScores | None]:
        """The step's forward and tail; (the packed results on the device, logprobs per request,
        the scored prompt rows)."""
        return self._run_tail(self._run_forward(step, plan, fused))

    def _run_forward(self, step: HostStep, plan: StepPlan, fused: bool) -> PendingTail:
        """Queues the step's target forward and LM head. A step launched ahead is completed on the
        device first (by the forward's graph where one replays it)."""
        key = None
        streams = self.kv_stream is not None and self.kv_stream.active  # layer by layer: eagerly
        if self.graphs is not None and not streams:
            key = self.graphs.lookup(step.num_tokens, int(step.query_lens.max()))
        if key is not None and fused:
            assert self.graphs is not None
            self.graphs.replay_forward(step, key)
            return PendingTail(step, plan, fused, key)
        logits_indices, tensors = step.to_device(self.device, self.model_config.hidden_size)
        if step.ahead:
            tensors.complete_ahead(self.inputs, self.block_size)
        if key is not None:
            assert self.graphs is not None
            self.graphs.replay_forward(step, key)
            self.graphs.fill_outputs(tensors.forward)
            logits = self.graphs.logits[: len(step.logits_indices)]
        else:
            self._target_forward(tensors.forward)
            logits = self.model.compute_logits(tensors.forward.hidden[logits_indices])
        return PendingTail(step, plan, fused, None, logits, tensors)

    def _run_tail(
        self, pending: PendingTail
    ) -> tuple[torch.Tensor, list[list[TokenLogprobs | None]], PromptScores | None]:
        """The tail after `_run_forward`: the grammar masks filled and copied in (while the forward
        runs), then the tail's graph or its eager kernels."""
        step, plan, fused = pending.step, pending.plan, pending.fused
        if pending.key is not None:
            assert self.graphs is not None
            self._copy_masks(step, plan, self.graphs.bitmask)
            packed = self.graphs.replay_tail(step, pending.key, plan)
            return packed, [], self._score_prompt(self.graphs.hidden[: step.num_tokens], step)
        assert pending.logits is not None and pending.tensors is not None
        tensors = pending.tensors
        if fused and step.has_grammar:
            tensors.bitmask = torch.empty(
                len(step.masked_rows), self.step_masks.num_words, dtype=torch.int32, device=self.device
            )
            self._copy_masks(step, plan, tensors.bitmask)
        prompt = self._score_prompt(tensors.forward.hidden, step)
        return (*self._tail_eagerly(pending.logits, tensors, plan, fused), prompt)

    def _target_forward(self, forward: ForwardContext) -> None:
        """The target over the step's tokens, eagerly: its final hidden states and, for the
        EAGLE-3 head, the streams entering its layers, in the same pass."""
        args = (forward.input_ids, forward.positions, self.kv_caches, forward.meta)
        streamer = self.kv_stream
        after_layer = streamer.after_layer if streamer is not None and streamer.active else None
        if not self.aux_layers:
            forward.hidden = self.model(*args, after_layer=after_layer)
            return
        forward.hidden, forward.aux_hidden = self.model.forward_with_aux(*args, self.aux_layers, after_layer)

    def _copy_masks(self, step: HostStep, plan: StepPlan, out: torch.Tensor) -> None:
        """The grammar masks of the step's rows into `out` ([>= num_rows, num_words] on the device),
        filled on the host once the forward is launched, so that the filling runs while the device
        computes it (rank 0 fills; the other ranks receive its masks). Nothing for a step without a
        grammar: no row reads a mask."""
        if not step.has_grammar:
            return
        masks = self.ranks.share(lambda: self.step_masks.fill(plan.seqs, step.cu_num_rows))
        self.step_masks.copy_to(masks, out[: len(masks)])

    def _score_prompt(self, hidden: torch.Tensor, step: HostStep) -> PromptScores | None:
        """Prompt logprobs of the step's prompt rows, from its final hidden states (a graph's
        replay leaves them in its buffer): eager kernels after the step's own."""
        if step.prompt_rows is None:
            return None
        return score_prompt_rows(
            hidden, step.prompt_rows, self.model.compute_logits, self.model_config.vocab_size
        )

    def _read_back(
        self,
        packed: torch.Tensor,
        step: HostStep,
        logprobs: list[list[TokenLogprobs | None]],
        prompt: PromptScores | None,
        device_only: bool,
    ) -> LaunchedStep:
        """Starts the copy of the packed results to the host (pinned memory on a GPU, so that it
        runs behind the step's kernels while the host works on)."""
        done = None
        if packed.device.type == "cuda":
            self._results.reverse()
            packed, done = self._results[0].read(packed)
        elif self.graphs is not None:  # a graph's output, which the next step may overwrite unread
            packed = packed.clone()
        assert self.tail is not None
        max_rows = self.tail.max_rows(packed.shape[1])  # a graph's query class
        scored = None if prompt is None or step.prompt_rows is None else (step.prompt_rows, prompt)
        tree_width = self.tail.draft_width if self.tail.trees else 0
        return LaunchedStep(
            packed, done, max_rows, step.num_tokens, step.is_decode, logprobs, scored, device_only, tree_width
        )

    def _fusable(self, step: HostStep) -> bool:
        """Whether the fused verify kernel alone samples the rows of every request of the step
        (`input_batch.fused_from`)."""
        return bool((step.num_output >= self.inputs.fused_from[step.seq_slots]).all())

    def _tail_eagerly(
        self, logits: torch.Tensor, t: StepTensors, plan: StepPlan, fused: bool
    ) -> tuple[torch.Tensor, list[list[TokenLogprobs | None]]]:
        """The tail without a graph; requests the fused kernel cannot verify go through the torch
        `RejectionSampler` first (penalties, logit bias, min_tokens suppression, logprobs)."""
        assert self.tail is not None
        if fused:
            return self.tail(logits, t, plan), []
        if t.tree_parents is not None:
            return self._tree_tail(logits, t, plan)
        token_ids, num_accepted, logprobs = self.ranks.share(lambda: self._verify_on_host(logits, t, plan))
        moved = [torch.from_numpy(x).to(self.device, non_blocking=True) for x in (token_ids, num_accepted)]
        return self.tail.update_and_draft(moved[0], moved[1], t, plan), logprobs

    def _tree_tail(
        self, logits: torch.Tensor, t: StepTensors, plan: StepPlan
    ) -> tuple[torch.Tensor, list[list[TokenLogprobs | None]]]:
        """The tail of a step that verifies draft trees beside requests the fused kernel cannot
        verify (services/engine/tree_verify.py): the tree rule verifies every request it can (trees,
        and chains without a grammar: no mask is filled on this path), the torch `RejectionSampler`
        only the others (`_verified_on_host`), which bring no tree (`tree_verifiable`); then the
        target KV of each accepted path is compacted, the requests updated and drafted."""
        assert self.tail is not None and t.tree_parents is not None
        token_ids, num_accepted = self.tail.verify_trees(logits, t)
        chosen = [i for i, seq in enumerate(plan.seqs) if self._verified_on_host(seq)]
        logprobs: list[list[TokenLogprobs | None]] = []
        if chosen:
            host_ids, host_accepted, logprobs = self._verify_on_host(logits, t, plan, chosen)
            on_host = torch.zeros(len(plan.seqs), dtype=torch.bool)
            on_host[chosen] = True
            on_host = on_host.to(self.device)
            token_ids = torch.where(on_host[:, None], torch.from_numpy(host_ids).to(self.device), token_ids)
            num_accepted = torch.where(on_host, torch.from_numpy(host_accepted).to(self.device), num_accepted)
            assert t.tree_path is not None
            chain = torch.minimum(
                torch.arange(t.tree_path.shape[1], device=self.device), num_accepted[:, None]
            )
            t.tree_path = torch.where(on_host[:, None], chain.long(), t.tree_path)
        self.tail.compact_trees(t, num_accepted)
        return self.tail.update_and_draft(token_ids, num_accepted, t, plan), logprobs

    def _verified_on_host(self, seq: Sequence) -> bool:
        """Whether a request of a tree step the fused kernel cannot verify whole needs the torch
        `RejectionSampler`: it brings no tree, and it follows a grammar or its rows need what the
        fused kernel lacks (penalties, logit bias, logprobs, min_tokens suppression)."""
        if self._verifies_tree(seq):
            return False
        fused_from = self.inputs.fused_from[self.inputs.slot_of[seq.request_id]]
        return seq.grammar is not None or seq.num_output_tokens < fused_from

    def _verify_on_host(
        self, logits: torch.Tensor, t: StepTensors, plan: StepPlan, chosen: list[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray, list[list[TokenLogprobs | None]]]:
        """The torch `RejectionSampler` over the plan's requests (rank 0, which has them), or over
        those `chosen` (their indices) only: (token_ids [num_seqs, max_rows] int32 -1 padded,
        num_accepted [num_seqs] int32, logprobs), nothing for the requests not chosen."""
        seqs = plan.seqs if chosen is None else [plan.seqs[i] for i in chosen]
        if chosen is not None:  # their logit rows: each request brings 1 + its drafts (row_batch's)
            num_rows = np.array([1 + len(seq.spec.draft_token_ids) for seq in plan.seqs], dtype=np.int64)
            starts = np.cumsum(num_rows) - num_rows
            rows = np.concatenate([np.arange(starts[i], starts[i] + num_rows[i]) for i in chosen])
            logits = logits.index_select(0, torch.from_numpy(rows).to(logits.device))
        results = self.verifier(
            logits,
            row_batch(seqs, self.model_config.vocab_size, self.step_masks),
            [verify_request(seq) for seq in seqs],
        )
        indices = range(len(plan.seqs)) if chosen is None else chosen
        token_ids = np.full((len(plan.seqs), t.max_rows), -1, dtype=np.int32)
        num_accepted = np.zeros(len(plan.seqs), dtype=np.int32)
        logprobs: list[list[TokenLogprobs | None]] = [[] for _ in plan.seqs]
        for i, result in zip(indices, results):
            token_ids[i, : len(result.token_ids)] = result.token_ids
            num_accepted[i] = result.num_accepted
            logprobs[i] = result.logprobs
        return token_ids, num_accepted, logprobs

    def prepare(self, batch: ScheduledBatch, plan: StepPlan) -> HostStep:
        """The step's host inputs: every scheduled token for the forward, and for each request of
        the plan its logit rows (its last real token and its drafts) and slot. Per request only
        what changes from step to step is read from it; the rest is numpy over the step's arrays."""
        seqs = batch.seqs
        start_list = [seq.num_computed_tokens for seq in seqs]  # Python ints: cheaper to slice with
        spans = map(token_span, seqs, start_list, map(int.__add__, start_list, batch.num_new_tokens))
        starts = np.array(start_list, dtype=np.int64)
        lens = np.array(batch.num_new_tokens, dtype=np.int64)
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        input_ids = np.fromiter(itertools.chain.from_iterable(spans), dtype=np.int64, count=int(cu[-1]))
        seq_of_token = np.repeat(np.arange(len(seqs)), lens)
        positions = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1] - starts, lens)
        slot_list = [self.inputs.slot_of[seq.request_id] for seq in seqs]
        slots = np.array(slot_list, dtype=np.int64)
        tables = self.inputs.block_tables.rows(seqs, slot_list)
        size = self.block_size
        slot_mapping = tables[seq_of_token, positions // size].astype(np.int64) * size + positions % size
        seq_rows = sampled_rows(seqs, plan.seqs)
        num_rows = 1 + np.array([len(seq.spec.draft_token_ids) for seq in plan.seqs], dtype=np.int64)
        num_rows = np.minimum(num_rows, lens[seq_rows])
        cu_rows = np.zeros(len(plan.seqs) + 1, dtype=np.int32)
        np.cumsum(num_rows, out=cu_rows[1:])
        rows_start = cu[seq_rows + 1] - num_rows
        request_of_row = np.repeat(np.arange(len(plan.seqs), dtype=np.int32), num_rows)
        has_grammar = np.array([seq.grammar is not None for seq in plan.seqs], dtype=np.int32)
        row_in_request = np.arange(cu_rows[-1]) - np.repeat(cu_rows[:-1], num_rows)
        num_output = np.array([seq.num_output_tokens for seq in plan.seqs], dtype=np.int64)
        seq_lens = (starts + lens).astype(np.int32)
        tree_mask = tree_parents = None
        row_depths = row_in_request
        if self.tree is not None:
            shapes = [tree_shape(seq) if self._verifies_tree(seq) else None for seq in plan.seqs]
            row_depths = row_in_request.copy()
            tree_mask, tree_parents = self._tree_inputs(shapes, seq_rows, num_rows, cu, positions, row_depths)
        return HostStep(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            token_slots=slots[seq_of_token],
            query_lens=lens.astype(np.int32),
            seq_lens=seq_lens,
            block_tables=tables,
            logits_indices=np.repeat(rows_start, num_rows) + row_in_request,
            row_slots=np.repeat(slots[seq_rows], num_rows),
            row_positions=np.repeat(num_output, num_rows) + row_depths,
            draft_ids=draft_row_ids(plan.seqs, num_rows, row_in_request),
            request_of_row=request_of_row,
            masked_rows=np.repeat(has_grammar, num_rows),
            cu_num_rows=cu_rows,
            seq_slots=slots[seq_rows],
            seq_rows=seq_rows,
            num_output=num_output,
            seq_methods=np.array(plan.methods, dtype=np.int32),
            num_wanted=np.array(plan.num_wanted, dtype=np.int32),
            max_seq_len=min(int(seq_lens.max()) + self.max_num_drafts + 1, self.max_model_len),
            prompt_rows=PromptRows.of(seqs, starts, lens, cu, self.config.logprobs_mode),
            tree_mask=tree_mask,
            tree_parents=tree_parents,
        )

    def _verifies_tree(self, seq: Sequence) -> bool:
        """Whether the request's drafts this step are the server's draft tree (else a chain)."""
        return seq.spec.method == self.spec.method and bool(seq.spec.draft_token_ids)

    def _tree_inputs(
        self,
        shapes: list[list[int] | None],
        seq_rows: np.ndarray,
        num_rows: np.ndarray,
        cu: np.ndarray,
        positions: np.ndarray,
        row_depths: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The step's tree-attention masks ([num_tokens] int64) and parent arrays ([num_sampled,
        max_rows] int64) from each request's tree shape (its parent array, root included; None:
        a chain); a tree request's nodes move to their root's position + depth in `positions`,
        and their rows to their depth in `row_depths` (the output position a row samples is the
        request's output count + depth). Other queries stay causal."""
        tree_mask = np.full(len(positions), CAUSAL_MASK, dtype=np.int64)
        cu_rows = np.concatenate([[0], np.cumsum(num_rows)])
        for i, (row, n) in enumerate(zip(seq_rows.tolist(), num_rows.tolist())):
            shape = shapes[i]
            if shape is None:
                continue
            first = int(cu[row + 1]) - n
            earlier = first - int(cu[row])  # the request's query tokens before its tree's root
            if earlier + n > MAX_TREE_NODES:
                raise ValueError(f"a draft tree after {earlier} other query tokens exceeds {MAX_TREE_NODES}")
            depths, masks = shape_arrays(tuple(shape[:n]))
            tree_mask[first : first + n] = (masks << earlier) | ((1 << earlier) - 1)
            positions[first : first + n] = positions[first] + depths
            row_depths[cu_rows[i] : cu_rows[i] + n] = depths
        max_rows = int(num_rows.max(initial=1))
        parents = tree_parents(shapes, num_rows.tolist(), max_rows).numpy()
        return tree_mask, parents

    def caches(self, name: str) -> list[KVCache]:
        """The per-layer KV caches that share the block tables: target, draft, mtp or eagle3."""
        caches = {
            "target": self.kv_caches,
            "draft": self.draft_kv_caches,
            "mtp": self.mtp_kv_caches,
            "eagle3": self.eagle3_kv_caches,
        }
        if name not in caches:
            raise ValueError(f"unknown KV cache {name!r}; known: {', '.join(caches)}")
        return caches[name]

    # ---- KV in and out (split deployments) ---------------------------------------------------------

    @torch.inference_mode()
    def import_blocks(
        self,
        cache: str,
        index: int,
        block_ids: list[int],
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> None:
        """Writes one layer of KV with every head (`key`, `value` [num_blocks, block_size,
        num_kv_heads, head_dim], rank 0 only) into blocks `block_ids` of cache `cache`; each rank
        keeps its heads."""
        key_cache, value_cache = self.caches(cache)[index]  # an unknown cache fails before any rank acts
        if self.tp.size == 1:
            assert key is not None and value is not None
            self.import_layers(block_ids, [(cache, index, key, value)])
            return
        self.ranks.send(ImportBlocks(cache, index, block_ids))
        local = key_cache.new_empty(2, len(block_ids), *key_cache.shape[1:])
        whole = None
        if key is not None and value is not None:
            whole = torch.stack([key, value]).to(self.device, key_cache.dtype)
        self._scatter_heads(cache, whole, local)
        blocks = torch.tensor(block_ids, device=self.device)
        key_cache[blocks] = local[0]
        value_cache[blocks] = local[1]

    @torch.inference_mode()
    def import_layers(
        self, block_ids: list[int], layers: list[tuple[str, int, torch.Tensor, torch.Tensor]]
    ) -> None:
        """Writes a request's layers (cache, index, key, value; key and value [num_blocks, block_size,
        num_kv_heads, head_dim], every head, one dtype) into its blocks `block_ids`: on one rank
        straight into the caches, through a single host-to-device copy; with several, layer by layer."""
        targets = [self.caches(cache)[index] for cache, index, _, _ in layers]  # unknown ones fail first
        if self.tp.size > 1:
            for cache, index, key, value in layers:
                self.import_blocks(cache, index, block_ids[: key.shape[0]], key, value)
            return
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for (key_cache, value_cache), key, value in zip(targets, *self._to_device(layers)):
            num_blocks = key.shape[0]
            key_cache.index_copy_(0, blocks[:num_blocks], key.to(key_cache.dtype))
            value_cache.index_copy_(0, blocks[:num_blocks], value.to(value_cache.dtype))

    @torch.inference_mode()
    def import_stacked(self, block_ids: list[int], caches: dict[str, torch.Tensor]) -> None:
        """Writes a request's caches, each [num_layers, 2, num_blocks, block_size, heads, head_dim]
        with every head (as `gather_blocks` made them, on any device), into its blocks `block_ids`:
        one copy per cache where this rank holds the whole cache as one tensor, else layer by layer."""
        for cache, source in caches.items():
            stack = self._stack(cache) if self.tp.size == 1 else None
            if stack is None or source.shape[:2] != stack.shape[:2] or source.shape[3:] != stack.shape[3:]:
                self.import_layers(block_ids, [(cache, i, kv[0], kv[1]) for i, kv in enumerate(source)])
                continue
            blocks = torch.tensor(block_ids[: source.shape[2]], dtype=torch.long, device=self.device)
            stack.index_copy_(2, blocks, source.to(self.device, stack.dtype))

    def _to_device(
        self, layers: list[tuple[str, int, torch.Tensor, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every key and value of `layers` on the device. To a GPU they go packed in one page-locked
        staging buffer with one asynchronous copy, so the host never waits on a copy per layer."""
        tensors = [tensor for _, _, key, value in layers for tensor in (key, value)]
        if self.device.type == "cpu" or not tensors:
            return tensors[0::2], tensors[1::2]
        if all(tensor.is_cuda for tensor in tensors):  # opened from another process's GPU memory
            on_gpu = [tensor.to(self.device) for tensor in tensors]
            return on_gpu[0::2], on_gpu[1::2]
        if len({tensor.dtype for tensor in tensors}) != 1:
            raise ValueError(
                f"layers of one request differ in dtype: {sorted({str(t.dtype) for t in tensors})}"
            )
        staging = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=True)
        torch.cat([tensor.reshape(-1) for tensor in tensors], out=staging)
        flat = staging.to(self.device, non_blocking=True).split([t.numel() for t in tensors])
        on_device = [part.view(tensor.shape) for part, tensor in zip(flat, tensors)]
        return on_device[0::2], on_device[1::2]

    @torch.inference_mode()
    def export_blocks(
        self, block_ids: list[int], caches: tuple[str, ...] = EXPORTED_CACHES
    ) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
        """(cache, layer, key, value) of every layer of `caches` for blocks `block_ids`, each
        [num_blocks, block_size, num_kv_heads, head_dim] with every head, on the host: one copy from
        the device per cache, not one per tensor (on rank 0; the other ranks send theirs and get an
        empty list)."""
        self.ranks.send(ExportBlocks(block_ids))
        blocks = torch.tensor(block_ids, device=self.device)
        layers = []
        for cache in caches:
            if not self.caches(cache):
                continue
            local = self._stacked(cache, blocks)
            whole = self._gather_heads(
                cache, local
            )  # [num_layers, 2, num_blocks, block_size, heads, head_dim]
            if whole is not None:
                layers += [(cache, i, kv[0], kv[1]) for i, kv in enumerate(whole.cpu())]
        return layers

    @torch.inference_mode()
    def gather_blocks(
        self, block_ids: list[int], allocate: Callable[[int], torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Every layer of every cache for blocks `block_ids`, with every head, gathered on the device
        into one buffer `allocate(num_bytes)` gives (uint8): the buffer and each cache's view of it,
        [num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]. Only enqueued
        on the current stream: nothing here waits for the device."""
        self.ranks.send(ExportBlocks(block_ids))
        blocks = torch.tensor(block_ids, device=self.device)
        shapes = {
            cache: (
                len(caches),
                2,
                len(block_ids),
                *caches[0][0].shape[1:-2],
                self._num_heads(cache),
                caches[0][0].shape[-1],
            )
            for cache in ("target", "mtp", "draft")
            if (caches := self.caches(cache))
        }
        dtypes = {cache: self.caches(cache)[0][0].dtype for cache in shapes}
        sizes = [math.prod(shape) * dtypes[cache].itemsize for cache, shape in shapes.items()]
        buffer = allocate(sum(sizes))
        views = {
            cache: part.view(dtypes[cache]).view(shape)
            for (cache, shape), part in zip(shapes.items(), buffer.split(sizes))
        }
        for cache, view in views.items():
            if not self._sharded(cache) and (stack := self._stack(cache)) is not None:
                torch.index_select(stack, 2, blocks, out=view)  # one op for every layer, into the buffer
            elif not self._sharded(cache):
                for layer, (key_cache, value_cache) in enumerate(self.caches(cache)):
                    torch.index_select(key_cache, 0, blocks, out=view[layer, 0])
                    torch.index_select(value_cache, 0, blocks, out=view[layer, 1])
            elif (whole := self._gather_heads(cache, self._stacked(cache, blocks))) is not None:
                view.copy_(whole)
        return buffer, views

    def rows_agree(self) -> bool:
        """Whether every rank's input batch holds the same tokens: the rank-consistency check (the
        same tokens accepted everywhere, so the same rows)."""
        self.ranks.send(CompareRows())
        inputs = self.inputs
        weights = torch.arange(1, inputs.row_capacity + 1, device=self.device, dtype=torch.long)
        digest = torch.stack(
            [(inputs.token_rows.long() * weights).sum(1), inputs.num_tokens.long(), inputs.num_output.long()]
        )
        return bool((self.tp.all_gather(digest) == digest).all())

    def _sharded(self, cache: str) -> bool:
        """Whether each rank holds only its heads of `cache` (the draft model's and the EAGLE-3
        head's are replicated)."""
        return self.tp.size > 1 and cache not in ("draft", "eagle3")

    def _stacked(self, cache: str, blocks: torch.Tensor) -> torch.Tensor:
        """This rank's heads of `cache` for `blocks`: [num_layers, 2, num_blocks, block_size, heads, head_dim]."""
        stack = self._stack(cache)
        if stack is not None:
            return stack.index_select(2, blocks)
        return torch.stack([torch.stack([k[blocks], v[blocks]]) for k, v in self.caches(cache)])

    def _stack(self, cache: str) -> torch.Tensor | None:
        """Every layer of `cache` as the one tensor they are views of, [num_layers, 2, num_blocks,
        block_size, heads, head_dim]; None if they are not laid out so."""
        caches = self.caches(cache)
        if not caches:
            return None
        first = caches[0][0]
        size = (len(caches), 2, *first.shape)
        stride = [1] * len(size)
        for dim in range(len(size) - 2, -1, -1):
            stride[dim] = stride[dim + 1] * size[dim + 1]
        if first.untyped_storage().nbytes() < math.prod(size) * first.element_size() + first.storage_offset():
            return None
        stack = first.as_strided(size, stride, first.storage_offset())
        views = [tensor for kv in caches for tensor in kv]
        if any(
            view.data_ptr() != stack[i // 2, i % 2].data_ptr() or not view.is_contiguous()
            for i, view in enumerate(views)
        ):
            return None
        return stack

    def _num_heads(self, cache: str) -> int:
        """KV heads of `cache` in all (a rank holds only its share of a sharded one)."""
        if self._sharded(cache):
            return self._cache_config(cache).num_key_value_heads
        return int(self.caches(cache)[0][0].shape[2])

    def _cache_config(self, cache: str) -> ModelConfig:
        if cache == "mtp":
            assert self.mtp_head is not None
            return self.mtp_head.config
        if cache == "eagle3":
            assert self.eagle3_head is not None
            return self.eagle3_head.config
        return self.model_config

    def _scatter_heads(self, cache: str, whole: torch.Tensor | None, local: torch.Tensor) -> None:
        """`local` [..., local heads, head_dim] from rank 0's `whole` [..., heads, head_dim]: this
        rank's heads, or all of a replicated cache's."""
        if self.tp.size == 1:
            assert whole is not None
            local.copy_(whole)
        elif not self._sharded(cache):
            if whole is not None:
                local.copy_(whole)
            dist.broadcast(local, src=0, group=self.tp.group)
        else:
            parts = None
            if whole is not None:
                num_heads = whole.shape[-2]
                parts = [
                    whole[..., ranks_heads.start : ranks_heads.stop, :].contiguous()
                    for ranks_heads in (
                        kv_head_range(num_heads, TensorParallel(r, self.tp.size)) for r in range(self.tp.size)
                    )
                ]
            dist.scatter(local, parts, src=0, group=self.tp.group)

    def _gather_heads(self, cache: str, local: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every head of `cache` from the ranks' [..., local heads, head_dim]; others: None."""
        if not self._sharded(cache):
            return local if self.ranks.is_driver else None
        parts = [torch.empty_like(local) for _ in range(self.tp.size)] if self.ranks.is_driver else None
        dist.gather(local, parts, dst=0, group=self.tp.group)
        if parts is None:
            return None
        num_heads = self._cache_config(cache).num_key_value_heads
        owners = kv_head_owners(num_heads, self.tp.size)
        heads = [
            parts[rank][..., head - kv_head_range(num_heads, TensorParallel(rank, self.tp.size)).start, :]
            for head, rank in enumerate(owners)
        ]
        return torch.stack(heads, dim=-2)

    # ---- KV-cache sizing -------------------------------------------------------------------------

    def _agree_min(self, value: int) -> int:
        """The smallest `value` of any rank (every rank must size its caches alike)."""
        if self.tp.size == 1:
            return value
        found = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(found, op=dist.ReduceOp.MIN, group=self.tp.group)
        return int(found.item())

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
            kv_caches = self._allocate_kv_cache(-(-context // self.block_size), config, model.tp)
            query_len = 1
            while query_len <= min(context, WARM_UP_QUERY_LEN):
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
        kv_caches = self._allocate_kv_cache(num_blocks, self.model_config, self.tp)
        ids, positions, meta = self._one_sequence(num_tokens, num_tokens)
        hidden = self.model(ids, positions, kv_caches, meta)
        rows = min(num_tokens, self.config.max_num_seqs)
        self.model.compute_logits(hidden[:rows]).softmax(dim=-1)
        del kv_caches, hidden
        torch.cuda.synchronize(self.device)

    def _allocate_kv_cache(self, num_blocks: int, c: ModelConfig, tp: TensorParallel) -> list[KVCache]:
        """Per layer, this rank's heads of (key, value) caches: views of one allocation
        [num_layers, 2, num_blocks, block_size, heads, head_dim], so that a request's blocks of every
        layer move in one operation (`_stack`)."""
        shape = (num_blocks, self.block_size, len(kv_head_range(c.num_key_value_heads, tp)), c.head_dim)
        stack = torch.zeros((c.num_hidden_layers, 2, *shape), dtype=self.dtype, device=self.device)
        return [(stack[layer, 0], stack[layer, 1]) for layer in range(c.num_hidden_layers)]


def verify_request(seq: Sequence) -> VerifyRequest:
    return VerifyRequest(seq.params, seq.seed, seq.num_output_tokens, list(seq.spec.draft_token_ids))


def token_span(seq: Sequence, start: int, end: int) -> list[int]:
    """Tokens `start:end` of the sequence followed by its drafts, without copying its whole history
    (a step would otherwise cost time growing with every request's length)."""
    tokens, drafts = seq.token_ids, seq.spec.draft_token_ids
    num_tokens = len(tokens)
    if end <= num_tokens:
        return tokens[start:end]
    return tokens[start:] + drafts[max(0, start - num_tokens) : end - num_tokens]


def sampled_rows(seqs: list[Sequence], sampled: list[Sequence]) -> np.ndarray:
    """[num_sampled] int64 each sampled request's index among the step's sequences (`sampled`
    is a subsequence of `seqs`: all of it in a decode step)."""
    if len(sampled) == len(seqs):
        return np.arange(len(seqs), dtype=np.int64)
    index = {seq.request_id: i for i, seq in enumerate(seqs)}
    return np.array([index[seq.request_id] for seq in sampled], dtype=np.int64)


def draft_row_ids(seqs: list[Sequence], num_rows: np.ndarray, row_in_request: np.ndarray) -> np.ndarray:
    """[num_rows] int32 the draft each logit row checks: a request's drafts on its rows but the
    last (`num_rows` [num_seqs]: its rows), -1 on that bonus row."""
    draft_ids = np.full(len(row_in_request), -1, dtype=np.int32)
    checks_draft = row_in_request < np.repeat(num_rows - 1, num_rows)
    if checks_draft.any():
        drafts = (seq.spec.draft_token_ids[: n - 1] for seq, n in zip(seqs, num_rows.tolist()))
        draft_ids[checks_draft] = np.fromiter(
            itertools.chain.from_iterable(drafts), dtype=np.int32, count=int(checks_draft.sum())
        )
    return draft_ids


def row_batch(seqs: list[Sequence], vocab_size: int, masks: StepMasks) -> SamplingBatch:
    """Sampling inputs per logit row: row j of a sequence sees its output plus its first j drafts,
    so penalties, min_tokens and the grammar apply to each draft position as they would in plain
    decoding."""
    batch = SamplingBatch(params=[], prompt_token_ids=[], output_token_ids=[], suppressed_token_ids=[])
    batch.bitmask = _grammar_bitmask(seqs, vocab_size, masks) if any(seq.grammar for seq in seqs) else None
    for seq in seqs:
        drafts = seq.spec.draft_token_ids
        penalties = seq.params.has_penalties
        for j in range(len(drafts) + 1):
            batch.params.append(seq.params)
            batch.prompt_token_ids.append(seq.prompt_token_ids if penalties else [])
            batch.output_token_ids.append(seq.output_token_ids + drafts[:j] if penalties else [])
            batch.suppressed_token_ids.append(_suppressed(seq, seq.num_output_tokens + j))
    return batch


def _grammar_bitmask(seqs: list[Sequence], vocab_size: int, masks: StepMasks) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)]: each grammar row's allowed tokens, every token elsewhere."""
    cu_num_rows = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([1 + len(seq.spec.draft_token_ids) for seq in seqs], out=cu_num_rows[1:])
    bitmask = allocate_bitmask(int(cu_num_rows[-1]), vocab_size)
    masks.write(seqs, cu_num_rows, bitmask)
    return bitmask


def _suppressed(seq: Sequence, num_output_tokens: int) -> list[int]:
    if num_output_tokens >= seq.params.min_tokens:
        return []
    eos = [] if seq.params.ignore_eos else list(seq.eos_token_ids)
    return eos + list(seq.params.stop_token_ids)


def _check_kernels_support(model_config: ModelConfig, device: torch.device) -> None:
    """Refuses a model the CUDA kernels would compute wrong, before anything loads."""
    if model_config.attn_logit_softcapping is None or device.type != "cuda":
        return
    if kernels.cuda_available(torch.empty(0, device=device)):
        raise ModelConfigError(
            f"{model_config.architecture}: attn_logit_softcapping {model_config.attn_logit_softcapping} is "
            "not supported by the CUDA attention kernel; serve it on CPU, or set SPECMESH_KERNELS=ref "
            "to run the exact (slower) torch attention on the GPU"
        )
