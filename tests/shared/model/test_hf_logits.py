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

YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
YARN_ROPE_MSCALE = {**YARN_ROPE, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}
# odd shapes: head_dim 24 or 20 with 6 heads over hidden 96, 3 or 2 KV heads, windows of 7 tokens
GEMMA2 = {"head_dim": 24, "sliding_window": 7, "query_pre_attn_scalar": 20}
GEMMA2_CAPPED = {**GEMMA2, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}
GEMMA3 = {
    "head_dim": 20,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "sliding_window": 7,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "query_pre_attn_scalar": 24,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    },
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
    "qwen3": ("qwen3", {"head_dim": 20}),
    "qwen3-bias-tied": (
        "qwen3",
        {"attention_bias": True, "tie_word_embeddings": True, "num_key_value_heads": 1},
    ),
    "phi3-window": ("phi3", {"sliding_window": 9, "num_key_value_heads": 2}),
    "gemma2": ("gemma2", GEMMA2),
    "gemma2-softcapped": ("gemma2", GEMMA2_CAPPED),
    "gemma3": ("gemma3", GEMMA3),
    "gemma3-logit-capped": ("gemma3", {**GEMMA3, "final_logit_softcapping": 3.0}),
    "llama-yarn": ("llama", {"rope_scaling": YARN_ROPE, "max_position_embeddings": 64}),
    "qwen2-yarn-mscale": ("qwen2", {"rope_scaling": YARN_ROPE_MSCALE, "max_position_embeddings": 64}),
}


def hf_model(path):
    """transformers' model in float32, with eager attention: its SDPA path drops the attention
    soft-capping of Gemma."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("case", sorted(CASES))
@torch.inference_mode()
def test_logits_match_transformers(make_checkpoint, case: str) -> None:
    arch, overrides = CASES[case]
    path = make_checkpoint(arch, **overrides)
    reference = hf_model(path)
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
        "rope_scaling": {"rope_type": "longrope", "factor": 4.0},
    }
    with pytest.raises(ModelConfigError, match="longrope"):
        ModelConfig.from_dict(raw)


def test_dynamic_ntk_matches_transformers_one_token_at_a_time(make_checkpoint) -> None:
    """Dynamic NTK past the pretraining length (32 here): each token rotated for its own position,
    as transformers does when tokens past it come one at a time (generate()); our prefill of the
    whole sequence gives the logits transformers gives token by token."""
    path = make_checkpoint(
        "llama", max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 3.0}
    )
    reference = hf_model(path)
    ours = load_model(path, torch.float32, torch.device("cpu"), max_positions=96)
    assert ModelConfig.from_dir(path).max_context_len == 96
    token_ids = torch.randint(0, 384, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        first = reference(torch.tensor([token_ids[:20]]), use_cache=True)
        expected, cache = [first.logits[0]], first.past_key_values
        for token in token_ids[20:]:
            step = reference(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            expected.append(step.logits[0])
            cache = step.past_key_values
        actual = run_prefill(ours, token_ids)
    assert (actual - torch.cat(expected)).abs().max().item() < 1e-4


RAW = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 8,
    "hidden_size": 8,
    "intermediate_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
            "partial_rotary_factor",
        ),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"}, "hidden_activation"),
        ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "use_bidirectional"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
        ({"sliding_window": 4, "layer_types": ["full_attention"]}, "layer_types"),
        ({"rope_scaling": {"rope_type": "dynamic"}}, "rope_scaling.factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope_scaling.factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
        ({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": -1}, "attn_logit_softcapping"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration"),
        (
            {"architectures": [], "model_type": "gemma3_text", "attn_logit_softcapping": 50.0},
            "attn_logit_softcapping",
        ),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(fields: dict, named: str) -> None:
    from shared.model import ModelConfigError

    with pytest.raises(ModelConfigError, match=named):
        ModelConfig.from_dict({**RAW, **fields})


def test_rope_scaling_stretches_the_context() -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    assert (
        ModelConfig.from_dict({**RAW, "max_position_embeddings": 4096, "rope_scaling": yarn}).max_context_len
        == 16384
    )
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert (
        ModelConfig.from_dict(
            {**RAW, "max_position_embeddings": 100, "rope_scaling": dynamic}
        ).max_context_len
        == 200
    )
    linear = {"rope_type": "linear", "factor": 2.0}
    assert (
        ModelConfig.from_dict({**RAW, "max_position_embeddings": 100, "rope_scaling": linear}).max_context_len
        == 100
    )


@pytest.mark.parametrize(
    "case", ["llama3-rope", "qwen2", "mistral-window", "qwen3", "phi3-window", "gemma2-softcapped", "gemma3"]
)
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
