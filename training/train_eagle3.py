"""`specmesh train-eagle3`: an EAGLE-3 head trained on a frozen target with training-time test.

The head (shared/model/eagle3.py; Li et al., arXiv 2503.01840) reads the target's streams entering
three of its layers at position i and the token t_{i+1}, and drafts t_{i+2}. Like the MTP head
(training/train_mtp.py) it is trained to reproduce the *target's own* next-token distribution, so
no labels are needed beyond raw text; unlike it, it is trained as it drafts. *Training-time test*
(EAGLE-3 §3.2) unrolls the head `ttt_steps` times: step 0 reads the target's features, every later
step reads the head's own output of the step before at the next position (what a chained draft
sees at inference), attending to step 0's rows up to where its chain started and to its own
chain's rows. Per step j and row i (a draft of t_{i+j+2}):

    loss = sum_j step_decay^j * mean_i KL(target_probs[i + j + 1] restricted to the draft
                                        vocabulary || head_probs_j[i])

The draft vocabulary is the `draft_vocab_size` most frequent tokens of the training text (EAGLE-3's
reduced LM head): a token outside it can never be drafted, so the log records the share of held-out
tokens it covers. The reported *agreement* of step j is the share of rows whose draft equals the
target's greedy token, and the *chain agreement* the share whose steps 0..j all agree: the
acceptance proxy of a chain of j + 1 drafts under greedy verification. Their sum plus one is the
*mean accepted length* of a chain of `ttt_steps` drafts on teacher-forced text; the saved head is
the evaluated one with the highest.

Steps draw either windows of that text or, with chance `generated_fraction`, *generated*
sequences: a train-split prompt ending where an indented line starts, continued greedily by the
base (specmesh's engine) for `new_tokens` tokens, scored on the continuation rows only; that is
the text verification checks (as training/refine_mtp.py does for the MTP head).

Data: the package split of training/data.py (the split of every reference model, same seed) over
the source roots `--data` (default: this interpreter's stdlib and site-packages, as the reference
build); train on the train split, evaluate on the held-out one.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator
from tqdm import tqdm

from shared.model import LlamaForCausalLM, ModelConfig, load_model
from shared.model.eagle3 import (
    Eagle3Head,
    default_aux_layers,
    head_layer_config,
    load_eagle3_head,
    save_eagle3_head,
)
from shared.model.llama import DecoderLayer
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from training.build_reference import PRESETS
from training.config import (
    Count,
    HeadRunConfig,
    NonNegativeReal,
    PositiveCount,
    PositiveReal,
    warmup_cosine,
)
from training.corpus import tokenize_files
from training.data import default_roots, split_corpus
from training.refine_mtp import indented_line_starts, sample_prompts, start_engine
from training.train_lm import device_name
from training.train_mtp import LOSS_PLOT, TRAIN_LOG, bf16_autocast, make_windows

logger = logging.getLogger(__name__)

SAVED_DTYPE = torch.bfloat16
"""The dtype the head is written in (as the reference models)."""
SPLIT_SEED = 0
"""The build's seed (manifest.json): the package split every reference model was trained on."""


