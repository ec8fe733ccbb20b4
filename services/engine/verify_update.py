"""The step's tail: verify the drafts, update each request, draft its next step — on tensors only.

`verify_and_update` is the one implementation of what follows the target's forward. A CUDA-graph
step captures it once per shape and replays it; every other step (prefill chunks, batches past the
largest graph, CPU) calls it eagerly, so both paths keep the same tokens and stop alike:

1. verify + sample (`kernels.verify_sample`): per request, its accepted drafts and then the
   recovered or bonus token;
2. the post-step update (`kernels.post_step_update_slots`): those tokens are appended to the request's
   token row up to the first one that ends it (EOS, a stop id, max_tokens once min_tokens is
   reached), so no token past a stop is kept;
3. drafting: each device proposer drafts the next step of its own requests that are still running,
   after the tokens just kept (services/engine/spec_decode/); the drafts are also kept by slot
   (`InputBatch.drafts`, and where the server drafts trees their parents, `draft_parents`), where a
   step launched before this one's read-back finds them;
4. one packed int32 tensor per request (the `Column`s below), the step's only device-to-host read.

Grammar requests verify here too: their rows are marked in `masked_rows` and the kernel applies the
grammar bitmask the host filled while the forward ran (services/engine/grammar.py, `StepMasks`).
Steps whose verification the fused kernel cannot do (penalties, min_tokens suppression, logprobs)
verify with the torch `RejectionSampler` and run steps 2-4 with `update_and_draft`.

Steps that verify draft trees (`StepTensors.tree_parents`) take the tree rule in step 1 instead
(services/engine/tree_verify.py: each row's target token, the accepted path, the target's KV of the
path compacted), on the device as well, so their tail is captured too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

import kernels
from kernels.post_step_ref import RUNNING
from kernels.run_ahead_ref import SlotState
from services.engine.input_batch import GatheredParams, InputBatch
from services.engine.sequence import Sequence
from services.engine.spec_decode.draft_sampling import DraftSampling
from services.engine.spec_decode.proposer import DraftBatch, Drafts, ForwardContext, Proposer, StepRoots
from services.engine.tree_verify import target_tokens, verify_tree
from shared.model.llama import KVCache

ACCEPTED, KEPT, FINISH, STOP_TOKEN, NUM_DRAFTS, TOKENS = range(6)
"""Columns of the packed result; the kept tokens start at TOKENS, the drafts follow them."""


@dataclass
class StepTensors:
    """A step's inputs on the device beyond the forward's (in a CUDA-graph step, views of static
    buffers): per logit row what the verifier needs, per request that gets a token its slot."""

    forward: ForwardContext
    row_slots: torch.Tensor  # [num_rows] int64 slot of each logit row's request
    row_positions: torch.Tensor  # [num_rows] int64 output position each row samples (its noise key)
    draft_ids: torch.Tensor  # [num_rows] int32 the draft each row checks, -1 on bonus rows
    request_of_row: torch.Tensor  # [num_rows] int32
    cu_num_rows: torch.Tensor  # [num_seqs + 1] int32
    seq_slots: torch.Tensor  # [num_seqs] int64 (padding: the scratch slot)
    seq_rows: torch.Tensor  # [num_seqs] int64 each request's index among the step's sequences
    seq_methods: torch.Tensor  # [num_seqs] int32 index of each request's device proposer, -1: none
    num_wanted: torch.Tensor  # [num_seqs] int32 drafts each request wants next step
    masked_rows: torch.Tensor  # [num_rows] int32 1: the row's request follows a grammar
    max_rows: int
    """The most logit rows of one request (1 + its drafts)."""
    bitmask: torch.Tensor | None = None  # [num_rows, num_words] int32, read on `masked_rows` only
    """The grammar masks of the rows, filled once the forward is launched; None: no row is masked."""
    tree_parents: torch.Tensor | None = None  # [num_seqs, max_rows] int64 (HostStep.tree_parents)
    tree_path: torch.Tensor | None = None  # [num_seqs, max_rows] int64 (TreeVerdict.path)
    """Where the step verifies draft trees: each request's accepted path, once verified."""

    @functools.cached_property
    def roots(self) -> StepRoots:
        """Each request's root row, position and block table (computed once a step, on first use)."""
        return StepRoots(self.forward, self.seq_rows, self.cu_num_rows)

    def complete_ahead(
        self, slots: SlotState, block_size: int, num_filled: torch.Tensor | None = None
    ) -> None:
        """Completes a step launched ahead (services/engine/run_ahead.py) in place, from what the
        last step's tail left in `slots`: its tokens' ids, positions and KV slots, its rows'
        output positions and drafts, its requests' context lengths (`kernels.fill_ahead`: one
        launch). `num_filled`: [1] int32 on the device, how many leading tokens are the step's
        (0: a step the host described whole, left as it is); None: every token. Where the step
        verifies draft trees, their masks and parent arrays too, from the drafts' parents."""
        forward, meta = self.forward, self.forward.meta
        kernels.fill_ahead(
            num_filled,
            forward.token_slots,
            self.request_of_row,
            meta.query_start_loc,
            meta.block_tables,
            slots,
            forward.input_ids,
            forward.positions,
            meta.slot_mapping,
            meta.seq_lens,
            self.row_positions,
            self.draft_ids,
            block_size,
            meta.tree_mask if self.tree_parents is not None else None,
            self.tree_parents,
        )
        if not kernels.cuda_available(forward.positions):
            meta.seq_lens_cpu = meta.seq_lens.tolist()  # the attention's torch twin reads them on the host


