"""`python -m training.refine_mtp`: refines a trained MTP head on its base's own greedy generations.

`train_mtp` distils the head on human-written 512-token windows, but acceptance is measured on the
target's *own* greedy output, which is more repetitive (a loop of blank lines where the head
expects a comment) and, for code continuation, lies past position 512, where the head never
attended. So, like Medusa-2's self-distillation (Cai et al. 2024, arXiv 2401.10774, §2.3.2), this
trains the head further (float32 master weights, bf16 autocast on CUDA; `train_mtp`'s loss,
schedule and scoring) on batches of two kinds, drawn at random:

- *generated*: `prompt_tokens` train-stream tokens ending where an indented line starts (the
  cursor inside a block, as in the code-continuation workload) plus the base's greedy continuation
  of `new_tokens` tokens by specmesh's engine; the KL counts the continuation rows only;
- *corpus*: windows of `seq_len` train-stream tokens, every row.

The streams are the build's package split (`training.data`) in the base's tokens. Held-out prompts
(`HELD_OUT_PACKAGES`) are made and generated alike, only to evaluate: agreement on generated text,
beside the build's teacher-forced protocol (256 windows of `eval_seq_len` tokens) and teacher-forced
agreement from position `eval_seq_len` on.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm import tqdm

from services.engine.llm import LLM
from shared.model import LlamaForCausalLM, load_model
from shared.model.mtp import MTPHead, load_mtp_head, save_mtp_head
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from training import train_mtp
from training.build_reference import PRESETS, shrink_mtp_dir
from training.config import resolve_device, warmup_cosine
from training.corpus import tokenize_files
from training.data import DataSplit, default_roots, split_corpus
from training.tokenizer import EOS_TOKEN_ID
from training.train_lm import device_name
from training.train_mtp import LOSS_PLOT, TRAIN_LOG, EvalStats, make_windows, sample_batch

SPLIT_SEED = 0
"""The build's seed (manifest.json): the package split must be the one the models were trained on."""
EVAL_WINDOWS = 256
"""Teacher-forced held-out windows scored, as the build does (8 batches of 32)."""
GENERATE_CHUNK = 1024
"""Prompts per engine call: the unit at which the progress bar moves and the time limit is checked."""
MAX_NUM_BATCHED_TOKENS = 8192
"""The engine's step budget: prefill 576-token prompts in fewer steps than the default 2k would."""
GENERATE_DEADLINE = 0.5
"""No new chunk of train prompts is generated after this fraction of `time_limit_s`."""


class RefineMTPConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    base: Path
    head: Path
    out: Path
    """directory for the refined head (bf16), train_log.json and loss.png"""
    roots: list[Path] = Field(default_factory=list)
    """source roots (default: this interpreter's stdlib and site-packages, as the build)"""
    max_train_tokens: int = Field(default=20_000_000, ge=1)
    num_prompts: int = Field(default=8192, ge=1)
    num_held_out_prompts: int = Field(default=256, ge=1)
    prompt_tokens: int = Field(default=576, ge=2)
    new_tokens: int = Field(default=128, ge=2)
    seq_len: int = Field(default=1024, ge=3)
    """tokens per corpus window (the build's 512 left later positions untrained)"""
    eval_seq_len: int = Field(default=512, ge=3)
    steps: int = Field(default=3000, ge=1)
    batch_size: int = Field(default=16, ge=1)
    """corpus windows per corpus step"""
    generated_batch_size: int = Field(default=32, ge=1)
    """generated sequences per generated step, and sequences per evaluation batch"""
    generated_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """the chance that a step is a generated one"""
    lr: float = Field(default=3e-4, gt=0.0)
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(default=100, ge=0)
    weight_decay: float = Field(default=0.01, ge=0.0)
    grad_clip: float = Field(default=1.0, gt=0.0)
    eval_every: int = Field(default=500, ge=1)
    seed: int = Field(default=0, ge=0)
    device: str = "auto"
    max_num_seqs: int = Field(default=256, ge=1)
    time_limit_s: float | None = Field(default=None, gt=0.0)
    """safety net: fewer train prompts and steps (logged) rather than an overrun"""
    progress: bool = True

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)


@dataclass
class RefineData:
    windows: torch.Tensor  # [num_windows, seq_len] train-corpus windows
    generated: torch.Tensor  # [num_prompts, prompt_tokens + new_tokens] train prompts + continuations
    eval_sets: dict[str, tuple[torch.Tensor, int]]
    """Held-out sequences, each set with its first scored draft row."""
    meta: dict[str, Any]


