"""The offline benchmark's engine driver, its admission rule, the method registry and the HF baseline."""

from __future__ import annotations

import pytest

from benchmarks.client import Sampling
from benchmarks.compare import add_output_identity, compare_outputs
from benchmarks.dataset import BenchRequest, warmup_burst
from benchmarks.methods import BASELINE, max_k, request_override, resolve_methods, with_k
from benchmarks.offline import Admission, json_schema_grammar, run_requests, sampling_params
from services.engine.engine import LLMEngine
from shared.config import EngineConfig
from shared.reference import default_model
from shared.speculative_config import SpeculativeConfig
from tests.benchmarks.smoke_workload import FUNCTIONS

REQUESTS = [BenchRequest(f"r{i}", "code_editing", FUNCTIONS[i % 3] + "\n# again:\n", 6) for i in range(5)]


def test_admission_caps_the_engine_and_dates_arrivals() -> None:
    admission = Admission(REQUESTS[:3], limit=2, request_rate=None, seed=0)
    start = admission.started
    first = admission.due(start + 1.0)
    assert len(first) == 2 and all(arrived == start for _, arrived in first)  # due at 0, a slot was free
    assert admission.due(start + 2.0) == []  # full
    admission.finished(start + 3.0)
    ((late, arrived),) = admission.due(start + 3.5)
    assert late.id == "r2" and arrived == start + 3.0  # a closed-loop client sends it when a slot frees


def test_poisson_admission_keeps_the_scheduled_arrival() -> None:
    admission = Admission(REQUESTS, limit=len(REQUESTS), request_rate=2.0, seed=3)
    due_times = [due for _, due in admission.pending]
    admitted = admission.due(due_times[-1] + 5.0)
    assert [arrived for _, arrived in admitted] == due_times


@pytest.fixture(scope="module")
def ngram_engine() -> LLMEngine:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    return LLMEngine(
        EngineConfig(
            model=default_model(), device="cpu", max_model_len=512, num_kv_blocks=128, speculative_config=spec
        )
    )


def test_run_requests_times_every_request(ngram_engine: LLMEngine) -> None:
    records = run_requests(ngram_engine, REQUESTS, Sampling(ignore_eos=True), concurrency=2)
    assert [r.request_id for r in records] == [r.id for r in REQUESTS]
    for r in records:
        assert r.ok and r.num_output_tokens == 6 and r.num_prompt_tokens > 0
        assert r.arrived_at < r.token_times[0] and r.token_times == sorted(r.token_times)
        assert r.finished_at == r.token_times[-1]
        assert len(r.token_times) <= r.num_output_tokens  # a step may deliver several tokens
    assert sum(r.spec.num_verify_steps for r in records) > 0
    assert not ngram_engine.has_unfinished_requests()


