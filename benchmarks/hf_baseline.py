"""Hugging Face transformers `generate()` on the same model and device, as an outside baseline.

Two variants, one request at a time (HF's assisted generation takes batch 1): `hf` (plain greedy
or sampled decoding) and `hf_prompt_lookup` (`prompt_lookup_num_tokens`, HF's n-gram drafting,
Saxena 2023). Prompts are tokenized with specmesh's tokenizer so both engines see the same ids; a
streamer stamps each delivered token, so TTFT, TPOT and ITL mean what they mean for specmesh.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.client import Sampling
from benchmarks.dataset import WARMUP_PROMPT, BenchRequest
from benchmarks.metrics import RequestRecord
from shared.tokenizer import Tokenizer

VARIANTS = ("hf", "hf_prompt_lookup")


def unavailable_reason(device: str) -> str | None:
    """Why the HF baseline cannot run on `device`, or None when it can."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install -e '.[bench]')"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"device {device} requested but CUDA is not available"
    return None


class StampStreamer:
    """A `generate()` streamer that records when each batch of new tokens arrives (the first `put`
    is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        if value.device.type == "cuda":
            torch.cuda.synchronize(value.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFBaseline:
    def __init__(self, model_dir: str, device: str, dtype: torch.dtype):
        import transformers

        self.device = torch.device(device)
        # `dtype` since transformers 4.56; older releases call it `torch_dtype`
        old = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (4, 56)
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, **{"torch_dtype" if old else "dtype": dtype}
        )
        self.model = model.to(self.device).eval()
        self.tokenizer = Tokenizer(model_dir)

    def close(self) -> None:
        """Frees the model's memory (the engine runs next on the same device)."""
        del self.model

    def run(
        self,
        requests: list[BenchRequest],
        sampling: Sampling,
        prompt_lookup_num_tokens: int | None,
        progress: tqdm | None = None,
    ) -> list[RequestRecord]:
        self.generate(BenchRequest("warmup", "warmup", WARMUP_PROMPT, 8), sampling, prompt_lookup_num_tokens)
        records = []
        for request in requests:
            records.append(self.generate(request, sampling, prompt_lookup_num_tokens))
            if progress is not None:
                progress.update(1)
        return records

    @torch.inference_mode()
    def generate(
        self, request: BenchRequest, sampling: Sampling, prompt_lookup_num_tokens: int | None
    ) -> RequestRecord:
        ids = self.tokenizer.encode(request.prompt)
        input_ids = torch.tensor([ids], device=self.device)
        streamer = StampStreamer()
        record = RequestRecord(request.id, request.workload, arrived_at=time.perf_counter())
        output = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            streamer=streamer,
            **self._generate_kwargs(request, sampling, prompt_lookup_num_tokens),
        )
        record.finished_at = time.perf_counter()
        record.token_times = streamer.times
        record.num_prompt_tokens = len(ids)
        record.num_output_tokens = int(output.shape[1]) - len(ids)
        return record

    def _generate_kwargs(
        self, request: BenchRequest, sampling: Sampling, prompt_lookup_num_tokens: int | None
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "max_new_tokens": request.max_tokens,
            "pad_token_id": self.model.config.pad_token_id or 0,
        }
        if sampling.temperature > 0:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=1.0, top_k=0)
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if sampling.ignore_eos:
            kwargs["min_new_tokens"] = request.max_tokens
        if prompt_lookup_num_tokens:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
        return kwargs
