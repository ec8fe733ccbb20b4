"""Routes each request to its draft method and keeps every proposer in step with the requests.

Requests in one batch may use different methods (a request can override the server's method and
k); each method proposes for its own requests, and the adaptive controller decides each request's
k first. Requests at k = 0 skip their proposer, and each method's drafting is timed apart: the
controller weighs drafting's own cost against what the drafts save.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence
from services.engine.spec_decode.adaptive import AdaptiveSpeculation
from services.engine.spec_decode.draft_model import DraftModelProposer
from services.engine.spec_decode.mtp import MTPProposer, VerifiedSpan
from services.engine.spec_decode.ngram import NgramProposer
from services.engine.spec_decode.proposer import Drafts, ModelDrafterContext
from services.engine.spec_decode.suffix import (
    BackgroundGlobalIndex,
    GlobalIndex,
    SuffixConfig,
    SuffixProposer,
)
from shared.sampling_params import SamplingParams
from shared.speculative_config import MODEL_BASED_METHODS, SpeculativeConfig

if TYPE_CHECKING:
    from services.engine.model_runner import ModelRunner


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
        self.ngram = NgramProposer(
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            device=getattr(runner, "device", None),
            history=getattr(runner, "token_history", None),
        )
        suffix_config = SuffixConfig.from_speculative_config(config)
        if suffix_index is None and _indexes_in_background(config, runner):
            suffix_index = BackgroundGlobalIndex(suffix_config.global_index())
        self.suffix = SuffixProposer(suffix_config, global_index=suffix_index)
        ctx = ModelDrafterContext(runner, block_manager)
        self.mtp = MTPProposer(ctx, config.mtp_steps) if runner.mtp_head is not None else None
        self.draft_model = DraftModelProposer(ctx) if runner.draft_model is not None else None
        # a draft model runs one forward per draft, the MTP head up to its steps (with_ngram fills
        # the rest of k without forwards)
        max_forwards = {"draft_model": config.k, "mtp": config.mtp_steps}
        self.adaptive = AdaptiveSpeculation(config.adaptive, config.adaptive_min_acceptance, max_forwards)
        self.device: torch.device | None = getattr(runner, "device", None)
        self.runner = runner
        self.drafting_s = 0.0
        """Seconds the last `propose` spent in the proposers (the controller's own choice excluded)."""

    # ---- request lifecycle ------------------------------------------------------------------------

    def configure(self, seq: Sequence) -> None:
        """Resolves the request's method and k from the server config and its override."""
        method, max_k = self.resolve(seq.params)
        seq.spec.method, seq.spec.max_k, seq.spec.k = method, max_k, max_k
        if method == "suffix":
            self.suffix.start_request(seq.request_id, seq.prompt_token_ids)

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

    def accepted(self, seq: Sequence, token_ids: list[int], num_drafts: int, num_accepted: int) -> None:
        """Books a verify step: statistics, acceptance estimate, suffix tree."""
        seq.spec.record(num_drafts, num_accepted)
        self.adaptive.observe(seq, num_drafts, num_accepted)
        if seq.spec.method == "suffix" and token_ids:
            self.suffix.add_tokens(seq.request_id, token_ids)

    def finish(self, seq: Sequence) -> None:
        if seq.spec.method == "ngram":
            self.ngram.forget(seq.request_id)
        if seq.spec.method == "suffix":
            self.suffix.stop_request(seq.request_id)
        if self.mtp is not None:
            self.mtp.forget(seq.request_id)
        self.adaptive.forget(seq.request_id)

    # ---- each step --------------------------------------------------------------------------------

    def catch_up(self, spans: list[VerifiedSpan], target_hidden: torch.Tensor) -> None:
        """Model-based drafters that read the target's hidden states consume this step's."""
        if self.mtp is not None:
            self.mtp.catch_up([s for s in spans if s.seq.spec.method == "mtp"], target_hidden)

    def propose(self, seqs: list[Sequence], num_other_tokens: int) -> None:
        """Sets `seq.spec.draft_token_ids` (and draft probs) for the next step of each sequence."""
        self.drafting_s = 0.0
        seqs = [seq for seq in seqs if seq.spec.method != "naive"]
        if not seqs:
            return
        ks = self.adaptive.choose(seqs, num_other_tokens)
        # a step emits at most k + 1 tokens: never draft past the request's max_tokens
        ks = [min(k, seq.params.max_tokens - seq.num_output_tokens - 1) for seq, k in zip(seqs, ks)]
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None:  # past the largest CUDA graph a step runs eagerly, several times slower
            ks = fit_draft_budget(
                ks, [seq.spec.acceptance for seq in seqs], graphs.max_tokens - num_other_tokens
            )
        for seq in seqs:
            seq.spec.k, seq.spec.draft_token_ids, seq.spec.draft_probs = 0, [], None
        drafting = [(seq, k) for seq, k in zip(seqs, ks) if k > 0]
        for method in dict.fromkeys(seq.spec.method for seq, _ in drafting):
            group = [(seq, k) for seq, k in drafting if seq.spec.method == method]
            context_tokens = self._context_tokens(method, [seq for seq, _ in group])
            started = self._now(method)
            drafts = self._propose(method, [s for s, _ in group], [k for _, k in group])
            seconds = time.perf_counter() - started
            self.drafting_s += seconds
            self.adaptive.record_drafting(method, [k for _, k in group], context_tokens, seconds)
            for (seq, _), draft in zip(group, drafts):
                seq.spec.k = len(draft.token_ids)
                seq.spec.draft_token_ids = draft.token_ids
                seq.spec.draft_probs = draft.probs

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """Books an engine step's time: its drafting went to each method's drafting cost in
        `propose`; the rest (target forward, verification, host work) is the step cost."""
        self.adaptive.record_step(num_tokens, seconds - self.drafting_s)

    @staticmethod
    def _context_tokens(method: str, seqs: list[Sequence]) -> int:
        """Tokens the proposer reads before drafting: a draft model first catches up on every token
        since its last draft (the whole prompt at the first); the others read nothing new."""
        if method != "draft_model":
            return 0
        return sum(seq.num_tokens - seq.spec.draft_num_computed for seq in seqs)

    def _now(self, method: str) -> float:
        """The time, once the device is idle: a drafting model's timing must not include kernels
        still in flight from the target step or the MTP catch-up."""
        if method in MODEL_BASED_METHODS and self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _propose(self, method: str, seqs: list[Sequence], ks: list[int]) -> list[Drafts]:
        if method == "ngram":
            batch = [(seq.request_id, seq.token_ids, k) for seq, k in zip(seqs, ks)]
            return [Drafts(ids) for ids in self.ngram.propose_batch(batch)]
        if method == "suffix":
            batch = [(seq.request_id, seq.token_ids, k) for seq, k in zip(seqs, ks)]
            return [Drafts(ids) for ids in self.suffix.propose_batch(batch)]
        if method == "draft_model":
            assert self.draft_model is not None
            return self.draft_model.propose(seqs, ks)
        assert self.mtp is not None
        drafts = self.mtp.propose(seqs, ks)
        if self.config.mtp_strategy == "with_ngram":
            self._append_ngram(seqs, ks, drafts)
        return drafts

    def _append_ngram(self, seqs: list[Sequence], ks: list[int], drafts: list[Drafts]) -> None:
        """Fills the slots the MTP chain leaves free with n-gram drafts continuing after the MTP ones."""
        for seq, k, draft in zip(seqs, ks, drafts):
            extra = self.ngram.propose(seq.token_ids + draft.token_ids, k - len(draft.token_ids))
            if not extra:
                continue
            if draft.probs is not None:
                one_hot = torch.zeros(len(extra), draft.probs.shape[1], device=draft.probs.device)
                one_hot[torch.arange(len(extra)), torch.tensor(extra)] = 1.0
                draft.probs = torch.cat([draft.probs, one_hot])
            draft.token_ids = draft.token_ids + extra


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


def _indexes_in_background(config: SpeculativeConfig, runner: ModelRunner) -> bool:
    """On a GPU, where a decode step takes a millisecond or less, the in-process global suffix tree
    is indexed off the step by a thread."""
    device = getattr(runner, "device", None)
    return config.method == "suffix" and device is not None and device.type == "cuda"
