"""EAGLE-3 heads in the layout public releases use load and serve; specmesh's own round-trip; a
head that does not fit the target is refused with what does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.engine.llm import LLM
from shared.model import LlamaForCausalLM, ModelConfigError, load_model
from shared.model.eagle3 import load_eagle3_head, save_eagle3_head
from shared.sampling_params import SamplingParams
from tests.paged import empty_cache, two_chunks

CPU = torch.device("cpu")
DRAFT_VOCAB = 100
HEAD_INTERMEDIATE = 64


@pytest.fixture(scope="module")
def target_dir(make_checkpoint) -> Path:
    return make_checkpoint("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def target(target_dir) -> LlamaForCausalLM:
    return load_model(target_dir, torch.float32, CPU, max_positions=512)


def public_tensors(
    target: LlamaForCausalLM, embedding: bool = False, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random weights under the names and shapes of a public EAGLE-3 release for `target`: q/k/v
    read [embedding | features] (2 x hidden), the LM head a draft vocabulary of every third token."""
    config = target.config
    hidden, head_dim = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    draft_to_target = torch.arange(DRAFT_VOCAB) * 3
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": 1 + rand(hidden),
        "midlayer.hidden_norm.weight": 1 + rand(hidden),
        "midlayer.self_attn.q_proj.weight": rand(q_rows, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_rows, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_rows, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, q_rows),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden),
        "midlayer.mlp.gate_proj.weight": rand(HEAD_INTERMEDIATE, hidden),
        "midlayer.mlp.up_proj.weight": rand(HEAD_INTERMEDIATE, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, HEAD_INTERMEDIATE),
        "norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(DRAFT_VOCAB, hidden),
        "d2t": draft_to_target - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, draft_to_target, True),
    }
    if embedding:
        tensors["embed_tokens.weight"] = rand(config.vocab_size, hidden)
    return tensors


def write_public_head(
    out: Path, target: LlamaForCausalLM, embedding: bool = False, **config_changes: object
) -> Path:
    config = target.config
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": HEAD_INTERMEDIATE,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": 2048,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        **config_changes,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw))
    tensors = {
        name: t.half() if t.is_floating_point() else t
        for name, t in public_tensors(target, embedding).items()
    }
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_a_public_layout_head_loads_every_weight_where_it_belongs(target, tmp_path) -> None:
    head_dir = write_public_head(tmp_path / "head", target)
    head = load_eagle3_head(head_dir, target, torch.float32, CPU)
    stored = {
        name: t.half().float() if t.is_floating_point() else t for name, t in public_tensors(target).items()
    }
    attn = head.midlayer.self_attn
    assert torch.equal(head.fc.weight, stored["fc.weight"])
    qkv = [stored[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat(qkv))
    gate_up = [stored[f"midlayer.mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(head.midlayer.mlp.gate_up_proj.weight, torch.cat(gate_up))
    assert torch.equal(head.lm_head.weight, stored["lm_head.weight"])
    assert torch.equal(head.midlayer.hidden_norm.weight, stored["midlayer.hidden_norm.weight"])
    assert head.aux_layers == (2, 2, 1)  # EAGLE-3's low / mid / high of a 4-layer target
    assert head.embed_tokens is None  # the target's embedding, shared
    assert torch.equal(head.target_ids, torch.arange(DRAFT_VOCAB) * 3)
    hidden = torch.randn(5, target.config.hidden_size)
    with torch.no_grad():
        logits, draft = head.logits(hidden), head.draft_logits(hidden)
    assert torch.equal(logits[:, head.target_ids], draft)
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool).index_fill_(0, head.target_ids, False)
    assert torch.isneginf(logits[:, outside]).all()


def test_a_head_with_its_own_embedding_uses_it(target, tmp_path) -> None:
    head_dir = write_public_head(tmp_path / "head", target, embedding=True)
    head = load_eagle3_head(head_dir, target, torch.float32, CPU)
    assert head.embed_tokens is not None
    ids = torch.tensor([3, 7, 11])
    expected = public_tensors(target, embedding=True)["embed_tokens.weight"].half().float()[ids]
    assert torch.equal(head.embed(ids), expected)


@torch.inference_mode()
@pytest.mark.parametrize("embedding", [False, True], ids=["target-embedding", "own-embedding"])
def test_a_chained_draft_is_the_unfused_layer_and_its_logits(target, tmp_path, embedding: bool) -> None:
    """`forward_with_logits` (a chained draft: the input norms in one kernel, the last residual add
    in the final norm's) equals the layer's formulas op by op and `logits` of its output."""
    head = load_eagle3_head(
        write_public_head(tmp_path / "head", target, embedding), target, torch.float32, CPU
    )
    layer, config = head.midlayer, head.config
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, target.config.vocab_size, (9,), generator=generator)
    features = torch.randn(9, config.hidden_size, generator=generator)
    caches = [empty_cache(9, 4, config.num_key_value_heads, config.head_dim) for _ in range(2)]
    for chunk in two_chunks(9, 4):
        chunk_ids, hidden = ids[chunk.start : chunk.end], features[chunk.start : chunk.end]
        inputs = torch.cat((layer.input_layernorm(head.embed(chunk_ids)), layer.hidden_norm(hidden)), dim=-1)
        stream = hidden + layer.self_attn(chunk.positions, inputs, caches[0], chunk.meta)
        expected = stream + layer.mlp(layer.post_attention_layernorm(stream))
        logits, out = head.forward_with_logits(
            chunk_ids.int(), chunk.positions, hidden, caches[1], chunk.meta
        )
        assert torch.equal(out, expected)
        assert torch.equal(logits, head.logits(expected))


def test_a_public_layout_head_serves_the_targets_greedy_output(target_dir, target, tmp_path) -> None:
    """A user's published head for their model is served as is: drafts from the mapped draft
    vocabulary, verified by the target, greedy output unchanged."""
    head_dir = write_public_head(
        tmp_path / "head", target, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}
    )
    prompts = [[5, 9, 5, 9, 5, 9, 5], [40, 41, 42, 43, 40, 41]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    naive = LLM(str(target_dir), device="cpu", max_model_len=64).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(str(target_dir), device="cpu", max_model_len=64, speculative_config=spec)
    assert llm.engine.runner.aux_layers == (0, 1, 3)
    drafted = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in naive]
    assert all(o.spec_stats["num_draft_tokens"] > 0 for o in drafted)


