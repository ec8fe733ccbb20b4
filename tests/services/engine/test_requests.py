"""Per-request behaviour of the engine: seeds, stops, logprobs, validation, aborts."""

from __future__ import annotations

import pytest
import torch

from services.engine.engine import RequestError
from services.engine.llm import LLM
from shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(make_checkpoint) -> LLM:
    return LLM(
        str(make_checkpoint("qwen2", num_hidden_layers=2)), device="cpu", max_model_len=128, block_size=8
    )


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 384, (int(n),), generator=generator).tolist()
        for n in torch.randint(4, 40, (count,), generator=generator)
    ]


def test_seeded_request_is_identical_alone_and_in_a_batch_of_32(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=20, ignore_eos=True)
    prompt = random_prompts(1, seed=1)[0]
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=seeded)[0].token_ids
    others = random_prompts(31, seed=2)
    params = [seeded] + [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 31
    batched = llm.generate(prompt_token_ids=[prompt] + others, sampling_params=params)[0].token_ids
    assert batched == alone
    other_seed = llm.generate(
        prompt_token_ids=[prompt], sampling_params=seeded.model_copy(update={"seed": 43})
    )
    assert other_seed[0].token_ids != alone


def test_max_tokens_and_ignore_eos(llm: LLM) -> None:
    out = llm.generate(
        prompt_token_ids=random_prompts(3),
        sampling_params=SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    )
    assert [len(o.token_ids) for o in out] == [7, 7, 7]
    assert {o.finish_reason for o in out} == {"length"}


def test_stop_token_id_ends_at_that_token(llm: LLM) -> None:
    prompt = random_prompts(1, seed=3)[0]
    free = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    )[0]
    stop_id = free.token_ids[10]
    first = free.token_ids.index(stop_id)
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]
        ),
    )[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_min_tokens_suppresses_stop_ids(llm: LLM) -> None:
    prompt = random_prompts(1, seed=3)[0]
    free = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    )[0]
    stop_id = free.token_ids[0]
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=30, min_tokens=5, stop_token_ids=[stop_id]),
    )[0]
    assert len(out.token_ids) >= 5
    assert stop_id not in out.token_ids[:5]


def test_stop_string_is_cut_and_not_returned(llm: LLM) -> None:
    prompt = random_prompts(1, seed=4)[0]
    free = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    )[0]
    text = free.text
    assert len(text) > 12
    stop = text[8:11]
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
    )[0]
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_streamed_deltas_add_up_to_the_text(llm: LLM) -> None:
    engine = llm.engine
    prompt = random_prompts(1, seed=5)[0]
    engine.add_request(
        "stream",
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop=["zzzz"]),
    )
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            final = out
    assert final is not None and final.finished
    assert "".join(deltas) == final.text


def test_each_steps_output_keeps_what_it_had_while_later_steps_run(llm: LLM) -> None:
    """A streamed output read after later steps still holds its own step's tokens and logprobs (the
    whole output so far, and this step's new part), though it reads them from the request's lists,
    which the later steps extend."""
    engine = llm.engine
    engine.add_request(
        "kept",
        prompt_token_ids=random_prompts(1)[0],
        params=SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True),
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and len(final.token_ids) == 12
    emitted = 0
    for out in outputs:
        new = len(out.new_token_ids)
        assert out.token_ids == final.token_ids[: emitted + new]
        assert out.new_token_ids == final.token_ids[emitted : emitted + new]
        assert out.logprobs == final.logprobs[: emitted + new]
        assert out.new_logprobs == final.logprobs[emitted : emitted + new]
        emitted += new
    assert emitted == 12


def test_logprobs_per_token(llm: LLM) -> None:
    out = llm.generate(
        prompt_token_ids=random_prompts(1),
        sampling_params=SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True),
    )[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token_id
        assert len(entry.top) == 2
        assert entry.logprob == pytest.approx(max(entry.top.values()), abs=1e-5)  # greedy: the best one


def test_text_prompt_and_chat_template(llm: LLM) -> None:
    out = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("def add(a, b):")
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3))
    assert (
        llm.tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False)
        == "<|user|>hi<|endoftext|><|assistant|>"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt_token_ids=[[1, 2, 999]]), "out of range"),
        (dict(prompt_token_ids=[[]]), "empty"),
        (
            dict(prompt_token_ids=[[1] * 120], sampling_params=SamplingParams(max_tokens=20)),
            "maximum context length is 128",
        ),
        (
            dict(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(stop_token_ids=[5000])),
            "stop_token_ids",
        ),
    ],
)
def test_bad_requests_get_clear_errors_and_leave_nothing_behind(llm: LLM, kwargs, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        llm.generate(**kwargs)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(logprobs=100), "logprobs"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(temperatur=0.5), "temperatur"),
    ],
)
def test_invalid_sampling_params_are_refused(fields, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_abort_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(
        "to-abort",
        prompt_token_ids=random_prompts(1)[0],
        params=SamplingParams(max_tokens=50, ignore_eos=True),
    )
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    out = engine.abort_request("to-abort")
    assert out is not None and out.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_unknown_model_directory_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_max_model_len_beyond_the_trained_positions_is_refused(make_checkpoint) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(make_checkpoint("qwen2", num_hidden_layers=2)), device="cpu", max_model_len=4096)


def test_a_request_placed_again_keeps_its_place_in_line(llm: LLM) -> None:
    """Arrival order, not the order the requests reached this engine: after a worker dies, its
    requests come back in any order, and each must not queue behind requests newer than it."""
    engine = llm.engine
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("newest", prompt_token_ids=[5, 6], params=params, arrival_time=300.0)
    engine.add_request("oldest", prompt_token_ids=[5, 7], params=params, arrival_time=100.0)
    engine.add_request("middle", prompt_token_ids=[5, 8], params=params, arrival_time=200.0)
    engine.add_request("now", prompt_token_ids=[5, 9], params=params)
    try:
        assert [seq.request_id for seq in engine.scheduler.waiting] == ["oldest", "middle", "newest", "now"]
    finally:
        for request_id in ("newest", "oldest", "middle", "now"):
            engine.abort_request(request_id)


def test_a_request_that_ended_can_come_back_at_once_under_its_id(llm: LLM) -> None:
    """A worker placed again with a request whose earlier placement just ended here (its last
    output is emitted a step later) discards that one: the new one runs, and no output of the old
    one comes out after it."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request("again", prompt_token_ids=[5, 6, 7], params=params)
    engine.step()  # the token is sampled and the request ends; its output comes with the next step
    assert "again" in engine.sequences
    engine.discard_request("again")
    engine.add_request(
        "again", prompt_token_ids=[5, 6, 7], params=params.model_copy(update={"max_tokens": 3})
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "again"]
    assert [len(o.token_ids) for o in outputs if o.finished] == [3]
    assert "again" not in engine.sequences
