"""Quantized models (shared/model/quantization.py, quant_config.py, the loader): logits close to the
unquantized model's, compressed-tensors checkpoints that load as the quantize-at-load model, and
clear errors for schemes specmesh does not run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.quant_ref import pack_int32, quantize_weight_ref, unpack_int32
from shared.model import ModelConfig, ModelConfigError, load_model
from shared.model.parallel import TensorParallel
from shared.model.quant_config import QuantScheme, parse_quantization_config
from shared.model.quantization import QuantizedLinear

SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.05,
)
"""Every input-feature count a multiple of 128 (int4's groups), also on each of 2 ranks."""
LOGIT_TOLERANCE = {"int8": 0.04, "fp8": 0.15, "int4": 0.55}
"""Relative error (L2 norm) of a quantized random model's logits against the unquantized model's,
same dtype, float32 or bf16: about 1.5x what this model gives (round to nearest on Gaussian
weights; an unrelated model would be at ~1.4)."""
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return Path(make_checkpoint("llama", **SHAPE))


def prompt_ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits_of(model_dir: Path | str, dtype: torch.dtype, quantization: str | None = None) -> torch.Tensor:
    model = load_model(model_dir, dtype, CPU, 64, quantization=quantization)
    return model.compute_logits(model.forward_dense(prompt_ids()))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_logits_stay_within_tolerance_of_the_unquantized_model(checkpoint, dtype) -> None:
    reference = logits_of(checkpoint, dtype)
    errors = {}
    for method, tolerance in LOGIT_TOLERANCE.items():
        errors[method] = relative_error(logits_of(checkpoint, dtype, method), reference)
        assert 0 < errors[method] < tolerance, f"{method} {dtype}: {errors[method]:.3f}"
    assert errors["int8"] < errors["int4"]  # more bits, closer


def test_every_decoder_linear_is_quantized_and_the_lm_head_and_embeddings_are_not(checkpoint) -> None:
    model = load_model(checkpoint, torch.bfloat16, CPU, 64, quantization="int4")
    layer = model.layers[0]
    for linear in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert isinstance(linear, QuantizedLinear) and linear.scheme == QuantScheme("int4", 128)
        assert linear.qweight.dtype == torch.int32 and linear.weight_scale.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.bfloat16
    fp8 = load_model(checkpoint, torch.bfloat16, CPU, 64, quantization="fp8").layers[0].mlp.down_proj
    assert fp8.qweight.dtype == torch.float8_e4m3fn and fp8.weight_scale.shape == (256, 1)


def test_quantize_at_load_stores_each_matrix_as_the_reference_quantizes_it(checkpoint) -> None:
    model = load_model(checkpoint, torch.float32, CPU, 64, quantization="int4")
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        up = f.get_tensor("model.layers.1.mlp.up_proj.weight")
    expected_weight, expected_scale = quantize_weight_ref(up, "int4", 128)
    gate_up = model.layers[1].mlp.gate_up_proj
    assert torch.equal(gate_up.qweight[512:], expected_weight)  # the up half of the fused rows
    assert torch.equal(gate_up.weight_scale[512:], expected_scale)


# ---- compressed-tensors checkpoints ----------------------------------------------------------------

WEIGHTS = {
    "int4": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
    "int8": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None},
    "fp8": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "group_size": None},
}
FORMATS = {"int4": "pack-quantized", "int8": "pack-quantized", "fp8": "float-quantized"}


