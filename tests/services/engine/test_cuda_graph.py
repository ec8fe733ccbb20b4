"""Decode steps replayed from CUDA graphs: padding that changes nothing, the tail's post-step update
stopping where the eager path does, one output buffer for every graph, and the same tokens as eager."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kernels.ngram
import kernels.verify
from kernels import AttentionMetadata, TokenHistory
from kernels.ngram_ref import ngram_match_ref
from kernels.verify_ref import ACCEPT_ALL, GREEDY, verify_sample_ref
from services.engine.cuda_graph import (
    BUCKETS,
    DecodeGraphs,
    HostBatch,
    PaddedInputs,
    StopInputs,
    TailInputs,
    TailOutput,
    TailSpec,
    eager_post_step,
    pad_decode_batch,
)
from services.engine.llm import LLM
from services.engine.model_runner import row_batch, verify_request
from services.engine.rejection_sampler import RejectionSampler, RowSampling
from services.engine.sequence import FinishReason, Sequence
from services.engine.spec_decode.ngram import NgramProposer
from shared.model import load_model
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

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


def run_eager(model, caches, inputs: PaddedInputs):
    """The model's logits for a (padded) decode batch, run eagerly over the reference attention."""
    meta = AttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        query_start_loc=inputs.query_start_loc,
        seq_lens=inputs.seq_lens,
        block_tables=inputs.block_tables,
        query_lens_cpu=inputs.query_lens,
        seq_lens_cpu=inputs.seq_lens.tolist(),
    )
    return model.compute_logits(model(inputs.input_ids, inputs.positions, caches, meta))


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
    expected = run_eager(model, fresh, plain)
    bucket = 12
    padded = pad_decode_batch(batch, bucket)
    assert padded.query_lens == [1, 4, 2] + [1] * 5 + [0] * 4
    assert padded.slot_mapping[batch.num_tokens :].eq(-1).all()
    padded_caches = [(k.clone(), v.clone()) for k, v in caches]
    got = run_eager(model, padded_caches, padded)
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


# ---- the tail's post-step update against the eager path ------------------------------------------

EOS = 2
SPAN = [21, 22, 23, 24, 25, 26]
A, B, C, D = 11, 12, 13, 14


@dataclass
class PlantedStep:
    """A verify step of six requests whose drafts all pass (greedy, accept_all) and end at an EOS, a
    stop id or max_tokens, or run on; its logits plant the bonus tokens."""

    seqs: list[Sequence]
    row_of: dict[str, int]
    """History row of the n-gram requests."""
    batch: HostBatch
    tail: TailInputs
    logits: torch.Tensor  # [num_tokens, vocab_size] float32 on the CPU
    expected: list[TailOutput]
    """The eager path's outputs (torch verifier, post-step twin) on the CPU."""


def planted_step(graphs: DecodeGraphs, history: TokenHistory, vocab_size: int) -> PlantedStep:
    def greedy(**fields) -> SamplingParams:
        return SamplingParams(temperature=0.0, **({"max_tokens": 20} | fields))

    cases = [  # (params, drafts, has a history row)
        (greedy(), [A, EOS, B, C], True),  # EOS mid-draft
        (greedy(ignore_eos=True), [A, EOS, B, C], True),  # runs on and drafts again
        (greedy(stop_token_ids=[B]), [A, B, C], False),  # a stop id; no history row
        (greedy(max_tokens=4), [A, B, C, D], True),  # max_tokens mid-draft
        (greedy(min_tokens=4), [EOS, A, EOS], True),  # an EOS too early, then one that counts
        (greedy(), [], True),  # plain decode
    ]
    seqs = []
    for i, (params, drafts, _) in enumerate(cases):
        seq = Sequence(f"r{i}", SPAN * 2 + [30 + i], params, frozenset({EOS}))
        seq.token_ids.append(SPAN[0])  # one output token so far
        seq.spec.method, seq.spec.max_k, seq.spec.draft_token_ids = "ngram", 4, drafts
        seqs.append(seq)
    with_rows = [seq for seq, case in zip(seqs, cases) if case[2]]
    rows = history.sync([(seq.request_id, seq.token_ids) for seq in with_rows])
    row_of = {seq.request_id: row for seq, row in zip(with_rows, rows)}
    sampling, requests, stops = row_batch(seqs), [verify_request(s) for s in seqs], StopInputs.of(seqs)
    tail = TailInputs(RowSampling.of(sampling.params, requests), stops, [], [], [])
    for seq in seqs:
        row = row_of.get(seq.request_id)
        tail.history_rows.append(graphs.scratch_row if row is None else row)
        tail.history_lens.append(0 if row is None else seq.num_tokens)
        tail.num_drafts.append(0 if row is None else seq.spec.max_k)
    query_lens = [1 + len(drafts) for _, drafts, _ in cases]
    batch = HostBatch([0] * sum(query_lens), [], [], query_lens, [1] * len(seqs), [[0]] * len(seqs), [])
    logits = torch.randn(batch.num_tokens, vocab_size, generator=torch.Generator().manual_seed(0))
    bonus_rows = torch.tensor(query_lens).cumsum(0) - 1
    logits[bonus_rows, torch.tensor([D, SPAN[0], D, D, D, SPAN[1]])] = 50.0  # bonus tokens that match again
    verifier = RejectionSampler("greedy", "accept_all")
    expected = eager_post_step(verifier(logits, sampling, requests), stops, torch.device("cpu"))
    return PlantedStep(seqs, row_of, batch, tail, logits, expected)


