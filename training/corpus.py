"""Token streams of a split, and the windows language-model training draws from them.

A *token stream* is every document of a split encoded and concatenated, each followed by EOS, as
one flat int32 tensor. A *window* is `seq_len + 1` consecutive stream tokens: the model reads the
first `seq_len` and is scored on predicting the last `seq_len`. Windows may cross a document
boundary; the EOS between documents teaches the model where one file ends.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from training.data import SourceFile
from training.tokenizer import EOS_TOKEN_ID

ENCODE_BATCH_FILES = 1024
"""Files per `encode_batch` call: large enough to use every core, small enough to stop near the cap."""
EOS = np.array([EOS_TOKEN_ID], dtype=np.int32)


def tokenize_files(
    files: list[SourceFile], tokenizer: Tokenizer, max_tokens: int | None = None
) -> torch.Tensor:  # [num_tokens] int32
    """Encodes `files` in order (in parallel within each batch) into one EOS-separated stream,
    cut at `max_tokens`. (`encode_batch_fast` is `encode_batch` without character offsets.)"""
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    chunks: list[np.ndarray] = []
    num_tokens = 0
    for start in range(0, len(files), ENCODE_BATCH_FILES):
        texts = [f.read() for f in files[start : start + ENCODE_BATCH_FILES]]
        for encoding in encode_batch(texts, add_special_tokens=False):
            chunks += [np.array(encoding.ids, dtype=np.int32), EOS]
            num_tokens += len(chunks[-2]) + 1
        if max_tokens is not None and num_tokens >= max_tokens:
            break
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    return torch.from_numpy(stream[:max_tokens])


def save_tokens(tokens: torch.Tensor, path: Path) -> Path:
    """Writes a stream as .npy (the format `train_mtp --data-tokens` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, tokens.numpy(), allow_pickle=False)
    return path


def random_offsets(
    num_tokens: int, seq_len: int, num_steps: int, batch_size: int, generator: torch.Generator
) -> torch.Tensor:  # [num_steps, batch_size] int64
    """Start offsets of every training window of a run, uniform over the stream, drawn up front
    from a CPU `generator`: the batch order depends on the seed alone, not on the device, and the
    training loop never waits on a host-to-device copy."""
    num_offsets = num_tokens - seq_len
    if num_offsets < 1:
        raise ValueError(f"a stream of {num_tokens} tokens has no window of {seq_len + 1} tokens")
    return torch.randint(num_offsets, (num_steps, batch_size), generator=generator)


def windows_at(
    tokens: torch.Tensor,  # [num_tokens]
    offsets: torch.Tensor,  # [batch_size] on the device of `tokens`
    seq_len: int,
) -> torch.Tensor:  # [batch_size, seq_len + 1] int64
    return tokens[offsets[:, None] + torch.arange(seq_len + 1, device=tokens.device)].long()


def contiguous_windows(
    tokens: torch.Tensor,  # [num_tokens]
    seq_len: int,
    max_windows: int | None = None,
) -> torch.Tensor:  # [num_windows, seq_len + 1] int64
    """Non-overlapping windows from the start of the stream (for evaluation: every token scored once).
    Consecutive windows share one token: the last target of one is the first input of the next."""
    num_windows = (tokens.numel() - 1) // seq_len
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    if num_windows < 1:
        raise ValueError(f"a stream of {tokens.numel()} tokens has no window of {seq_len + 1} tokens")
    starts = torch.arange(num_windows)[:, None] * seq_len
    return tokens[starts + torch.arange(seq_len + 1)].long()
