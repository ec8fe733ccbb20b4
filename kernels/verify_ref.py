"""Torch reference of the fused verify + accept + sample kernel (one-hot drafts).

Every request contributes `k + 1` rows of logits (row `j < k` scores draft `j`, row `k` is the bonus
row); `cu_num_rows` holds their prefix sums. Per row: temperature (0 = greedy), top_k (0 = off),
top_p, min_p, and the (seed, position) that key its noise (kernels/sampling_noise_ref.py).

A row may carry a grammar's token bitmask (`bitmask`, bit `t % 32` of word `t // 32` set: token `t`
allowed), applied where `masked_rows` says so before anything else: a masked token's logit is -inf,
so it is never the argmax, never sampled, never inside the truncated set, and a draft the grammar
refuses fails at its own row whatever the strategy. Rows not marked read no mask.

Strategies (services/engine/rejection_sampler.py explains them): GREEDY accepts a draft equal to
the argmax; TARGET_MATCH and REJECTION (one-hot drafts, where Leviathan et al.'s test reduces to
it) accept a draft equal to the target's own sample at that row; TOPP accepts a draft inside the
truncated set. Greedy requests always verify greedily. The emitted tokens are the accepted drafts
and then the argmax (greedy requests) or the sample at the first rejected row or the bonus row.
"""

from __future__ import annotations

import torch

from kernels.sampling_noise_ref import STREAM_TARGET, exponential_noise_ref

GREEDY, TARGET_MATCH, TOPP, REJECTION = 0, 1, 2, 3
STRATEGIES = {"greedy": GREEDY, "target_match": TARGET_MATCH, "topp": TOPP, "rejection": REJECTION}
NORMAL, ACCEPT_ALL, REJECT_ALL = 0, 1, 2
POLICIES = {"normal": NORMAL, "accept_all": ACCEPT_ALL, "reject_all": REJECT_ALL}
BITS_PER_MASK_WORD = 32
"""A token bitmask packs the allowed ids of a row into int32 words: bit `t % 32` of word `t // 32`."""


def num_mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return -(-vocab_size // BITS_PER_MASK_WORD)


def allowed_tokens_ref(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] bool: the tokens each row's bitmask ([num_rows, num_words] int32) allows."""
    bits = torch.arange(BITS_PER_MASK_WORD, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask[:, :, None] >> bits) & 1  # [num_rows, num_words, 32]
    return allowed.flatten(1)[:, :vocab_size].bool()


def check_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor | None, masked_rows: torch.Tensor | None
) -> None:
    """Refuses grammar masks that do not fit `logits` [num_rows, vocab_size]: ValueError saying why."""
    if (bitmask is None) != (masked_rows is None):
        raise ValueError("bitmask and masked_rows go together: pass both or neither")
    if bitmask is None or masked_rows is None:
        return
    num_rows, vocab_size = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.shape != (num_rows, num_mask_words(vocab_size)):
        raise ValueError(
            f"bitmask must be int32 [{num_rows}, {num_mask_words(vocab_size)}] (num_rows, ceil(vocab_size / 32)), "
            f"got {bitmask.dtype} {list(bitmask.shape)}"
        )
    if masked_rows.dtype != torch.int32 or masked_rows.shape != (num_rows,):
        raise ValueError(
            f"masked_rows must be int32 [{num_rows}], got {masked_rows.dtype} {list(masked_rows.shape)}"
        )


def mask_logits_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    bitmask: torch.Tensor | None,  # [num_rows, num_words] int32
    masked_rows: torch.Tensor | None,  # [num_rows] int32, nonzero: the row's bitmask applies
) -> torch.Tensor:
    """The logits with every token a marked row's grammar refuses at -inf (`logits` itself when no
    row is marked)."""
    check_bitmask(logits, bitmask, masked_rows)
    if bitmask is None or masked_rows is None or not bool(masked_rows.any()):
        return logits
    refused = ~allowed_tokens_ref(bitmask.to(logits.device), logits.shape[-1])
    refused &= masked_rows.to(logits.device).bool()[:, None]
    return logits.masked_fill(refused, float("-inf"))


