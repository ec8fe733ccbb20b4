"""The engine times drafting apart from the step, and the controller's choice on that cost never
changes greedy output."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np
import pytest

from services.engine.llm import LLM
from services.engine.model_runner import LaunchedStep
from services.engine.sequence import Sequence
from services.engine.spec_decode.adaptive import (
    AdaptiveSpeculation,
    DraftCost,
    DraftCostModel,
    StepCost,
    StepCostModel,
)
from services.engine.spec_decode.suffix import (
    INSERT_CHUNK_TOKENS,
    MAX_STARVED_PREPARES,
    DeferredGlobalIndex,
    SuffixConfig,
    SuffixProposer,
)
from services.engine.spec_decode.suffix_automaton import SuffixAutomaton
from services.engine.spec_decode.suffix_tree import GlobalSuffixIndex, SuffixDraft
from shared.reference import default_model
from tests.services.engine.spec_decode.helpers import GREEDY, repetitive_prompts

CHOOSE = AdaptiveSpeculation.choose


def generate(target: str, method: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], int]:
    """Greedy output with adaptive speculation, and the drafts the controller asked for in all."""
    asked = []

    def counting_choose(
        self: AdaptiveSpeculation,
        seqs: list[Sequence],
        num_other_tokens: int,
        mixed: bool = False,
        backlogs: list[int] | None = None,
    ) -> list[int]:
        ks = CHOOSE(self, seqs, num_other_tokens, mixed, backlogs)
        asked.append(sum(ks))
        return ks

    monkeypatch.setattr(AdaptiveSpeculation, "choose", counting_choose)
    spec = dict(method=method, num_speculative_tokens=3, adaptive_min_acceptance=0.0)
    if method == "draft_model":
        spec["model"] = target  # its own draft model: every greedy draft passes
    llm = LLM(target, device="cpu", max_model_len=192, speculative_config=spec)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    return [o.token_ids for o in outputs], sum(asked)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_costly_drafting_stops_drafting_and_keeps_greedy_output(
    target, naive_tokens, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a flat step cost, drafting priced at nothing is asked for nearly every step, and drafts
    priced at 1 s each (a draft token in the forward, a chained forward, a request's host
    drafting) only on probes; both give naive's tokens (the draft model's cache catching up on the
    steps it skipped)."""
    monkeypatch.setattr(StepCostModel, "fit", lambda self: StepCost(0.010))
    monkeypatch.setattr(DraftCostModel, "fit", lambda self, step: DraftCost())
    free_tokens, free_drafts = generate(target, method, monkeypatch)
    monkeypatch.setattr(
        StepCostModel, "fit", lambda self: StepCost(fixed_s=0.010, verify_s=1.0, per_chain_step_s=1.0)
    )
    monkeypatch.setattr(DraftCostModel, "fit", lambda self, step: DraftCost(per_request_s=1.0))
    costly_tokens, costly_drafts = generate(target, method, monkeypatch)
    assert free_tokens == costly_tokens == naive_tokens
    assert free_drafts > 100
    assert costly_drafts <= free_drafts // 4


