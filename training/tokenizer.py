"""Trains the reference family's byte-level BPE tokenizer (GPT-2 style) on the train split.

Byte-level BPE (Radford et al. 2019) starts from the 256 byte symbols, so any text, including
code with odd Unicode, encodes without an unknown token and decodes back byte for byte. Special
tokens take the first ids: `<|endoftext|>` is id 0 and is both the document separator in training
and the end-of-sequence (EOS) token in serving; there is no beginning-of-sequence (BOS) token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from training.data import SourceFile

EOS_TOKEN = "<|endoftext|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN, PAD_TOKEN)
"""In id order: EOS is id 0."""
EOS_TOKEN_ID = 0
PAD_TOKEN_ID = SPECIAL_TOKENS.index(PAD_TOKEN)
DEFAULT_VOCAB_SIZE = 8192
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""Each turn is `<|role|>\\n content <|endoftext|>\\n`; a generation prompt opens an assistant turn,
which the model ends with EOS."""


def train_tokenizer(
    files: list[SourceFile], vocab_size: int = DEFAULT_VOCAB_SIZE, max_bytes: int | None = None
) -> Tokenizer:
    """BPE merges learned from `files` (the first ones up to `max_bytes`, in the given order).

    Deterministic: the same texts in the same order give the same vocabulary and merges.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(files, max_bytes), trainer)
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_TOKEN_ID:
        raise AssertionError(f"{EOS_TOKEN} got id {tokenizer.token_to_id(EOS_TOKEN)}, not {EOS_TOKEN_ID}")
    return tokenizer


def _texts(files: list[SourceFile], max_bytes: int | None) -> Iterator[str]:
    num_bytes = 0
    for source in files:
        if max_bytes is not None and num_bytes >= max_bytes:
            return
        num_bytes += source.num_bytes
        yield source.read()


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for both specmesh's Tokenizer and transformers' AutoTokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> list[Path]:
    """Writes tokenizer.json and tokenizer_config.json into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / TOKENIZER_FILE), pretty=False)  # compact: it is committed twice
    config_path = out_dir / TOKENIZER_CONFIG_FILE
    config_path.write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
    return [out_dir / TOKENIZER_FILE, config_path]