class TrainEagle3Config(HeadRunConfig):
    """One training run (the optimiser settings: training.config)."""

    head: Path | None = None
    """Continue training this head (its draft vocabulary and target layers) instead of a new one."""
    data: list[Path] = Field(default_factory=list)
    """Source roots (directories of .py files), split by package as the reference models' corpus;
    empty: this interpreter's stdlib and site-packages (`training.data.default_roots`)."""
    max_train_tokens: int = Field(default=5_000_000, ge=1)
    max_held_out_tokens: int = Field(default=200_000, ge=1)
    seq_len: int = Field(default=256, ge=4)
    """Tokens per window."""
    ttt_steps: int = Field(default=3, ge=1, le=5)
    """Unrolled steps of training-time test (1: plain teacher forcing)."""
    step_decay: float = Field(default=0.8, gt=0.0, le=1.0)
    """Weight of step j's loss: step_decay ** j."""
    draft_vocab_size: int | None = Field(default=4096, ge=1)
    """Tokens of the head's LM head (the most frequent in the training text); None: the whole vocabulary."""
    eagle3_layers: tuple[int, int, int] | None = None
    """Target layers whose entering streams the head reads; None: EAGLE-3's low / mid / high."""
    generated_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """The chance that a step trains on the base's greedy continuations instead of corpus windows."""
    num_prompts: int = Field(default=2048, ge=1)
    """Train-split prompts the base continues (when generated_fraction > 0)."""
    new_tokens: int = Field(default=128, ge=1)
    """Tokens the base generates per prompt; each prompt is seq_len - new_tokens tokens."""
    max_generate_seqs: int = Field(default=256, ge=1)
    """Sequences the engine generates at a time."""
    time_limit_s: float | None = Field(default=None, gt=0.0)
    """Wall-time budget of the whole run, data loading included: training stops early (the log
    says so) leaving time for the last evaluation, and the learning rate decays over the budget."""

    batch_size: PositiveCount = 8
    lr: PositiveReal = 1e-3
    warmup_steps: Count = 20
    weight_decay: NonNegativeReal = 0.01
    eval_every: PositiveCount = 200
    eval_batches: PositiveCount = 8

    @field_validator("data")
    @classmethod
    def _roots_exist(cls, data: list[Path]) -> list[Path]:
        missing = [str(p) for p in data if not p.is_dir()]
        if missing:
            raise ValueError(f"not a directory of source files: {', '.join(missing)}")
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainEagle3Config:
        self._check_warmup(hint="; lower --warmup-steps")
        self._check_out()
        if self.generated_fraction > 0 and self.seq_len - self.new_tokens < 2:
            raise ValueError(
                f"new_tokens ({self.new_tokens}) must leave a prompt of at least 2 tokens in seq_len ({self.seq_len})"
            )
        return self


@dataclass
class EvalStats:
    step: int
    kl: float
    """Mean KL(target || head) of step 0's rows, in nats (over the draft vocabulary)."""
    agreement: list[float]
    """Per unrolled step: the share of rows whose draft is the target's greedy token."""
    chain_agreement: list[float]
    """Per unrolled step j: the share of rows whose steps 0..j all agree."""
    num_rows: int
    mean_accepted_length: float = field(init=False)
    """1 + the sum of the chain agreements: the greedy accepted length of a chain of every step."""

    def __post_init__(self) -> None:
        self.mean_accepted_length = 1.0 + sum(self.chain_agreement)


@dataclass
class Streams:
    train: torch.Tensor  # [num_train_windows, seq_len] int64
    held_out: torch.Tensor  # [num_held_out_windows, seq_len] int64
    token_counts: torch.Tensor  # [vocab_size] int64 occurrences in the training stream
    held_out_counts: torch.Tensor  # [vocab_size] int64 occurrences in the held-out stream
    meta: dict[str, Any]
    generated: torch.Tensor | None = None  # [num_prompts, seq_len] int64 prompts + the base's continuations


# ---------------------------------------------------------------------------------------------- data


def load_streams(config: TrainEagle3Config, vocab_size: int) -> Streams:
    """The package split of the roots, tokenized and windowed (train and held-out)."""
    roots = config.data or default_roots()
    split = split_corpus(roots, SPLIT_SEED, PRESETS["full"].validation_fraction)
    if not split.held_out:
        raise ValueError(f"the roots {', '.join(map(str, roots))} hold none of the held-out packages")
    tokenizer = Tokenizer(config.base).backend
    train = tokenize_files(split.train, tokenizer, config.max_train_tokens).long()
    held_out = tokenize_files(split.held_out, tokenizer, config.max_held_out_tokens).long()
    windows, held_out_windows = make_windows(train, config.seq_len), make_windows(held_out, config.seq_len)
    if not len(windows) or not len(held_out_windows):
        raise ValueError(f"the corpus gives no window of {config.seq_len} tokens to train or evaluate on")
    meta = {**split.summary(), "train_tokens": train.numel(), "held_out_tokens": held_out.numel()}
    held_out_counts = torch.bincount(held_out, minlength=vocab_size)
    return Streams(
        windows, held_out_windows, torch.bincount(train, minlength=vocab_size), held_out_counts, meta
    )


