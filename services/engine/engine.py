"""The engine every worker runs: schedule a batch, plan its drafts, run it, emit the outputs.

batch = scheduler.schedule()
plan = drafter.plan(batch)                   # each request's k for its next step
launched = model_runner.launch(batch, plan)  # forward, verify, update, draft (CUDA graphs on a GPU)
outputs = emit(last step's tokens)           # detokenize, stop strings: while the device works
drafter.choose_pending()                     # the ks of host-drafted steps, chosen after the launch
drafter.prepare_on_host(launched.running)    # drafting work that needs no result of this step
apply(batch, launched.result())              # tokens, finishes, KV lengths, next drafts

A step's outputs are therefore returned by the next call of `step()` (or by the one after the
last step): the host's per-token work overlaps the device's next step instead of delaying it.

Asynchronous scheduling (the default; `--no-async-scheduling` turns it off): a decode step whose
inputs the device holds is launched *before* the step in flight lands, from what that step's tail
leaves on the device (services/engine/run_ahead.py), so the device never waits for the host's
apply / emit / plan between two decode steps. The host then runs one step behind: a request that
ends (EOS, a stop id, max_tokens) is found a step late, and what its extra step computed is
discarded (never emitted; its KV and slot freed); blocks are reserved for two steps' growth; a stop
string found by `_emit` ends the request with the same text, its extra steps dropped.

A step with grammar rows runs ahead in two parts: its forward is launched before the step in flight
lands; its tail (verify with the masks) once that step has landed, its tokens advanced each grammar
and the host filled the masks, while the forward runs (`_launch_tail`). The device waits for the
masks only where landing and filling outlast the forward. Grammar requests that verify drafts do
not run ahead (`_drafts_ahead`).

Steps that need the host wait for the step in flight and take the path above: prefill chunks,
requests joining (admitted, resumed, activated) or preempted, grammar requests with drafts, the
torch verifier (penalties, logit bias, logprobs, min_tokens not reached yet), drafts made on the
host (suffix decoding's, where a request drafts at all: one left at k = 0 runs ahead), a short KV
cache or a request near max_model_len. Draft trees run ahead like chains: the tail that drafts
them keeps their parents on the device, and the step ahead lays its trees out from them. Under
tensor parallelism every rank launches the same steps ahead, each completing them from its own
input batch (a grammar step's masks included: rank 0 fills them when it launches the tail and
sends them, the others receive them before theirs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.engine.block_manager import BlockManager
from services.engine.grammar import GrammarCompiler, GrammarState
from services.engine.kv_export import KVExport, KVStreamMessage, KVStreamStart
from services.engine.model_runner import (
    EXPORTED_CACHES,
    LaunchedStep,
    ModelRunner,
    PendingTail,
    SeqResult,
    StepOutput,
)
from services.engine.output_processor import OutputProcessor
from services.engine.prompt_logprobs import record_prompt_logprobs
from services.engine.scheduler import ScheduledBatch, Scheduler
from services.engine.sequence import FinishReason, Sequence, SequenceStatus, TokenLogprobs
from services.engine.spec_decode.drafter import Drafter, SpeculationError
from services.engine.spec_decode.suffix import GlobalIndex
from services.engine.verify_update import StepPlan
from shared.config import EngineConfig
from shared.model import ModelConfig
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutputError
from shared.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class Emission:
    """A request's tokens of one step, appended to it, whose output is still to be produced."""

    seq: Sequence
    num_new: int
    finish_reason: FinishReason | None
    """The post-step update's verdict (None: running, or handed off)."""
    stop_token_id: int | None
    kept: int | None = None
    """How many tokens the text kept, once observed (a stop string can end the request earlier)."""

    def observe(self, outputs: OutputProcessor) -> int:
        if self.kept is None:
            self.kept = outputs.observe(self.seq, self.num_new, self.finish_reason, self.stop_token_id)
        return self.kept


@dataclass
class InFlight:
    """A launched step and what the host decided for it."""

    batch: ScheduledBatch
    plan: StepPlan
    launched: LaunchedStep | PendingTail
    """A step launched ahead with grammar rows is a `PendingTail` until the step before it lands."""
    called_s: float
    """When the `step()` call that launched it began (`perf_counter`)."""
    host_gap_s: float | None = None
    """How long the device idled for the host before this step's launch: from the landing of a step
    that could have had this one launched ahead of it, less the host drafting in between (None:
    launched ahead, or after a step nothing could run ahead of)."""
    ahead: bool = False
    """Launched ahead of the step before it (`_launch_ahead`)."""


