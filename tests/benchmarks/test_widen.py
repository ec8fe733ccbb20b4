"""A widened checkpoint computes its source's function: the same logits through the serving
forward, the same greedy tokens (and MTP and EAGLE-3 drafts) through the engine, the same MTP head
logits;
the loader reads what it writes, and shapes it cannot reach are refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks.widen import MAX_SHARD_BYTES, Shape, WidenResult, weight_bytes_per_step, widen, widened_config
from services.engine.llm import LLM
from shared.errors import ModelConfigError
from shared.model import LlamaForCausalLM, ModelConfig, load_model
from shared.model.loader import iter_checkpoint
from shared.model.mtp import MTPHead, load_mtp_head, save_mtp_head
from shared.sampling_params import SamplingParams
from tests.paged import prefill_logits

CPU = torch.device("cpu")
SOURCE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
WIDENINGS = {
    # more kv heads, same group size, same head_dim
    "wider": Shape(
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
    ),
    # larger groups and head_dim 16 -> 32 (new RoPE base, scaled queries), written in shards
    "longer-heads": Shape(
        hidden_size=80,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
    ),
}
SHARD_BYTES = {"wider": MAX_SHARD_BYTES, "longer-heads": 200_000}  # one file; several
TIED = {"wider": True, "longer-heads": False}  # an untied LM head only reads the stream
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def token_ids(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=generator).tolist() for n in lengths]


def load(path: Path) -> LlamaForCausalLM:
    return load_model(path, torch.float32, CPU, max_positions=512)


@pytest.fixture(scope="module", params=sorted(WIDENINGS))
def widening(request) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def source(make_checkpoint, widening: str) -> Path:
    return make_checkpoint("llama", **SOURCE, tie_word_embeddings=TIED[widening])


@pytest.fixture(scope="module")
def source_mtp(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head with every weight random, norm gains included, so no part of it can hide."""
    torch.manual_seed(1)
    head = MTPHead(load(source))
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    return save_mtp_head(head, tmp_path_factory.mktemp("source-mtp"))