def generate_sequences(config: TrainEagle3Config, stream: torch.Tensor) -> torch.Tensor:
    """[num_prompts, seq_len] int64: train-split prompts of seq_len - new_tokens tokens, each ending
    where an indented line starts, followed by the base's greedy continuation."""
    tokenizer = Tokenizer(config.base)
    prompt_tokens = config.seq_len - config.new_tokens
    choose = torch.Generator().manual_seed(config.seed)
    prompts = sample_prompts(
        stream, config.num_prompts, prompt_tokens, indented_line_starts(tokenizer), choose
    )
    llm = start_engine(config.base, config.torch_device, config.max_generate_seqs, config.seq_len)
    params = SamplingParams(temperature=0.0, max_tokens=config.new_tokens, ignore_eos=True)
    outputs = llm.generate(
        prompt_token_ids=prompts.tolist(), sampling_params=params, use_tqdm=config.progress
    )
    del llm  # frees its KV cache before training
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cat([prompts, torch.tensor([o.token_ids for o in outputs])], dim=1)


def draft_vocabulary(token_counts: torch.Tensor, size: int | None) -> torch.Tensor:
    """[size] int64 the most frequent target ids, ascending (all of them for None)."""
    if size is None or size >= len(token_counts):
        return torch.arange(len(token_counts))
    return token_counts.topk(size).indices.sort().values


def vocabulary_coverage(draft_ids: torch.Tensor, token_counts: torch.Tensor) -> float:
    """The share of a stream's tokens (`token_counts`: [vocab_size]) inside the draft vocabulary."""
    return float(token_counts[draft_ids.cpu()].sum()) / max(1, int(token_counts.sum()))


# --------------------------------------------------------------------------------------------- model


def init_head_from_target(
    target: LlamaForCausalLM, draft_ids: torch.Tensor, aux_layers: tuple[int, ...], device: torch.device
) -> Eagle3Head:
    """A float32 head that starts near "the target's last layer over its high stream": fc picks the
    high stream, the layer's feature half and MLP are the target's last layer, its embedding half
    starts at zero, and the LM head is the target's rows of the draft vocabulary. Training then
    learns the shift by one position from features already in the target's space."""
    raw = {**_raw_config(target.config), "num_hidden_layers": 1}
    head = Eagle3Head(target, head_layer_config(raw, target.config), len(draft_ids), aux_layers).to(device)
    head.set_vocab_map(draft_ids.to(device))
    last = cast(DecoderLayer, target.layers[-1])
    size = head.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, -size:] = torch.eye(size, device=device)
        attn = head.midlayer.self_attn
        attn.qkv_proj.weight.zero_()
        attn.qkv_proj.weight[:, size:] = last.self_attn.qkv_proj.weight.float()
        attn.o_proj.load_state_dict(last.self_attn.o_proj.state_dict())
        head.midlayer.mlp.load_state_dict(last.mlp.state_dict())
        head.midlayer.hidden_norm.weight.copy_(last.input_layernorm.weight)
        head.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        head.norm.weight.copy_(target.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight[draft_ids.to(device)])
    return head.float()


def _raw_config(config: ModelConfig) -> dict[str, Any]:
    """The fields of a Llama config.json that shape the head's layer (the target's shape)."""
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "hidden_act": config.hidden_act,
    }


def start_head(config: TrainEagle3Config, target: LlamaForCausalLM, streams: Streams) -> Eagle3Head:
    """The head `config.head` names (float32, to train), or a new one initialised from the target."""
    device = config.torch_device
    if config.head is not None:
        return load_eagle3_head(config.head, target, torch.float32, device, config.eagle3_layers)
    draft_ids = draft_vocabulary(streams.token_counts, config.draft_vocab_size).to(device)
    aux_layers = config.eagle3_layers or default_aux_layers(target.config.num_hidden_layers)
    return init_head_from_target(target, draft_ids, aux_layers, device)


# ---------------------------------------------------------------------------------------------- loss