def truncated_probs_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    temperature: torch.Tensor,  # [num_rows] float32; 0 rows are left at temperature 1
    top_k: torch.Tensor,  # [num_rows] int32, 0 = off
    top_p: torch.Tensor,  # [num_rows] float32
    min_p: torch.Tensor,  # [num_rows] float32
) -> torch.Tensor:  # [num_rows, vocab_size] renormalised target distribution
    """Temperature, softmax, then min_p, top_k, top_p masks (as services/engine/sampler.py)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / t[:, None], dim=-1)
    keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    probs_kept = probs.masked_fill(~keep, 0.0)
    sorted_probs, order = probs_kept.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, probs.shape[-1]))[:, None]
    keep_sorted = rank < k
    sorted_probs = sorted_probs.masked_fill(~keep_sorted, 0.0)
    mass = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    # top_p = 1 is no cut: the float cumsum may reach 1 before the tail, which must stay kept
    keep_sorted &= ((mass.cumsum(dim=-1) - mass) < top_p[:, None]) | (top_p[:, None] >= 1)
    keep &= torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def verify_sample_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, penalties already applied
    temperature: torch.Tensor,  # [num_rows] float32
    top_k: torch.Tensor,  # [num_rows] int32
    top_p: torch.Tensor,  # [num_rows] float32
    min_p: torch.Tensor,  # [num_rows] float32
    seeds: torch.Tensor,  # [num_rows] int64
    positions: torch.Tensor,  # [num_rows] int64: output position of each row
    draft_ids: torch.Tensor,  # [num_rows] int32, -1 on bonus rows
    cu_num_rows: torch.Tensor,  # [num_reqs + 1] int32
    strategy: int,
    policy: int = NORMAL,
    max_rows: int | None = None,  # the tokens' width (default: the most rows of one request)
    bitmask: torch.Tensor | None = None,  # [num_rows, num_words] int32 grammar masks
    masked_rows: torch.Tensor | None = None,  # [num_rows] int32, nonzero: apply the row's bitmask
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (token_ids [num_reqs, max_rows] int32 padded with -1, num_accepted [num_reqs] int32,
    and per row: greedy_ids, sampled_ids, passes [num_rows] int32)."""
    logits = mask_logits_ref(logits, bitmask, masked_rows)
    greedy_rows = temperature == 0
    greedy_ids = logits.argmax(dim=-1)
    drafts = draft_ids.long()
    is_draft = drafts >= 0
    # the truncated distribution and the noise only for rows that sample (a row is independent)
    sampling = (~greedy_rows).nonzero()[:, 0]
    sampled_ids = greedy_ids.clone()
    in_nucleus = torch.zeros_like(is_draft)
    if len(sampling):
        args = (t[sampling] for t in (temperature, top_k, top_p, min_p))
        probs = truncated_probs_ref(logits[sampling], *args)
        noise = exponential_noise_ref(seeds[sampling], positions[sampling], logits.shape[-1], STREAM_TARGET)
        sampled_ids[sampling] = (probs / noise).argmax(dim=-1)
        in_nucleus[sampling] = probs.gather(1, drafts[sampling].clamp(min=0)[:, None])[:, 0] > 0
    if strategy == GREEDY:
        passes = drafts == greedy_ids
    elif strategy == TOPP:
        passes = in_nucleus
    else:
        passes = drafts == sampled_ids
    passes = torch.where(greedy_rows, drafts == greedy_ids, passes)
    if policy == ACCEPT_ALL:
        passes = is_draft
    elif policy == REJECT_ALL:
        passes = torch.zeros_like(is_draft)
    passes &= is_draft
    return (
        *_accept(cu_num_rows, drafts, greedy_rows, greedy_ids, sampled_ids, passes, max_rows),
        greedy_ids.int(),
        sampled_ids.int(),
        passes.int(),
    )


def _accept(
    cu_num_rows: torch.Tensor,
    drafts: torch.Tensor,
    greedy_rows: torch.Tensor,
    greedy_ids: torch.Tensor,
    sampled_ids: torch.Tensor,
    passes: torch.Tensor,
    max_rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepts each request's leading passing drafts, then its argmax / sample at the next row."""
    cu = cu_num_rows.tolist()
    num_reqs = len(cu) - 1
    if max_rows is None:
        max_rows = max((cu[i + 1] - cu[i] for i in range(num_reqs)), default=1)
    token_ids = torch.full((num_reqs, max_rows), -1, dtype=torch.int32)
    num_accepted = torch.zeros(num_reqs, dtype=torch.int32)
    passes_cpu, drafts_cpu = passes.tolist(), drafts.tolist()
    last_ids = torch.where(greedy_rows, greedy_ids, sampled_ids).tolist()
    for i in range(num_reqs):
        start, end = cu[i], cu[i + 1]
        if start == end:  # an empty request (a CUDA graph's grid past the batch) emits nothing
            continue
        n = 0
        while start + n < end - 1 and passes_cpu[start + n]:
            n += 1
        token_ids[i, :n] = torch.tensor(drafts_cpu[start : start + n], dtype=torch.int32)
        token_ids[i, n] = last_ids[start + n]
        num_accepted[i] = n
    return token_ids.to(cu_num_rows.device), num_accepted.to(cu_num_rows.device)
