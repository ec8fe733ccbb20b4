"""Routes each request to its draft method and plans how many drafts each request gets.

Requests in one batch may use different methods (a request can override the server's method and
k). Every step, before the forward, `plan` chooses each request's k for its *next* step (the
adaptive controller, from acceptance and measured costs), trims the batch to the largest CUDA
graph and reserves the KV blocks a drafting model's chain writes; the device proposers then draft
in the step's tail, and the host proposers (suffix decoding) after the step's read-back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.engine.block_manager import BlockManager
from services.engine.grammar import cut_refused_drafts
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence
from services.engine.spec_decode.adaptive import AdaptiveSpeculation
from services.engine.spec_decode.draft_model import DraftModelProposer
from services.engine.spec_decode.eagle3 import Eagle3Proposer
from services.engine.spec_decode.mtp import MTPProposer
from services.engine.spec_decode.ngram import NgramProposer
from services.engine.spec_decode.proposer import DraftBatch, Proposer
from services.engine.spec_decode.suffix import (
    DeferredGlobalIndex,
    GlobalIndex,
    SuffixConfig,
    SuffixProposer,
)
from services.engine.spec_decode.tree import DraftTree, node_depths, tree_shape
from services.engine.tree_verify import tree_verifiable
from services.engine.verify_update import StepPlan
from shared.sampling_params import SamplingParams
from shared.speculative_config import MODEL_BASED_METHODS, SpeculativeConfig

if TYPE_CHECKING:
    from services.engine.model_runner import ModelRunner


HEAD_METHODS = ("mtp", "eagle3")
"""Drafting models that are one-layer heads over the target's hidden states."""


class SpeculationError(ValueError):
    """A request's speculative override the server cannot honour."""