@torch.no_grad()
def target_pass(
    target: LlamaForCausalLM, head: Eagle3Head, token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # aux [batch, seq, 3 * hidden], logits [batch, seq, vocab] float32
    hidden, aux = target.forward_dense_with_aux(token_ids, head.aux_layers)
    return aux, target.compute_logits(hidden)


def unrolled_logits(
    head: Eagle3Head,
    token_ids: torch.Tensor,  # [batch, seq]
    aux: torch.Tensor,  # [batch, seq, 3 * hidden]
    num_steps: int,
) -> list[torch.Tensor]:  # per step j: [batch, seq - 1, draft_vocab] float32, row i drafts t_{i+j+2}
    """Training-time test: step 0 over the target's features, each later step over the head's own
    output one position further; rows past the window read token 0 and are never scored."""
    num_rows = token_ids.shape[1] - 1
    hidden = head.project(aux[:, :num_rows])
    padded = F.pad(token_ids, (0, num_steps))
    rows = torch.arange(num_rows, device=token_ids.device)
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    logits = []
    for step in range(num_steps):
        embeds = head.embed(padded[:, 1 + step : 1 + step + num_rows])
        hidden, kv = head.midlayer.forward_unrolled(rows + step, embeds, hidden, past)
        past.append(kv)
        logits.append(head.draft_logits(hidden))
    return logits


def step_kl(
    head_logits: torch.Tensor,  # [batch, seq - 1, draft_vocab]
    target_logits: torch.Tensor,  # [batch, seq, vocab]
    draft_ids: torch.Tensor,  # [draft_vocab]
    step: int,
    first_row: int = 0,
) -> torch.Tensor:  # scalar: mean over the step's scored rows
    """KL(target's distribution at i + step + 1 over the draft vocabulary || head's at row i), for
    rows i from `first_row` on."""
    num_scored = head_logits.shape[1] - step
    target_logprobs = F.log_softmax(target_logits[:, 1 + step + first_row :, draft_ids].float(), dim=-1)
    head_logprobs = F.log_softmax(head_logits[:, first_row:num_scored].float(), dim=-1)
    return F.kl_div(head_logprobs, target_logprobs, log_target=True, reduction="none").sum(-1).mean()


def training_loss(
    logits: list[torch.Tensor],
    target_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    decay: float,
    first_row: int = 0,
) -> torch.Tensor:
    weights = [decay**step for step in range(len(logits))]
    losses = [
        w * step_kl(step_logits, target_logits, draft_ids, j, first_row)
        for j, (w, step_logits) in enumerate(zip(weights, logits))
    ]
    return torch.stack(losses).sum() / sum(weights)


def agreements(
    logits: list[torch.Tensor], target_logits: torch.Tensor, draft_ids: torch.Tensor
) -> torch.Tensor:  # [num_steps, batch, seq - num_steps] bool
    """Per step, whether each row's draft is the target's greedy token (rows every step scores)."""
    num_rows = logits[0].shape[1] - len(logits) + 1
    greedy = target_logits.argmax(-1)
    return torch.stack(
        [
            draft_ids[step_logits[:, :num_rows].argmax(-1)] == greedy[:, 1 + j : 1 + j + num_rows]
            for j, step_logits in enumerate(logits)
        ]
    )


# ---------------------------------------------------------------------------------------------- loop


def train_eagle3(config: TrainEagle3Config) -> dict[str, Any]:
    """Trains a head on the frozen base, evaluating as it goes; saves the best evaluated head with
    its log and plot."""
    started = time.perf_counter()
    deadline = started + (config.time_limit_s or float("inf"))
    torch.manual_seed(config.seed)
    device = config.torch_device
    model_config = ModelConfig.from_dir(config.base)
    if config.seq_len + config.ttt_steps > model_config.max_position_embeddings:
        raise ValueError(
            f"seq_len + ttt_steps ({config.seq_len + config.ttt_steps}) exceeds the base model's "
            f"max_position_embeddings ({model_config.max_position_embeddings})"
        )
    streams = load_streams(config, model_config.vocab_size)
    if config.generated_fraction > 0:
        streams.generated = generate_sequences(config, streams.train.flatten())
        streams.meta["generated"] = {"sequences": len(streams.generated), "new_tokens": config.new_tokens}
    target_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = load_model(config.base, target_dtype, device, config.seq_len + config.ttt_steps).requires_grad_(
        False
    )
    head = start_head(config, target, streams)
    draft_ids, aux_layers = head.target_ids, head.aux_layers
    data_s = time.perf_counter() - started
    losses, evals, stopped_early, best = train_loop(head, target, streams, draft_ids, config, deadline)
    best_stats = best.restore(head)
    save_eagle3_head(head.to(SAVED_DTYPE), config.out)
    log = {
        "config": config.model_dump(mode="json"),
        "data": {
            **streams.meta,
            "draft_vocab_coverage": vocabulary_coverage(draft_ids, streams.held_out_counts),
        },
        "aux_layers": list(aux_layers),
        "device": device_name(device),
        "steps": [{"step": i + 1, "loss": loss, "generated": g} for i, (loss, g) in enumerate(losses)],
        "evals": [asdict(stats) for stats in evals],
        "best_step": best_stats.step,
        "stopped_early": stopped_early,
        "phases_s": {"data": data_s, "train": time.perf_counter() - started - data_s},
        "elapsed_s": time.perf_counter() - started,
    }
    (config.out / TRAIN_LOG).write_text(json.dumps(log) + "\n")  # compact: one record per step
    plot_losses([loss for loss, _ in losses], evals, config.out / LOSS_PLOT)
    return log


class BestHead:
    """The head's weights at its best evaluation so far (highest mean accepted length), on the host."""

    def __init__(self) -> None:
        self.stats: EvalStats | None = None
        self.state: dict[str, torch.Tensor] = {}

    def offer(self, stats: EvalStats, head: Eagle3Head) -> None:
        """Keeps `head`'s weights if `stats` beats the best so far (the first offer always does)."""
        if self.stats is None or stats.mean_accepted_length > self.stats.mean_accepted_length:
            self.stats = stats
            self.state = {name: t.detach().to("cpu", copy=True) for name, t in head.state_dict().items()}

    def restore(self, head: Eagle3Head) -> EvalStats:
        """Loads the best weights into `head`; returns their evaluation."""
        if self.stats is None:
            raise RuntimeError("no evaluated head to restore")
        head.load_state_dict(self.state)
        return self.stats


def train_loop(
    head: Eagle3Head,
    target: LlamaForCausalLM,
    streams: Streams,
    draft_ids: torch.Tensor,
    config: TrainEagle3Config,
    deadline: float,
) -> tuple[list[tuple[float, bool]], list[EvalStats], bool, BestHead]:
    """AdamW with warm-up + cosine decay over the steps or the time left before `deadline` (a
    perf_counter time), whichever runs out first; returns each step's loss and whether it was on
    generated text, the evaluations, whether the deadline stopped it and the best evaluated weights."""
    device = config.torch_device
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=device.type == "cuda"
    )
    # every batch's rows drawn up front from the seed (the same order on any device) and held on the
    # device with the data: a step never copies from the host, which would wait for the steps before it
    batches = torch.Generator().manual_seed(config.seed)
    shape = (config.steps, config.batch_size)
    train_windows = streams.train.to(device)
    train_picks = torch.randint(len(streams.train), shape, generator=batches).to(device)
    generated, generated_picks = None, train_picks
    if streams.generated is not None:
        generated = streams.generated.to(device)
        generated_picks = torch.randint(len(generated), shape, generator=batches).to(device)
    mix = torch.Generator().manual_seed(config.seed + 1)
    on_generated = (torch.rand(config.steps, generator=mix) < config.generated_fraction).tolist()
    first_generated_row = config.seq_len - config.new_tokens - 1  # its input is the first generated token
    best = BestHead()
    evals, eval_s = [], 0.0
    progress = tqdm(range(1, config.steps + 1), desc="train-eagle3", disable=not config.progress, unit="step")

    def evaluate_now(step: int) -> None:
        nonlocal eval_s
        eval_started = time.perf_counter()
        evals.append(evaluate(head, target, streams.held_out, draft_ids, config, step))
        eval_s = time.perf_counter() - eval_started
        best.offer(evals[-1], head)
        progress.write(_describe(evals[-1]), file=sys.stderr)

    evaluate_now(0)
    train_started = time.perf_counter()
    step_losses: list[torch.Tensor] = []  # kept on the device: reading one back waits for the step
    stopped_early = False
    for step in progress:
        time_fraction = (time.perf_counter() - train_started) / max(1e-9, deadline - eval_s - train_started)
        scale = warmup_cosine(step - 1, config.warmup_steps, config.steps, config.min_lr_ratio, time_fraction)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * scale
        if generated is not None and on_generated[step - 1]:
            batch, first_row = generated[generated_picks[step - 1]], first_generated_row
        else:
            batch, first_row = train_windows[train_picks[step - 1]], 0
        step_losses.append(train_step(head, target, batch, first_row, draft_ids, optimizer, config))
        stopped_early = step < config.steps and time.perf_counter() + eval_s > deadline
        if step % config.eval_every == 0 or step == config.steps or stopped_early:
            progress.set_postfix(loss=f"{float(step_losses[-1]):.4f}", refresh=False)
            evaluate_now(step)
        if stopped_early:
            break
    progress.close()
    kinds = [generated is not None and g for g in on_generated]
    return list(zip(torch.stack(step_losses).tolist(), kinds)), evals, stopped_early, best


