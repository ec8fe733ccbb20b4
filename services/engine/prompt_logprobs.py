"""Prompt log-probabilities (vLLM's `prompt_logprobs`): how likely the target found each prompt token.

Prompt position `i > 0` is scored by the logits of position `i - 1`, whose hidden state the prefill
forward computes anyway: a request that asks keeps the hidden rows of its prompt chunk, and they go
through the LM head and a log-softmax in chunks of rows (never `[prompt_len, vocab_size]` at once),
in whichever step prefills them, chunked prefill included. Position 0 has no entry. In the
`processed` logprobs mode the logits are divided by the request's temperature (logit bias,
penalties and a grammar act on the output, not on the prompt); in `raw` they are the model's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.sequence import Sequence, TokenLogprobs

MAX_CHUNK_LOGITS = 1 << 23
"""Most logits one chunk of prompt rows materializes ([rows, vocab_size] float32: 32 MiB)."""


@dataclass
class PromptRows:
    """The step's forward rows that score prompt tokens, for the requests that asked."""

    token_indices: np.ndarray  # [num_rows] int64 forward token whose logits score the next prompt token
    target_ids: np.ndarray  # [num_rows] int64 the prompt token each row scores
    temperatures: np.ndarray  # [num_rows] float32 the logits are divided by these (1: as they are)
    num_top: int
    """Alternatives to keep per row: the most any of the step's requests wants."""
    segments: list[tuple[int, int, int]]
    """(index of the request among the step's sequences, its first prompt position scored, rows)."""

    @property
    def num_rows(self) -> int:
        return len(self.token_indices)

    @classmethod
    def of(
        cls, seqs: list[Sequence], starts: np.ndarray, lens: np.ndarray, cu: np.ndarray, mode: str
    ) -> PromptRows | None:
        """The rows of `seqs` (the step's, computing `lens[i]` tokens from `starts[i]`, the first
        at forward token `cu[i]`) that score a prompt token; None when no request asks."""
        if all(seq.prompt_logprobs is None for seq in seqs):  # the common case, told apart cheaply
            return None
        indices, targets, temperatures, segments, num_top = [], [], [], [], 0
        for i, seq in enumerate(seqs):
            if not seq.scores_prompt:
                continue
            start = int(starts[i])
            end = min(start + int(lens[i]), seq.num_prompt_tokens - 1)  # the last prompt row samples
            if end <= start:
                continue
            indices.append(np.arange(cu[i], cu[i] + end - start))
            targets.append(np.asarray(seq.prompt_token_ids[start + 1 : end + 1]))
            temperature = seq.params.temperature if mode == "processed" and not seq.params.greedy else 1.0
            temperatures.append(np.full(end - start, temperature, dtype=np.float32))
            segments.append((i, start + 1, end - start))
            num_top = max(num_top, seq.params.prompt_logprobs or 0)
        if not segments:
            return None
        return cls(
            token_indices=np.concatenate(indices).astype(np.int64),
            target_ids=np.concatenate(targets).astype(np.int64),
            temperatures=np.concatenate(temperatures),
            num_top=num_top,
            segments=segments,
        )


@dataclass
class PromptScores:
    """The scored rows, on the device until `entries` reads them back."""

    logprobs: torch.Tensor  # [num_rows] float32 of each row's prompt token
    ranks: torch.Tensor  # [num_rows] int64 its rank (1: the most likely)
    top_ids: torch.Tensor  # [num_rows, num_top] int64
    top_logprobs: torch.Tensor  # [num_rows, num_top] float32

    def entries(self) -> list[TokenLogprobs]:
        """One per row, every row with `num_top` alternatives."""
        rows = zip(
            self.logprobs.tolist(), self.ranks.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        )
        return [TokenLogprobs(0, lp, dict(zip(ids, values)), rank) for lp, rank, ids, values in rows]


def score_prompt_rows(
    hidden: torch.Tensor,
    rows: PromptRows,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> PromptScores:
    """hidden: [num_tokens, hidden_size] the step's final hidden states. Each chunk of rows goes
    through `compute_logits` (under tensor parallelism a collective: every rank runs the same
    chunks) and a log-softmax; only the scores leave the chunk."""
    device = hidden.device
    indices = torch.from_numpy(rows.token_indices).to(device)
    targets = torch.from_numpy(rows.target_ids).to(device)
    temperatures = torch.from_numpy(rows.temperatures).to(device)
    chunk = max(1, MAX_CHUNK_LOGITS // vocab_size)
    parts = []
    for first in range(0, rows.num_rows, chunk):
        span = slice(first, first + chunk)
        logits = compute_logits(hidden[indices[span]]) / temperatures[span, None]  # [rows, vocab_size]
        logprobs = torch.log_softmax(logits, dim=-1)
        target = logprobs.gather(1, targets[span, None])  # [rows, 1]
        ranks = (logprobs > target).sum(dim=-1) + 1
        top = torch.topk(logprobs, rows.num_top, dim=-1)
        parts.append((target[:, 0], ranks, top.indices, top.values))
    return PromptScores(*(torch.cat(column) for column in zip(*parts)))


def record_prompt_logprobs(seqs: list[Sequence], rows: PromptRows, scores: PromptScores) -> None:
    """Writes the scored positions into each request's `prompt_logprobs`, each entry with the
    request's own number of alternatives."""
    entries = scores.entries()
    first_row = 0
    for index, first_position, num_rows in rows.segments:
        seq = seqs[index]
        assert seq.prompt_logprobs is not None
        num_top = seq.params.prompt_logprobs or 0
        for offset, entry in enumerate(entries[first_row : first_row + num_rows]):
            position = first_position + offset
            entry.token_id = seq.prompt_token_ids[position]
            entry.top = dict(list(entry.top.items())[:num_top])
            seq.prompt_logprobs[position] = entry
        first_row += num_rows