def clock_only_suffix_advances(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """`time.perf_counter` becomes a clock that only the suffix proposer moves: 1 ms a request
    (returned: [its time], for others to move too)."""
    clock = [0.0]
    suffix = llm.engine.drafter.suffix
    propose_batch = suffix.propose_batch

    def slow_propose_batch(requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        clock[0] += 0.001 * len(requests)
        return propose_batch(requests)

    monkeypatch.setattr(suffix, "propose_batch", slow_propose_batch)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    return clock


def test_drafting_time_is_booked_apart_from_the_step(target, naive_tokens, monkeypatch) -> None:
    """On a clock that only the suffix proposer advances (1 ms a request), every drafting sample
    is exactly that time and every step sample is zero: the drafter took its drafting out."""
    llm = LLM(target, device="cpu", max_model_len=192, speculative_config=dict(method="suffix"))
    drafter = llm.engine.drafter
    clock_only_suffix_advances(llm, monkeypatch)
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens

    drafting = drafter.adaptive.draft_cost["suffix"].samples
    rows = drafting.rows[: min(drafting.num_recorded, len(drafting.rows))]
    assert len(rows) > 0
    assert rows[:, -1] == pytest.approx(0.001 * rows[:, 2])  # seconds == 1 ms x requests
    steps = drafter.adaptive.cost.samples
    step_seconds = steps.rows[: min(steps.num_recorded, len(steps.rows)), -1]
    assert len(step_seconds) > 0 and max(abs(step_seconds)) < 1e-12


def test_the_audit_sees_whole_decode_steps(monkeypatch) -> None:
    """On a clock that only the suffix proposer advances (1 ms a request), the audit's decode steps
    that verified drafts carry the drafting done in them, and those that verified none carry none
    (their drafting belongs to the next step's drafts). The shipped model, whose outputs repeat
    its prompts: drafts are found and accepted."""
    llm = LLM(default_model(), device="cpu", max_model_len=192, speculative_config=dict(method="suffix"))
    drafter = llm.engine.drafter
    clock_only_suffix_advances(llm, monkeypatch)
    llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)

    realized = drafter.adaptive.realized
    drafting = realized.drafting.rows[: min(realized.drafting.num_recorded, len(realized.drafting.rows))]
    plain = realized.plain.rows[: min(realized.plain.num_recorded, len(realized.plain.rows))]
    assert len(drafting) > 0 and len(plain) > 0  # [n, (step, 1, requests, emitted, seconds)]
    assert (drafting[:, 3] > drafting[:, 2]).any()  # drafts accepted: more tokens than requests
    milliseconds = 1e3 * drafting[:, -1]  # a drafting step's own drafting: 1 ms a request drafted for
    assert milliseconds.sum() > 0 and milliseconds == pytest.approx(milliseconds.round())
    assert (plain[:, -1] == 0).all()


def drafting_share(
    target: str,
    concurrency: int,
    monkeypatch: pytest.MonkeyPatch,
    seconds_per_token: float = 0.0,
    seconds_per_global_query: float = 0.0,
    max_cached_requests: int = 0,
) -> tuple[list[list[int]], float]:
    """Greedy suffix-decoding output at a concurrency, on a clock that only the suffix indexes
    advance (`seconds_per_token` for each token a request's index takes in, and
    `seconds_per_global_query` for each context the global index is asked about), and the share of
    the controller's choices that drafted."""
    clock = [0.0]
    extend = SuffixAutomaton.extend
    speculate_batch = GlobalSuffixIndex.speculate_batch

    def slow_extend(self: SuffixAutomaton, token_ids: list[int]) -> None:
        clock[0] += seconds_per_token * len(token_ids)
        extend(self, token_ids)

    def slow_speculate_batch(
        self: GlobalSuffixIndex, queries: list[tuple[list[int], int]]
    ) -> list[SuffixDraft | None]:
        clock[0] += seconds_per_global_query * len(queries)
        return speculate_batch(self, queries)

    choices: list[int] = []

    def counting_choose(
        self: AdaptiveSpeculation,
        seqs: list[Sequence],
        num_other_tokens: int,
        mixed: bool = False,
        backlogs: list[int] | None = None,
    ) -> list[int]:
        ks = CHOOSE(self, seqs, num_other_tokens, mixed, backlogs)
        choices.append(sum(ks))
        return ks

    monkeypatch.setattr(SuffixAutomaton, "extend", slow_extend)
    monkeypatch.setattr(GlobalSuffixIndex, "speculate_batch", slow_speculate_batch)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(AdaptiveSpeculation, "choose", counting_choose)
    monkeypatch.setattr(StepCostModel, "fit", lambda self: StepCost(fixed_s=0.010))
    spec = dict(
        method="suffix",
        num_speculative_tokens=3,
        suffix_decoding_max_cached_requests=max_cached_requests,
    )
    llm = LLM(target, device="cpu", max_model_len=192, speculative_config=spec)
    prompts = repetitive_prompts()
    outputs = []
    for start in range(0, len(prompts), concurrency):
        batch = prompts[start : start + concurrency]
        outputs += llm.generate(prompt_token_ids=batch, sampling_params=GREEDY)
    return [o.token_ids for o in outputs], sum(1 for k in choices if k > 0) / len(choices)


def test_a_slow_suffix_index_is_priced_and_backs_off_at_high_concurrency(
    target, naive_tokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The requests' index updates are drafting time: with each indexed token costing 2 ms against
    a 10 ms step, drafting pays for one request at a time (it saves whole steps) but not for six
    (its time would buy six tokens a step); a free index drafts at six too. Greedy output is
    naive's throughout."""
    alone_tokens, alone_share = drafting_share(target, 1, monkeypatch, seconds_per_token=0.002)
    batched_tokens, batched_share = drafting_share(target, 6, monkeypatch, seconds_per_token=0.002)
    free_tokens, free_share = drafting_share(target, 6, monkeypatch)
    assert alone_tokens == batched_tokens == free_tokens == naive_tokens
    assert alone_share > 0.6 and free_share > 0.6
    assert batched_share < 0.25


def test_slow_global_look_ups_are_priced_and_back_off_at_high_concurrency(
    target, naive_tokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The global index's look-ups are drafting time of the requests that draft: at 3 ms a look-up
    against a 10 ms step, drafting pays for one request at a time (where its acceptance is high
    enough) but not for six; free look-ups draft at six. Requests left at k = 0 are not counted
    as drafting (counted, they made the per-request cost look like a fixed cost shared by all).
    Greedy output is naive's throughout."""
    slow = dict(seconds_per_global_query=0.003, max_cached_requests=1000)
    alone_tokens, alone_share = drafting_share(target, 1, monkeypatch, **slow)
    batched_tokens, batched_share = drafting_share(target, 6, monkeypatch, **slow)
    free_tokens, free_share = drafting_share(target, 6, monkeypatch, max_cached_requests=1000)
    assert alone_tokens == batched_tokens == free_tokens == naive_tokens
    assert alone_share > 0.3 and free_share > 0.6
    assert batched_share < 0.15


@pytest.mark.parametrize("device_busy", [False, True])
def test_prompts_indexed_while_the_device_runs_are_not_charged(
    target, naive_tokens, device_busy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the device is still at the step after the host's own work (a GPU), the requests'
    prompts are indexed then, and drafting is charged only for the outputs it indexes; on the CPU
    (never busy) the first drafts index the prompts. Greedy output is naive's either way."""
    monkeypatch.setattr(LaunchedStep, "running", lambda self: device_busy)
    context_tokens: list[int] = []
    record = AdaptiveSpeculation.record_drafting

    def recording(
        self: AdaptiveSpeculation, method: str, ks: list[int], num_context_tokens: int, seconds: float
    ) -> None:
        context_tokens.append(num_context_tokens)
        record(self, method, ks, num_context_tokens, seconds)

    monkeypatch.setattr(AdaptiveSpeculation, "record_drafting", recording)
    spec = dict(method="suffix", num_speculative_tokens=3, adaptive=False)
    llm = LLM(target, device="cpu", max_model_len=192, speculative_config=spec)
    prompts = repetitive_prompts()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    num_outputs = sum(len(o.token_ids) for o in outputs)
    if device_busy:
        assert 0 < sum(context_tokens) <= num_outputs
    else:
        assert sum(context_tokens) >= sum(map(len, prompts)) + len(prompts)


def test_finished_outputs_go_into_the_global_tree_while_the_device_runs(
    target, naive_tokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the engine's deferred global index (a GPU's), finished outputs are inserted only
    while the device runs a step (here: busy for two looks a step), never inside the step's
    drafting or bookkeeping; greedy output is naive's, and the tree ends with every output."""
    looks = itertools.cycle([True, True, False])
    monkeypatch.setattr(LaunchedStep, "running", lambda self: next(looks))
    deferred = DeferredGlobalIndex(GlobalSuffixIndex())
    monkeypatch.setattr(SuffixConfig, "global_index", lambda self: deferred)
    in_window = [False]
    prepare = SuffixProposer.prepare

    def preparing(self: SuffixProposer, device_busy: Callable[[], bool]) -> None:
        in_window[0] = True
        prepare(self, device_busy)
        in_window[0] = False

    monkeypatch.setattr(SuffixProposer, "prepare", preparing)
    insert_chunk = DeferredGlobalIndex.insert_chunk
    chunks_in_window: list[bool] = []

    def watched(self: DeferredGlobalIndex) -> bool:
        chunks_in_window.append(in_window[0])
        return insert_chunk(self)

    monkeypatch.setattr(DeferredGlobalIndex, "insert_chunk", watched)
    llm = LLM(target, device="cpu", max_model_len=192, speculative_config=dict(method="suffix"))
    prompts = repetitive_prompts()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    assert chunks_in_window and all(chunks_in_window)
    deferred.index_while(lambda: True)  # what the last steps' windows left
    assert len(deferred.index) == len(prompts)


def test_outputs_starved_of_device_windows_still_reach_the_global_tree() -> None:
    """Where the device never outlasts the host's work (no window has busy time), a finished output
    waits MAX_STARVED_PREPARES windows, then goes in one chunk a window until it is all in; a window
    with busy time restarts the wait."""
    deferred = DeferredGlobalIndex(GlobalSuffixIndex())
    output = list(range(3, 3 + 5 * INSERT_CHUNK_TOKENS))
    deferred.add_sequence("done", output)
    for _ in range(MAX_STARVED_PREPARES):
        deferred.insert_if_starved()
    assert deferred.num_pending == 1 and len(deferred.index) == 0
    deferred.insert_if_starved()  # the first starved window: one chunk on the host's time
    assert deferred.num_pending == 1  # being inserted
    deferred.insert_chunk()  # a window with busy time: a chunk, and the wait starts again
    for _ in range(MAX_STARVED_PREPARES):
        deferred.insert_if_starved()
    assert deferred.num_pending == 1
    for _ in range(4):
        deferred.insert_if_starved()
    assert deferred.num_pending == 0 and len(deferred.index) == 1
    assert deferred.speculate_batch([(output[:6], 4)])[0] is not None  # look-ups see it


@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_host_drafted_steps_choose_their_ks_after_the_launch(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose requests all draft on the host (suffix decoding) is launched before the
    controller chooses their next ks (its solve then runs while the device works): each launch
    comes before its choice. A device method's tail reads its ks, so they are chosen first. Greedy
    output is naive's either way (the shipped model, whose outputs repeat its prompts: drafts are
    accepted)."""
    naive = LLM(default_model(), device="cpu", max_model_len=192)
    naive_tokens = [
        o.token_ids for o in naive.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    ]
    events: list[str] = []

    def logged_choose(
        self: AdaptiveSpeculation,
        seqs: list[Sequence],
        num_other_tokens: int,
        mixed: bool = False,
        backlogs: list[int] | None = None,
    ) -> list[int]:
        events.append("choose")
        return CHOOSE(self, seqs, num_other_tokens, mixed, backlogs)

    monkeypatch.setattr(AdaptiveSpeculation, "choose", logged_choose)
    monkeypatch.setattr(StepCostModel, "fit", lambda self: StepCost(0.010))  # drafting pays
    monkeypatch.setattr(DraftCostModel, "fit", lambda self, step: DraftCost())
    spec = dict(method=method, num_speculative_tokens=3, adaptive_min_acceptance=0.0)
    llm = LLM(default_model(), device="cpu", max_model_len=192, speculative_config=spec)
    runner = llm.engine.runner
    for name in ("launch", "launch_ahead"):
        launch = getattr(runner, name)
        setattr(runner, name, lambda *args, launch=launch: events.append("launch") or launch(*args))
    outputs = llm.generate(prompt_token_ids=repetitive_prompts(), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens
    assert sum(o.spec_stats["num_accepted_tokens"] for o in outputs) > 0
    first = ["launch", "choose"] if method == "suffix" else ["choose", "launch"]
    assert len(events) > 20 and events[: len(events) // 2 * 2] == first * (len(events) // 2)


def test_an_audited_step_carries_the_launches_since_the_last_landing(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock that only launches (0.25 ms each, a step's host work before the device runs it) and
    the suffix proposer (1 ms a request) advance, an audited decode step carries the launches since
    the last landing: a plain step launched ahead its successor's, a synchronous drafting step its
    own, planned and launched after the last landing (before, it carried none: drafting steps
    looked cheaper than they are). One launch a step, but where the engine moves between steps
    launched ahead and synchronous ones (one step then carries two, another none). Greedy output
    is naive's."""
    llm = LLM(default_model(), device="cpu", max_model_len=192, speculative_config=dict(method="suffix"))
    naive = LLM(default_model(), device="cpu", max_model_len=192)
    prompts = repetitive_prompts()
    naive_tokens = [o.token_ids for o in naive.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    clock = clock_only_suffix_advances(llm, monkeypatch)
    runner = llm.engine.runner
    for name in ("launch", "launch_ahead"):
        launch = getattr(runner, name)

        def timed_launch(*args: object, launch: Callable[..., LaunchedStep] = launch) -> LaunchedStep:
            clock[0] += 0.00025
            return launch(*args)

        monkeypatch.setattr(runner, name, timed_launch)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == naive_tokens

    realized = llm.engine.drafter.adaptive.realized
    drafting = realized.drafting.rows[: min(realized.drafting.num_recorded, len(realized.drafting.rows))]
    plain = realized.plain.rows[: min(realized.plain.num_recorded, len(realized.plain.rows))]
    assert len(drafting) > 0 and len(plain) > 0  # [n, (step, 1, requests, emitted, seconds)]
    plain_launches = (1e3 * plain[:, -1] / 0.25).round(6)
    assert np.isin(plain_launches, [0, 1, 2]).all() and (plain_launches == 1).mean() > 0.8
    drafting_ms = 1e3 * drafting[:, -1]  # launches, then 1 ms a request drafted for after them
    drafting_launches = ((drafting_ms % 1) / 0.25).round(6)
    assert np.isin(drafting_launches, [1, 2]).all()