# ---------------------------------------------------------------------------------------------- data


def prepare_data(config: RefineMTPConfig, gen: torch.Generator, deadline: float) -> RefineData:
    """Splits and tokenizes the sources, samples prompts and generates their continuations."""
    started = time.perf_counter()
    tokenizer = Tokenizer(config.base)
    split, train, held_out = tokenize_split(config, tokenizer)
    is_cut = indented_line_starts(tokenizer)
    held_out_prompts = sample_prompts(
        held_out, config.num_held_out_prompts, config.prompt_tokens, is_cut, gen
    )
    prompts = sample_prompts(train, config.num_prompts, config.prompt_tokens, is_cut, gen)
    data_s = time.perf_counter() - started
    held_out_generated, generated = generate(config, held_out_prompts, prompts, deadline)
    eval_sets = make_eval_sets(config, held_out, held_out_generated)
    meta = {
        **split.summary(),
        "train_tokens": train.numel(),
        "held_out_tokens": held_out.numel(),
        "num_prompts": len(generated),
        "num_held_out_prompts": len(held_out_generated),
        "generated_tokens": (len(generated) + len(held_out_generated)) * config.new_tokens,
        "phases_s": {"data": data_s, "generate": time.perf_counter() - started - data_s},
    }
    return RefineData(make_windows(train, config.seq_len), generated, eval_sets, meta)


def tokenize_split(
    config: RefineMTPConfig, tokenizer: Tokenizer
) -> tuple[DataSplit, torch.Tensor, torch.Tensor]:  # split, [num_train_tokens], [num_held_out_tokens]
    """The build's package split of the sources, and its train and held-out streams (int64)."""
    split = split_corpus(config.roots or default_roots(), SPLIT_SEED, PRESETS["full"].validation_fraction)
    train = tokenize_files(split.train, tokenizer.backend, config.max_train_tokens).long()
    held_out = tokenize_files(split.held_out, tokenizer.backend, PRESETS["full"].mtp.max_held_out_tokens)
    return split, train, held_out.long()


def make_eval_sets(
    config: RefineMTPConfig,
    held_out: torch.Tensor,  # [num_held_out_tokens]
    held_out_generated: torch.Tensor,  # [num_held_out_prompts, prompt_tokens + new_tokens]
) -> dict[str, tuple[torch.Tensor, int]]:
    """The held-out sets, each with its first scored draft row: the build's teacher-forced
    windows, longer windows scored past `eval_seq_len`, and the generated continuations."""
    return {
        "held_out": (make_windows(held_out, config.eval_seq_len)[:EVAL_WINDOWS], 0),
        "held_out_long": (
            make_windows(held_out, config.seq_len)[: EVAL_WINDOWS // 2],
            config.eval_seq_len - 1,
        ),
        # row i drafts t_{i+2}: scored from the row whose input is the first generated token
        "held_out_generated": (held_out_generated, config.prompt_tokens - 1),
    }


def indented_line_starts(tokenizer: Tokenizer) -> torch.Tensor:  # [vocab_size] bool
    """Tokens that are a line break plus the next line's indentation (GPT-2 pre-tokenization)."""
    texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)]
    return torch.tensor([re.fullmatch(r"\n[ \t]+", text) is not None for text in texts])


