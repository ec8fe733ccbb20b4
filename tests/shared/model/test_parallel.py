"""The model split over tensor-parallel ranks: the same logits as one rank and as transformers
(2 gloo processes on CPU), and a loader that reads only each rank's slices of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shared.model.loader as loader
from shared.model import load_model
from shared.model.parallel import TensorParallel
from tests.paged import prefill_logits

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA, one KV head per rank; a vocabulary that does not split evenly (a padded last shard)
    "llama-gqa-llama3-rope": (
        "llama",
        {
            "num_key_value_heads": 2,
            "vocab_size": 391,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    # biases on every projection: the row-parallel ones are added once, after the all-reduce
    "llama-mha-bias": ("llama", {"num_key_value_heads": 6, "attention_bias": True, "mlp_bias": True}),
    # one KV head, replicated on both ranks; tied embedding and LM head, both vocab-parallel
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "mistral-window": ("mistral", {"sliding_window": 7, "num_key_value_heads": 2}),
    # q/k/v and gate/up fused in the checkpoint: each rank reads its rows of every part
    "phi3-fused": ("phi3", {"num_key_value_heads": 2}),
    # per-head q/k norms (replicated), GeGLU, offset norms, soft-capping, two RoPE bases
    "qwen3": ("qwen3", {"head_dim": 20, "num_key_value_heads": 2}),
    "gemma3": (
        "gemma3",
        {
            "head_dim": 20,
            "num_key_value_heads": 1,
            "sliding_window": 7,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma2-softcapped": (
        "gemma2",
        {
            "head_dim": 24,
            "num_key_value_heads": 2,
            "sliding_window": 7,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    ),
}
TOKEN_IDS = torch.randint(0, 384, (45,), generator=torch.Generator().manual_seed(1)).tolist()


def _rank_logits(rank: int, paths: list[str], store_path: str, out_dir: str) -> None:
    """One rank of 2: the prefill logits of every checkpoint, saved by rank 0."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        tp = TensorParallel(rank, 2, dist.group.WORLD)
        for i, path in enumerate(paths):
            model = load_model(path, torch.float32, torch.device("cpu"), max_positions=512, tp=tp)
            with torch.inference_mode():
                logits = prefill_logits(model, TOKEN_IDS)
            if rank == 0:
                torch.save(logits, Path(out_dir) / f"{i}.pt")
        dist.barrier()  # neither rank tears the group down while the other still talks to it
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint) -> dict[str, Path]:
    return {case: make_checkpoint(arch, **overrides) for case, (arch, overrides) in CASES.items()}


@pytest.fixture(scope="module")
def split_logits(checkpoints, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Every case's logits from 2 ranks (one pair of processes for all of them)."""
    out = tmp_path_factory.mktemp("tp-logits")
    paths = [str(checkpoints[case]) for case in CASES]
    mp.spawn(_rank_logits, args=(paths, str(out / "store"), str(out)), nprocs=2, join=True)
    return {case: torch.load(out / f"{i}.pt") for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", sorted(CASES))
@torch.inference_mode()
def test_two_ranks_give_the_logits_of_one_and_of_transformers(checkpoints, split_logits, case: str) -> None:
    import transformers

    path = checkpoints[case]
    one_rank = prefill_logits(
        load_model(path, torch.float32, torch.device("cpu"), max_positions=512), TOKEN_IDS
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    expected = reference(torch.tensor([TOKEN_IDS])).logits[0]

    two_ranks = split_logits[case]
    assert two_ranks.shape == one_rank.shape == expected.shape
    assert (two_ranks - one_rank).abs().max().item() < 1e-4
    assert (two_ranks - expected).abs().max().item() < 1e-4


class Recorder:
    """Stands in for `safe_open`: counts the elements each tensor's slices hand over."""

    def __init__(self, real_open: Any) -> None:
        self.real_open = real_open
        self.elements: dict[str, int] = {}
        self.whole: dict[str, int] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return RecordedFile(self, self.real_open(*args, **kwargs))


class RecordedFile:
    def __init__(self, recorder: Recorder, inner: Any):
        self.recorder, self.inner = recorder, inner

    def __enter__(self) -> RecordedFile:
        self.file = self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.file.keys())

    def get_slice(self, name: str) -> RecordedSlice:
        return RecordedSlice(self.recorder, name, self.file.get_slice(name))


class RecordedSlice:
    def __init__(self, recorder: Recorder, name: str, inner: Any):
        self.recorder, self.name, self.inner = recorder, name, inner
        recorder.whole[name] = int(torch.Size(inner.get_shape()).numel())

    def get_shape(self) -> list[int]:
        return list(self.inner.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self.inner[index]
        self.recorder.elements[self.name] = self.recorder.elements.get(self.name, 0) + tensor.numel()
        return tensor


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_slices(checkpoints, monkeypatch, rank: int) -> None:
    path = checkpoints["llama-gqa-llama3-rope"]  # hidden 96, 6 heads of 16, intermediate 160
    recorder = Recorder(loader.safe_open)
    monkeypatch.setattr(loader, "safe_open", recorder)
    model = load_model(path, torch.float32, torch.device("cpu"), 512, TensorParallel(rank, 2))
    monkeypatch.undo()
    whole = load_model(path, torch.float32, torch.device("cpu"), 512)

    rows = model.embed_tokens.num_embeddings  # 196 of the 391 rows per rank
    # the last shard's rows past the vocabulary, in the embedding and in the (untied) LM head
    padding = 2 * (2 * rows - 391) * 96 if rank == 1 else 0
    read = sum(recorder.elements.values())
    assert read == sum(p.numel() for p in model.parameters()) - padding
    assert read < 0.6 * sum(recorder.whole.values())
    q_rows = 3 * 16
    first_q = whole.layers[0].self_attn.qkv_proj.weight[rank * q_rows : (rank + 1) * q_rows]
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight[:q_rows], first_q)
    down = whole.layers[1].mlp.down_proj.weight[:, rank * 80 : (rank + 1) * 80]
    assert torch.equal(model.layers[1].mlp.down_proj.weight, down)
    embed = whole.embed_tokens.weight[rank * rows : (rank + 1) * rows]
    assert torch.equal(model.embed_tokens.weight[: embed.shape[0]], embed)