@dataclass
class StepCounts:
    """The engine's landed steps, for benchmarks: how many, how many were launched ahead, how many
    waited for the host where they could have been launched ahead of the step before (host drafts,
    a request to admit), the device's idle time before those, and the whole time of the steps that
    waited and of the rest."""

    num_steps: int = 0
    num_ahead: int = 0
    num_waited: int = 0
    host_gap_s: float = 0.0
    waited_s: float = 0.0
    other_s: float = 0.0

    def add(self, seconds: float, host_gap_s: float | None, ahead: bool = False) -> None:
        self.num_steps += 1
        self.num_ahead += ahead
        if host_gap_s is None:
            self.other_s += seconds
            return
        self.num_waited += 1
        self.host_gap_s += host_gap_s
        self.waited_s += seconds

    def summary(self) -> dict[str, float]:
        """Share of steps launched ahead and of those that waited, the waiting ones' mean host gap
        and mean time, the others' mean time."""
        num_other = self.num_steps - self.num_waited
        return {
            "num_steps": self.num_steps,
            "ahead_share": self.num_ahead / max(self.num_steps, 1),
            "waited_share": self.num_waited / max(self.num_steps, 1),
            "mean_host_gap_ms": 1e3 * self.host_gap_s / max(self.num_waited, 1),
            "mean_waited_step_ms": 1e3 * self.waited_s / max(self.num_waited, 1),
            "mean_other_step_ms": 1e3 * self.other_s / max(num_other, 1),
        }


class RequestError(ValueError):
    """A request the engine refuses, with a message meant for the client."""


class CapacityError(RequestError):
    """A valid request this instance has no room for right now (another instance may)."""


@dataclass
class RequestOutput:
    """What a request produced so far. `new_*` fields hold only this step's delta (for streaming).

    The output's tokens and logprobs so far (`token_ids`, `logprobs`) are read on access from the
    request's own lists, as far as they reached at this step (later steps only extend them): copying
    them into every step's output would make each step cost in proportion to the output's length,
    a quadratic cost over a long generation, on the engine's critical path."""

    request_id: str
    prompt_token_ids: list[int]
    num_output_tokens: int
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    all_token_ids: list[int] = field(default_factory=list, repr=False)
    """The request's tokens, its prompt first (`Sequence.token_ids`)."""
    all_logprobs: list[TokenLogprobs | None] | None = field(default=None, repr=False)
    """One per output token (`Sequence.logprobs`), when the request asked for them."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Per prompt position (None at 0), complete from the first output on; None when not asked
    for, or when the prompt ran elsewhere (a resumed request, the decode side of a hand-off)."""
    num_cached_prompt_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    spec_stats: dict[str, object] = field(default_factory=dict)
    """Draft and accepted tokens, mean accepted length (bonus included), per-position acceptance."""

    @property
    def token_ids(self) -> list[int]:
        """The output tokens so far."""
        start = len(self.prompt_token_ids)
        return self.all_token_ids[start : start + self.num_output_tokens]

    @property
    def logprobs(self) -> list[TokenLogprobs | None] | None:
        """One per output token so far, when the request asked for them."""
        return None if self.all_logprobs is None else self.all_logprobs[: self.num_output_tokens]

    @property
    def new_logprobs(self) -> list[TokenLogprobs | None] | None:
        """This step's: one per new token, when the request asked for them."""
        if self.all_logprobs is None:
            return None
        return self.all_logprobs[self.num_output_tokens - len(self.new_token_ids) : self.num_output_tokens]