class Drafter:
    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        block_manager: BlockManager,
        suffix_index: GlobalIndex | None = None,
    ):
        self.config = config
        self.block_manager = block_manager
        self.proposers = make_proposers(config, runner, suffix_index)
        self.device_methods = [m for m, p in self.proposers.items() if p.on_device]
        """Device proposers in the order the step's tail runs them (`StepTensors.seq_methods`)."""
        self._device_index = {method: i for i, method in enumerate(self.device_methods)}
        self.own = own_proposer(self.device_methods, config.method)
        self.tree = DraftTree(config.tree) if config.tree else None
        """The server's draft tree (its own method's requests draft it), or None: chains."""
        self.num_branch = config.ngram_branch_drafts
        """The most drafts of the tree's n-gram branch (with_ngram), beside its head's nodes."""
        self.chain_steps = {"mtp": config.mtp_steps, "eagle3": config.k, "draft_model": config.k}
        """Per drafting-model method: the most chained forwards (and KV positions) one step writes."""
        tree_tokens: dict[str, list[int]] = {}
        if self.tree is not None:  # a tree's k is its depth; depth k verifies its nodes to there
            tree_tokens[config.method] = [self._tree_drafts(k) for k in range(config.k + 1)]
        host_methods = frozenset(m for m, p in self.proposers.items() if not p.on_device)
        self.adaptive = AdaptiveSpeculation(
            config.adaptive, config.adaptive_min_acceptance, self.chain_steps, tree_tokens, host_methods
        )
        self.max_graph_tokens: int | None = None
        """Tokens of the largest CUDA graph (set once graphs are captured): drafts are trimmed to fit."""
        self.host_drafting_s = 0.0
        self._pending: list[tuple[StepPlan, ScheduledBatch, int]] = []
        """Plans whose ks are chosen after their step's launch (`plan`): (plan, batch, running requests)."""
        self.inputs = runner.inputs

    @property
    def suffix(self) -> SuffixProposer:
        proposer = self.proposers["suffix"]
        assert isinstance(proposer, SuffixProposer)
        return proposer

    @property
    def device_proposers(self) -> list[Proposer]:
        return [self.proposers[m] for m in self.device_methods]

    # ---- request lifecycle ------------------------------------------------------------------------

    def configure(self, seq: Sequence) -> None:
        """Resolves the request's method and k from the server config and its override."""
        method, max_k = self.resolve(seq.params)
        seq.spec.method, seq.spec.max_k, seq.spec.k = method, max_k, max_k
        if method != "naive":
            self.proposers[method].start(seq)

    def resolve(self, params: SamplingParams) -> tuple[str, int]:
        override = params.speculative
        method, k = self.config.method, self.config.k
        if override is None:
            return method, k
        if not self.config.allow_request_override:
            raise SpeculationError("this server does not allow per-request speculative settings")
        if not override.enabled:
            return "naive", 0
        if override.method is not None:
            if override.method in MODEL_BASED_METHODS and override.method != self.config.method:
                raise SpeculationError(
                    f"speculative method {override.method!r} is not loaded on this server (it runs {self.config.method!r}); "
                    "use ngram, suffix or naive"
                )
            method = override.method
        if method == "naive":
            return "naive", 0
        if override.num_speculative_tokens is not None:
            limit = self.config.k if self.config.enabled else 0
            if override.num_speculative_tokens > limit:
                raise SpeculationError(
                    f"num_speculative_tokens {override.num_speculative_tokens} exceeds this server's limit of {limit}"
                )
            k = override.num_speculative_tokens
        if k == 0:
            return "naive", 0
        return method, k

    def accepted(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Books a verify step: statistics and acceptance estimate (a proposer with host state reads
        the request's tokens when it next drafts). A draft the grammar refused before verification
        counts as the rejected one after those verified."""
        seq.spec.record(num_drafts, num_accepted)
        if self._drafts_tree(seq) and num_drafts:  # its acceptance is per depth: the depths it drafted
            num_drafts = max(node_depths(tree_shape(seq)))
        self.adaptive.observe(seq, num_drafts + min(seq.spec.num_refused, 1), num_accepted)
        seq.spec.num_refused = 0

    def take_drafts(self, seq: Sequence, drafts: list[int], parents: list[int]) -> None:
        """Takes a device proposer's drafts for the request's next step: a chain, or where the
        request drafts the server's tree, that tree (its n-gram branch merged in on the device)
        with each draft's parent."""
        if self._drafts_tree(seq) and drafts:
            seq.spec.draft_parents = parents
        seq.spec.draft_token_ids = drafts
        seq.spec.k = len(drafts)

    def finish(self, seq: Sequence) -> None:
        if seq.spec.method != "naive":
            self.proposers[seq.spec.method].forget(seq.request_id)
        self.adaptive.forget(seq.request_id)

    # ---- each step --------------------------------------------------------------------------------

    def plan(self, batch: ScheduledBatch, num_running: int) -> StepPlan:
        """Each sampled request's k for its next step, trimmed to the largest CUDA graph, with the
        KV blocks its drafting model's chain writes reserved (k = 0 where they cannot be).

        Where every request of the step drafts on the host or not at all, nothing the step launches
        reads the ks: they are left to `choose_pending`, which the engine calls once the step is
        launched, so that the controller's solve runs while the device works instead of delaying
        the launch (a new request's first token among what it delayed)."""
        seqs = batch.sampled_seqs
        methods = [self.method_index(seq) for seq in seqs]
        only = self.own if self.own is not None and all(m in (-1, self.own) for m in methods) else None
        plan = StepPlan(seqs, [0] * len(seqs), 0, methods, only)
        if all(m == -1 for m in methods) and not any(self._drafts_tree(seq) for seq in seqs):
            self._pending.append((plan, batch, num_running))
        else:
            plan.num_wanted, plan.num_steps = self._choose(batch, seqs, num_running)
        return plan

    def choose_pending(self) -> None:
        """Chooses the ks `plan` left for after the launch; called before anything reads them (the
        host's drafting after the step, a step launched ahead of it). A request that ended
        meanwhile drafts nothing."""
        pending, self._pending = self._pending, []
        for plan, batch, num_running in pending:
            running = [i for i, seq in enumerate(plan.seqs) if seq.finish_reason is None]
            ks, _ = self._choose(batch, [plan.seqs[i] for i in running], num_running)
            plan.num_wanted = [0] * len(plan.seqs)
            if not any(ks):  # nobody drafts (host drafting paused, or not worth it)
                continue
            for i, k in zip(running, ks):
                plan.num_wanted[i] = k

    def _choose(self, batch: ScheduledBatch, seqs: list[Sequence], num_running: int) -> tuple[list[int], int]:
        """(each of `seqs`' k, the longest drafting-model chain they need): `plan`'s choice."""
        drafting = [i for i, seq in enumerate(seqs) if seq.spec.method != "naive"]
        ks = [0] * len(seqs)
        candidates = [seqs[i] for i in drafting]
        chosen = self.adaptive.choose(
            candidates, num_running, mixed=not batch.is_decode, backlogs=self._backlogs(candidates)
        )
        if not any(chosen):
            return ks, 0
        for i, k in zip(drafting, chosen):
            if k == 0:
                continue
            seq = seqs[i]
            # the step emits at least one token, the next one at least one more
            ks[i] = max(0, min(k, seq.params.max_tokens - seq.num_output_tokens - 2))
            if self._drafts_tree(seq):  # k is the tree's depth; the drafts are its nodes to that depth
                ks[i] = self._tree_drafts(ks[i]) if tree_verifiable(seq) else 0
        if self.max_graph_tokens is not None:  # past the largest CUDA graph a step runs eagerly
            ks = fit_draft_budget(
                ks, [seq.spec.acceptance for seq in seqs], self.max_graph_tokens - num_running
            )
        chained = [i for i, (seq, k) in enumerate(zip(seqs, ks)) if k and seq.spec.method in self.chain_steps]
        if chained:
            num_new = dict(zip((seq.request_id for seq in batch.seqs), batch.num_new_tokens))
            for i in chained:
                ks[i] = self._reserve_chain(seqs[i], ks[i], num_new[seqs[i].request_id])
        chains = [self._chain_length(seqs[i], ks[i]) for i in chained]
        return ks, max(chains, default=0)

    def _backlogs(self, seqs: list[Sequence]) -> list[int]:
        """Per request, the tokens its host proposer would index at its next draft beyond the last
        step's (a prompt `prepare` has not indexed yet); 0 for device methods."""
        host = self.adaptive.host_methods
        return [
            self.proposers[s.spec.method].backlog(s.request_id) if s.spec.method in host else 0 for s in seqs
        ]

    def method_index(self, seq: Sequence) -> int:
        """The request's device proposer in the tail's order; -1 for host-drafted or naive requests."""
        return self._device_index.get(seq.spec.method, -1)

    def drafts_on_device(self, seq: Sequence, num_wanted: int) -> bool:
        """Whether the request's `num_wanted` drafts for its next step need nothing of the host:
        none are wanted (naive requests; host-drafted ones the controller left at k = 0, which
        then cost what naive requests cost) or a device proposer makes them in the step's tail (a
        chain, or a tree whose parents stay on the device beside it). Its next step can then be
        launched ahead."""
        return num_wanted == 0 or seq.spec.method in self._device_index

    def max_lookahead(self, seq: Sequence) -> int:
        """The most KV positions past a step's newest token the request's drafting-model chain
        writes (0 without one); a head drafting the server's tree writes each node above its
        last depth one position past the newest token (`_reserve_chain`)."""
        if self._drafts_tree(seq):
            assert self.tree is not None
            return max(seq.spec.max_k, self.tree.num_nodes(self.tree.depth - 1) - 1)
        return seq.spec.max_k if seq.spec.method in self.chain_steps else 0

    def prepare_on_host(self, device_busy: Callable[[], bool]) -> None:
        """Host proposers' work that needs no result of the step in flight, while `device_busy()`."""
        for proposer in self.proposers.values():
            if not proposer.on_device:
                proposer.prepare(device_busy)

    def propose_on_host(self, plan: StepPlan) -> None:
        """Drafts of the host proposers' requests that are still running (after the step's tokens).
        Nothing per request where none drafts (host drafting paused, or every k = 0): their drafts
        are the step's device drafts, none for a host-drafted request (`LLMEngine._take_result`)."""
        started = time.perf_counter()
        self.host_drafting_s = 0.0
        if not any(plan.num_wanted):
            return
        for method, proposer in self.proposers.items():
            if proposer.on_device:
                continue
            group = []
            for seq, k in zip(plan.seqs, plan.num_wanted):
                if seq.spec.method != method or seq.finish_reason is not None:
                    continue
                if k == 0:  # not drafting: neither asked nor counted in the drafting cost
                    seq.spec.draft_token_ids, seq.spec.k = [], 0
                else:
                    group.append((seq, k))
            if not group:
                continue
            seqs, ks = [seq for seq, _ in group], [k for _, k in group]
            batch = DraftBatch.on_host(self.inputs, seqs, ks)
            drafted = time.perf_counter()
            drafts = proposer.propose(batch)
            seconds = time.perf_counter() - drafted
            self.adaptive.record_drafting(method, ks, drafts.num_context_tokens, seconds)
            counts = drafts.num_drafts.tolist()
            for seq, row, n in zip(seqs, drafts.token_ids.tolist(), counts):
                seq.spec.draft_token_ids = row[:n]
                seq.spec.k = n
        self.host_drafting_s = time.perf_counter() - started

    def cut_refused_drafts(self, seqs: list[Sequence]) -> None:
        """Cuts structured requests' drafts at the first one their grammar refuses, so that the step
        verifies only drafts the grammar allows (a refused one would be rejected at its row)."""
        structured = [seq for seq in seqs if seq.grammar is not None]
        if not structured:  # nothing to walk (nor the grammar library to load)
            return
        for seq, num_cut in zip(structured, cut_refused_drafts(structured)):
            seq.spec.num_refused = num_cut
            seq.spec.k = len(seq.spec.draft_token_ids)

    def record_step(
        self,
        plan: StepPlan,
        num_requests: int,
        num_tokens: int,
        num_emitted: int,
        seconds: float,
        mixed: bool,
        host_gap_s: float | None,
    ) -> None:
        """Books an engine step's time (from the last landing to its own, the engine's `_land`) less
        its host drafting and its host gap: its requests, the target forward's tokens, the tokens it
        emitted and the drafting models' chain (`plan`'s), which runs inside the step; `mixed`: it
        carried prefill chunks; `host_gap_s`: how long the device idled for the host before its
        launch where it could have been launched ahead (None: it was, or could not be), booked
        apart as the overlap a step waiting for the host loses. A decode step of requests that all
        draft on the host (or not at all) also goes to the audit of host drafting: whole where it
        verified drafts, less its drafting for the next step where it verified none. (`plan` is the
        step's own: with steps launched ahead, the last one planned is the next step's.)"""
        own_s = seconds - self.host_drafting_s - (host_gap_s or 0.0)
        self.adaptive.record_step(num_requests, num_tokens, num_emitted, plan.num_steps, own_s, mixed)
        if host_gap_s is not None and not mixed:  # a step with prefill chunks plans more than decoding
            self.adaptive.record_host_gap(num_requests, host_gap_s)
        host_only = all(m == -1 for m in plan.methods)
        if not mixed and host_only:
            drafted = num_tokens > num_requests
            audited_s = seconds if drafted else seconds - self.host_drafting_s
            self.adaptive.record_realized(num_requests, num_emitted, drafted, audited_s)

    def _chain_length(self, seq: Sequence, k: int) -> int:
        """The chained forwards a request's k drafts take: k, or the depth of the head's tree
        (k drafts less the n-gram branch's; at least depth 1, which also drafts the branch)."""
        if k == 0 or not self._drafts_tree(seq):
            return k
        assert self.tree is not None
        return self.tree.depths[min(max(k - self.num_branch, 1), self.tree.num_nodes() - 1)]

    def _tree_drafts(self, depth: int) -> int:
        """The drafts of the server's tree cut at `depth`: the head's nodes to there and the n-gram
        branch's (none at depth 0)."""
        assert self.tree is not None
        return self.tree.num_nodes(depth) - 1 + self.num_branch if depth else 0

    def _drafts_tree(self, seq: Sequence) -> bool:
        return self.tree is not None and seq.spec.method == self.config.method

    def _reserve_chain(self, seq: Sequence, k: int, num_new: int) -> int:
        """k, or 0 when the blocks the request's drafting-model chain writes cannot be had."""
        steps = self.chain_steps.get(seq.spec.method)
        if k == 0 or steps is None:
            return k
        # a head's chain writes KV from the newest token on; the draft model's from the one after;
        # a head drafting a tree writes each node above the last depth one position past the newest
        lookahead = min(k, steps) - 1 if seq.spec.method in HEAD_METHODS else k
        if self._drafts_tree(seq):
            assert self.tree is not None
            lookahead = self.tree.num_nodes(self.tree.depth - 1) - 1
        if lookahead <= 0:
            return k
        if not self.block_manager.can_append(seq, num_new + lookahead):
            return 0
        self.block_manager.append_slots(seq, num_new + lookahead)
        return k


def make_proposers(
    config: SpeculativeConfig, runner: ModelRunner, suffix_index: GlobalIndex | None
) -> dict[str, Proposer]:
    """Every method a request on this server may use: n-gram and suffix always, the server's
    drafting model when it loads one."""
    proposers = make_device_proposers(config, runner)
    suffix_config = SuffixConfig.from_speculative_config(config)
    if suffix_index is None and runner.device.type == "cuda":
        # where the device runs the step while the host waits, the in-process global tree takes in
        # finished outputs then (prepare_on_host), not on the step's critical path
        suffix_index = DeferredGlobalIndex(suffix_config.global_index())
    proposers["suffix"] = SuffixProposer(suffix_config, global_index=suffix_index)
    return proposers


def make_device_proposers(config: SpeculativeConfig, runner: ModelRunner) -> dict[str, Proposer]:
    """The proposers that draft in the step's tail, in the tail's order (every tensor-parallel
    rank builds the same ones, in the same order)."""
    proposers: dict[str, Proposer] = {
        "ngram": NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.k),
    }
    block_size = runner.block_size
    tree = DraftTree(config.tree) if config.tree else None
    with_ngram = config.mtp_strategy == "with_ngram" or config.with_ngram
    ngram = (config.prompt_lookup_min, config.prompt_lookup_max) if with_ngram else None
    num_branch = config.ngram_branch_drafts
    if runner.mtp_head is not None:
        proposers["mtp"] = MTPProposer(
            runner.mtp_head, runner.mtp_kv_caches[0], config.mtp_steps, block_size, ngram, tree, num_branch
        )
    if runner.eagle3_head is not None:
        proposers["eagle3"] = Eagle3Proposer(
            runner.eagle3_head, runner.eagle3_kv_caches[0], config.k, block_size, tree, ngram, num_branch
        )
    if runner.draft_model is not None:
        proposers["draft_model"] = DraftModelProposer(runner.draft_model, runner.draft_kv_caches, block_size)
    return proposers


def own_proposer(device_methods: list[str], method: str) -> int | None:
    """The server's own device proposer, where the tail carries others too (n-gram for requests
    that ask for it): steps whose requests all use the server's method run it alone, from CUDA
    graphs of their own. None where there is nothing to leave out."""
    if method not in device_methods or len(device_methods) == 1:
        return None
    return device_methods.index(method)


def fit_draft_budget(ks: list[int], acceptance: list[float], budget: int) -> list[int]:
    """The most valuable `budget` drafts of those chosen: draft j of a request is worth a^j (the
    chance it and those before it are accepted), so the best drafts are prefixes of each request's
    chain; ties keep the earlier request."""
    if sum(ks) <= budget:
        return ks
    worth = sorted(
        ((acceptance[i] ** j, -i, i) for i, k in enumerate(ks) for j in range(1, k + 1)), reverse=True
    )
    kept = [0] * len(ks)
    for _, _, i in worth[: max(budget, 0)]:
        kept[i] += 1
    return kept