def check_tail_outputs(step: PlantedStep, got: list[TailOutput], history: TokenHistory) -> None:
    """The eager path's kept tokens, finish reasons and stop ids; history rows that end with the
    kept tokens (nothing past a stop); the host proposer's next drafts for the requests running."""
    assert [(o.token_ids, o.num_accepted, o.finish_reason, o.stop_token_id) for o in got] == [
        (o.token_ids, o.num_accepted, o.finish_reason, o.stop_token_id) for o in step.expected
    ]
    stop, length = FinishReason.STOP, FinishReason.LENGTH
    assert [o.finish_reason for o in got] == [stop, None, stop, length, stop, None]
    assert [got[0].token_ids, got[3].token_ids, got[4].token_ids] == [[A, EOS], [A, B, C], [EOS, A, EOS]]
    assert got[2].stop_token_id == B
    proposer = NgramProposer(1, 3)
    for seq, out in zip(step.seqs, got):
        row = step.row_of.get(seq.request_id)
        if row is None:
            assert out.drafts == []
            continue
        kept = seq.token_ids + out.token_ids
        tokens = history.tokens[row].cpu()
        assert tokens[: len(kept)].tolist() == kept
        assert tokens[len(kept) : len(kept) + 5].eq(0).all()  # nothing past a stop
        assert out.drafts == (proposer.propose(kept, 4) if out.finish_reason is None else [])
    assert got[1].drafts and got[5].drafts


def verify_twin(*args, max_rows: int, request_of_row: torch.Tensor):
    """`verify_sample_cuda` by its torch twin, shaped as the kernel's output: the grid's empty
    sequences (at its end) emit nothing, and every request has `max_rows` token columns."""
    cu = args[8].tolist()
    num_reqs = len(cu) - 1
    real = sum(1 for i in range(num_reqs) if cu[i + 1] > cu[i])
    token_ids, num_accepted, *rest = verify_sample_ref(*args[:8], args[8][: real + 1], *args[9:])
    padded = torch.full((num_reqs, max_rows), -1, dtype=torch.int32)
    padded[:real, : token_ids.shape[1]] = token_ids
    accepted = torch.zeros(num_reqs, dtype=torch.int32)
    accepted[:real] = num_accepted
    return padded, accepted, *rest


def ngram_twin(history, lengths, min_n, max_n, k, budget=None, max_k=None, row_ids=None):
    return ngram_match_ref(history, lengths, min_n, max_n, k, budget, row_ids)


def test_tail_step_stops_where_the_eager_path_does(make_checkpoint, monkeypatch) -> None:
    """What a tail graph replays, run here with the CUDA kernels' torch twins: the step's inputs
    copied into the static buffers of a bigger bucket (padding and empty grid sequences), `_tail`
    as captured, the read-back unpacked."""
    monkeypatch.setattr(kernels.verify, "verify_sample_cuda", verify_twin)
    monkeypatch.setattr(kernels.ngram, "ngram_match_cuda", ngram_twin)
    model = load_model(
        str(make_checkpoint("llama", num_hidden_layers=1)), torch.float32, torch.device("cpu"), 128
    )
    history = TokenHistory(torch.device("cpu"), num_rows=8, capacity=96, fixed=True)
    graphs = DecodeGraphs(model, [], 32, [1, 5], 64, BLOCK, TailSpec(GREEDY, ACCEPT_ALL, history, 1, 3, 4))
    step = planted_step(graphs, history, model.config.vocab_size)
    bucket, query_len = 32, 5
    assert bucket in graphs.buckets and bucket > step.batch.num_tokens
    graphs.logits[: step.batch.num_tokens] = step.logits
    graphs.query_start_loc[: bucket + 1] = pad_decode_batch(step.batch, bucket).query_start_loc
    graphs.fill_tail(step.batch, bucket, step.tail)
    packed = graphs._tail(bucket, query_len)
    got = [TailOutput.unpack(row, query_len) for row in packed[: len(step.seqs)].tolist()]
    check_tail_outputs(step, got, history)