@pytest.fixture(scope="module")
def source_eagle3(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE-3 head over every other token, every weight random, norm gains included."""
    from shared.model.eagle3 import default_aux_layers, save_eagle3_head
    from training.train_eagle3 import init_head_from_target

    model = load(source)
    layers = default_aux_layers(model.config.num_hidden_layers)
    head = init_head_from_target(model, torch.arange(0, model.config.vocab_size, 2), layers, CPU)
    torch.manual_seed(3)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    return save_eagle3_head(head, tmp_path_factory.mktemp("source-eagle3"))


@pytest.fixture(scope="module")
def widened(
    widening: str,
    source: Path,
    source_mtp: Path,
    source_eagle3: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> WidenResult:
    return widen(
        source,
        source_mtp,
        WIDENINGS[widening],
        tmp_path_factory.mktemp(f"widened-{widening}"),
        torch.float32,
        seed=2,
        max_shard_bytes=SHARD_BYTES[widening],
        eagle3_dir=source_eagle3,
    )


@torch.inference_mode()
def test_logits_match_through_the_paged_forward(source: Path, widened: WidenResult) -> None:
    original, wide = load(source), load(widened.target_dir)
    for ids in token_ids([23, 45], seed=3):
        expected = prefill_logits(original, ids)
        assert (prefill_logits(wide, ids) - expected).abs().max().item() < 1e-4


@torch.inference_mode()
def test_mtp_head_logits_match(source: Path, source_mtp: Path, widened: WidenResult) -> None:
    assert widened.mtp_dir is not None
    original, wide = load(source), load(widened.target_dir)
    original_head = load_mtp_head(source_mtp, original, torch.float32, CPU)
    wide_head = load_mtp_head(widened.mtp_dir, wide, torch.float32, CPU)
    ids = torch.tensor(token_ids([40, 40], seed=4))
    hidden, wide_hidden = original.forward_dense(ids), wide.forward_dense(ids)
    assert wide_hidden[..., SOURCE["hidden_size"] :].abs().max().item() == 0.0  # the stream's extra dims
    expected = original_head.logits(original_head.forward_dense(ids[:, 1:], hidden[:, :-1]))
    actual = wide_head.logits(wide_head.forward_dense(ids[:, 1:], wide_hidden[:, :-1]))
    assert (actual - expected).abs().max().item() < 1e-4


def test_greedy_generation_and_mtp_drafts_are_identical(
    source: Path, source_mtp: Path, widened: WidenResult
) -> None:
    prompts = token_ids([3, 17, 40, 9], seed=5)

    def run(target: Path, head: Path) -> list[tuple[list[int], dict]]:
        spec = dict(method="mtp", model=str(head), num_speculative_tokens=2, adaptive=False)
        llm = LLM(str(target), device="cpu", max_model_len=96, speculative_config=spec)
        return [
            (o.token_ids, o.spec_stats)
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        ]

    assert widened.mtp_dir is not None
    naive = LLM(str(source), device="cpu", max_model_len=96).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY
    )
    expected = run(source, source_mtp)
    assert [ids for ids, _ in expected] == [o.token_ids for o in naive]
    assert run(widened.target_dir, widened.mtp_dir) == expected  # tokens and acceptance


def test_greedy_generation_and_eagle3_drafts_are_identical(
    widening: str, source: Path, source_eagle3: Path, widened: WidenResult
) -> None:
    """The widened EAGLE-3 head (its layer of the target's shape, over the widened target's
    streams) drafts what the source head drafts: the same tokens and acceptance, chain and tree."""
    prompts = token_ids([3, 17, 40, 9], seed=6)

    def run(target: Path, head: Path, **tree: list[int]) -> list[tuple[list[int], dict]]:
        spec = dict(method="eagle3", model=str(head), num_speculative_tokens=2, adaptive=False, **tree)
        llm = LLM(str(target), device="cpu", max_model_len=96, speculative_config=spec)
        return [
            (o.token_ids, o.spec_stats)
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        ]

    assert widened.eagle3_dir is not None
    config = json.loads((widened.eagle3_dir / "config.json").read_text())
    assert config["hidden_size"] == config["target_hidden_size"] == WIDENINGS[widening].hidden_size
    for tree in ({}, {"tree": [2, 2]}):
        expected = run(source, source_eagle3, **tree)
        assert sum(stats["num_draft_tokens"] for _, stats in expected) > 0
        assert run(widened.target_dir, widened.eagle3_dir, **tree) == expected


def test_checkpoint_keeps_the_stream_clean(widening: str, widened: WidenResult) -> None:
    """Writers into the residual stream are zero outside the source's block, readers are random
    there (zeros could time faster), and the config keeps the source's vocabulary and tying."""
    config = ModelConfig.from_dir(widened.target_dir)
    hidden, num_layers = SOURCE["hidden_size"], SOURCE["num_hidden_layers"]
    tied = TIED[widening]
    assert (config.vocab_size, config.tie_word_embeddings, config.rope_scaling) == (384, tied, None)
    assert Shape.of(config) == WIDENINGS[widening]
    assert (widened.target_dir / "tokenizer.json").is_file()
    tensors = dict(iter_checkpoint(widened.target_dir))
    embedding = tensors["model.embed_tokens.weight"]
    assert embedding[:, hidden:].abs().max() == 0
    assert ("lm_head.weight" in tensors) != tied
    if not tied:
        assert (tensors["lm_head.weight"][:, hidden:] != 0).all()
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        for writer in ("self_attn.o_proj", "mlp.down_proj"):
            weight = tensors[f"{layer}{writer}.weight"]
            assert weight[hidden:].abs().max() == 0
            assert (weight.abs().max() == 0) == (i >= num_layers)  # new layers write nothing
        for reader in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj"):
            assert (tensors[f"{layer}{reader}.weight"][:, hidden:] != 0).all()
    gathered = 0 if tied else embedding.numel()  # an untied embedding is only gathered from
    assert widened.target_bytes_per_step == 4 * (sum(t.numel() for t in tensors.values()) - gathered)
    mtp = dict(iter_checkpoint(widened.mtp_dir)) if widened.mtp_dir else {}
    assert mtp["eh_proj.weight"][hidden:].abs().max() == 0


def test_sharded_when_asked(widening: str, widened: WidenResult) -> None:
    index = widened.target_dir / "model.safetensors.index.json"
    sharded = SHARD_BYTES[widening] < MAX_SHARD_BYTES
    assert index.is_file() == sharded
    if sharded:
        weight_map = json.loads(index.read_text())["weight_map"]
        for name, file_name in weight_map.items():
            with safe_open(str(widened.target_dir / file_name), framework="pt") as f:
                assert name in f.keys()  # noqa: SIM118 - safe_open is not a mapping


def test_preset_shapes_and_their_weight_bytes() -> None:
    """The figures the command prints for the shipped 15M model (bf16): every parameter once."""
    raw = json.loads(Path("models/specmesh-code-15m/config.json").read_text())
    expected = {"llama-3.2-1b": (64, 1e4, 1_979_846_656), "qwen2.5-7b": (128, 1e8, 13_109_705_728)}
    for name, (head_dim, rope_theta, weight_bytes) in expected.items():
        config = ModelConfig.from_dict(widened_config(raw, Shape.preset(name), torch.bfloat16))
        assert (config.head_dim, config.vocab_size, config.architecture) == (
            head_dim,
            8192,
            "LlamaForCausalLM",
        )
        assert config.rope_theta == pytest.approx(rope_theta)
        assert config.rms_norm_eps == pytest.approx(1e-5 * 384 / config.hidden_size)
        assert weight_bytes_per_step(config, torch.bfloat16) == weight_bytes


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(num_attention_heads=3, num_key_value_heads=3), "query heads per kv head < the source's 2"),
        (dict(hidden_size=48), "hidden_size 48 < the source's 64"),
        (dict(head_dim=8), "head_dim 8 < the source's 16"),
        (dict(num_attention_heads=6, num_key_value_heads=4), "not a multiple of num_key_value_heads"),
    ],
)
def test_unreachable_shapes_are_refused(make_checkpoint, tmp_path: Path, change: dict, message: str) -> None:
    shape = dataclasses.replace(WIDENINGS["wider"], **change)
    with pytest.raises(ModelConfigError, match=message):
        widen(make_checkpoint("llama", **SOURCE), None, shape, tmp_path)
    assert not (tmp_path / "target").exists()


def test_unknown_preset_and_existing_output_are_refused(make_checkpoint, tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="unknown shape 'llama-70b'; known shapes: llama-3.2-1b"):
        Shape.preset("llama-70b")
    (tmp_path / "target").mkdir()
    with pytest.raises(FileExistsError, match="target exists"):
        widen(make_checkpoint("llama", **SOURCE), None, WIDENINGS["wider"], tmp_path)


def test_biased_source_is_refused(make_checkpoint, tmp_path: Path) -> None:
    qwen2 = make_checkpoint("qwen2")  # q/k/v biases
    with pytest.raises(ModelConfigError, match="the source has biases"):
        widen(qwen2, None, Shape.of(ModelConfig.from_dir(qwen2)), tmp_path)
