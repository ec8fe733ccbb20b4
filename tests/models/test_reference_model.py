"""The shipped reference family: Hugging Face transformers and specmesh compute the same logits
from the base checkpoint, the MTP head and the draft model load and draft like the base, and
`specmesh generate` without --model serves the base and writes Python."""

from __future__ import annotations

import io
import tokenize
from collections.abc import Iterator

import pytest
import torch

from services import cli
from shared.model import LlamaForCausalLM, load_model
from shared.model.mtp import load_mtp_head
from shared.reference import DRAFT_MODEL, MTP_HEAD, reference_dir
from shared.tokenizer import Tokenizer
from tests.paged import prefill_logits

CPU = torch.device("cpu")
PROMPTS = (
    "def add(a, b):\n    return",
    "import os\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n\n    def read(self):",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:",
)
LOGIT_TOLERANCE = 1e-3
"""Largest |specmesh - transformers| logit difference, relative to the largest |logit|.

Both run float32 from the same bfloat16 weights (widened exactly), so they differ only in the order
of floating-point operations (fused q/k/v and gate/up projections, paged vs eager attention, two
prefill chunks vs one pass): float32 rounding (1.2e-7) carried through 8 layers, measured at about
1e-5 on logits up to 20, i.e. 5e-7 relative. A real mismatch (RoPE, tied embedding, norm epsilon,
GQA head mapping) moves logits by O(1), 5e-2 relative or more. 1e-3 sits well clear of both."""


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Small models on a shared 2-core box: two OpenMP threads wait on each other more than they help."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(reference_dir())


@pytest.fixture(scope="module")
def base() -> LlamaForCausalLM:
    return load_model(reference_dir(), torch.float32, CPU, max_positions=2048)


def held_out_window(tokenizer: Tokenizer, num_tokens: int = 384) -> list[int]:
    """The first tokens of a held-out file (json/encoder.py of this interpreter's stdlib)."""
    import json as held_out_package

    with open(held_out_package.encoder.__file__, encoding="utf-8") as source:
        return tokenizer.encode(source.read())[:num_tokens]


def paged_prefill(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """The serving path: two chunks through a paged cache with out-of-order blocks."""
    return prefill_logits(model, token_ids, block_size=16)


@torch.inference_mode()
def test_transformers_and_specmesh_compute_the_same_logits(
    base: LlamaForCausalLM, tokenizer: Tokenizer
) -> None:
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_dir(), dtype=torch.float32)
    for prompt in PROMPTS:
        token_ids = tokenizer.encode(prompt)
        expected = reference.eval()(torch.tensor([token_ids])).logits[0]
        actual = paged_prefill(base, token_ids)
        scale = expected.abs().max().item()
        assert (actual - expected).abs().max().item() <= LOGIT_TOLERANCE * scale, prompt
        assert torch.equal(actual.argmax(-1), expected.argmax(-1)), prompt


@torch.inference_mode()
def test_mtp_head_loads_against_the_base_and_drafts_its_tokens(
    base: LlamaForCausalLM, tokenizer: Tokenizer
) -> None:
    """Row i of the head (h_i, t_{i+1}) drafts t_{i+2}; on held-out code its top-1 agrees with the
    base's own prediction there as the card says (0.64 at training; an untrained head: 0.02)."""
    head = load_mtp_head(reference_dir(MTP_HEAD), base, torch.float32, CPU)
    token_ids = torch.tensor([held_out_window(tokenizer)])
    hidden = base.forward_dense(token_ids)  # [1, n, hidden_size]
    target_next = base.compute_logits(hidden[0]).argmax(-1)  # [n]: the base's t_{i+1}
    drafts = head.logits(head.forward_dense(token_ids[:, 1:], hidden[:, :-1])[0]).argmax(-1)  # [n - 1]
    agreement = (drafts[:-1] == target_next[1:-1]).float().mean().item()
    assert agreement >= 0.45


@torch.inference_mode()
def test_draft_model_loads_and_mostly_agrees_with_the_base(
    base: LlamaForCausalLM, tokenizer: Tokenizer
) -> None:
    draft = load_model(reference_dir(DRAFT_MODEL), torch.float32, CPU, max_positions=2048)
    assert draft.config.vocab_size == base.config.vocab_size
    assert draft.config.num_hidden_layers < base.config.num_hidden_layers
    token_ids = torch.tensor([held_out_window(tokenizer)])
    draft_next = draft.compute_logits(draft.forward_dense(token_ids)[0]).argmax(-1)
    target_next = base.compute_logits(base.forward_dense(token_ids)[0]).argmax(-1)
    assert (draft_next == target_next).float().mean().item() >= 0.5


def test_generate_without_model_writes_python(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = "def add(a, b):"
    assert cli.main(["generate", "--prompt", prompt, "--max-tokens", "16", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("\n    "), f"the function body is not indented: {text!r}"
    assert text.isascii() and any(s in text for s in ('"""', "return", "(", ":")), text
    assert tokenizes_as_python(prompt + text), text


def tokenizes_as_python(source: str) -> bool:
    """Whether Python's tokenizer reads `source` without an error token or a bad dedent; a string
    or bracket left open at the end (16 tokens cut a docstring short) is allowed."""
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.ERRORTOKEN and token.string.strip():
                return False
    except tokenize.TokenError:  # EOF inside a multi-line string or statement
        return True
    except IndentationError:
        return False
    return True
