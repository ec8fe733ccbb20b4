"""Structured output under speculation: every verified row is masked by the grammar state after the
drafts before it, so greedy output equals plain constrained decoding whatever the method, every
output follows its grammar, and requests without one are untouched."""

from __future__ import annotations

import json
import re
import threading

import pytest

import services.engine.grammar as grammar_module
import services.engine.input_batch as input_batch
from services.engine.engine import RequestError
from services.engine.grammar import StepMasks, fill_masks
from services.engine.input_batch import UNLIMITED
from services.engine.llm import LLM
from services.engine.model_runner import ModelRunner
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutput
from tests.services.engine.spec_decode.helpers import (
    CHOICES,
    GRAMMARS,
    GREEDY,
    REGEX,
    SCHEMA,
    repetitive_prompts,
)

jsonschema = pytest.importorskip("jsonschema")  # a test dependency; GPU images may lack it

PROMPTS = [
    '{"name": "ab", "ok": true, "kind": "add", "count": 3}\n' * 3,
    "me@home.org you@work.com us@",
    "def add(a, b):\n    return a + b\nclass Point",
    "for i in range(10):\n",
]


def spec_llm(target: str, **spec: object) -> LLM:
    return LLM(target, device="cpu", max_model_len=256, speculative_config={"adaptive": False, **spec})


def drafting(method: str, target: str, mtp_head: str) -> dict[str, object]:
    return {
        "ngram": dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3),
        "suffix": dict(method="suffix", num_speculative_tokens=6),
        "mtp": dict(method="mtp", model=mtp_head, num_speculative_tokens=3, mtp_strategy="with_ngram"),
        # the target as its own unconstrained draft model proposes exactly the tokens the grammar
        # must overrule: its drafts leave the grammar all the time
        "draft_model": dict(method="draft_model", model=target, num_speculative_tokens=3),
    }[method]


def constrained(params: SamplingParams, grammar: str) -> SamplingParams:
    return params.model_copy(update={"structured": GRAMMARS[grammar], "max_tokens": 48, "ignore_eos": False})


def assert_follows(grammar: str, text: str, finish_reason: str | None) -> None:
    if finish_reason != "stop":  # cut by max_tokens: a prefix of a legal answer
        return
    if grammar == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif grammar == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES


@pytest.fixture(scope="module")
def naive_by_grammar(target) -> dict[str, list[list[int]]]:
    llm = LLM(target, device="cpu", max_model_len=256)
    return {
        grammar: [o.token_ids for o in llm.generate(PROMPTS, constrained(GREEDY, grammar))]
        for grammar in GRAMMARS
    }


@pytest.mark.parametrize("method", ["ngram", "suffix", "mtp", "draft_model"])
def test_greedy_output_under_a_grammar_equals_naive(target, mtp_head, naive_by_grammar, method: str) -> None:
    llm = spec_llm(target, **drafting(method, target, mtp_head))
    num_drafts = num_stops = 0
    for grammar in GRAMMARS:
        outputs = llm.generate(PROMPTS, constrained(GREEDY, grammar))
        assert [o.token_ids for o in outputs] == naive_by_grammar[grammar], grammar
        for output in outputs:
            assert_follows(grammar, output.text, output.finish_reason)
        num_drafts += sum(int(o.spec_stats["num_draft_tokens"]) for o in outputs)
        num_stops += sum(o.finish_reason == "stop" for o in outputs)
    assert num_drafts > 0
    assert num_stops >= len(PROMPTS)  # the grammars end, so most answers are complete


def test_greedy_output_under_a_grammar_is_the_same_with_the_fill_on_threads(
    target, naive_by_grammar, monkeypatch
) -> None:
    """The step's masks filled on three threads, each taking parts of the batch: greedy output is
    plain constrained decoding's, and parts were filled off the engine's thread."""
    llm = spec_llm(target, **drafting("ngram", target, ""))
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "step_masks", StepMasks(runner.model_config.vocab_size, runner.device, 3))
    filled_on: set[str] = set()

    def recording(*args: object) -> None:
        filled_on.add(threading.current_thread().name)
        fill_masks(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(grammar_module, "fill_masks", recording)
    for grammar in GRAMMARS:  # each prompt four times: 16 rows or more, two parts or more
        outputs = llm.generate(PROMPTS * 4, constrained(GREEDY, grammar))
        assert [o.token_ids for o in outputs] == naive_by_grammar[grammar] * 4, grammar
    assert any(name.startswith("grammar-fill") for name in filled_on)
    runner.step_masks.close()


def test_drafts_that_leave_the_grammar_are_cut_before_verification(target, naive_by_grammar) -> None:
    """The target drafting for itself without the grammar: its drafts are the unconstrained greedy
    tokens, so one the grammar allows is the constrained greedy token too. The drafts the grammar
    refuses are cut on the host, so every draft that reaches verification is accepted, and the
    output is plain constrained decoding's."""
    llm = spec_llm(target, **drafting("draft_model", target, ""))
    outputs = llm.generate(PROMPTS, constrained(GREEDY, "json_schema"))
    assert [o.token_ids for o in outputs] == naive_by_grammar["json_schema"]
    stats = [o.spec_stats for o in outputs]
    assert sum(int(s["num_refused_draft_tokens"]) for s in stats) > 0
    verified = sum(int(s["num_draft_tokens"]) for s in stats)
    assert 0 < verified == sum(int(s["num_accepted_tokens"]) for s in stats)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_seeded_sampling_under_a_grammar_is_legal_and_lossless(target, mtp_head, method: str) -> None:
    params = SamplingParams(temperature=0.9, top_k=50, seed=11)
    prompts = PROMPTS[:2]
    plain = LLM(target, device="cpu", max_model_len=256)
    llm = spec_llm(target, **drafting(method, target, mtp_head))
    for grammar in GRAMMARS:
        naive = plain.generate(prompts, constrained(params, grammar))
        drafted = llm.generate(prompts, constrained(params, grammar))
        assert [o.token_ids for o in drafted] == [o.token_ids for o in naive], grammar
        for output in drafted:
            assert_follows(grammar, output.text, output.finish_reason)


def test_a_request_without_a_grammar_beside_one_with_keeps_its_tokens(target, naive_tokens) -> None:
    llm = spec_llm(target, **drafting("ngram", target, ""))
    prompts = repetitive_prompts()
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"plain-{i}", prompt_token_ids=prompt, params=GREEDY)
        engine.add_request(f"json-{i}", prompt=PROMPTS[0], params=constrained(GREEDY, "json_schema"))
    tokens: dict[str, list[int]] = {}
    fusable: dict[str, bool] = {}
    while engine.has_unfinished_requests():
        for seq in engine.scheduler.running:
            fusable[seq.request_id] = seq.num_output_tokens >= input_batch.fused_from(seq)
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert [tokens[f"plain-{i}"] for i in range(len(prompts))] == naive_tokens
    assert all(fusable[f"plain-{i}"] for i in range(len(prompts)))  # the fused verify keeps them
    assert all(fusable[f"json-{i}"] for i in range(len(prompts)))  # and the grammar requests too