def quantization_config(method: str, **changes: Any) -> dict[str, Any]:
    """`quantization_config` as llm-compressor writes it for W4A16 / W8A16 / FP8-dynamic."""
    weights = {**WEIGHTS[method], "dynamic": False, "actorder": None, "observer": "minmax"}
    input_activations = None
    if method == "fp8":
        input_activations = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        }
    config = {
        "quant_method": "compressed-tensors",
        "format": FORMATS[method],
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": input_activations,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }
    config.update(changes)
    return config


def write_compressed_tensors(
    source: Path, out: Path, method: str, per_tensor_fp8: bool = False, unpacked_int8: bool = False
) -> Path:
    """`source` re-saved as compressed-tensors: every decoder projection as `weight_packed` (int32,
    8 / 4 values a word, + 2^(bits-1), low bits first), `weight_scale` ([out, groups]) and
    `weight_shape`, or fp8 `weight` + `weight_scale`, or (`unpacked_int8`, format `int-quantized`)
    int8 `weight` + `weight_scale`; the rest as it was."""
    shutil.copytree(source, out)
    tensors = {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            tensor = f.get_tensor(name)
            if not any(f".{proj}." in name for proj in LINEARS):
                tensors[name] = tensor
                continue
            prefix = name.removesuffix(".weight")
            if method == "fp8":
                amax = tensor.float().abs().amax(1, keepdim=True)
                scale = (amax.amax() if per_tensor_fp8 else amax) / 448.0
                tensors[f"{prefix}.weight"] = (tensor.float() / scale).to(torch.float8_e4m3fn)
                tensors[f"{prefix}.weight_scale"] = scale.reshape(1) if per_tensor_fp8 else scale
                continue
            qweight, scale = quantize_weight_ref(tensor, method, WEIGHTS[method]["group_size"])
            bits = WEIGHTS[method]["num_bits"]
            assert torch.equal(pack_int32(unpack_int32(qweight, bits), bits), qweight)
            if unpacked_int8:
                tensors[f"{prefix}.weight"] = unpack_int32(qweight, 8)
                tensors[f"{prefix}.weight_scale"] = scale
                continue
            tensors[f"{prefix}.weight_packed"] = qweight
            tensors[f"{prefix}.weight_scale"] = scale
            tensors[f"{prefix}.weight_shape"] = torch.tensor(tensor.shape, dtype=torch.int32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(method)
    if per_tensor_fp8:
        config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    if unpacked_int8:
        config["quantization_config"]["format"] = "int-quantized"
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_compressed_tensors_checkpoint_loads_as_the_quantize_at_load_model(
    checkpoint, tmp_path, method
) -> None:
    quantized = write_compressed_tensors(checkpoint, tmp_path / "ct", method)
    assert ModelConfig.from_dir(quantized).quantization == QuantScheme.default(method)
    expected = logits_of(checkpoint, torch.float32, method)
    assert torch.equal(logits_of(quantized, torch.float32), expected)
    assert torch.equal(logits_of(quantized, torch.float32, method), expected)  # the same method asked for


def test_unpacked_int8_checkpoint_loads_as_the_quantize_at_load_model(checkpoint, tmp_path) -> None:
    """W8A8 checkpoints store int8 `weight` unpacked (format int-quantized); the weights run as int8
    weight-only."""
    quantized = write_compressed_tensors(checkpoint, tmp_path / "ct", "int8", unpacked_int8=True)
    assert torch.equal(logits_of(quantized, torch.float32), logits_of(checkpoint, torch.float32, "int8"))
    for rank in range(2):
        part = load_model(quantized, torch.float32, CPU, 64, TensorParallel(rank, 2))
        expected = load_model(checkpoint, torch.float32, CPU, 64, TensorParallel(rank, 2), "int8")
        assert torch.equal(part.layers[0].mlp.down_proj.qweight, expected.layers[0].mlp.down_proj.qweight)


def test_per_tensor_fp8_scales_load_as_one_scale_for_every_row(checkpoint, tmp_path) -> None:
    quantized = write_compressed_tensors(checkpoint, tmp_path / "ct", "fp8", per_tensor_fp8=True)
    model = load_model(quantized, torch.float32, CPU, 64)
    scale = model.layers[0].mlp.down_proj.weight_scale
    assert scale.shape == (256, 1) and torch.equal(scale, scale[:1].expand(256, 1))
    assert relative_error(logits_of(quantized, torch.float32), logits_of(checkpoint, torch.float32)) < 0.1


def test_a_quantized_checkpoint_refuses_another_method(checkpoint, tmp_path) -> None:
    quantized = write_compressed_tensors(checkpoint, tmp_path / "ct", "int4")
    with pytest.raises(
        ModelConfigError, match=r"already quantized as int4 \(groups of 128\); --quantization fp8"
    ):
        load_model(quantized, torch.float32, CPU, 64, quantization="fp8")


UNSUPPORTED = [
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    (
        {"config_groups": {"g": {"targets": ["Linear"], "weights": {**WEIGHTS["int4"], "symmetric": False}}}},
        "asymmetric weights",
    ),
    (
        {"config_groups": {"g": {"targets": ["Linear"], "weights": {**WEIGHTS["int4"], "num_bits": 2}}}},
        "int weights of 2 bits are not supported",
    ),
    (
        {
            "config_groups": {
                "g": {"targets": ["Linear"], "weights": {**WEIGHTS["int4"], "actorder": "group"}}
            }
        },
        "activation-ordered",
    ),
    ({"format": "marlin-24"}, "format 'marlin-24'; supported: pack-quantized"),
    ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "ignore lists layers besides the LM head"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
]


@pytest.mark.parametrize(("changes", "message"), UNSUPPORTED)
def test_unsupported_compressed_tensors_schemes_are_refused_by_name(changes, message) -> None:
    with pytest.raises(ModelConfigError, match=message):
        parse_quantization_config(quantization_config("int4", **changes))


def test_unsupported_scheme_is_refused_before_the_weights_load(checkpoint, tmp_path) -> None:
    quantized = write_compressed_tensors(checkpoint, tmp_path / "ct", "int4")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 3
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="int weights of 3 bits are not supported"):
        load_model(quantized, torch.float32, CPU, 64)


def test_bad_quantization_values_and_shapes_say_what_is_wrong(make_checkpoint) -> None:
    small = make_checkpoint("llama")  # hidden_size 96: no whole groups of 128
    with pytest.raises(
        ModelConfigError, match="quantization 'int3' is not supported; choose one of fp8, int8, int4"
    ):
        load_model(small, torch.float32, CPU, 64, quantization="int3")
    with pytest.raises(ModelConfigError, match=r"qkv_proj cannot be quantized as int4 \(groups of 128\)"):
        load_model(small, torch.float32, CPU, 64, quantization="int4")


# ---- tensor-parallel shards --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["int4", "fp8"])
@pytest.mark.parametrize("stored", [False, True])
def test_each_rank_holds_its_slice_of_the_whole_quantized_matrices(
    checkpoint, tmp_path, method, stored
) -> None:
    """Rows of column-parallel layers, packed words and groups of row-parallel ones, the scales with
    them (a per-channel scale of a row-parallel layer whole on each rank): from a bf16 checkpoint
    quantized at load, or from a compressed-tensors one."""
    source = write_compressed_tensors(checkpoint, tmp_path / "ct", method) if stored else checkpoint
    whole = load_model(checkpoint, torch.float32, CPU, 64, quantization=method)
    for rank in range(2):
        part = load_model(source, torch.float32, CPU, 64, TensorParallel(rank, 2), method)
        for name in ("qweight", "weight_scale"):
            full, local = (
                getattr(whole.layers[0].self_attn.qkv_proj, name),
                getattr(part.layers[0].self_attn.qkv_proj, name),
            )
            q = full[rank * 128 : (rank + 1) * 128]  # q rows [0, 256), k [256, 384), v [384, 512)
            k = full[256 + rank * 64 : 256 + (rank + 1) * 64]
            v = full[384 + rank * 64 : 384 + (rank + 1) * 64]
            assert torch.equal(local, torch.cat([q, k, v])), f"qkv {name} rank {rank}"
            down_full, down = (
                getattr(whole.layers[0].mlp.down_proj, name),
                getattr(part.layers[0].mlp.down_proj, name),
            )
            columns = down_full.shape[1] // 2
            expected = (
                down_full if down_full.shape[1] == 1 else down_full[:, rank * columns : (rank + 1) * columns]
            )
            assert torch.equal(down, expected), f"down_proj {name} rank {rank}"


def test_a_rank_without_whole_groups_is_refused(make_checkpoint) -> None:
    narrow = make_checkpoint(
        "llama", **{**SHAPE, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
    )
    with pytest.raises(ModelConfigError, match=r"o_proj cannot be quantized as int4 \(groups of 128\)"):
        load_model(narrow, torch.float32, CPU, 64, TensorParallel(0, 2), "int4")  # 64 input features a rank


def test_per_tensor_fp8_scales_split_like_per_channel_ones(checkpoint, tmp_path) -> None:
    quantized = write_compressed_tensors(checkpoint, tmp_path / "ct", "fp8", per_tensor_fp8=True)
    whole = load_model(quantized, torch.float32, CPU, 64)
    for rank in range(2):
        part = load_model(quantized, torch.float32, CPU, 64, TensorParallel(rank, 2))
        assert torch.equal(
            part.layers[1].mlp.down_proj.weight_scale, whole.layers[1].mlp.down_proj.weight_scale
        )
        gate_up = whole.layers[1].mlp.gate_up_proj.weight_scale
        expected = torch.cat(
            [gate_up[rank * 256 : (rank + 1) * 256], gate_up[512 + rank * 256 : 512 + (rank + 1) * 256]]
        )
        assert torch.equal(part.layers[1].mlp.gate_up_proj.weight_scale, expected)