def test_json_schema_constrains_every_request(ngram_engine: LLMEngine, tmp_path) -> None:
    """`--json-schema` (a file or the text) reaches every request's sampling parameters; a schema
    the grammar engine cannot follow stops the run with its reason."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    structured = json_schema_grammar(str(schema))
    assert structured == json_schema_grammar(schema.read_text())
    sampling = Sampling(ignore_eos=False, structured=structured)
    records = run_requests(ngram_engine, REQUESTS[:2], sampling, concurrency=2)
    assert all(r.ok for r in records)
    assert all(sampling_params(r, sampling).structured == structured for r in REQUESTS)
    with pytest.raises(SystemExit, match="--json-schema: unsupported or invalid JSON schema"):
        json_schema_grammar('{"type": "objekt"}')


def test_methods_put_naive_first_and_validate() -> None:
    methods = resolve_methods(
        ["ngram", 'wide={"method": "ngram", "num_speculative_tokens": 9}'], default_model()
    )
    assert list(methods) == [BASELINE, "ngram", "wide"]
    assert set(resolve_methods(None, default_model())) == {
        "naive",
        "ngram",
        "suffix",
        "mtp",
        "hybrid",
        "draft_model",
    }
    with pytest.raises(ValueError, match="unknown method"):
        resolve_methods(["nonsense"], default_model())
    with pytest.raises(ValueError, match="bad"):
        resolve_methods(['bad={"method": "ngram", "num_speculative_tokens": 99}'], default_model())
    with pytest.raises(ValueError, match="reference model"):
        resolve_methods(["mtp"], "/some/other/model")


def test_k_and_per_request_overrides() -> None:
    hybrid = resolve_methods(["hybrid"], default_model())["hybrid"]
    assert with_k(hybrid, 2)["num_speculative_tokens"] == 2 and with_k(hybrid, 2)["num_model_steps"] == 1
    assert max_k(hybrid) == 5 and max_k({"method": "ngram"}) == 15
    assert request_override({"method": "naive"}) == {"enabled": False}
    assert request_override({"method": "suffix", "num_speculative_tokens": 8}) == {
        "enabled": True,
        "method": "suffix",
        "num_speculative_tokens": 8,
    }


def test_hf_baseline_streams_the_same_number_of_tokens(make_checkpoint) -> None:
    pytest.importorskip("transformers")
    from benchmarks.hf_baseline import HFBaseline

    hf = HFBaseline(str(make_checkpoint("llama")), "cpu", __import__("torch").float32)
    requests = [BenchRequest("a", "w", "def add(a, b):\n    return a + b\n" * 3, 8)]
    plain = hf.run(requests, Sampling(ignore_eos=True), prompt_lookup_num_tokens=None)
    lookup = hf.run(requests, Sampling(ignore_eos=True), prompt_lookup_num_tokens=4)
    for record in (plain[0], lookup[0]):
        assert record.ok and record.num_output_tokens == 8
        assert 1 <= len(record.token_times) <= 8 and record.ttft_s > 0
    assert len(plain[0].token_times) == 8


def cached_blocks(engine: LLMEngine, request: BenchRequest) -> int:
    """How many of the request's prompt blocks the engine's prefix cache already holds."""
    engine.add_request("probe", prompt=request.prompt, params=sampling_params(request, Sampling()))
    found = len(engine.block_manager.match_prefix(engine.sequences["probe"]))
    engine.abort_request("probe")
    return found


def test_a_warm_up_burst_fills_the_slots_and_seeds_no_cache_of_the_measured_requests() -> None:
    engine = LLMEngine(
        EngineConfig(model=default_model(), device="cpu", max_model_len=512, num_kv_blocks=128)
    )
    burst = warmup_burst(REQUESTS, concurrency=3)
    assert len(burst) == 3 and len({r.id for r in burst}) == 3 and len({r.prompt for r in burst}) == 3
    assert [r.max_tokens for r in burst] == [r.max_tokens for r in REQUESTS[:3]]
    assert len(warmup_burst(REQUESTS, concurrency=64)) == len(REQUESTS)
    records = run_requests(engine, burst, Sampling(ignore_eos=True), concurrency=3)
    assert all(r.ok for r in records)
    assert all(cached_blocks(engine, request) == 0 for request in REQUESTS)
    run_requests(engine, REQUESTS[:1], Sampling(ignore_eos=True), concurrency=1)
    assert cached_blocks(engine, REQUESTS[0]) > 0  # the probe sees a prompt the engine did cache


def test_greedy_outputs_are_compared_with_naive_by_their_hashes(ngram_engine: LLMEngine) -> None:
    naive_engine = LLMEngine(
        EngineConfig(model=default_model(), device="cpu", max_model_len=512, num_kv_blocks=128)
    )
    try:
        naive = run_requests(naive_engine, REQUESTS, Sampling(ignore_eos=True), concurrency=2)
    finally:
        naive_engine.close()
    ngram = run_requests(ngram_engine, REQUESTS, Sampling(ignore_eos=True), concurrency=2)

    def cell(method: str, records: list) -> dict:
        return {
            "method": method,
            "workload": "code_editing",
            "concurrency": 2,
            "records": [r.compact() for r in records],
        }

    cells = [cell(BASELINE, naive), cell("ngram", ngram)]
    assert add_output_identity(cells) == [
        "outputs ngram code_editing c=2: identical to naive for 5 of 5 requests"
    ]
    assert cells[1]["same_outputs_as_naive"] == [5, 5]
    cells[1]["records"][0]["output_digest"] = "0" * 16  # one output differs
    other = {"cells": [cell("ngram", ngram)]}
    assert compare_outputs({"cells": cells[1:]}, other) == [
        "outputs ngram code_editing c=2: identical in both runs for 4 of 5 requests"
    ]
