"""`mtp` drafting with a DeepSeek-V3-style multi-token-prediction head (see shared/model/mtp.py).

After every target step the head *catches up*: for each position i the target just verified, it
consumes the target's hidden state h_i with the token t_{i+1} that now follows it, writing its own
KV cache (one layer, sharing the target's block tables). It therefore consumes exactly the tokens
the target accepted: a partial acceptance is a shorter query, never a bigger batch. The head's
output at the last verified position predicts the token after the newest one: draft 1. Drafts 2..m
chain the head on its own output hidden state and the previous draft (`num_model_steps` = m).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.sequence import Sequence
from services.engine.spec_decode.draft_sampling import choose_drafts, stack_draft_probs
from services.engine.spec_decode.proposer import Drafts, ModelDrafterContext


@dataclass
class VerifiedSpan:
    """Positions [start, start + length) of `seq` that the target verified this step, and where
    their hidden states sit in the step's flat batch."""

    seq: Sequence
    start: int
    length: int
    hidden_row: int


class MTPProposer:
    def __init__(self, ctx: ModelDrafterContext, num_steps: int):
        assert ctx.runner.mtp_head is not None
        self.ctx = ctx
        self.head = ctx.runner.mtp_head
        self.kv_cache = ctx.runner.mtp_kv_caches[0]
        self.num_steps = num_steps
        self.last_hidden: dict[str, torch.Tensor] = {}
        """Per request: the head's output at its last verified position ([hidden_size])."""

    @torch.inference_mode()
    def catch_up(self, spans: list[VerifiedSpan], target_hidden: torch.Tensor) -> None:
        """Feeds the head (h_i, t_{i+1}) for every verified position of the step."""
        spans = [s for s in spans if s.length > 0]
        if not spans:
            return
        seqs = [s.seq for s in spans]
        rows = torch.cat([torch.arange(s.hidden_row, s.hidden_row + s.length) for s in spans])
        next_ids = [t for s in spans for t in s.seq.token_ids[s.start + 1 : s.start + s.length + 1]]
        positions, meta = self.ctx.runner.metadata(seqs, [s.start for s in spans], [s.length for s in spans])
        previous = target_hidden[rows.to(target_hidden.device)]
        input_ids = torch.tensor(next_ids, dtype=torch.long, device=positions.device)
        out = self.head(input_ids, positions, previous, self.kv_cache, meta)
        last_rows = (meta.query_start_loc[1:].long() - 1).tolist()
        for seq, row in zip(seqs, last_rows):
            self.last_hidden[seq.request_id] = out[row]

    def forget(self, request_id: str) -> None:
        self.last_hidden.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Drafts]:
        ks = [min(k, self.num_steps) for k in ks]
        ks = self.ctx.reserve_lookahead(seqs, ks, lookahead=[max(k - 1, 0) for k in ks])
        drafts = [Drafts() for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0 and seqs[i].request_id in self.last_hidden]
        if not active:
            return drafts
        hidden = torch.stack([self.last_hidden[seqs[i].request_id] for i in active])
        rows: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        step = 0
        while active:
            ids, probs = choose_drafts(
                self.head.logits(hidden),
                [seqs[i] for i in active],
                [len(drafts[i].token_ids) for i in active],
            )
            for i, token, prob in zip(active, ids, probs):
                drafts[i].token_ids.append(token)
                rows[i].append(prob)
            step += 1
            keep = [n for n, i in enumerate(active) if len(drafts[i].token_ids) < ks[i]]
            if not keep:
                break
            active = [active[n] for n in keep]
            hidden = self._chain([seqs[i] for i in active], [ids[n] for n in keep], hidden[keep], step)
        vocab_size = self.head.config.vocab_size
        for draft, row in zip(drafts, rows):
            draft.probs = stack_draft_probs(row, draft.token_ids, vocab_size)
        return drafts

    def _chain(
        self, seqs: list[Sequence], token_ids: list[int], previous: torch.Tensor, step: int
    ) -> torch.Tensor:
        """One more head step: (its own last output, the last draft) at the next position."""
        starts = [seq.num_computed_tokens + step - 1 for seq in seqs]
        positions, meta = self.ctx.runner.metadata(seqs, starts, [1] * len(seqs))
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=positions.device)
        return self.head(input_ids, positions, previous, self.kv_cache, meta)
