"""Per-step token-mask cost of structured output: the grammar engines on the host, side by side,
and (`--engine-model`) what a grammar adds to the engine's decode step.

    python -m benchmarks.grammar_mask --batch 1 64
    python -m benchmarks.grammar_mask --step-masks --batch 1 16 64 --drafts 0 3
    python -m benchmarks.grammar_mask --step-masks --schemas code json_editing --threads 1 2 4 8 16
    python -m benchmarks.grammar_mask --engine-model /tmp/widened-llama-3.2-1b/target --device cuda \
        --batch 1 64 --out grammar-mask.json

For each engine (llguidance, xgrammar: whichever is importable) and each workload (a JSON schema,
free JSON, a regex): the compile time of the grammar, then the host time of one decode step's
masks: every row of the batch advanced by one token of a legal answer and its next-token bitmask
filled, plus the bitmask applied to a [batch, vocab] float32 logits tensor. A speculative step
fills one mask per verified row; the per-row figure is the same work.

With `--step-masks`, the engine's own fill (services/engine/grammar.py, `StepMasks.fill`) of one
decode step's masks: `batch` requests under a JSON schema (`--schemas`: `long`, the engine mode's;
`code`, benchmarks/workloads/edit_schema.json with answers holding code_editing's functions;
`json_editing`, json_edit_schema.json with the records of json_editing's prompts), each at a
different place in a legal answer, each with k drafts that follow it (so every request fills k + 1
rows), advanced by one token per step; on each of `--threads` (the fill's threads).

With `--engine-model` (a checkpoint: on a GPU, the 1B-cost widened target of benchmarks.widen), the
engine decodes `batch` requests side by side three times: plain, then each constrained to a JSON
schema that cannot end before max_tokens (so every step masks every row), with steps launched
ahead (the engine's default) and synchronously (as before grammar steps ran ahead). The figure is
the median decode step with the grammar against the plain one (the goal: at most 5% more), beside
the host time spent filling the masks per step, which runs while the forward runs.

With `--host-path` (CPU, the shipped model): the host's path of a decode step with grammar rows,
from reading the step before back to launching this step's tail (`host_path`), steps launched
ahead against synchronous ones, every request under the long JSON schema:

    python -m benchmarks.grammar_mask --host-path --batch 16 64 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.sampler import apply_bitmask
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutput

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


LONG_SCHEMA = {
    "type": "array",
    "minItems": 512,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "count": {"type": "integer"},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "count", "ok"],
        "additionalProperties": False,
    },
}
"""The engine mode's grammar: an answer this long outlasts any max_tokens measured."""
ENGINE_PROMPT = "# the inventory as JSON: name, count, ok\n"


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


def decode_steps_ms(engine: Any, batch: int, params: SamplingParams) -> list[float]:
    """Wall time of each step of `batch` requests decoding together (steps that carry a prompt are
    left out), in ms."""
    for i in range(batch):
        engine.add_request(f"r{i}", prompt=ENGINE_PROMPT, params=params)
    times = []
    while engine.has_unfinished_requests():
        scheduler = engine.scheduler
        prefilling = bool(scheduler.waiting) or any(
            seq.num_computed_tokens < seq.num_prompt_tokens for seq in scheduler.running
        )
        started = time.perf_counter()
        engine.step()
        if not prefilling:
            times.append(1e3 * (time.perf_counter() - started))
    return times[1:]  # the first decode step still brings the first drafts' set-up