def train_step(
    head: Eagle3Head,
    target: LlamaForCausalLM,
    token_ids: torch.Tensor,  # [batch, seq]
    first_row: int,
    draft_ids: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    config: TrainEagle3Config,
) -> torch.Tensor:  # scalar loss, on the device
    head.train()
    with bf16_autocast(token_ids.device):
        aux, target_logits = target_pass(target, head, token_ids)
        logits = unrolled_logits(head, token_ids, aux, config.ttt_steps)
        loss = training_loss(logits, target_logits, draft_ids, config.step_decay, first_row)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def evaluate(
    head: Eagle3Head,
    target: LlamaForCausalLM,
    windows: torch.Tensor,  # [num_windows, seq_len]
    draft_ids: torch.Tensor,
    config: TrainEagle3Config,
    step: int,
) -> EvalStats:
    """KL of step 0 and per-step (chain) agreement over the first `eval_batches` held-out batches."""
    head.eval()
    kl_sum, num_kl_rows = 0.0, 0
    found = []
    for batch in windows[: config.eval_batches * config.batch_size].split(config.batch_size):
        token_ids = batch.to(config.torch_device)
        with bf16_autocast(token_ids.device):
            aux, target_logits = target_pass(target, head, token_ids)
            logits = unrolled_logits(head, token_ids, aux, config.ttt_steps)
        rows = logits[0].shape[0] * logits[0].shape[1]
        kl_sum += float(step_kl(logits[0], target_logits, draft_ids, 0)) * rows
        num_kl_rows += rows
        found.append(agreements(logits, target_logits, draft_ids).flatten(1))
    agree = torch.cat(found, dim=1)  # [num_steps, num_rows]
    chain = agree.cumprod(dim=0)
    return EvalStats(
        step=step,
        kl=kl_sum / num_kl_rows,
        agreement=agree.float().mean(1).tolist(),
        chain_agreement=chain.float().mean(1).tolist(),
        num_rows=agree.shape[1],
    )


