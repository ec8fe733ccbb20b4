"""The host side of structured output: a step's masks filled for the whole batch in one pass equal
the masks filled one row at a time, and drafts are cut at the first token their grammar refuses;
neither moves a request's place in its grammar."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
import torch
import xgrammar

from kernels.verify_ref import num_mask_words
from services.engine.grammar import (
    RETRIAL_EVERY_FILLS,
    TRIAL_FILLS,
    GrammarCompiler,
    GrammarState,
    MaskFiller,
    StepMasks,
    ThreadChoice,
    allocate_bitmask,
    cut_refused_drafts,
    fill_masks,
)
from services.engine.llm import LLM
from services.engine.sequence import Sequence
from shared.reference import reference_dir
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from tests.services.engine.spec_decode.helpers import GRAMMARS

ANSWERS = {
    "json_schema": json.dumps({"name": "ab", "ok": True, "kind": "add", "count": 3}),
    "regex": "me@home.org",
    "choice": "class Point",
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(reference_dir())


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, frozenset(tokenizer.eos_token_ids))
    yield compiler
    compiler.close()


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_row_masks_follow_the_drafts_and_leave_the_state_where_it_was(tokenizer, compiler) -> None:
    """Row j's mask is the grammar's after j drafts; a refused draft stops the rows there; filling
    the masks does not move the state."""
    state = GrammarState(compiler.submit(GRAMMARS["choice"]), max_num_drafts=4)
    serial = xgrammar.BatchGrammarMatcher(1)
    drafts = encode(tokenizer, "class Point")
    bitmask = allocate_bitmask(len(drafts) + 1, tokenizer.vocab_size)
    fill_masks(serial, [state.matcher], [drafts], [0], bitmask)
    for j, draft in enumerate(drafts):
        assert allowed(bitmask, j, draft)
    eos = min(tokenizer.eos_token_ids)
    assert allowed(bitmask, len(drafts), eos) and not allowed(bitmask, 0, eos)

    refused = [drafts[0], encode(tokenizer, "@")[0], drafts[1]]
    bitmask = allocate_bitmask(len(refused) + 1, tokenizer.vocab_size)
    fill_masks(serial, [state.matcher], [refused], [0], bitmask)
    assert allowed(bitmask, 0, refused[0]) and not allowed(bitmask, 1, refused[1])
    assert bool((bitmask[2:] == -1).all())  # untouched past the refused draft
    assert state.advance(drafts)  # the state was still at the start


@pytest.mark.parametrize("num_threads", [1, 2, 5])
def test_the_batched_fill_equals_the_row_by_row_fill(tokenizer, compiler, num_threads: int) -> None:
    """A batch of requests under different grammars, at different places in them, with drafts that
    stay in the grammar, leave it midway, end it or are absent: the masks filled in one batched pass
    (the requests shared out among the threads) are bit for bit those filled one row at a time with
    the matcher, and every state ends where it was."""
    eos = min(tokenizer.eos_token_ids)
    requests = []  # (grammar, tokens kept, drafts)
    for grammar, answer in ANSWERS.items():
        ids = encode(tokenizer, answer)
        for kept in sorted({0, 1, len(ids) // 2, len(ids) - 2}):
            rest = ids[kept:]
            requests.append((grammar, ids[:kept], rest[:4]))  # drafts the grammar takes
            requests.append((grammar, ids[:kept], [rest[0], *encode(tokenizer, " ]]"), *rest[1:3]]))
            requests.append((grammar, ids[:kept], []))
        requests.append((grammar, ids, [eos, *ids[:2]]))  # a draft that ends the grammar
    states = []
    for grammar, kept, _ in requests:
        state = GrammarState(compiler.submit(GRAMMARS[grammar]), max_num_drafts=6)
        assert state.advance(kept)
        states.append(state)
    drafts = [d for _, _, d in requests]
    num_rows = [1 + len(d) for d in drafts]
    first_rows = [sum(num_rows[:i]) for i in range(len(requests))]
    expected = allocate_bitmask(sum(num_rows), tokenizer.vocab_size)
    for state, request_drafts, first_row in zip(states, drafts, first_rows):
        fill_row_by_row(state.matcher, request_drafts, expected, first_row)
    before = next_masks(states, tokenizer.vocab_size)

    filler = MaskFiller(num_threads)
    assert filler.choice.counts == sorted({1, num_threads})
    for _ in filler.choice.counts:  # the trial's first fills: one thread, then all of them
        batched = torch.full_like(expected, 7)  # a reused buffer: every row is written
        filler.fill([state.matcher for state in states], drafts, first_rows, batched)
        assert torch.equal(batched, expected)
        assert len({tuple(row) for row in batched.tolist()}) > len(requests) // 2  # rows of many states
        assert torch.equal(next_masks(states, tokenizer.vocab_size), before)
    filler.close()


def test_the_filler_keeps_the_thread_count_that_filled_faster_and_tries_again_later() -> None:
    choice = ThreadChoice(4)
    seconds_per_row = {1: 2e-6, 4: 1e-6}
    used = []
    for _ in range(RETRIAL_EVERY_FILLS + 2 * TRIAL_FILLS):
        threads = choice.next()
        used.append(threads)
        choice.record(threads, seconds_per_row[threads] * 64, 64)
        if len(used) == RETRIAL_EVERY_FILLS:
            seconds_per_row = {1: 1e-6, 4: 3e-6}  # the grammars changed: one thread pays now
    trial = 2 * TRIAL_FILLS
    assert used[:trial] == [1, 4] * TRIAL_FILLS
    assert set(used[trial:RETRIAL_EVERY_FILLS]) == {4}
    assert used[RETRIAL_EVERY_FILLS : RETRIAL_EVERY_FILLS + trial] == [1, 4] * TRIAL_FILLS
    assert choice.next() == 1
    assert ThreadChoice(1).next() == 1


def test_step_masks_write_only_the_rows_of_requests_with_a_grammar(tokenizer, compiler) -> None:
    ids = encode(tokenizer, ANSWERS["regex"])
    with_grammar = sequence("regex", ids[1:3])
    with_grammar.grammar = GrammarState(compiler.submit(GRAMMARS["regex"]), max_num_drafts=2)
    assert with_grammar.grammar.advance(ids[:1])
    seqs = [sequence("plain", [5, 6]), with_grammar]
    host = torch.full((6, num_mask_words(tokenizer.vocab_size)), 7, dtype=torch.int32)
    StepMasks(tokenizer.vocab_size, torch.device("cpu")).write(seqs, np.array([0, 3, 6]), host)
    expected = allocate_bitmask(3, tokenizer.vocab_size)
    fill_row_by_row(with_grammar.grammar.matcher, ids[1:3], expected, 0)
    assert bool((host[:3] == 7).all()) and torch.equal(host[3:], expected)


def test_a_reused_buffer_allows_every_token_in_the_rows_without_a_grammar(tokenizer, compiler) -> None:
    """The step's host buffer keeps the last step's masks: a row a grammar masked then, and a
    request without a grammar holds now, allows every token again."""
    ids = encode(tokenizer, ANSWERS["regex"])
    masks = StepMasks(tokenizer.vocab_size, torch.device("cpu"), num_threads=1)
    first = [sequence("a", ids[1:3]), sequence("b", ids[1:3])]
    for seq in first:
        seq.grammar = GrammarState(compiler.submit(GRAMMARS["regex"]), max_num_drafts=2)
        assert seq.grammar.advance(ids[:1])
    masked = masks.fill(first, np.array([0, 3, 6])).clone()
    assert not bool((masked == -1).all())
    second = [first[1], sequence("plain", [5, 6])]
    again = masks.fill(second, np.array([0, 3, 6]))
    assert torch.equal(again[:3], masked[3:]) and bool((again[3:] == -1).all())
    masks.close()


def test_drafts_are_cut_at_the_first_one_the_grammar_refuses(tokenizer, compiler) -> None:
    ids = encode(tokenizer, ANSWERS["choice"])
    eos = min(tokenizer.eos_token_ids)
    refused = encode(tokenizer, "@")[0]
    drafts = {
        "legal": ids[:3],
        "refused midway": [ids[0], refused, ids[1]],
        "refused first": [refused, *ids[:2]],
        "after the end": [*ids, eos, ids[0]],
        "none": [],
    }
    seqs = []
    for name, request_drafts in drafts.items():
        seq = sequence(name, request_drafts)
        seq.grammar = GrammarState(compiler.submit(GRAMMARS["choice"]), max_num_drafts=len(ids) + 2)
        seqs.append(seq)
    seqs.append(sequence("plain", [refused, refused]))  # no grammar: left alone
    assert cut_refused_drafts(seqs) == [0, 2, 3, 1, 0, 0]
    kept = [seq.spec.draft_token_ids for seq in seqs]
    assert kept == [ids[:3], [ids[0]], [], [*ids, eos], [], [refused, refused]]
    for seq in seqs[:-1]:
        assert seq.grammar is not None and seq.grammar.advance(ids)  # every state still at the start


def sequence(request_id: str, drafts: list[int]) -> Sequence:
    seq = Sequence(request_id, [1, 2], SamplingParams(), frozenset())
    seq.spec.draft_token_ids = list(drafts)
    return seq


def fill_row_by_row(matcher, drafts: list[int], bitmask: torch.Tensor, first_row: int) -> None:
    """The masks one row at a time: the matcher advanced draft by draft, then rolled back."""
    if matcher.is_terminated():
        return
    matcher.fill_next_token_bitmask(bitmask, first_row)
    num_taken = 0
    for j, draft in enumerate(drafts):
        if not matcher.accept_token(draft):
            break
        num_taken += 1
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, first_row + j + 1)
    if num_taken:
        matcher.rollback(num_taken)


def next_masks(states: list[GrammarState], vocab_size: int) -> torch.Tensor:
    """[len(states), num_words]: each state's mask where it stands."""
    bitmask = allocate_bitmask(len(states), vocab_size)
    for i, state in enumerate(states):
        state.matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask


def allowed(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


def test_a_request_whose_grammar_still_compiles_waits_while_others_run(monkeypatch) -> None:
    """The step does not wait for a compile while it has other work: the request stays queued,
    the others decode, and it runs once its grammar is there (or once nothing else is left), its
    output as if it had never waited."""
    llm = LLM(str(reference_dir()), device="cpu", max_model_len=256)
    engine = llm.engine
    structured = SamplingParams(temperature=0.0, max_tokens=12, structured=GRAMMARS["json_schema"])
    expected = llm.generate(["# a record\n"], structured)[0].token_ids
    compiled = engine.grammars.submit(GRAMMARS["json_schema"]).result()
    compiling: Future[object] = Future()
    monkeypatch.setattr(engine.grammars, "submit", lambda _: compiling)
    safety = threading.Timer(60, compiling.set_result, [compiled])  # a regression fails, never hangs
    safety.start()
    engine.add_request("plain", prompt="def add(a, b):", params=SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    engine.add_request("json", prompt="# a record\n", params=structured)
    tokens: dict[str, list[int]] = {}
    num_steps = 0
    while any(seq.request_id == "plain" for seq in engine.scheduler.running):
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        assert [seq.request_id for seq in engine.scheduler.waiting] == ["json"]
        num_steps += 1
    assert num_steps >= 4 and safety.is_alive()  # it decoded beside the compile, never waiting for it
    safety.cancel()
    compiling.set_result(compiled)
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert tokens["json"] == expected