@pytest.mark.gpu
@needs_cuda
def test_captured_tail_stops_where_the_eager_path_does(make_checkpoint) -> None:
    """The same step through a captured tail graph and the CUDA kernels (verify, post-step,
    n-gram), against the eager path on the CPU."""
    device = torch.device("cuda")
    model = load_model(str(make_checkpoint("llama", num_hidden_layers=1)), torch.float32, device, 128)
    config = model.config
    shape = (4, BLOCK, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))]
    history = TokenHistory(device, num_rows=8, capacity=96, fixed=True)
    graphs = DecodeGraphs(
        model, caches, 32, [1, 5], 64, BLOCK, TailSpec(GREEDY, ACCEPT_ALL, history, 1, 3, 4)
    )
    graphs.capture()
    step = planted_step(graphs, history, config.vocab_size)
    key = (32, 5)
    graphs.logits[: step.batch.num_tokens] = step.logits.to(device)  # as if the forward had run
    graphs.query_start_loc[: key[0] + 1] = pad_decode_batch(step.batch, key[0]).query_start_loc.to(device)
    got = graphs.replay_tail(step.batch, key, step.tail)
    check_tail_outputs(step, got, history)


@pytest.mark.gpu
@needs_cuda
def test_graph_outputs_share_one_buffer(make_checkpoint) -> None:
    """Every graph writes into one persistent max-bucket output buffer and the pool keeps one
    capture's temporaries: capturing all buckets up to 256 for two query classes reserves about two
    max-bucket logits buffers (plus small change), where per-graph outputs took the sum over
    buckets (~8 of them). A large vocabulary makes the logits dominate."""
    vocab_size, max_tokens = 131072, 256
    device = torch.device("cuda")
    path = str(make_checkpoint("llama", num_hidden_layers=1, vocab_size=vocab_size))
    model = load_model(path, torch.float32, device, 256)
    config = model.config
    shape = (8, BLOCK, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    graphs = DecodeGraphs(model, caches, max_tokens, [1, 5], 256, BLOCK)
    graphs.capture()
    torch.cuda.empty_cache()
    grown = torch.cuda.memory_reserved(device) - before
    one_logits = max_tokens * vocab_size * 4
    assert graphs.logits.shape == (max_tokens, vocab_size)
    assert grown < 3.5 * one_logits, f"graphs reserve {grown / one_logits:.1f} max-bucket logits buffers"


@pytest.mark.gpu
@needs_cuda
def test_graph_replay_stops_where_eager_does(make_checkpoint) -> None:
    """EOS, stop ids, min_tokens, ignore_eos and max_tokens under accepted n-gram drafts through the
    engine: the tail graph's post-step update ends each request where the eager path does
    (tokens, finish and stop reasons, draft and acceptance counts)."""
    path = str(make_checkpoint("llama", num_hidden_layers=2))
    eos = min(Tokenizer(path).eos_token_ids)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "accept_policy": "accept_all"}
    generator = torch.Generator().manual_seed(9)
    prompts, params = [], []
    for i in range(16):
        span = torch.randint(3, 384, (7,), generator=generator).tolist()
        span[4] = eos  # the drafts that follow span[:2] reach an EOS at their third token
        prompts.append(torch.randint(3, 384, (i,), generator=generator).tolist() + span * 3 + span[:2])
        fields: dict = {"temperature": 0.0, "max_tokens": 6 + 2 * i}
        fields |= [{}, {"ignore_eos": True}, {"stop_token_ids": [span[3]]}, {"min_tokens": 5}][i % 4]
        params.append(SamplingParams(**fields))
    outputs = {}
    for eager in (True, False):
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            max_model_len=256,
            speculative_config=spec,
            enforce_eager=eager,
            cuda_graph_max_tokens=128,  # 16 x (1 + 4) tokens: no draft trimming to fit a graph
        )
        generated = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outputs[eager] = [
            (
                o.token_ids,
                o.finish_reason,
                o.stop_reason,
                o.spec_stats["num_draft_tokens"],
                o.spec_stats["num_accepted_tokens"],
            )
            for o in generated
        ]
        if not eager:
            graphs = llm.engine.runner.graphs
            assert graphs is not None and graphs.num_tail_replays > 5
    assert outputs[False] == outputs[True]
    reasons = [finish for _, finish, *_ in outputs[True]]
    assert "stop" in reasons and "length" in reasons  # EOS mid-draft: tests/services/engine/test_post_step.py
