"""Per-step token-mask cost of the grammar engines on the shipped model's vocabulary, side by side.

    python -m benchmarks.grammar_mask --batch 1 64

For each engine (llguidance, xgrammar: whichever is importable) and each workload (a JSON schema,
free JSON, a regex): the compile time of the grammar, then the host time of one decode step's
masks: every row of the batch advanced by one token of a legal answer and its next-token bitmask
filled, plus the bitmask applied to a [batch, vocab] float32 logits tensor. A speculative step
fills one mask per verified row; the per-row figure is the same work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from services.engine.sampler import apply_bitmask

MODEL = Path("models/specmesh-code-15m")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["a", "ccc", "bb"],
        "address": {"city": "London", "zip": "12345"},
    }
)
REGEX = r"[a-z]+@[a-z]+\.(com|org|net) [0-9]{3}-[0-9]{4}"
REGEX_ANSWER = "ada@example.org 555-1234"

WORKLOADS: dict[str, tuple[str, str, str]] = {
    "json_schema": ("json_schema", json.dumps(SCHEMA), ANSWER),
    "json_object": ("json_object", "", ANSWER),
    "regex": ("regex", REGEX, REGEX_ANSWER),
}


class Engine:
    """One grammar library behind the three calls a step makes: compile, advance, fill a mask."""

    name = ""

    def compile(self, kind: str, spec: str) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def advance(self, matcher: Any, token_id: int) -> None:
        raise NotImplementedError

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, vocab_size: int):
        import llguidance
        import llguidance.torch

        self.ll = llguidance
        self.fill_row = llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.LLTokenizer(str(MODEL / "tokenizer.json"), n_vocab=vocab_size)

    def compile(self, kind: str, spec: str) -> Any:
        grammar = {
            "json_schema": lambda: self.ll.LLMatcher.grammar_from_json_schema(spec),
            "json_object": lambda: self.ll.LLMatcher.grammar_from_json_schema('{"type": "object"}'),
            "regex": lambda: self.ll.LLMatcher.grammar_from_regex(spec),
        }[kind]()
        self.matcher(grammar)  # llguidance compiles lazily: the first matcher pays
        return grammar

    def matcher(self, compiled: Any) -> Any:
        matcher = self.ll.LLMatcher(self.tokenizer, compiled)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def advance(self, matcher: Any, token_id: int) -> None:
        assert matcher.consume_token(token_id), matcher.get_error()

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        self.fill_row(matcher, bitmask, row)


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, vocab_size: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(MODEL / "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[0])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind: str, spec: str) -> Any:
        return {
            "json_schema": lambda: self.compiler.compile_json_schema(spec, any_whitespace=False),
            "json_object": lambda: self.compiler.compile_builtin_json_grammar(),
            "regex": lambda: self.compiler.compile_regex(spec),
        }[kind]()

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def advance(self, matcher: Any, token_id: int) -> None:
        assert matcher.accept_token(token_id)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)


def engines(vocab_size: int) -> list[Engine]:
    found: list[Engine] = []
    for make in (LLGuidance, XGrammar):
        try:
            found.append(make(vocab_size))
        except ImportError as exc:
            print(f"skipping {make.name}: {exc}")
    return found


def time_workload(
    engine: Engine, kind: str, spec: str, answer_ids: list[int], batch: int, vocab_size: int
) -> dict[str, float]:
    """Compile time, then per-step time (advance + fill every row) and mask-apply time, in ms."""
    started = time.perf_counter()
    compiled = engine.compile(kind, spec)
    compile_ms = 1e3 * (time.perf_counter() - started)
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    bitmask = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(batch, vocab_size)
    fill_ms: list[float] = []
    apply_ms: list[float] = []
    for step, token_id in enumerate([None, *answer_ids[:-1]]):
        started = time.perf_counter()
        for row, matcher in enumerate(matchers):
            if token_id is not None:
                engine.advance(matcher, token_id)
            engine.fill(matcher, bitmask, row)
        fill_ms.append(1e3 * (time.perf_counter() - started))
        started = time.perf_counter()
        apply_bitmask(logits.clone(), bitmask)
        apply_ms.append(1e3 * (time.perf_counter() - started))
        allowed = bool((bitmask[0, answer_ids[step] // 32] >> (answer_ids[step] % 32)) & 1)
        assert allowed, f"{engine.name} masks out token {step} of the answer"
    return {
        "compile_ms": compile_ms,
        "step_ms_median": statistics.median(fill_ms),
        "step_ms_p90": sorted(fill_ms)[int(0.9 * (len(fill_ms) - 1))],
        "apply_ms_median": statistics.median(apply_ms),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="rows per step (default: 1 64)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the best is kept (default: 3)")
    args = parser.parse_args(argv)
    from shared.tokenizer import Tokenizer

    tokenizer = Tokenizer(MODEL)
    vocab_size = json.loads((MODEL / "config.json").read_text())["vocab_size"]
    print(f"vocabulary: {vocab_size} tokens ({MODEL}); torch threads {torch.get_num_threads()}")
    print("engine      workload     batch  compile_ms  step_ms(med)  step_ms(p90)  apply_ms(med)")
    for engine in engines(vocab_size):
        for workload, (kind, spec, answer) in WORKLOADS.items():
            answer_ids = tokenizer.encode(answer, add_special_tokens=False)
            for batch in args.batch:
                runs = [
                    time_workload(engine, kind, spec, answer_ids, batch, vocab_size)
                    for _ in range(args.repeats)
                ]
                best = min(runs, key=lambda r: r["step_ms_median"])
                print(
                    f"{engine.name:<11} {workload:<12} {batch:>5}  {min(r['compile_ms'] for r in runs):>10.2f}"
                    f"  {best['step_ms_median']:>12.3f}  {best['step_ms_p90']:>12.3f}  {best['apply_ms_median']:>13.3f}"
                )


if __name__ == "__main__":
    main()
