"""Per-request logit processing: logit bias, penalties, temperature, min_p, top_k, top_p.

The rejection sampler turns the processed distribution into tokens with the exponential-race form
of the Gumbel-max trick: with `e ~ Exp(1)` i.i.d. per token, `argmax(probs / e)` is a sample from
`probs`; `e` is keyed by the request's seed and the token's output position
(kernels/sampling_noise_ref.py), so a seeded request's tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.verify_ref import allowed_tokens_ref
from services.engine.sequence import TokenLogprobs
from shared.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """The sampling inputs of the rows that produce a token this step, one entry per row."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    suppressed_token_ids: list[list[int]]
    """Ids that must not be sampled now (EOS and stop ids before `min_tokens`)."""
    bitmask: torch.Tensor | None = None
    """[num_rows, ceil(vocab_size / 32)] int32: the tokens each row's grammar allows (None: no row
    has a grammar)."""

    @property
    def num_rows(self) -> int:
        return len(self.params)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Grammar mask, logit bias, suppressed ids, then repetition (prompt + output), frequency and
    presence (output) penalties. Returns `logits` itself, uncopied, when no row has any (the common
    case on the hot path)."""
    rows = [i for i, p in enumerate(batch.params) if p.has_penalties]
    biased = [i for i, p in enumerate(batch.params) if p.logit_bias]
    if not rows and not biased and not any(batch.suppressed_token_ids) and batch.bitmask is None:
        return logits
    logits = logits.clone()
    if batch.bitmask is not None:
        apply_bitmask(logits, batch.bitmask)
    for i in biased:
        bias = batch.params[i].logit_bias
        bias_ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
        logits[i, bias_ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    for i, ids in enumerate(batch.suppressed_token_ids):
        if ids:
            _suppress(logits[i], ids)
    if not rows:
        return logits
    vocab_size = logits.shape[-1]
    device = logits.device
    counts = torch.zeros(len(rows), vocab_size, device=device)
    seen_in_prompt = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    for r, i in enumerate(rows):
        out = torch.tensor(batch.output_token_ids[i], dtype=torch.long, device=device)
        counts[r].index_add_(0, out, torch.ones(len(out), device=device))
        seen_in_prompt[r, torch.tensor(batch.prompt_token_ids[i], dtype=torch.long, device=device)] = True
    params = [batch.params[i] for i in rows]
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    sub = logits[rows]
    seen = seen_in_prompt | (counts > 0)
    penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalised, sub)
    sub = sub - frequency * counts - presence * (counts > 0).float()
    logits[rows] = sub
    return logits


def _suppress(row_logits: torch.Tensor, token_ids: list[int]) -> None:
    """Bans `token_ids` (min_tokens) unless nothing else is left: where a grammar allows only its
    stop token, the grammar wins over min_tokens."""
    kept = row_logits[token_ids].clone()
    row_logits[token_ids] = float("-inf")
    if torch.isneginf(row_logits).all():
        row_logits[token_ids] = kept


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets to -inf, in place, every logit whose bit is clear. logits: [num_rows, vocab_size];
    bitmask: [num_rows, ceil(vocab_size / 32)] int32 (a grammar's allowed next tokens per row)."""
    allowed = allowed_tokens_ref(bitmask.to(logits.device), logits.shape[-1])
    return logits.masked_fill_(~allowed, float("-inf"))


def apply_temperature(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Divides each row by its temperature; greedy rows (temperature 0) are left at temperature 1."""
    temperatures = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if all(t == 1.0 for t in temperatures):
        return logits
    return logits / torch.tensor(temperatures, device=logits.device)[:, None]


def truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax, then min_p, top_k and top_p masks; returns the renormalised distribution."""
    probs = torch.softmax(logits, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    min_p = torch.tensor([p.min_p for p in params], device=probs.device)[:, None]
    if (min_p > 0).any():
        keep &= probs >= min_p * probs.max(dim=-1, keepdim=True).values
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = torch.tensor([p.top_p for p in params], device=probs.device)[:, None]
    if any(top_k) or (top_p < 1).any():
        keep &= _top_k_top_p_mask(probs.masked_fill(~keep, 0.0), top_k, top_p)
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _top_k_top_p_mask(probs: torch.Tensor, top_k: list[int], top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the top_k most likely tokens, then the smallest prefix of them whose mass reaches top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.tensor([t if t > 0 else probs.shape[-1] for t in top_k], device=probs.device)[:, None]
    keep_sorted = rank < k
    sorted_probs = sorted_probs.masked_fill(~keep_sorted, 0.0)
    mass = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    mass_before = mass.cumsum(dim=-1) - mass
    # top_p = 1 is no cut: the float cumsum may reach 1 before the tail, which must stay kept
    keep_sorted &= (mass_before < top_p) | (top_p >= 1)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[TokenLogprobs | None]:
    """logprobs: [num_rows, vocab]; the sampled token's value and the top-n of each requesting row."""
    out: list[TokenLogprobs | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        token = int(token_ids[i])
        top = torch.topk(logprobs[i], p.logprobs) if p.logprobs else None
        alternatives = dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {}
        alternatives = {t: v for t, v in alternatives.items() if v != float("-inf")}  # masked out
        out.append(TokenLogprobs(token, float(logprobs[i, token]), alternatives))
    return out
