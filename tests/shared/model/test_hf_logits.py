"""The model code computes the same logits as Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from shared.model import ModelConfig, load_model
from tests.paged import prefill_logits as run_prefill

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama-untied": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama3-rope-tied": ("llama", {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-mha-bias": ("llama", {"num_key_value_heads": 6, "attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "mistral": ("mistral", {"head_dim": 24}),
    "mistral-window": ("mistral", {"sliding_window": 7}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@torch.inference_mode()
def test_logits_match_transformers(make_checkpoint, case: str) -> None:
    import transformers

    arch, overrides = CASES[case]
    path = make_checkpoint(arch, **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, torch.float32, torch.device("cpu"), max_positions=512)
    token_ids = torch.randint(0, 384, (45,), generator=torch.Generator().manual_seed(1)).tolist()

    expected = reference(torch.tensor([token_ids])).logits[0]
    actual = run_prefill(ours, token_ids)

    assert (actual - expected).abs().max().item() < 1e-4


def test_unsupported_architecture_is_refused_by_name() -> None:
    from shared.model import ModelConfigError

    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})


def test_unsupported_rope_type_is_refused() -> None:
    from shared.model import ModelConfigError

    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    with pytest.raises(ModelConfigError, match="yarn"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("case", ["llama3-rope", "qwen2", "mistral-window"])
@torch.inference_mode()
def test_dense_forward_matches_paged_forward(make_checkpoint, case: str) -> None:
    arch, overrides = CASES[case]
    model = load_model(
        make_checkpoint(arch, **overrides), torch.float32, torch.device("cpu"), max_positions=512
    )
    token_ids = torch.randint(0, 384, (2, 30), generator=torch.Generator().manual_seed(4))
    dense = model.compute_logits(model.forward_dense(token_ids))
    for row in range(2):
        paged = run_prefill(model, token_ids[row].tolist())
        assert (dense[row] - paged).abs().max().item() < 1e-4