def sample_prompts(
    stream: torch.Tensor, num_prompts: int, prompt_tokens: int, is_cut: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:  # [min(num_prompts, num_candidates), prompt_tokens]
    """Distinct windows of `stream` that end right before an `is_cut` token and hold no EOS."""
    num_eos = torch.nn.functional.pad(torch.cumsum(stream == EOS_TOKEN_ID, 0), (1, 0))  # EOS in [0, i)
    ends = torch.arange(prompt_tokens, max(prompt_tokens, stream.numel()))
    ends = ends[is_cut[stream[ends]] & (num_eos[ends] == num_eos[ends - prompt_tokens])]
    if not len(ends):
        raise ValueError(f"no {prompt_tokens}-token prompt in a stream of {stream.numel()} tokens")
    ends = ends[torch.randperm(len(ends), generator=gen)[:num_prompts]]
    return stream[ends[:, None] + torch.arange(-prompt_tokens, 0)]


def generate(
    config: RefineMTPConfig, held_out_prompts: torch.Tensor, prompts: torch.Tensor, deadline: float
) -> tuple[torch.Tensor, torch.Tensor]:  # [n, prompt_tokens + new_tokens] each
    """Greedy continuations by specmesh's engine: every held-out prompt, then train prompts chunk
    by chunk until done or past `deadline` (a perf_counter time)."""
    llm = start_engine(
        config.base, config.torch_device, config.max_num_seqs, config.prompt_tokens + config.new_tokens
    )
    params = SamplingParams(temperature=0.0, max_tokens=config.new_tokens, ignore_eos=True)
    chunks: list[torch.Tensor] = []
    total = len(held_out_prompts) + len(prompts)
    with tqdm(total=total, desc="generate", unit="seq", disable=not config.progress) as bar:
        for chunk in [held_out_prompts, *prompts.split(GENERATE_CHUNK)]:
            if len(chunks) > 1 and time.perf_counter() > deadline:
                break
            outputs = llm.generate(prompt_token_ids=chunk.tolist(), sampling_params=params)
            chunks.append(torch.cat([chunk, torch.tensor([o.token_ids for o in outputs])], dim=1))
            bar.update(len(chunk))
    del llm  # frees its KV cache before training
    gc.collect()
    torch.cuda.empty_cache()
    return chunks[0], torch.cat(chunks[1:])


def start_engine(base: Path, device: torch.device, max_num_seqs: int, max_model_len: int) -> LLM:
    """specmesh's engine on the base, with KV-cache room for `max_num_seqs` full-length sequences."""
    return LLM(
        str(base),
        device=str(device),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        num_kv_blocks=max_num_seqs * (max_model_len // 16 + 2),  # 16-token blocks, room for every seq
    )


# ---------------------------------------------------------------------------------------------- loop


def refine_step(
    head: MTPHead,
    target: LlamaForCausalLM,
    token_ids: torch.Tensor,  # [batch, seq]
    first_row: int,
    optimizer: torch.optim.Optimizer,
    grad_clip: float,
) -> float:
    """One AdamW step on the KL of the draft rows from `first_row` on."""
    head.train()
    with train_mtp.bf16_autocast(token_ids.device):
        target_hidden, target_logits = train_mtp.target_pass(target, token_ids)
        head_logits = train_mtp.head_pass(head, token_ids, target_hidden)
        loss = train_mtp.distillation_kl(head_logits[:, first_row:], target_logits[:, first_row:])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), grad_clip)
    optimizer.step()
    return float(loss.detach())


def refine_loop(
    head: MTPHead,
    target: LlamaForCausalLM,
    data: RefineData,
    config: RefineMTPConfig,
    gen: torch.Generator,
    deadline: float,
) -> tuple[list[dict[str, Any]], dict[str, list[EvalStats]]]:
    """Warm-up + cosine decay from the head's weights; returns per-step records and the evaluations
    of every held-out set (step 0 first, the saved head last)."""
    optimizer, schedule = make_optimizer(head, config)
    on_generated = (torch.rand(config.steps, generator=gen) < config.generated_fraction).tolist()
    evals: dict[str, list[EvalStats]] = {name: [] for name in data.eval_sets}
    progress = tqdm(range(1, config.steps + 1), desc="refine-mtp", unit="step", disable=not config.progress)
    record_evals(0, evaluate_all(head, target, data, config, step=0), evals, progress)
    steps: list[dict[str, Any]] = []
    for step in progress:
        batch, first_row = draw_batch(data, config, on_generated[step - 1], gen)
        lr = float(schedule.get_last_lr()[0])
        loss = refine_step(
            head, target, batch.to(config.torch_device), first_row, optimizer, config.grad_clip
        )
        schedule.step()
        steps.append({"step": step, "loss": loss, "lr": lr, "generated": first_row > 0})
        progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
        out_of_time = time.perf_counter() > deadline
        if step % config.eval_every == 0 or step == config.steps or out_of_time:
            record_evals(step, evaluate_all(head, target, data, config, step), evals, progress)
        if out_of_time:
            break
    progress.close()
    return steps, evals


def make_optimizer(
    head: MTPHead, config: RefineMTPConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the head, with train_mtp's warm-up + cosine schedule (training.config)."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: warmup_cosine(step, config.warmup_steps, config.steps, config.min_lr_ratio),
    )
    return optimizer, schedule


def draw_batch(
    data: RefineData, config: RefineMTPConfig, generated: bool, gen: torch.Generator
) -> tuple[torch.Tensor, int]:  # [batch, seq] token ids, first draft row the loss counts
    """Generated sequences (their continuation rows only), or corpus windows (every row)."""
    if generated:
        return sample_batch(data.generated, config.generated_batch_size, gen), config.prompt_tokens - 1
    return sample_batch(data.windows, config.batch_size, gen), 0


