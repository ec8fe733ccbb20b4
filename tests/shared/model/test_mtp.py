"""The MTP head computes the same hidden states over the paged KV cache as densely, survives a
save / load round trip, and refuses to load against a target it was not made for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model import LlamaForCausalLM, ModelConfigError, load_model
from shared.model.mtp import MTPHead, load_mtp_head, save_mtp_head
from tests.paged import empty_cache, two_chunks

CPU = torch.device("cpu")


def load_target(path: Path) -> LlamaForCausalLM:
    return load_model(path, torch.float32, CPU, max_positions=512)


def random_head(target: LlamaForCausalLM, seed: int = 0) -> MTPHead:
    """A head with every weight random (norm gains included), so no part of it can hide."""
    torch.manual_seed(seed)
    head = MTPHead(target)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    return head.eval()


def paged_forward(
    head: MTPHead, input_ids: list[int], previous_hidden: torch.Tensor, block_size: int = 4
) -> torch.Tensor:
    """Runs one sequence through the head in two chunks over non-contiguous cache blocks."""
    config = head.config
    kv_cache = empty_cache(len(input_ids), block_size, config.num_key_value_heads, config.head_dim)
    chunks = []
    for chunk in two_chunks(len(input_ids), block_size):
        ids = torch.tensor(input_ids[chunk.start : chunk.end])
        hidden = previous_hidden[chunk.start : chunk.end]
        chunks.append(head(ids, chunk.positions, hidden, kv_cache, chunk.meta))
    return torch.cat(chunks)


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 7}], ids=["full", "window"])
@torch.inference_mode()
def test_paged_forward_matches_dense(make_checkpoint, overrides: dict) -> None:
    arch = "mistral" if overrides else "llama"
    target = load_target(make_checkpoint(arch, **overrides))
    head = random_head(target)
    token_ids = torch.randint(0, 384, (31,), generator=torch.Generator().manual_seed(2))
    hidden = target.forward_dense(token_ids[None])[0]  # [31, hidden]
    # row i pairs h_i with t_{i+1}
    dense = head.forward_dense(token_ids[None, 1:], hidden[None, :-1])[0]
    paged = paged_forward(head, token_ids[1:].tolist(), hidden[:-1])
    assert (dense - paged).abs().max().item() < 1e-4
    assert head.logits(dense).shape == (30, 384)


@torch.inference_mode()
def test_save_load_round_trip_is_exact(make_checkpoint, tmp_path: Path) -> None:
    target = load_target(make_checkpoint("llama"))
    head = random_head(target, seed=3)
    save_mtp_head(head, tmp_path / "mtp")

    config = json.loads((tmp_path / "mtp" / "config.json").read_text())
    assert config["architectures"] == ["SpecmeshMTPHead"]
    assert config["num_nextn_predict_layers"] == 1
    names = set(load_file(tmp_path / "mtp" / "model.safetensors"))
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "layer.self_attn.k_proj.weight"} <= names
    assert "layer.mlp.gate_proj.weight" in names and "layer.mlp.gate_up_proj.weight" not in names
    assert not any(name.startswith(("embed_tokens", "lm_head", "norm")) for name in names)

    loaded = load_mtp_head(tmp_path / "mtp", target, torch.float32, CPU)
    token_ids = torch.randint(0, 384, (2, 20), generator=torch.Generator().manual_seed(5))
    hidden = target.forward_dense(token_ids)
    assert torch.equal(head.forward_dense(token_ids, hidden), loaded.forward_dense(token_ids, hidden))
    assert loaded.target is target
    assert not any(p.data_ptr() == target.embed_tokens.weight.data_ptr() for p in loaded.parameters())


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}, "hidden_size"),
        ({"vocab_size": 400}, "vocab_size"),
    ],
    ids=["hidden", "vocab"],
)
def test_head_for_another_target_is_refused(make_checkpoint, tmp_path: Path, overrides, field) -> None:
    save_mtp_head(MTPHead(load_target(make_checkpoint("llama"))), tmp_path / "mtp")
    other = load_target(make_checkpoint("llama", **overrides))
    with pytest.raises(ModelConfigError, match=rf"not trained for this target model: .*{field}"):
        load_mtp_head(tmp_path / "mtp", other, torch.float32, CPU)


def test_wrong_architecture_and_missing_weights_are_refused(make_checkpoint, tmp_path: Path) -> None:
    target_dir = make_checkpoint("llama")
    target = load_target(target_dir)
    with pytest.raises(ModelConfigError, match="not an MTP head"):
        load_mtp_head(target_dir, target, torch.float32, CPU)

    mtp_dir = save_mtp_head(MTPHead(target), tmp_path / "mtp")
    tensors = load_file(mtp_dir / "model.safetensors")
    del tensors["layer.self_attn.v_proj.weight"]
    save_file(tensors, mtp_dir / "model.safetensors")
    with pytest.raises(ModelConfigError, match=r"missing weights: layer\.self_attn\.qkv_proj\.weight#2"):
        load_mtp_head(mtp_dir, target, torch.float32, CPU)


def test_a_directory_without_a_readable_config_is_refused_clearly(make_checkpoint, tmp_path: Path) -> None:
    target = load_target(make_checkpoint("llama"))
    with pytest.raises(ModelConfigError, match="has no config.json; expected an MTP head directory"):
        load_mtp_head(tmp_path, target, torch.float32, CPU)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="config.json is not valid JSON"):
        load_mtp_head(tmp_path, target, torch.float32, CPU)