@dataclass
class StepPlan:
    """What the host decided for the step's tail: its requests, their next drafts, the chain."""

    seqs: list[Sequence]
    """The requests that get a token this step, in the step's order."""
    num_wanted: list[int]
    """Drafts each wants next step."""
    num_steps: int
    """The longest drafting-model chain any request needs."""
    methods: list[int] = field(default_factory=list)
    """Each request's device proposer (its index in the tail's list), -1 for none."""
    only: int | None = None
    """The one device proposer the tail runs (every request of the step uses it or none), or
    None: each of them."""


class VerifyAndUpdate:
    def __init__(
        self,
        inputs: InputBatch,
        proposers: list[Proposer],
        strategy: int,
        policy: int,
        max_num_drafts: int,
        target_caches: list[KVCache] | None = None,
        block_size: int = 1,
        trees: bool = False,
    ):
        """`proposers`: the device proposers, indexed by `StepTensors.seq_methods`; `target_caches`:
        the target's KV caches (paged in `block_size` blocks), where steps verify draft trees;
        `trees`: the server drafts trees, whose drafts' parents are kept by slot and packed after
        the drafts."""
        self.inputs = inputs
        self.proposers = proposers
        self.strategy = strategy
        self.policy = policy
        self.max_num_drafts = max_num_drafts
        self.target_caches = target_caches or []
        self.block_size = block_size
        self.trees = trees
        width, device = self.draft_width, inputs.device
        # on the device once: a CUDA graph's capture cannot copy from the host
        self._no_drafts = torch.full((width,), -1, dtype=torch.int32, device=device)
        """A request's drafts where no proposer drafts for it."""
        self._chain_parents = torch.arange(width, dtype=torch.int32, device=device)
        """A chain's parents: draft j hangs from node j."""

    @property
    def draft_width(self) -> int:
        """Columns of the drafts in the packed result (their parents follow them where `trees`)."""
        return max(self.max_num_drafts, 1)

    def width(self, max_rows: int) -> int:
        """Columns of the packed result of a step whose requests bring at most `max_rows` rows."""
        return TOKENS + max_rows + self.draft_width * (2 if self.trees else 1)

    def max_rows(self, width: int) -> int:
        """The `max_rows` of a packed result `width` columns wide (`width`'s inverse)."""
        return width - TOKENS - self.draft_width * (2 if self.trees else 1)

    def __call__(self, logits: torch.Tensor, t: StepTensors, plan: StepPlan) -> torch.Tensor:
        """[num_seqs, width(max_rows)] int32; `logits` [num_rows, vocab_size] float32."""
        if t.tree_parents is None:
            token_ids, num_accepted = self.verify(logits, t)
        else:
            token_ids, num_accepted = self.verify_trees(logits, t)
            self.compact_trees(t, num_accepted)
        return self.update_and_draft(token_ids, num_accepted, t, plan)

    def verify(self, logits: torch.Tensor, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """(token_ids [num_seqs, max_rows] int32, -1 padded; num_accepted [num_seqs] int32)."""
        params = self.inputs.gather(t.row_slots)
        token_ids, num_accepted, *_ = kernels.verify_sample(
            logits,
            params.temperature,
            params.top_k,
            params.top_p,
            params.min_p,
            params.seeds,
            t.row_positions,
            t.draft_ids,
            t.cu_num_rows,
            self.strategy,
            self.policy,
            max_rows=t.max_rows,
            request_of_row=t.request_of_row,
            bitmask=t.bitmask,
            masked_rows=None if t.bitmask is None else t.masked_rows,
        )
        return token_ids, num_accepted

    def verify_trees(self, logits: torch.Tensor, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree rule over every request (a chain is a tree of one branch): (token_ids [num_seqs,
        max_rows] int32, -1 padded; num_accepted [num_seqs] int32); each request's accepted path
        goes to `t.tree_path`."""
        assert t.tree_parents is not None
        params = self.inputs.gather(t.row_slots)
        masked_rows = None if t.bitmask is None else t.masked_rows
        targets = target_tokens(logits, params, t.row_positions, t.bitmask, masked_rows)
        verdict = verify_tree(targets, t.draft_ids, t.cu_num_rows, t.tree_parents)
        t.tree_path = verdict.path
        return verdict.token_ids, verdict.num_accepted

    def compact_trees(self, t: StepTensors, num_accepted: torch.Tensor) -> None:
        """Moves the target KV of each request's accepted path (`t.tree_path`, the first
        `num_accepted` depths) into the positions after its root, as a chain would have left it."""
        assert t.tree_path is not None
        roots = t.roots
        kernels.compact_path_kv(
            self.target_caches, t.tree_path, num_accepted, roots.positions, roots.tables, self.block_size
        )

    def update_and_draft(
        self, token_ids: torch.Tensor, num_accepted: torch.Tensor, t: StepTensors, plan: StepPlan
    ) -> torch.Tensor:
        """Post-step update and drafting after any verifier; the packed result."""
        params = self.inputs.gather(t.seq_slots)
        num_kept, finish, stop_token, num_output = self.update(token_ids, num_accepted, t.seq_slots)
        drafts = self.draft(t, plan, finish, params, num_output, num_accepted)
        self.inputs.drafts[t.seq_slots] = drafts.token_ids.int()
        self.inputs.num_drafts[t.seq_slots] = drafts.num_drafts.int()
        columns = [num_accepted, num_kept, finish, stop_token, drafts.num_drafts]
        packed = [torch.stack(columns, dim=1), token_ids, drafts.token_ids]
        if self.trees:
            assert drafts.parents is not None
            self.inputs.draft_parents[t.seq_slots] = drafts.parents
            packed.append(drafts.parents)
        return torch.cat(packed, dim=1)

    def update(
        self, token_ids: torch.Tensor, num_accepted: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Appends each request's emitted tokens to its row, up to the one that ends it; (num_kept,
        finish, stop_token, num_output after the update) per request. One kernel reads each
        request's lengths and stop settings at its slot and writes the lengths back there."""
        inputs = self.inputs
        return kernels.post_step_update_slots(
            inputs.token_rows,
            slots,
            inputs.num_tokens,
            inputs.num_output,
            token_ids,
            num_accepted,
            inputs.max_tokens,
            inputs.min_tokens,
            inputs.ignore_eos,
            inputs.eos_ids,
            inputs.stop_ids,
        )

    def draft(
        self,
        t: StepTensors,
        plan: StepPlan,
        finish: torch.Tensor,
        params: GatheredParams,
        num_output: torch.Tensor,
        num_accepted: torch.Tensor,
    ) -> Drafts:
        """Each device proposer drafts for its running requests (after the update: `num_output`
        each one's output tokens now); [num_seqs, max_num_drafts]."""
        inputs, slots = self.inputs, t.seq_slots
        room = (params.max_tokens - num_output - 1).clamp(min=0)
        sampling = DraftSampling.of(params, num_output)
        wanted = torch.where(finish == RUNNING, torch.minimum(t.num_wanted, room), 0)
        num_seqs = len(slots)
        token_ids = self._no_drafts.expand(num_seqs, -1)
        num_drafts: torch.Tensor | None = None
        parents = self._chain_parents.expand(num_seqs, -1) if self.trees else None
        chosen = range(len(self.proposers)) if plan.only is None else [plan.only]
        for index in chosen:
            proposer = self.proposers[index]
            mine = t.seq_methods == index
            batch = DraftBatch(
                inputs=inputs,
                seqs=plan.seqs,
                seq_slots=slots,
                seq_rows=t.seq_rows,
                num_wanted=torch.where(mine, wanted, 0),
                num_wanted_cpu=plan.num_wanted,
                num_steps=plan.num_steps,
                forward=t.forward,
                sampling=sampling,
                num_accepted=num_accepted,
                cu_num_rows=t.cu_num_rows,
                tree_path=t.tree_path,
                roots=t.roots,
            )
            drafts = proposer.propose(batch)
            token_ids = _merged(mine, drafts.token_ids, token_ids, self._no_drafts)
            if num_drafts is None:
                num_drafts = torch.where(mine, drafts.num_drafts, 0)
            else:
                num_drafts = torch.where(mine, drafts.num_drafts, num_drafts)
            if parents is not None and drafts.parents is not None:
                parents = _merged(mine, drafts.parents, parents, self._chain_parents)
        if num_drafts is None:
            num_drafts = torch.zeros_like(wanted)
        return Drafts(token_ids, num_drafts, parents=parents)


def _merged(
    mine: torch.Tensor,  # [num_seqs] bool the requests a proposer drafted for
    found: torch.Tensor,  # [num_seqs, found width] what it drafted (tokens or parents)
    others: torch.Tensor,  # [num_seqs, width] int32 what the other requests keep
    defaults: torch.Tensor,  # [width] int32 a request's columns where nothing is drafted
) -> torch.Tensor:  # [num_seqs, width] int32
    """`found` on the rows of `mine` (its columns past `width` cut, those it lacks `defaults`),
    `others` elsewhere."""
    width = defaults.shape[0]
    found = found[:, :width].int()
    if found.shape[1] < width:
        found = torch.cat([found, defaults[found.shape[1] :].expand(found.shape[0], -1)], dim=1)
    return torch.where(mine[:, None], found, others)