def evaluate_all(
    head: MTPHead, target: LlamaForCausalLM, data: RefineData, config: RefineMTPConfig, step: int
) -> dict[str, EvalStats]:
    """Mean KL and top-1 agreement on each held-out set, from its first scored row on."""
    return {
        name: train_mtp.score_windows(
            head, target, sequences, config.generated_batch_size, config.torch_device, step, first_row
        )
        for name, (sequences, first_row) in data.eval_sets.items()
    }


def record_evals(
    step: int, latest: dict[str, EvalStats], evals: dict[str, list[EvalStats]], progress: tqdm
) -> None:
    """Appends `latest` to each held-out set's history and prints the agreements."""
    for name, stats in latest.items():
        evals[name].append(stats)
    scores = ", ".join(f"{name} {stats.agreement:.3f}" for name, stats in latest.items())
    progress.write(f"step {step}: top-1 agreement {scores}", file=sys.stderr)


def refine_mtp(config: RefineMTPConfig) -> dict[str, Any]:
    """Generates, refines, evaluates and saves (module docstring); returns the train log."""
    started = time.perf_counter()
    limit_s = config.time_limit_s or float("inf")
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    data = prepare_data(config, gen, started + GENERATE_DEADLINE * limit_s)
    max_positions = max(config.seq_len, config.eval_seq_len, data.generated.shape[1])
    target, head = load_target_and_head(config, max_positions)
    train_started = time.perf_counter()
    steps, evals = refine_loop(head, target, data, config, gen, started + limit_s)
    save_mtp_head(head, config.out)
    log = make_train_log(config, data, steps, evals, started, train_started)
    (config.out / TRAIN_LOG).write_text(json.dumps(log) + "\n")
    train_mtp.plot_losses([s["loss"] for s in steps], evals["held_out_generated"], config.out / LOSS_PLOT)
    shrink_mtp_dir(config.out)  # bf16 weights and a compact log, as the build ships the head
    return log


def load_target_and_head(config: RefineMTPConfig, max_positions: int) -> tuple[LlamaForCausalLM, MTPHead]:
    """The frozen base (float32 on CPU, bf16 on CUDA) and the head to refine, in float32."""
    device = config.torch_device
    target_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = load_model(config.base, target_dtype, device, max_positions).requires_grad_(False)
    return target, load_mtp_head(config.head, target, torch.float32, device)


def make_train_log(
    config: RefineMTPConfig,
    data: RefineData,
    steps: list[dict[str, Any]],
    evals: dict[str, list[EvalStats]],
    started: float,
    train_started: float,
) -> dict[str, Any]:
    """train_log.json: settings, data, the initial head's own log, every step and evaluation;
    `started` and `train_started` are the perf_counter times the run and its training began."""
    initial_log = config.head / TRAIN_LOG
    initial = json.loads(initial_log.read_text()) if initial_log.is_file() else {}
    return {
        "config": config.model_dump(mode="json"),
        "data": data.meta,
        "initial_head": {k: initial.get(k) for k in ("config", "evals", "elapsed_s")},
        "device": device_name(config.torch_device),
        "train_s": time.perf_counter() - train_started,
        "stopped_early": len(steps) < config.steps,
        "steps": steps,
        "evals": {name: [asdict(e) for e in stats] for name, stats in evals.items()},
        "elapsed_s": time.perf_counter() - started,
    }


# ----------------------------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> RefineMTPConfig:
    """One flag per config field (`--no-progress` for the switch); unset flags keep the defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m training.refine_mtp",
        description=__doc__.split("\n\n")[0],
        argument_default=argparse.SUPPRESS,
    )
    for name, field in RefineMTPConfig.model_fields.items():
        flag, help_text = "--" + name.replace("_", "-"), field.description
        if field.annotation is bool:
            parser.add_argument(f"--no-{flag[2:]}", dest=name, action="store_false")
        elif field.annotation == list[Path]:
            parser.add_argument(flag, type=Path, nargs="+", help=help_text)
        else:
            kind: Any = field.annotation if field.annotation in (int, str, Path) else float
            parser.add_argument(flag, type=kind, required=field.is_required(), help=help_text)
    try:
        return RefineMTPConfig(**vars(parser.parse_args(argv)))
    except ValidationError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    log = refine_mtp(parse_args(argv))
    for name, stats in log["evals"].items():
        print(f"{name}: top-1 agreement {stats[0]['agreement']:.4f} -> {stats[-1]['agreement']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