def timed(record: list[float], fill: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fill`, appending the host time of each call (ms) to `record`."""

    def wrapper(*args: Any) -> torch.Tensor:
        started = time.perf_counter()
        masks = fill(*args)
        record.append(1e3 * (time.perf_counter() - started))
        return masks

    return wrapper


def long_answer_ids(tokenizer: Any, num_items: int) -> list[int]:
    """Tokens of a legal answer to LONG_SCHEMA, `num_items` items long."""
    items = [{"name": f"item{i}", "count": i, "ok": i % 3 == 0} for i in range(num_items)]
    return tokenizer.encode(json.dumps(items), add_special_tokens=False)


FILL_SCHEMAS = ("long", "code", "json_editing")
WORKLOADS_DIR = Path(__file__).parent / "workloads"


def fill_workload(name: str, tokenizer: Any) -> tuple[dict, list[list[int]]]:
    """A schema of `FILL_SCHEMAS` and legal answers to it (token ids), each in the schema's
    property order with the separators the engine's grammar allows."""
    if name == "long":
        return LONG_SCHEMA, [long_answer_ids(tokenizer, 512)]
    workload = "code_editing" if name == "code" else name
    schema_file = "edit_schema.json" if name == "code" else "json_edit_schema.json"
    schema = json.loads((WORKLOADS_DIR / schema_file).read_text())
    lines = (WORKLOADS_DIR / f"{workload}.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines]
    if name == "code":  # the function the prompt gives, returned with a short summary
        answers = [
            {"summary": "logging added", "code": prompt.split("\n\n# ")[0] + "\n", "changed_lines": [2, 3]}
            for prompt in prompts
        ]
    else:  # the record the prompt gives, on its second line
        answers = [json.loads(prompt.splitlines()[1]) for prompt in prompts]
    return schema, [tokenizer.encode(json.dumps(answer), add_special_tokens=False) for answer in answers]


def step_masks_cost(
    schemas: list[str],
    batches: list[int],
    ks: list[int],
    threads: list[int | None],
    num_steps: int,
    repeats: int,
) -> list[dict]:
    """Per schema, thread count, batch and k: the median host time of `StepMasks.fill` for one
    decode step (ms; the best of `repeats` runs), request i under answer i mod the number of
    answers, at its own place in it, with k legal drafts; a thread count of None: the engine's
    default."""
    from services.engine.grammar import GrammarCompiler, StepMasks
    from shared.tokenizer import Tokenizer

    tokenizer = Tokenizer(MODEL)
    vocab_size = json.loads((MODEL / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(tokenizer, vocab_size, frozenset(tokenizer.eos_token_ids))
    rows = []
    for name in schemas:
        schema, answers = fill_workload(name, tokenizer)
        compiled = compiler.submit(StructuredOutput.json_schema(schema))
        answers = [a for a in answers if len(a) > num_steps + max(ks) + 8]
        if not answers:
            raise SystemExit(f"{name}: no answer is longer than {num_steps} steps; ask for fewer --steps")
        for num_threads in threads:
            masks = StepMasks(vocab_size, torch.device("cpu"), num_threads)
            for batch in batches:
                for k in ks:
                    best = min(
                        fill_run(masks, compiled, answers, batch, k, max(ks), num_steps)
                        for _ in range(repeats)
                    )
                    rows.append(
                        {
                            "schema": name,
                            "threads": masks.num_threads,
                            "batch": batch,
                            "k": k,
                            "rows": batch * (k + 1),
                            "fill_ms_median": best,
                        }
                    )
                    print(
                        f"{name:<12} threads {masks.num_threads:>2}, batch {batch:>3}, k {k}: "
                        f"{batch * (k + 1):>4} rows, fill {best:.3f} ms/step"
                    )
            masks.close()
    compiler.close()
    return rows


def fill_run(
    masks: Any, compiled: Any, answers: list[list[int]], batch: int, k: int, max_k: int, num_steps: int
) -> float:
    """The median host time (ms) of `masks.fill` over `num_steps` decode steps of `batch` requests,
    request i at place 5 i (modulo its answer's length) of answer i mod len(answers)."""
    from services.engine.grammar import GrammarState
    from services.engine.sequence import Sequence

    seqs = [Sequence(f"r{i}", [1], SamplingParams(), frozenset()) for i in range(batch)]
    starts = []
    for i, seq in enumerate(seqs):
        answer = answers[i % len(answers)]
        starts.append(5 * i % (len(answer) - num_steps - max_k - 1))
        seq.grammar = GrammarState(compiled, max_k)
        assert seq.grammar.advance(answer[: starts[i]])
    cu_num_rows = np.arange(batch + 1) * (k + 1)
    times = []
    for step in range(num_steps):
        for i, seq in enumerate(seqs):
            place = starts[i] + step
            seq.spec.draft_token_ids = answers[i % len(answers)][place : place + k]
        started = time.perf_counter()
        masks.fill(seqs, cu_num_rows)
        times.append(1e3 * (time.perf_counter() - started))
        for i, seq in enumerate(seqs):
            token_id = answers[i % len(answers)][starts[i] + step]
            assert seq.grammar is not None and seq.grammar.advance([token_id])
    return statistics.median(times)


def engine_step_cost(
    model: str, device: str, dtype: str, batches: list[int], max_tokens: int, repeats: int
) -> list[dict]:
    """Per batch: the median decode step plain and with every request under LONG_SCHEMA (runs
    interleaved `repeats` times, the smallest median kept), and the median host time of one step's
    mask filling."""
    from services.engine.llm import LLM

    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=max(batches), max_model_len=512)
    engine = llm.engine
    fills: list[float] = []
    masks = engine.runner.step_masks
    masks.fill = timed(fills, masks.fill)  # type: ignore[method-assign]
    plain = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    constrained = plain.model_copy(update={"structured": StructuredOutput.json_schema(LONG_SCHEMA)})
    decode_steps_ms(engine, 1, constrained)  # warm-up: compiles the grammar, fills the caches
    rows = []
    for batch in batches:
        plain_ms = grammar_ms = synchronous_ms = float("inf")
        fills.clear()
        for _ in range(repeats):
            plain_ms = min(plain_ms, statistics.median(decode_steps_ms(engine, batch, plain)))
            grammar_ms = min(grammar_ms, statistics.median(decode_steps_ms(engine, batch, constrained)))
            grammar_steps_ahead(engine, False)
            synchronous_ms = min(
                synchronous_ms, statistics.median(decode_steps_ms(engine, batch, constrained))
            )
            grammar_steps_ahead(engine, True)
        rows.append(
            {
                "batch": batch,
                "plain_step_ms": plain_ms,
                "grammar_step_ms": grammar_ms,
                "mask_cost_ms": grammar_ms - plain_ms,
                "mask_cost_fraction": (grammar_ms - plain_ms) / plain_ms,
                "grammar_step_synchronous_ms": synchronous_ms,
                "synchronous_cost_fraction": (synchronous_ms - plain_ms) / plain_ms,
                "host_fill_ms_median": statistics.median(fills) if fills else None,
                "num_fills": len(fills),
            }
        )
        fill_ms = statistics.median(fills) if fills else 0.0
        print(
            f"batch {batch:>3}: plain step {plain_ms:.3f} ms, with the grammar {grammar_ms:.3f} ms "
            f"({100 * (grammar_ms / plain_ms - 1):+.1f}%; its steps synchronous {synchronous_ms:.3f} ms, "
            f"{100 * (synchronous_ms / plain_ms - 1):+.1f}%), host fill {fill_ms:.3f} ms/step"
        )
    llm.close()
    return rows


def grammar_steps_ahead(engine: Any, ahead: bool) -> None:
    """Whether the engine launches steps with grammar rows ahead (its default) or synchronously,
    as it did before they ran ahead (the step before lands, then the step is planned and launched)."""
    may_run_ahead = engine.__class__._may_run_ahead

    def synchronous(flight: Any) -> bool:
        return may_run_ahead(engine, flight) and not any(seq.grammar for seq in flight.plan.seqs)

    engine._may_run_ahead = (lambda flight: may_run_ahead(engine, flight)) if ahead else synchronous


HostEvent = tuple[str, float, float, bool]
"""(kind, start, end, the step decodes only): a forward or (once its masks are in) a tail
launched, a fill, a result read."""


def record_host_events(engine: Any, events: list[HostEvent]) -> Callable[[], None]:
    """Appends to `events` when each step's forward and tail are launched and end (on a CPU they
    compute inline), when each fill runs, and when each result is read back; what undoes the
    read-back's recording (the others are the engine's own)."""
    from services.engine.model_runner import LaunchedStep

    runner, masks = engine.runner, engine.runner.step_masks

    def wrap(owner: Any, name: str, kind: str, is_decode: Callable[..., bool]) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            value = original(*args, **kwargs)
            events.append((kind, started, time.perf_counter(), is_decode(*args)))
            return value

        setattr(owner, name, wrapper)

    wrap(runner, "_run_forward", "forward", lambda step, *_: step.is_decode)
    wrap(runner, "_tail_eagerly", "tail", lambda *_: True)  # once the masks are copied in
    wrap(masks, "fill", "fill", lambda *_: True)
    wrap(engine, "step", "step", lambda: True)
    original_result = LaunchedStep.result

    def result(self: Any) -> Any:
        output = original_result(self)
        events.append(("read", time.perf_counter(), time.perf_counter(), self.is_decode))
        return output

    LaunchedStep.result = result  # type: ignore[method-assign]
    return lambda: setattr(LaunchedStep, "result", original_result)


def host_path(events: list[HostEvent]) -> dict[str, float]:
    """Per decode step S (median, ms): the host's time from reading back step S - 1 to launching
    S's tail, less S's forward where it lies between (a GPU runs it; here the CPU computes it
    inline), split into the part before S's forward is launched, which the device idles through,
    and the part while it runs (landing S - 1, filling S's masks), which the device waits for only
    past the forward; the fill alone; and an engine step's host time, outside the model's forward
    and tail (the least a step can take however fast the device)."""
    before, during, fills, host = [], [], [], []
    last_read: float | None = None
    forward: HostEvent | None = None
    fill_s = computed_s = 0.0
    for event in events:
        kind, start, end, decode = event
        if kind in ("forward", "tail"):
            computed_s += end - start
        if kind == "step":  # recorded at its end: what it spent outside the model
            host.append(end - start - computed_s)
            computed_s = 0.0
        elif kind == "read":
            last_read, fill_s = end, 0.0
        elif kind == "forward":
            forward = event
        elif kind == "fill":
            fill_s += end - start
        elif kind == "tail" and decode and last_read is not None and forward is not None and forward[3]:
            if forward[1] >= last_read:  # launched after the read: a synchronous step
                before.append(forward[1] - last_read)
                during.append(start - forward[2])
            else:  # launched ahead
                before.append(0.0)
                during.append(start - last_read)
            fills.append(fill_s)
    skip = 2  # the first decode steps still bring the grammars' and drafts' set-up
    return {
        "before_forward_ms": 1e3 * statistics.median(before[skip:]),
        "while_forward_ms": 1e3 * statistics.median(during[skip:]),
        "fill_ms": 1e3 * statistics.median(fills[skip:]),
        "host_ms": 1e3 * statistics.median(host[skip:]),
        "num_steps": len(before) - skip,
    }


def host_path_cost(batches: list[int], max_tokens: int, repeats: int) -> list[dict]:
    """Per batch: `host_path` of decode steps with every request under LONG_SCHEMA, with steps
    that carry grammar rows launched ahead (the engine's) and synchronous (as before they ran
    ahead), the two interleaved `repeats` times on the shipped model on the CPU; the smallest
    median of each kept."""
    from services.engine.llm import LLM

    # one torch thread: torch's threads spinning after the forward would take the fill's core
    llm = LLM(str(MODEL), device="cpu", max_num_seqs=max(batches), max_model_len=512, cpu_threads=1)
    engine = llm.engine
    events: list[HostEvent] = []
    restore = record_host_events(engine, events)
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, structured=StructuredOutput.json_schema(LONG_SCHEMA)
    )
    decode_steps_ms(engine, 1, params)  # warm-up: compiles the grammar
    rows = []
    for batch in batches:
        best: dict[str, dict[str, float]] = {}
        for _ in range(repeats):
            for mode in ("synchronous", "ahead"):
                grammar_steps_ahead(engine, mode == "ahead")
                events.clear()
                step_ms = statistics.median(decode_steps_ms(engine, batch, params))
                path = host_path(events) | {"step_ms": step_ms}
                total = path["before_forward_ms"] + path["while_forward_ms"]
                if (
                    mode not in best
                    or total < best[mode]["before_forward_ms"] + best[mode]["while_forward_ms"]
                ):
                    best[mode] = path
        for mode, path in best.items():
            rows.append({"batch": batch, "grammar_steps": mode, **path})
            print(
                f"batch {batch:>3}, grammar steps {mode:<11}: host path {path['before_forward_ms']:.3f} ms "
                f"before the forward + {path['while_forward_ms']:.3f} ms while it runs "
                f"(fill {path['fill_ms']:.3f} ms); host {path['host_ms']:.3f} ms a step; CPU step {path['step_ms']:.1f} ms"
            )
    restore()
    llm.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="rows per step (default: 1 64)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the best is kept (default: 3)")
    parser.add_argument("--step-masks", action="store_true", help="time the engine's StepMasks.fill")
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 3], help="k per request (--step-masks)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per run (--step-masks)")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        help="the fill's threads, each (--step-masks; default: the engine's)",
    )
    parser.add_argument(
        "--schemas",
        nargs="+",
        choices=FILL_SCHEMAS,
        default=["long"],
        help="--step-masks' schemas (default: long)",
    )
    parser.add_argument("--engine-model", help="a checkpoint: time the engine's decode step with a grammar")
    parser.add_argument("--device", default="cuda", help="the engine's device (default: cuda)")
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype (default: bfloat16)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: 128)")
    parser.add_argument("--out", type=Path, help="write the engine mode's result JSON here")
    parser.add_argument(
        "--host-path",
        action="store_true",
        help="the host's path of a decode step with grammar rows, launched ahead and synchronous (CPU)",
    )
    args = parser.parse_args(argv)
    if args.host_path:
        rows = host_path_cost(args.batch, args.max_tokens, args.repeats)
        if args.out:
            args.out.write_text(json.dumps({"device": "cpu", "rows": rows}, indent=2) + "\n")
        return
    if args.step_masks:
        threads = args.threads or [None]
        if any(t is not None and t < 1 for t in threads):
            parser.error("--threads must be at least 1")
        rows = step_masks_cost(args.schemas, args.batch, args.drafts, threads, args.steps, args.repeats)
        if args.out:
            args.out.write_text(json.dumps({"device": "cpu", "rows": rows}, indent=2) + "\n")
        return
    if args.engine_model:
        rows = engine_step_cost(
            args.engine_model, args.device, args.dtype, args.batch, args.max_tokens, args.repeats
        )
        if args.out:
            result = {"model": args.engine_model, "device": device_name(args.device), "rows": rows}
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
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


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


if __name__ == "__main__":
    main()