@pytest.mark.parametrize("method", ["naive", "ngram", "suffix", "mtp", "draft_model"])
def test_the_fused_verify_under_a_grammar_emits_what_the_torch_path_does(
    target, mtp_head, monkeypatch, method: str
) -> None:
    """Grammar requests verify in the fused tail (the bitmask an input of the kernel; its reference
    on CPU) and emit exactly what the torch RejectionSampler, which verified them before, emits:
    greedy under every grammar, and seeded sampling."""
    llm = (
        LLM(target, device="cpu", max_model_len=256)
        if method == "naive"
        else spec_llm(target, **drafting(method, target, mtp_head))
    )
    sampled = SamplingParams(temperature=0.9, top_k=50, seed=11)
    params = [constrained(GREEDY, grammar) for grammar in GRAMMARS] + [constrained(sampled, "json_schema")]
    torch_calls = []
    verify_on_host = ModelRunner._verify_on_host
    monkeypatch.setattr(
        ModelRunner,
        "_verify_on_host",
        lambda self, *args: torch_calls.append(1) or verify_on_host(self, *args),
    )
    fused = [[o.token_ids for o in llm.generate(PROMPTS[:2], p)] for p in params]
    assert not torch_calls
    fused_from = input_batch.fused_from
    monkeypatch.setattr(
        input_batch, "fused_from", lambda seq: UNLIMITED if seq.grammar is not None else fused_from(seq)
    )
    on_torch_path = [[o.token_ids for o in llm.generate(PROMPTS[:2], p)] for p in params]
    assert torch_calls
    assert fused == on_torch_path


def test_each_distinct_grammar_is_compiled_once(target) -> None:
    llm = LLM(target, device="cpu", max_model_len=256)
    llm.generate(PROMPTS, constrained(GREEDY, "regex"))
    llm.generate(PROMPTS[:2], constrained(GREEDY, "regex"))
    assert llm.engine.grammars.num_compiled == 1
    llm.generate(PROMPTS[:1], constrained(GREEDY, "choice"))
    assert llm.engine.grammars.num_compiled == 2


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        (StructuredOutput(kind="regex", spec="[a-z"), "invalid regex"),
        (StructuredOutput.json_schema({"type": "objekt"}), 'Unsupported type "objekt"'),
    ],
)
def test_a_grammar_the_engine_cannot_follow_is_refused(target, structured, message: str) -> None:
    llm = LLM(target, device="cpu", max_model_len=256)
    with pytest.raises(RequestError, match=re.escape(message)):
        llm.generate(PROMPTS[:1], GREEDY.model_copy(update={"structured": structured}))


def test_drafts_the_grammar_refuses_count_as_rejected_so_drafting_backs_off(target) -> None:
    """The target drafting for itself without the grammar proposes tokens a letters-only regex
    refuses. Cut before verification, they still count as rejections: the request's acceptance
    estimate falls below the adaptive controller's floor, where it stops drafting but to probe."""
    llm = LLM(
        target,
        device="cpu",
        max_model_len=256,
        speculative_config=dict(method="draft_model", model=target, num_speculative_tokens=3),
    )
    letters = StructuredOutput(kind="regex", spec="[a-e ]{4,60}")
    params = GREEDY.model_copy(update={"structured": letters, "max_tokens": 40})
    engine = llm.engine
    engine.add_request("letters", prompt=PROMPTS[3], params=params)
    acceptance = []
    while engine.has_unfinished_requests():
        engine.step()
        acceptance += [seq.spec.acceptance for seq in engine.scheduler.running]
    floor = llm.engine.config.speculative_config.adaptive_min_acceptance
    assert acceptance[0] > floor and min(acceptance) < floor
