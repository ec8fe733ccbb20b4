"""Decode steps replayed from CUDA graphs: padding that changes nothing, and the same tokens as eager."""

from __future__ import annotations

import pytest
import torch

from kernels import AttentionMetadata, TokenHistory
from services.engine.cuda_graph import BUCKETS, DecodeGraphs, HostBatch, pad_decode_batch
from services.engine.llm import LLM
from shared.model import load_model
from shared.sampling_params import SamplingParams

BLOCK = 4


def decode_batch(query_lens: list[int], contexts: list[int], vocab: int) -> HostBatch:
    """Sequences with `contexts[i]` tokens already cached verifying `query_lens[i]` new ones, each in
    its own run of blocks."""
    generator = torch.Generator().manual_seed(0)
    batch = HostBatch([], [], [], [], [], [], [])
    next_block = 1  # block 0 is what padding reads
    for query_len, context in zip(query_lens, contexts):
        seq_len = context + query_len
        table = list(range(next_block, next_block + -(-seq_len // BLOCK)))
        next_block += len(table)
        row = batch.num_tokens
        batch.input_ids += torch.randint(0, vocab, (query_len,), generator=generator).tolist()
        batch.positions += range(context, seq_len)
        batch.slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context, seq_len)]
        batch.query_lens.append(query_len)
        batch.seq_lens.append(seq_len)
        batch.block_tables.append(table)
        batch.logits_indices += range(row, row + query_len)
    return batch


def run_eager(model, caches, input_ids, positions, slots, starts, seq_lens, tables, query_lens):
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=tables,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens.tolist(),
    )
    return model.compute_logits(model(input_ids, positions, caches, meta))


