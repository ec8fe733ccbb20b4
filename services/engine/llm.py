"""Offline API: `LLM(model=...).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from services.engine.engine import LLMEngine, RequestOutput
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_args: Any):
        """`engine_args`: EngineConfig fields, e.g. `tensor_parallel_size=2` (then `close()` the
        LLM, or use it as a context manager, to stop its other ranks)."""
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the engine's other tensor-parallel ranks, if any."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | SequenceABC[str] | None = None,
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        prompt_token_ids: SequenceABC[list[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; outputs come in input order."""
        inputs = self._inputs(prompts, prompt_token_ids)
        params = _broadcast(sampling_params, len(inputs))
        request_ids = [f"offline-{next(self._ids)}" for _ in inputs]
        try:
            for request_id, (text, ids), p in zip(request_ids, inputs, params):
                self.engine.add_request(request_id, prompt=text, params=p, prompt_token_ids=ids)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(inputs), disable=not use_tqdm, desc="generate", unit="req") as progress:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate(prompt_token_ids=[ids], sampling_params=sampling_params)[0]

    @staticmethod
    def _inputs(
        prompts: str | SequenceABC[str] | None, prompt_token_ids: SequenceABC[list[int]] | None
    ) -> list[tuple[str | None, list[int] | None]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            return [(text, None) for text in texts]
        return [(None, list(ids)) for ids in prompt_token_ids or []]


def _broadcast(
    sampling_params: SamplingParams | SequenceABC[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if len(sampling_params) != count:
        raise ValueError(f"{len(sampling_params)} sampling params for {count} prompts")
    return list(sampling_params)
