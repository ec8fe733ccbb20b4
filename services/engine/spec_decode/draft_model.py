"""`draft_model` drafting: a smaller model with the target's tokenizer and its own KV cache.

The draft model's cache shares the target's block tables (same block ids, its own tensors), so it
needs no allocator of its own. Each proposal first feeds the draft model every token it has not
seen (the accepted drafts and the new token of the last step, or the whole prompt the first time)
in one batched forward, then chains single-token forwards for the remaining drafts. Its cache
entries past the last real token are speculative and are overwritten by the next catch-up.
"""

from __future__ import annotations

import torch

from services.engine.sequence import Sequence
from services.engine.spec_decode.draft_sampling import choose_drafts, stack_draft_probs
from services.engine.spec_decode.proposer import Drafts, ModelDrafterContext


class DraftModelProposer:
    def __init__(self, ctx: ModelDrafterContext):
        assert ctx.runner.draft_model is not None
        self.ctx = ctx
        self.model = ctx.runner.draft_model
        self.kv_caches = ctx.runner.draft_kv_caches

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Drafts]:
        ks = self.ctx.reserve_lookahead(seqs, ks, lookahead=ks)
        live = [i for i, k in enumerate(ks) if k > 0]
        drafts = [Drafts() for _ in seqs]
        if not live:
            return drafts
        live_seqs = [seqs[i] for i in live]
        starts = [seq.spec.draft_num_computed for seq in live_seqs]
        lens = [seq.num_tokens - start for seq, start in zip(live_seqs, starts)]
        token_ids = [t for seq, start in zip(live_seqs, starts) for t in seq.token_ids[start:]]
        logits = self._forward(live_seqs, token_ids, starts, lens, last_rows=True)
        for seq in live_seqs:
            seq.spec.draft_num_computed = seq.num_tokens
        self._extend(live_seqs, [drafts[i] for i in live], [ks[i] for i in live], logits)
        return drafts

    def _extend(
        self, seqs: list[Sequence], drafts: list[Drafts], ks: list[int], logits: torch.Tensor
    ) -> None:
        """Appends one draft per step to every sequence still short of its k, feeding it back in."""
        rows: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while True:
            ids, probs = choose_drafts(
                logits, [seqs[i] for i in active], [len(drafts[i].token_ids) for i in active]
            )
            for i, token, prob in zip(active, ids, probs):
                drafts[i].token_ids.append(token)
                rows[i].append(prob)
            active = [i for i in active if len(drafts[i].token_ids) < ks[i]]
            if not active:
                break
            last = {i: drafts[i].token_ids[-1] for i in active}
            feed_seqs = [seqs[i] for i in active]
            starts = [seq.num_tokens - 1 + len(drafts[i].token_ids) for seq, i in zip(feed_seqs, active)]
            logits = self._forward(
                feed_seqs, [last[i] for i in active], starts, [1] * len(active), last_rows=False
            )
        vocab_size = self.model.config.vocab_size
        for draft, row in zip(drafts, rows):
            draft.probs = stack_draft_probs(row, draft.token_ids, vocab_size)

    def _forward(
        self, seqs: list[Sequence], token_ids: list[int], starts: list[int], lens: list[int], last_rows: bool
    ) -> torch.Tensor:
        positions, meta = self.ctx.runner.metadata(seqs, starts, lens)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=positions.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if last_rows:
            hidden = hidden[meta.query_start_loc[1:].long() - 1]
        return self.model.compute_logits(hidden)
