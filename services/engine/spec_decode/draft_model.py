"""`draft_model` drafting: a smaller model with the target's tokenizer and its own KV cache.

The draft model's cache shares the target's block tables (same block ids, its own tensors), so it
needs no allocator of its own. Every step it first *catches up* on the step's tokens (the same
input ids, positions and attention metadata as the target's forward, so prefill chunks fill its
cache too), then, for the requests that draft, chains single-token forwards from the newest token:
draft j is sampled from its logits and fed back at the next position. Rows of the step past the
kept tokens, and the chain, write KV past the request's length; the next catch-up overwrites it.
"""

from __future__ import annotations

import torch

from services.engine.spec_decode.proposer import DraftBatch, Drafts, Proposer
from shared.model.llama import KVCache, LlamaForCausalLM


class DraftModelProposer(Proposer):
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size

    def propose(self, batch: DraftBatch) -> Drafts:
        forward = batch.forward
        assert forward is not None
        self.model(forward.input_ids, forward.positions, self.kv_caches, forward.meta)
        if batch.num_steps == 0:
            return Drafts.none(len(batch.seq_slots), batch.seq_slots.device)
        inputs, slots = batch.inputs, batch.seq_slots
        newest = (inputs.num_tokens[slots].long() - 1).clamp(min=0)  # each request's newest token
        # padding requests read the scratch row, which holds whatever padding appended
        token = inputs.token_rows[slots, newest].long().clamp(0, self.model.config.vocab_size - 1)
        draft_ids = []
        for step, (positions, meta) in enumerate(
            batch.chain_inputs(newest, 0, batch.num_steps, self.block_size)
        ):
            hidden = self.model(token, positions, self.kv_caches, meta)
            token = batch.sample(self.model.compute_logits(hidden), step)
            draft_ids.append(token)
        return Drafts(torch.stack(draft_ids, dim=1), batch.num_wanted)