def _describe(stats: EvalStats) -> str:
    per_step = ", ".join(f"{a:.3f}" for a in stats.agreement)
    chain = ", ".join(f"{a:.3f}" for a in stats.chain_agreement)
    return f"step {stats.step}: held-out KL {stats.kl:.4f} nats, agreement per step [{per_step}], chain [{chain}]"


def plot_losses(losses: list[float], evals: list[EvalStats], path: Path) -> Path | None:
    """Training loss per step and held-out chain agreement per unrolled step, as a PNG; None
    without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'specmesh[train]'); not writing %s", path)
        return None
    figure = Figure(figsize=(10, 4), layout="constrained")
    loss_axes, agreement_axes = figure.subplots(1, 2)
    loss_axes.plot(range(1, len(losses) + 1), losses, linewidth=0.8, label="train loss")
    loss_axes.plot([e.step for e in evals], [e.kl for e in evals], "o-", label="held-out KL (step 0)")
    loss_axes.set(xlabel="step", ylabel="nats", yscale="log", title="training-time-test loss")
    loss_axes.legend()
    for j in range(len(evals[0].chain_agreement)):
        agreement_axes.plot(
            [e.step for e in evals], [e.chain_agreement[j] for e in evals], "o-", label=f"drafts 1..{j + 1}"
        )
    agreement_axes.set(
        xlabel="step", ylabel="chain agreement", ylim=(0, 1), title="held-out acceptance proxy"
    )
    agreement_axes.legend()
    figure.savefig(path, dpi=100)
    return path


# ----------------------------------------------------------------------------------------------- CLI


def add_train_eagle3_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `train-eagle3`. Unset flags are left out of the namespace so defaults live in TrainEagle3Config."""
    parser = subparsers.add_parser(
        "train-eagle3",
        help="train an EAGLE-3 draft head on a frozen base model (training-time test)",
        description=(
            "Trains an EAGLE-3 draft head on a frozen base model with training-time test, on the "
            f"package split of the source roots in --data; writes the head, {TRAIN_LOG} and {LOSS_PLOT} to --out."
        ),
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--base", type=Path, required=True, help="base (target) model directory")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the head to")
    parser.add_argument(
        "--data",
        type=Path,
        nargs="+",
        help="source roots (directories of .py files; default: this interpreter's stdlib and site-packages)",
    )
    for flag, kind, text in (
        ("--max-train-tokens", int, "training tokens read"),
        ("--max-held-out-tokens", int, "held-out tokens read"),
        ("--seq-len", int, "tokens per window"),
        ("--ttt-steps", int, "unrolled steps of training-time test"),
        ("--step-decay", float, "weight of step j's loss: decay ** j"),
        ("--draft-vocab-size", int, "tokens of the head's LM head"),
        ("--steps", int, "optimizer steps"),
        ("--batch-size", int, "windows per step"),
        ("--lr", float, "peak AdamW learning rate"),
        ("--warmup-steps", int, "linear warm-up steps"),
        ("--eval-every", int, "steps between evaluations"),
        ("--eval-batches", int, "held-out batches per evaluation"),
        ("--generated-fraction", float, "chance that a step trains on the base's greedy continuations"),
        ("--num-prompts", int, "train-split prompts the base continues"),
        ("--new-tokens", int, "tokens the base generates per prompt"),
        ("--max-generate-seqs", int, "sequences the engine generates at a time"),
        ("--time-limit-s", float, "wall-time budget of the run (data, training, last evaluation)"),
        ("--seed", int, "random seed"),
    ):
        name = flag.removeprefix("--").replace("-", "_")
        parser.add_argument(
            flag, type=kind, help=f"{text} (default: {TrainEagle3Config.model_fields[name].default})"
        )
    parser.add_argument("--head", type=Path, help="continue training this head instead of a new one")
    parser.add_argument("--eagle3-layers", type=int, nargs=3, help="the three target layers the head reads")
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(handler=cmd_train_eagle3)


