"""A text delta's SSE event from its choice's template is the one serializing its body gives."""

from __future__ import annotations

import pytest

from services.gateway.prepare import Job, ServedModel
from services.gateway.render import ChoiceState, Renderer, TokenText
from services.gateway.streaming import DeltaTemplate, event_bytes
from shared.protocol import GenerateRequest, TokenEvent, TokenLogprob
from shared.sampling_params import SamplingParams

TEXTS = [
    "x",
    " wörld ✓ 你好 😀",
    'a"b\\c\n\t\x00\x1f\x7f',
    "\u2028\u2029</script>",
    DeltaTemplate.PLACEHOLDER,
]


def job(kind: str, include_usage: bool, logprobs: int | None = None) -> Job:
    request = GenerateRequest(request_id="cmpl-1-0", prompt_token_ids=[1], params=SamplingParams())
    return Job(kind, "cmpl-1", 1700000000, [request], 1, True, include_usage, logprobs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_delta_from_the_template_is_the_serialized_chunk(
    served: ServedModel, kind: str, include_usage: bool
) -> None:
    renderer = Renderer(job(kind, include_usage), 'model "x"', TokenText(served.tokenizer))
    choice = ChoiceState(0)
    for text in TEXTS:
        event = TokenEvent("cmpl-1-0", [5], text, num_output_tokens=1)
        chunk = renderer.chunk(choice, event)
        assert chunk is not None
        assert renderer.delta_event(choice, event) == event_bytes(chunk, include_usage)


def test_events_beyond_a_text_delta_get_no_template(served: ServedModel) -> None:
    renderer = Renderer(job("completion", False), "m", TokenText(served.tokenizer))
    choice = ChoiceState(0)
    assert renderer.delta_event(choice, TokenEvent("r", [5], "", num_output_tokens=1)) is None
    ended = TokenEvent("r", [5], "x", finished=True, finish_reason="stop", num_output_tokens=1)
    assert renderer.delta_event(choice, ended) is None
    with_logprobs = Renderer(job("completion", False, logprobs=1), "m", TokenText(served.tokenizer))
    event = TokenEvent("r", [5], "x", [TokenLogprob(token_id=5, logprob=-0.5)], num_output_tokens=1)
    assert with_logprobs.delta_event(choice, event) is None
