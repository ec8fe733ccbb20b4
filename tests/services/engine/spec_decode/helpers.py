"""What the speculative-engine tests share: prompts that make drafts pay, greedy sampling, and the
grammars of the structured-output tests."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutput

MAX_TOKENS = 40


SMALL_DRAFT_MODEL = dict(
    seed=3,
    num_hidden_layers=1,
    hidden_size=48,
    num_attention_heads=3,
    num_key_value_heads=1,
    intermediate_size=64,
)
"""`make_checkpoint("llama", **SMALL_DRAFT_MODEL)`: a one-layer random draft model for the test targets
(its drafts mostly rejected: rollback every step)."""


def repetitive_prompts(count: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span, so n-gram and suffix drafts get accepted."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        span = torch.randint(3, 384, (6 + i,), generator=generator).tolist()
        tail = torch.randint(3, 384, (i * 3,), generator=generator).tolist()
        prompts.append(tail + span * 3 + span[:2])
    return prompts


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["add", "sub"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "kind", "count"],
    "additionalProperties": False,
}
"""The structured-output tests' JSON schema: a bounded string, an enum and a bounded integer."""
REGEX = r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"
CHOICES = ["def add", "class Point", "import os"]
GRAMMARS = {
    "json_schema": StructuredOutput.json_schema(SCHEMA),
    "regex": StructuredOutput(kind="regex", spec=REGEX),
    "choice": StructuredOutput.choice(CHOICES),
}


_EAGLE3_HEADS: dict[str, Path] = {}


def eagle3_head_for(target: str) -> Path:
    """An untrained EAGLE-3 head for `target` over every other token of its vocabulary (random
    weights: its drafts are mostly rejected, which exercises rollback), saved once per target."""
    from shared.model import load_model
    from shared.model.eagle3 import default_aux_layers, save_eagle3_head
    from training.train_eagle3 import init_head_from_target

    if target not in _EAGLE3_HEADS:
        model = load_model(target, torch.float32, torch.device("cpu"), 192)
        draft_ids = torch.arange(0, model.config.vocab_size, 2)
        layers = default_aux_layers(model.config.num_hidden_layers)
        head = init_head_from_target(model, draft_ids, layers, torch.device("cpu"))
        torch.manual_seed(0)
        for param in head.parameters():
            torch.nn.init.normal_(param, std=0.05)
        _EAGLE3_HEADS[target] = save_eagle3_head(head, tempfile.mkdtemp(prefix="eagle3-"))
    return _EAGLE3_HEADS[target]