def reblock(cache_blocks: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """[n, other_block_size, h, d] holding `num_tokens` tokens -> [m, block_size, h, d]."""
    flat = cache_blocks.flatten(0, 1)[:num_tokens]
    pad = flat.new_zeros(-num_tokens % block_size, *flat.shape[1:])
    return torch.cat([flat, pad]).view(-1, block_size, *flat.shape[1:])


class LLMEngine:
    def __init__(self, config: EngineConfig, suffix_index: GlobalIndex | None = None):
        """`suffix_index`: where the global suffix tree lives (default: in this process; a worker
        passes the shared suffix-cache service's client)."""
        self.config = config
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer(config.model)
        context_len = self.model_config.max_context_len
        requested_len = config.max_model_len or context_len
        if requested_len > context_len:
            raise ValueError(
                f"max_model_len {requested_len} exceeds the model's context ({context_len}: "
                "max_position_embeddings, times the RoPE scaling factor for YaRN and dynamic NTK): "
                "positions past it were never trained; lower --max-model-len"
            )
        self.runner = ModelRunner(config, self.model_config, requested_len, config.speculative_config)
        try:
            self._build(config, requested_len, suffix_index)
        except BaseException:
            self.runner.close()
            raise

    def _build(self, config: EngineConfig, requested_len: int, suffix_index: GlobalIndex | None) -> None:
        self.max_model_len = self._fit_max_model_len(requested_len)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.inputs = self.runner.inputs
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.resolved_max_num_batched_tokens(self.max_model_len),
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.drafter = Drafter(config.speculative_config, self.runner, self.block_manager, suffix_index)
        self.runner.start(self.drafter.device_proposers, self.drafter.own)
        if self.runner.graphs is not None:
            self.drafter.max_graph_tokens = self.runner.graphs.max_decode_tokens
            self.scheduler.decode_chunk_limit = self.runner.graphs.query_lens[-1]
        self.outputs = OutputProcessor(self.tokenizer)
        self.sequences: dict[str, Sequence] = {}
        self.seed_generator = torch.Generator().manual_seed(config.seed)
        self.reserved: dict[str, Sequence] = {}
        """Decode side of a split deployment: requests holding blocks while their KV arrives."""
        self.handoffs: list[KVExport] = []
        """Prefill side: KV of requests whose prefill finished this step, for the worker to send."""
        self.allocate_export: Callable[[int], torch.Tensor] | None = None
        """Prefill side: where exported KV goes. None: copied to the host; else gathered on the device
        into the uint8 buffer this gives for a number of bytes (one another process can open)."""
        self._kv_sink: Callable[[KVStreamMessage], None] | None = None
        """Prefill side: where the KV of requests to hand off streams as their prefill runs
        (`stream_kv`); None: it is exported whole after it."""
        self._unemitted: list[Emission] = []
        """Tokens the last step appended to requests, whose outputs the next call produces."""
        self.on_outputs: Callable[[list[RequestOutput]], None] | None = None
        """Where `step()` hands the last step's outputs as soon as they are made, while the device
        runs the step (a worker's engine core sends them on then); None: `step()` returns them."""
        self._stopped: list[Sequence] = []
        """Requests a stop string ended while a step in flight still ran them: freed after it."""
        self._in_flight: InFlight | None = None
        """A step launched in an earlier call whose result is not applied yet (`_launch_ahead`)."""
        self._landed_s = float("-inf")
        """When the last step landed (`perf_counter`): a step's time runs from there (`_land`)."""
        self._idle_since: float | None = None
        """When the device went idle in this `step()` call: the read-back of a landed step that the
        next could have been launched ahead of (None: no such landing in this call)."""
        self.step_counts = StepCounts()
        self.eos_token_ids = self.tokenizer.eos_token_ids | frozenset(self.model_config.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        logger.info(
            "engine ready: %s on %s/%s x%d, %d KV blocks of %d tokens, max_model_len %d",
            self.model_config.architecture,
            self.runner.device,
            self.runner.dtype,
            config.tensor_parallel_size,
            self.runner.num_kv_blocks,
            config.block_size,
            self.max_model_len,
        )

    def close(self) -> None:
        """Stops the engine's other tensor-parallel ranks (nothing to do with one) and its grammar
        threads (the compiler's, the mask fill's)."""
        self.grammars.close()
        self.runner.close()

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        resumed_token_ids: list[int] | None = None,
        handoff: bool = False,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request. `resumed_token_ids`: output an earlier instance already delivered (the
        request continues after them). `handoff`: prefill only; the KV then goes to a decode instance.
        `arrival_time`: when the request first arrived (wall clock; default now): it waits behind
        every request that arrived before it, so one placed again keeps its place in line."""
        seq = self._new_sequence(
            request_id, prompt, params or SamplingParams(), prompt_token_ids, resumed_token_ids
        )
        seq.handoff = handoff
        if arrival_time is not None:
            seq.queued_at = arrival_time
        self.scheduler.add(seq)

    def _new_sequence(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None,
        resumed_token_ids: list[int] | None,
    ) -> Sequence:
        if request_id in self.sequences:
            raise RequestError(f"request id {request_id!r} is already running")
        token_ids = self._prompt_ids(prompt, prompt_token_ids)
        resumed = list(resumed_token_ids or [])
        self._validate(token_ids + resumed, params, num_resumed=len(resumed))
        seq = Sequence(request_id, token_ids, params, self.eos_token_ids)
        try:
            self.drafter.configure(seq)
        except SpeculationError as exc:
            raise RequestError(str(exc)) from None
        seq.seed = params.seed if params.seed is not None else self._draw_seed()
        if params.prompt_logprobs is not None and not resumed:  # a resumed request sent them already
            seq.prompt_logprobs = [None] * len(token_ids)
        if params.structured is not None:
            seq.grammar = GrammarState(self.grammars.submit(params.structured), seq.spec.max_k)
            self._advance_grammar(seq, resumed)
        seq.token_ids += resumed
        if params.logprobs is not None:  # sampled elsewhere: their logprobs went out from there
            seq.logprobs = [None] * len(resumed)
        self.sequences[request_id] = seq
        self.outputs.start(seq)
        self.outputs.prime(seq, resumed)
        return seq

    def _draw_seed(self) -> int:
        """A seed for a request that brought none; the engine's own seed makes the draw repeatable."""
        return int(torch.randint(0, 2**62, (1,), generator=self.seed_generator))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request; None when it is unknown or already finished (its last output is due)."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.is_finished or seq in self._stopped:
            return None
        seq.finish_reason = FinishReason.ABORT
        self._drop_unemitted(seq)
        output = self._output(seq, [])
        self._free(seq)
        self._forget(seq)
        return output

    def discard_request(self, request_id: str) -> None:
        """Forgets a request at once, outputs still due included: between steps, for a request that
        ended here (its last output is emitted a step later) and arrives again, placed anew."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return
        self._drop_unemitted(seq)
        if seq in self._stopped:
            self._stopped.remove(seq)
        if not seq.is_finished:
            seq.finish_reason = seq.finish_reason or FinishReason.ABORT
            self._free(seq)
        self._forget(seq)

    def _drop_unemitted(self, seq: Sequence) -> None:
        """Drops the request's tokens whose output is still due: its text ends where it is."""
        self._unemitted = [e for e in self._unemitted if e.seq is not seq]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._unemitted)

    # ---- split deployment: the decode side -------------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resumed_token_ids: list[int] | None = None,
    ) -> None:
        """Holds blocks for a request being prefilled elsewhere; its KV then arrives by `import_kv`."""
        seq = self._new_sequence(request_id, None, params, prompt_token_ids, resumed_token_ids)
        seq.prompt_logprobs = None  # the prefill instance computes and sends them
        if not self.block_manager.can_allocate(seq, seq.num_tokens, []):
            self._forget(seq)
            self.drafter.finish(seq)
            raise CapacityError(f"no free KV blocks for {seq.num_tokens} tokens on this instance")
        self.block_manager.allocate(seq, [])
        self.block_manager.append_slots(seq, seq.num_tokens)
        self.reserved[request_id] = seq

    def import_kv(
        self, request_id: str, cache: str, index: int, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Writes one received layer ([num_blocks, block_size, kv_heads, head_dim], the sender's block
        size) into the reserved blocks."""
        self.import_layers(request_id, [(cache, index, key, value)])

    def import_layers(
        self, request_id: str, layers: list[tuple[str, int, torch.Tensor, torch.Tensor]]
    ) -> None:
        """Writes received layers (cache, index, key, value), as `import_kv` does one, with one
        copy to the device for all of them."""
        seq = self.reserved[request_id]
        layers = [
            (cache, index, self._reblocked(key, seq), self._reblocked(value, seq))
            for cache, index, key, value in layers
        ]
        num_blocks = max((key.shape[0] for _, _, key, _ in layers), default=0)
        self.runner.import_layers(seq.block_table[:num_blocks], layers)

    def import_stacked(self, request_id: str, caches: dict[str, torch.Tensor]) -> None:
        """Writes received caches (name -> [num_layers, 2, num_blocks, block_size, kv_heads, head_dim],
        as a prefill instance gathered them) into the reserved blocks: one copy per cache where the
        block sizes agree, else layer by layer through `import_layers`."""
        seq = self.reserved[request_id]
        if any(source.shape[3] != self.config.block_size for source in caches.values()):
            layers = [
                (name, i, kv[0], kv[1]) for name, source in caches.items() for i, kv in enumerate(source)
            ]
            self.import_layers(request_id, layers)
            return
        num_blocks = max((source.shape[2] for source in caches.values()), default=0)
        self.runner.import_stacked(seq.block_table[:num_blocks], caches)

    def _reblocked(self, cache_blocks: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """Blocks of the sender's block size in this engine's."""
        if cache_blocks.shape[1] == self.config.block_size:
            return cache_blocks
        return reblock(cache_blocks, self.config.block_size, seq.num_tokens)

    def activate(self, request_id: str, first_token_id: int) -> None:
        """All KV arrived: the request joins the running batch after its first token (which the
        prefill instance already streamed). Its first decode step brings no drafts: its drafting
        starts in that step's tail, from the caches that came with the KV."""
        seq = self.reserved.pop(request_id)
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(first_token_id)
        if seq.params.logprobs is not None:  # the prefill instance sent its logprob with it
            seq.logprobs.append(None)
        self._advance_grammar(seq, [first_token_id])
        self.outputs.observe(seq, 1)  # not a stop: the prefill side would have finished it
        self.outputs.take_delta(seq)
        self.block_manager.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)

    # ---- split deployment: the prefill side -------------------------------------------------------------

    def stream_kv(self, sink: Callable[[KVStreamMessage], None]) -> bool:
        """From now on the KV of requests to hand off streams to `sink` as their prefill runs: a
        `KVStreamStart` as a request's first chunk is launched, then at each of its chunks' steps
        the target layers' blocks the chunk completed (`KVLayers`) as the forward passes each layer;
        its `KVExport` (in `handoffs`, `streamed`) then carries only its drafting model's layers. False where the runner cannot stream (tensor
        parallelism): exports stay whole."""
        if not self.runner.stream_kv(sink):
            return False
        self._kv_sink = sink
        return True

    def _stream_chunks(self, batch: ScheduledBatch) -> None:
        """The step's copies of the KV its prefill chunks of requests to hand off write (a request's
        first chunk announces its transfer first)."""
        streamer = self.runner.kv_stream
        if streamer is None or self._kv_sink is None:
            return
        copies = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            if not seq.handoff or start >= seq.num_tokens:
                continue
            if seq.request_id not in streamer.requests:
                streamer.open(seq.request_id, seq.num_tokens)
                self._kv_sink(self._stream_start(seq))
            copies.append(streamer.chunk(seq.request_id, seq.block_table, start, start + num_new))
        streamer.start_step(copies)

    def _stream_start(self, seq: Sequence) -> KVStreamStart:
        dtype = self.runner.kv_caches[0][0].dtype
        return KVStreamStart(
            seq.request_id, seq.num_tokens, dtype, self.runner.kv_layer_shapes(seq.num_tokens)
        )

    def _export(self, seq: Sequence) -> KVExport:
        """Copies out the KV of a request whose prefill finished here: the target's layers and
        those of its drafting model (the MTP head or the draft model), which caught up on the prompt."""
        num_blocks = -(-seq.num_computed_tokens // self.config.block_size)
        block_ids = seq.block_table[:num_blocks]
        streamer = self.runner.kv_stream
        if streamer is not None and seq.request_id in streamer.requests:  # the target's layers went ahead
            layers = self.runner.export_blocks(block_ids, EXPORTED_CACHES[1:])
            return KVExport(
                seq.request_id, seq.num_computed_tokens, seq.token_ids[-1], layers, {}, streamed=True
            )
        if self.allocate_export is None:
            layers = self.runner.export_blocks(block_ids)
            return KVExport(seq.request_id, seq.num_computed_tokens, seq.token_ids[-1], layers, {})
        buffer, caches = self.runner.gather_blocks(block_ids, self.allocate_export)
        layers = [
            (cache, i, kv[0], kv[1]) for cache, stacked in caches.items() for i, kv in enumerate(stacked)
        ]
        return KVExport(
            seq.request_id,
            seq.num_computed_tokens,
            seq.token_ids[-1],
            layers,
            {},
            buffer=buffer,
            caches=caches,
        )

    # ---- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Launches a step and lands one (reads its result back and applies it). A decode step whose
        inputs the device holds is launched before the step in flight lands; any other waits for
        it to land and is planned from the host's state."""
        called_s = time.perf_counter()
        outputs: list[RequestOutput] = []
        self._idle_since = None
        if self._in_flight is not None:
            landing = self._in_flight
            self._in_flight = self._launch_ahead(landing, called_s)
            outputs = self._land(landing)
            if self._in_flight is not None or not self.scheduler.running:  # else: the host plans the next
                return outputs
        batch = self.scheduler.schedule()
        if batch.is_empty:
            outputs += self._emit(self._take_unemitted())
            self._free_stopped()
            return outputs
        self._update_slots(batch)
        plan = self.drafter.plan(batch, num_running=len(self.scheduler.running))
        self._stream_chunks(batch)
        flight = InFlight(batch, plan, self.runner.launch(batch, plan), called_s, self._host_gap_s())
        if self._may_run_ahead(flight):
            self._in_flight = flight
            return outputs + self._hand_over(self._emit(self._take_unemitted()))  # while the device runs it
        return outputs + self._land(flight)

    def _land(self, flight: InFlight) -> list[RequestOutput]:
        """Waits for a launched step and applies its result; the last step's outputs are produced
        while the device works, host drafting follows. The step's time runs from the last landing
        (or, after the engine idled, from the call that launched it) to this one: with steps back
        to back, one step's worth of the engine's whole time, a synchronous step's planning and
        launch and a step launched ahead's overlap with the last alike."""
        batch, plan, launched = flight.batch, flight.plan, flight.launched
        assert isinstance(launched, LaunchedStep)  # its tail was launched when the step before landed
        outputs = self._hand_over(self._emit(self._take_unemitted()))  # while the device works
        self.drafter.choose_pending()
        self.drafter.prepare_on_host(launched.running)
        step = launched.result()
        if self.runner.kv_stream is not None:
            self.runner.kv_stream.finish_step()  # every layer the step streams is handed over
        # where the device runs asynchronously (not on the CPU, where `launch` computes the step)
        asynchronous = launched.done is not None and self._may_run_ahead(flight)
        self._idle_since = time.perf_counter() if asynchronous else None
        ended = all(seq.is_finished for seq in batch.seqs)  # a step ahead of requests that all ended
        handed_off = self._apply(batch, plan, step)
        self._launch_tail()
        outputs += self._emit(handed_off)  # with their KV, not a step later
        self._free_stopped()
        self.drafter.propose_on_host(plan)
        self.drafter.cut_refused_drafts(plan.seqs)
        num_emitted = sum(e.num_new for e in self._unemitted + handed_off)
        landed_s = time.perf_counter()
        seconds = landed_s - max(flight.called_s, self._landed_s)
        self._landed_s = landed_s
        self.step_counts.add(seconds, flight.host_gap_s, flight.ahead)
        mixed = not step.is_decode  # prefill chunks: another cost regime
        if not ended:
            self.drafter.record_step(
                plan, len(batch.seqs), step.num_tokens, num_emitted, seconds, mixed, flight.host_gap_s
            )
        return outputs

    def _host_gap_s(self) -> float | None:
        """The device's idle time before a step launched now, since the landing in this call of a
        step it could have been launched ahead of, less the host drafting in between (which the
        drafting cost prices); None without such a landing."""
        if self._idle_since is None:
            return None
        return max(0.0, time.perf_counter() - self._idle_since - self.drafter.host_drafting_s)

    def _hand_over(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` to `on_outputs` now, if set (then `step()` does not return them), else kept."""
        if self.on_outputs is None or not outputs:
            return outputs
        self.on_outputs(outputs)
        return []

    def _launch_tail(self) -> None:
        """Launches the tail of the step in flight where it waits for its grammar masks: the step
        before it has just landed, so each grammar has moved past that step's tokens."""
        flight = self._in_flight
        if flight is not None and isinstance(flight.launched, PendingTail):
            flight.launched = self.runner.launch_tail(flight.launched)

    def _may_run_ahead(self, flight: InFlight) -> bool:
        """Whether the next step may be launched before `flight` lands."""
        launched = flight.launched
        assert isinstance(launched, LaunchedStep)
        return self.config.async_scheduling and self.runner.can_run_ahead and launched.device_only

    def _launch_ahead(self, previous: InFlight, called_s: float) -> InFlight | None:
        """The next decode step of the running requests, launched before `previous` (a decode step,
        every request in it) lands, from what its tail leaves on the device
        (services/engine/run_ahead.py): each request brings its newest token and a place for each
        draft it asked for. A request `previous` ends is found a step late; its extra step is
        discarded. None where the next step needs the host."""
        self.drafter.choose_pending()  # what `previous` drafts for the next step
        queries = [
            (seq, 1 + k, num_new)
            for seq, k, num_new in zip(
                previous.plan.seqs, previous.plan.num_wanted, previous.batch.num_new_tokens
            )
            if seq.finish_reason is None and seq.status is SequenceStatus.RUNNING
        ]
        if not queries or not all(self._drafts_ahead(seq, n - 1) for seq, n, _ in queries):
            return None
        seqs = [seq for seq, _, _ in queries]
        extra = [num_new + self.drafter.max_lookahead(seq) for seq, _, num_new in queries]
        batch = self.scheduler.schedule_ahead(seqs, [n for _, n, _ in queries], extra, self.max_model_len)
        if batch is None:
            return None
        plan = self.drafter.plan(batch, num_running=len(self.scheduler.running))
        return InFlight(batch, plan, self.runner.launch_ahead(batch, plan), called_s, ahead=True)

    def _drafts_ahead(self, seq: Sequence, num_drafts: int) -> bool:
        """Whether the request's next step, verifying `num_drafts` drafts, may be launched ahead: the
        drafts come from the device, and a grammar request verifies none. A grammar request's drafts
        are cut on the host at the first token its grammar refuses before its step is planned
        (`Drafter.cut_refused_drafts`); a step launched ahead verifies drafts the host has not seen.
        Its masked verify would reject a refused draft at its row all the same (the row's mask
        refuses it), so the tokens would not change, but the forward would compute the rows the
        cut drops, and the drafting controller would count the refusals as rejections."""
        return self.drafter.drafts_on_device(seq, num_drafts) and (seq.grammar is None or num_drafts == 0)

    def _take_unemitted(self) -> list[Emission]:
        unemitted, self._unemitted = self._unemitted, []
        return unemitted

    def _update_slots(self, batch: ScheduledBatch) -> None:
        """Requests the scheduler runs for the first time take an input-batch slot; preempted
        ones give theirs back (their tokens are written again when they return)."""
        for seq in batch.preempted:
            self.inputs.remove(seq.request_id)
        for seq in [seq for seq in batch.seqs if seq.request_id not in self.inputs.slot_of]:
            self.inputs.add(seq)
        self.inputs.flush()

    def _apply(self, batch: ScheduledBatch, plan: StepPlan, step: StepOutput) -> list[Emission]:
        """Takes each request's result (`_take_result`); frees the requests that finished (handing
        off their KV on the prefill side). Their text waits for `_emit`, but for the requests handed
        off, whose emissions are returned: their text goes out with their KV."""
        results = dict(zip((seq.request_id for seq in plan.seqs), step.results))
        if step.prompt is not None:
            record_prompt_logprobs(batch.seqs, *step.prompt)
        handed_off: list[Emission] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            result = results.get(seq.request_id)
            if result is None:  # a prefill chunk that is not the last
                seq.num_computed_tokens += num_new
            elif seq.finish_reason is None:  # else it ended while the step ran (a stop string, a step ahead)
                emission = self._take_result(seq, result)
                (handed_off if seq.handoff else self._unemitted).append(emission)
            self.block_manager.cache_full_blocks(seq)
        for seq in [seq for seq in batch.seqs if seq.finish_reason is not None and not seq.is_finished]:
            if seq.finish_reason is FinishReason.HANDOFF:
                self.handoffs.append(self._export(seq))
            if seq not in self._stopped:
                self._free(seq)
        return handed_off

    def _take_result(self, seq: Sequence, result: SeqResult) -> Emission:
        """Appends the request's kept tokens, rolls its KV back past the first rejected draft (by
        length), takes the post-step update's finish reason and the next drafts."""
        num_drafts = len(seq.spec.draft_token_ids)
        num_computed = seq.num_tokens + result.num_accepted  # every token it had, the accepted drafts
        seq.append_tokens(result.token_ids)
        if seq.grammar is not None:
            self._advance_grammar(seq, result.token_ids)
        seq.finish_reason = result.finish_reason
        if result.logprobs:
            seq.logprobs += [lp for lp in result.logprobs if lp is not None]
        seq.num_computed_tokens = min(num_computed, seq.num_tokens - 1)
        self.drafter.accepted(seq, num_drafts, result.num_accepted)
        self.drafter.take_drafts(seq, result.drafts, result.draft_parents)
        emission = Emission(seq, len(result.token_ids), result.finish_reason, result.stop_token_id)
        if seq.handoff:  # its text now: a stop string must end it here, not after the hand-off
            emission.observe(self.outputs)
            seq.finish_reason = seq.finish_reason or FinishReason.HANDOFF
        return emission

    @staticmethod
    def _advance_grammar(seq: Sequence, token_ids: list[int]) -> None:
        """Moves a structured request's grammar past tokens it kept. Every sampled token passed the
        grammar's mask, so a refusal means a debugging accept policy forced a draft through: the
        request then goes on unconstrained rather than with a grammar state that lies."""
        if seq.grammar is None or seq.grammar.advance(token_ids):
            return
        logger.error("request %s: a kept token left its grammar; it goes on unconstrained", seq.request_id)
        seq.grammar = None

    def _emit(self, emissions: list[Emission]) -> list[RequestOutput]:
        """The outputs of a step's tokens: detokenized, cut at a stop string (a request one ends
        is freed once the step in flight is done); finished requests are then forgotten."""
        outputs = []
        for emission in emissions:
            seq = emission.seq
            running = seq.finish_reason is None
            kept = emission.observe(self.outputs)
            if seq.params.logprobs is not None:
                del seq.logprobs[seq.num_output_tokens :]
            outputs.append(self._output(seq, seq.token_ids[seq.num_tokens - kept :]))
            if running and seq.finish_reason is not None:
                self._stopped.append(seq)
            elif seq.is_finished:
                self._forget(seq)
        return outputs

    def _free_stopped(self) -> None:
        """Frees the requests a stop string ended that no step in flight runs any more."""
        in_flight = {seq.request_id for seq in self._in_flight.batch.seqs} if self._in_flight else set()
        for seq in self._stopped:
            if seq.request_id not in in_flight:
                self._free(seq)
                self._forget(seq)
        self._stopped = [seq for seq in self._stopped if seq.request_id in in_flight]

    def _free(self, seq: Sequence) -> None:
        """Frees a finished request's blocks, slot and drafting state (full blocks stay cached)."""
        assert seq.finish_reason is not None
        self.reserved.pop(seq.request_id, None)
        if self.runner.kv_stream is not None:
            self.runner.kv_stream.forget(seq.request_id)
        self.inputs.remove(seq.request_id)
        self.scheduler.finish(seq, seq.finish_reason)
        self.drafter.finish(seq)

    def _forget(self, seq: Sequence) -> None:
        """Drops a finished request whose last output was produced."""
        self.outputs.release(seq.request_id)
        del self.sequences[seq.request_id]

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
            num_output_tokens=seq.num_output_tokens,
            text=self.outputs.text(seq.request_id),
            new_token_ids=new_token_ids,
            new_text=self.outputs.take_delta(seq),
            finished=finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            all_token_ids=seq.token_ids,
            all_logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
            metrics=metrics,
            spec_stats=seq.spec.stats() if finished else {},
        )

    # ---- validation -------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompt or prompt_token_ids")
        token_ids = self.tokenizer.encode(prompt) if prompt is not None else list(prompt_token_ids or [])
        if not token_ids:
            raise RequestError("the prompt is empty")
        return token_ids

    def _validate(self, token_ids: list[int], params: SamplingParams, num_resumed: int = 0) -> None:
        vocab_size = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias))):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise RequestError(f"{name}: token ids out of range [0, {vocab_size}): {bad[:5]}")
        if params.structured is not None:
            try:
                params.structured.check()
            except StructuredOutputError as exc:
                raise RequestError(str(exc)) from None
        if num_resumed >= params.max_tokens:
            raise RequestError(f"{num_resumed} tokens already delivered, max_tokens is {params.max_tokens}")
        total = len(token_ids) - num_resumed + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"needs {total} ({len(token_ids) - num_resumed} in the prompt, {params.max_tokens} to generate); "
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