def test_save_and_load_round_trip(target, tmp_path) -> None:
    head = load_eagle3_head(write_public_head(tmp_path / "public", target), target, torch.float32, CPU)
    saved = save_eagle3_head(head, tmp_path / "saved")
    again = load_eagle3_head(saved, target, torch.float32, CPU)
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert again.aux_layers == head.aux_layers
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"architectures": ["SpecmeshMTPHead"]}, "not an EAGLE-3 head"),
        ({"hidden_size": 48}, "hidden_size 48 != target's 96"),
        ({"vocab_size": 500}, "vocab_size 500 != target's 384"),
        ({"draft_vocab_size": 999}, "draft_vocab_size 999 is not in 1..vocab_size 384"),
        ({"num_hidden_layers": 2}, "num_hidden_layers 2 is not supported"),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}},
            "reads 3 target layers, not \\[0, 1\\]",
        ),
        ({"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}, "layers 0..3, not \\[7\\]"),
    ],
)
def test_a_head_that_does_not_fit_is_refused(target, tmp_path, changes: dict, message: str) -> None:
    head_dir = write_public_head(tmp_path / "head", target, **changes)
    with pytest.raises(ModelConfigError, match=message):
        load_eagle3_head(head_dir, target, torch.float32, CPU)


def test_a_vocabulary_map_that_does_not_fit_is_refused(target, tmp_path) -> None:
    head_dir = write_public_head(tmp_path / "head", target)
    tensors = public_tensors(target)
    tensors["d2t"][-1] = 10_000  # past the target's vocabulary
    save_file(tensors, str(head_dir / "model.safetensors"))
    with pytest.raises(ModelConfigError, match="d2t maps draft ids outside"):
        load_eagle3_head(head_dir, target, torch.float32, CPU)
    del tensors["d2t"]
    save_file(tensors, str(head_dir / "model.safetensors"))
    with pytest.raises(ModelConfigError, match="needs a d2t tensor"):
        load_eagle3_head(head_dir, target, torch.float32, CPU)


def test_a_directory_without_a_readable_config_is_refused_clearly(target, tmp_path) -> None:
    with pytest.raises(ModelConfigError, match="has no config.json; expected an EAGLE-3 head directory"):
        load_eagle3_head(tmp_path, target, torch.float32, CPU)
    (tmp_path / "config.json").write_text("[1, 2")
    with pytest.raises(ModelConfigError, match="config.json is not valid JSON"):
        load_eagle3_head(tmp_path, target, torch.float32, CPU)
