"""Torch reference of the post-step update: append emitted tokens to token rows, stop checks.

Per request `b`, the step emitted `new_tokens[b, :num_new[b]]` (accepted drafts and the recovered or
bonus token). They are appended one by one to the request's token row (`row_ids[b]`, or row `b`)
until one ends it: once `num_output >= min_tokens`, an EOS (unless ignore_eos) or a stop id ends it
with STOP; else reaching max_tokens ends it with LENGTH. The ending token is kept and the tokens
after it are dropped, so a row never holds tokens past a stop. A row never grows past its capacity.

The rows are the device token history of the CUDA-graph step (services/engine/cuda_graph.py), which
the n-gram kernel drafts from; requests without a row there share a scratch row. The KV cache's
roll-back by length stays with the host's block bookkeeping, and stop strings, which are text, stay
on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RUNNING, STOP, LENGTH = 0, 1, 2
"""Finish codes of the post-step update."""


def post_step_update_ref(
    token_ids: torch.Tensor,  # [num_rows, capacity] int32 token rows, appended to in place
    row_ids: torch.Tensor | None,  # [num_reqs] int64 row of each request; None: request b is row b
    lengths: torch.Tensor,  # [num_reqs] int32 tokens already in each request's row, updated
    num_output: torch.Tensor,  # [num_reqs] int32 generated tokens so far, updated
    new_tokens: torch.Tensor,  # [num_reqs, width] int32
    num_new: torch.Tensor,  # [num_reqs] int32
    max_tokens: torch.Tensor,  # [num_reqs] int32
    min_tokens: torch.Tensor,  # [num_reqs] int32
    ignore_eos: torch.Tensor,  # [num_reqs] int32 (0 / 1)
    eos_ids: torch.Tensor,  # [num_reqs, max_eos] int32 padded with -1
    stop_ids: torch.Tensor,  # [num_reqs, max_stop] int32 padded with -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (num_kept, finish (RUNNING / STOP / LENGTH), stop_token_id or -1), each
    [num_reqs] int32."""
    num_reqs, (capacity, width) = lengths.shape[0], (token_ids.shape[1], new_tokens.shape[1])
    rows = row_ids.tolist() if row_ids is not None else list(range(num_reqs))
    new, counts = new_tokens.tolist(), num_new.tolist()
    lens, produced = lengths.tolist(), num_output.tolist()
    limits = zip(max_tokens.tolist(), min_tokens.tolist(), ignore_eos.tolist())
    eos_rows, stop_rows = eos_ids.tolist(), stop_ids.tolist()
    num_kept, finish, stop_token = [0] * num_reqs, [RUNNING] * num_reqs, [-1] * num_reqs
    for b, (max_b, min_b, ignore_b) in enumerate(limits):
        eos = set() if ignore_b else {t for t in eos_rows[b] if t >= 0}
        stops = {t for t in stop_rows[b] if t >= 0}
        for token in new[b][: max(0, min(counts[b], width))]:
            if lens[b] >= capacity:
                break
            token_ids[rows[b], lens[b]] = token
            lens[b] += 1
            produced[b] += 1
            num_kept[b] += 1
            if produced[b] >= min_b and token in eos:
                finish[b] = STOP
                break
            if produced[b] >= min_b and token in stops:
                finish[b], stop_token[b] = STOP, token
                break
            if produced[b] >= max_b:
                finish[b] = LENGTH
                break
    lengths.copy_(torch.tensor(lens, dtype=torch.int32))
    num_output.copy_(torch.tensor(produced, dtype=torch.int32))
    device = lengths.device
    return (
        torch.tensor(num_kept, dtype=torch.int32, device=device),
        torch.tensor(finish, dtype=torch.int32, device=device),
        torch.tensor(stop_token, dtype=torch.int32, device=device),
    )


def post_step_update_slots_ref(
    token_rows: torch.Tensor,  # [num_slots, capacity] int32 token rows, appended to in place
    slots: torch.Tensor,  # [num_reqs] int64 slot (and row) of each request
    num_tokens: torch.Tensor,  # [num_slots] int32 tokens in each row, updated at `slots`
    num_output: torch.Tensor,  # [num_slots] int32 generated tokens of each slot, updated at `slots`
    new_tokens: torch.Tensor,  # [num_reqs, width] int32
    num_accepted: torch.Tensor,  # [num_reqs] int32: the step emitted num_accepted + 1 tokens
    max_tokens: torch.Tensor,  # [num_slots] int32
    min_tokens: torch.Tensor,  # [num_slots] int32
    ignore_eos: torch.Tensor,  # [num_slots] int32 (0 / 1)
    eos_ids: torch.Tensor,  # [num_slots, max_eos] int32 padded with -1 (any strides)
    stop_ids: torch.Tensor,  # [num_slots, max_stop] int32 padded with -1 (any strides)
    update: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = post_step_update_ref,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`post_step_update_ref` with every per-request input read at its slot of the batch's
    per-slot tensors and the lengths written back there (the tail's gathers and scatters folded
    in); returns (num_kept, finish, stop_token, num_output after the update), each [num_reqs].
    `update`: the per-request update between the gathers and the scatters (`kernels` passes the
    dispatching `post_step_update` for its unfused A/B path)."""
    lengths, produced = num_tokens[slots], num_output[slots]
    num_kept, finish, stop_token = update(
        token_rows,
        slots,
        lengths,
        produced,
        new_tokens,
        num_accepted + 1,
        max_tokens[slots],
        min_tokens[slots],
        ignore_eos[slots],
        eos_ids[slots],
        stop_ids[slots],
    )
    num_tokens[slots] = lengths
    num_output[slots] = produced
    return num_kept, finish, stop_token, produced
