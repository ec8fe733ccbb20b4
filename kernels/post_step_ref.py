"""Torch reference of the post-step update: append emitted tokens, advance lengths, stop checks.

Per request `b`, the step emitted `new_tokens[b, :num_new[b]]` (accepted drafts and the recovered or
bonus token). They are appended one by one to the request's token row until one ends it, as
services/engine/output_processor.py does at token level: once `num_output >= min_tokens`, an EOS
(unless ignore_eos) or a stop id ends it with STOP; else reaching max_tokens ends it with LENGTH.
The KV cache is rolled back by length: `num_computed` advances past the last real token and the
accepted drafts (the emitted count), never past the last token, whose KV the next step writes.
Stop strings are text and stay on the host.
"""

from __future__ import annotations

import torch

RUNNING, STOP, LENGTH = 0, 1, 2


def post_step_update_ref(
    token_ids: torch.Tensor,  # [num_reqs, capacity] int32, updated in place
    lengths: torch.Tensor,  # [num_reqs] int32 tokens in each row, updated
    num_computed: torch.Tensor,  # [num_reqs] int32 tokens whose KV is cached, updated
    num_output: torch.Tensor,  # [num_reqs] int32 generated tokens so far, updated
    new_tokens: torch.Tensor,  # [num_reqs, width] int32
    num_new: torch.Tensor,  # [num_reqs] int32
    max_tokens: torch.Tensor,  # [num_reqs] int32
    min_tokens: torch.Tensor,  # [num_reqs] int32
    ignore_eos: torch.Tensor,  # [num_reqs] int32 (0 / 1)
    eos_ids: torch.Tensor,  # [num_eos] int32
    stop_ids: torch.Tensor,  # [num_reqs, max_stop] int32 padded with -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (num_kept, finish_reason (RUNNING / STOP / LENGTH), stop_token_id or -1), each
    [num_reqs] int32."""
    num_reqs = token_ids.shape[0]
    eos = set(eos_ids.tolist())
    num_kept = torch.zeros(num_reqs, dtype=torch.int32)
    finish = torch.zeros(num_reqs, dtype=torch.int32)
    stop_token = torch.full((num_reqs,), -1, dtype=torch.int32)
    for b in range(num_reqs):
        stops = {t for t in stop_ids[b].tolist() if t >= 0}
        length, produced = int(lengths[b]), int(num_output[b])
        for j in range(int(num_new[b])):
            token = int(new_tokens[b, j])
            token_ids[b, length] = token
            length += 1
            produced += 1
            num_kept[b] += 1
            if produced >= int(min_tokens[b]):
                if not int(ignore_eos[b]) and token in eos:
                    finish[b] = STOP
                    break
                if token in stops:
                    finish[b], stop_token[b] = STOP, token
                    break
            if produced >= int(max_tokens[b]):
                finish[b] = LENGTH
                break
        lengths[b] = length
        num_output[b] = produced
        num_computed[b] = min(int(num_computed[b]) + int(num_new[b]), length - 1)
    device = token_ids.device
    return num_kept.to(device), finish.to(device), stop_token.to(device)