def cmd_train_eagle3(args: argparse.Namespace) -> int:
    fields = {name: value for name, value in vars(args).items() if name in TrainEagle3Config.model_fields}
    log = train_eagle3(TrainEagle3Config(**fields))
    first = log["evals"][0]
    best = next(e for e in log["evals"] if e["step"] == log["best_step"])
    print(
        f"saved the EAGLE-3 head of step {best['step']} to {fields['out']} in {log['elapsed_s']:.1f} s | "
        f"held-out chain agreement {[round(a, 3) for a in first['chain_agreement']]} -> "
        f"{[round(a, 3) for a in best['chain_agreement']]}, mean accepted length "
        f"{first['mean_accepted_length']:.2f} -> {best['mean_accepted_length']:.2f} | draft vocabulary "
        f"covers {log['data']['draft_vocab_coverage']:.1%} of held-out tokens",
        file=sys.stderr,
    )
    return 0


def replot(out: Path) -> Path | None:
    """Draws `out`/loss.png from `out`/train_log.json (for a run on a machine without matplotlib)."""
    log = json.loads((out / TRAIN_LOG).read_text())
    evals = [EvalStats(**{k: v for k, v in e.items() if k != "mean_accepted_length"}) for e in log["evals"]]
    return plot_losses([s["loss"] for s in log["steps"]], evals, out / LOSS_PLOT)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / TRAIN_LOG).is_file():
        sys.exit(
            f"usage: python -m training.train_eagle3 DIR (a head directory with {TRAIN_LOG}): draws {LOSS_PLOT}"
        )
    print(replot(Path(sys.argv[1])) or "matplotlib is not installed", file=sys.stderr)