@torch.inference_mode()
def test_padding_to_a_bucket_leaves_real_rows_and_cache_unchanged(make_checkpoint) -> None:
    """What a graph replays for a padded batch: the same logits for the real tokens, and padding
    writes nothing into the cache."""
    model = load_model(
        str(make_checkpoint("llama", num_hidden_layers=2)), torch.float32, torch.device("cpu"), 128
    )
    config = model.config
    shape = (64, BLOCK, config.num_key_value_heads, config.head_dim)
    generator = torch.Generator().manual_seed(1)
    caches = [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for _ in range(2)
    ]
    batch = decode_batch([1, 4, 2], [9, 17, 3], config.vocab_size)
    plain = pad_decode_batch(batch, batch.num_tokens)
    fresh = [(k.clone(), v.clone()) for k, v in caches]
    expected = run_eager(
        model,
        fresh,
        plain.input_ids,
        plain.positions,
        plain.slot_mapping,
        plain.query_start_loc,
        plain.seq_lens,
        plain.block_tables,
        plain.query_lens,
    )
    bucket = 12
    padded = pad_decode_batch(batch, bucket)
    assert padded.query_lens == [1, 4, 2] + [1] * 5 + [0] * 4
    assert padded.slot_mapping[batch.num_tokens :].eq(-1).all()
    padded_caches = [(k.clone(), v.clone()) for k, v in caches]
    got = run_eager(
        model,
        padded_caches,
        padded.input_ids,
        padded.positions,
        padded.slot_mapping,
        padded.query_start_loc,
        padded.seq_lens,
        padded.block_tables,
        padded.query_lens,
    )
    torch.testing.assert_close(got[: batch.num_tokens], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()
    written = torch.zeros(64 * BLOCK, dtype=torch.bool)
    written[batch.slots] = True
    for (k, v), (k0, v0), (k1, v1) in zip(caches, fresh, padded_caches):
        for before, unpadded, after in ((k, k0, k1), (v, v0, v1)):
            before, unpadded, after = (t.flatten(0, 1) for t in (before, unpadded, after))
            assert torch.equal(after[~written], before[~written])  # padding wrote nowhere
            torch.testing.assert_close(after[written], unpadded[written], rtol=1e-5, atol=1e-5)


def test_bucket_lookup_takes_the_smallest_fit() -> None:
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets = [b for b in BUCKETS if b < 100] + [100]
    graphs.query_lens = [1, 6]
    assert graphs.lookup(1, 1) == (1, 1)
    assert graphs.lookup(13, 1) == (16, 1)
    assert graphs.lookup(13, 4) == (16, 6)
    assert graphs.lookup(97, 6) == (100, 6)
    assert graphs.lookup(101, 1) is None  # past the largest bucket: eager
    assert graphs.lookup(8, 7) is None  # a longer query than any graph was captured for


def test_graphs_are_off_on_cpu(make_checkpoint) -> None:
    llm = LLM(str(make_checkpoint("llama", num_hidden_layers=1)), device="cpu", max_model_len=64)
    assert llm.engine.runner.graphs is None


def test_fixed_token_history_rows_are_a_cache() -> None:
    """The graph step's history never moves: a request needing a row when none is free takes the row
    of one not in the current call, and that one's row is rewritten when it comes back."""
    history = TokenHistory(torch.device("cpu"), num_rows=3, capacity=16, fixed=True)  # 2 rows + scratch
    a, b, c = [1, 2, 3], [4, 5], [6, 7, 8, 9]
    rows = history.sync([("a", a), ("b", b)])
    assert sorted(rows) == [0, 1]
    history.precomputed["a"] = (3, [9])
    [row_c] = history.sync([("c", c)])  # a or b gives its row up; the scratch row stays free
    assert row_c in (0, 1) and len(history.row_of) == 2
    evicted = "a" if "a" not in history.row_of else "b"
    assert evicted not in history.precomputed
    [row] = history.sync([(evicted, a if evicted == "a" else b)])
    expected = a if evicted == "a" else b
    assert history.tokens[row, : len(expected)].tolist() == expected
    with pytest.raises(ValueError, match="cannot grow"):
        history.sync([("long", list(range(20)))])


@pytest.mark.parametrize(
    "method,sampling",
    [
        ("naive", "greedy"),
        ("ngram", "greedy"),
        ("ngram", "seeded"),
        ("suffix", "greedy"),
        ("ngram", "penalty"),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_gives_the_eager_tokens(make_checkpoint, method: str, sampling: str, dtype: str) -> None:
    """Tokens from graph replays (forward, then verify + n-gram drafting in the tail graph) equal
    eager ones, with batches that cross bucket sizes (sequences finish at different lengths) and
    drafts of varying length; penalties take the eager verifier after the forward replay."""
    path = str(make_checkpoint("llama", num_hidden_layers=2))
    spec = {"method": method}
    if method != "naive":
        spec |= {"num_speculative_tokens": 4, "adaptive": False}
    generator = torch.Generator().manual_seed(5)
    prompts = []
    for i in range(21):
        span = torch.randint(3, 384, (5 + i % 7,), generator=generator).tolist()
        prompts.append(torch.randint(3, 384, (i,), generator=generator).tolist() + span * 3)
    extra = {
        "greedy": {"temperature": 0.0},
        "seeded": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 7},
        "penalty": {"temperature": 0.0, "repetition_penalty": 1.2},
    }[sampling]
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True, **extra) for i in range(21)]
    outputs = {}
    for eager in (True, False):
        llm = LLM(
            path,
            device="cuda",
            dtype=dtype,
            max_model_len=256,
            speculative_config=spec,
            enforce_eager=eager,
            cuda_graph_max_tokens=64,
        )
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outputs[eager] = [o.token_ids for o in generated]
        graphs = llm.engine.runner.graphs
        if eager:
            assert graphs is None
            continue
        assert graphs is not None and graphs.num_replays > 10
        if sampling == "penalty":
            assert graphs.num_tail_replays == 0  # penalties are applied by the eager verifier
        else:
            assert graphs.num_tail_replays == graphs.num_replays
        if method != "naive" and sampling != "penalty":  # a repetition penalty rejects repeats
            assert sum(o.spec_stats["num_accepted_tokens"] for o in generated) > 0
    if dtype == "float32":
        assert outputs[False] == outputs[True]
    else:  # bf16 GEMMs of a padded batch may round differently: allow a late divergence, not an early one
        for graph_tokens, eager_tokens in zip(outputs[False], outputs[True]):
            assert graph_tokens[:4] == eager_tokens[:4]
