"""README.md model cards for the reference family, from the numbers the build measured.

Every figure on a card comes from the run that produced the weights (its `BuildFacts` and the
training results); nothing is estimated. Speculative acceptance is measured later by another
command, so each card has an "Speculative acceptance" section that says so and stays empty until
`python -m benchmarks.acceptance` fills it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.tokenizer import SPECIAL_TOKENS
from training.train_lm import LMResult, TrainLMConfig
from training.train_mtp import TrainResult

CARD_FILE = "README.md"
ACCEPTANCE_HEADING = "## Speculative acceptance"
ACCEPTANCE_PLACEHOLDER = (
    f"{ACCEPTANCE_HEADING}\n\n"
    "Filled in by `python -m benchmarks.acceptance` (mean accepted length with the bonus token, and "
    "per-position acceptance, measured on the held-out packages with this family's base model as the "
    "target). Empty until that command has been run on these weights.\n"
)


@dataclass
class BuildFacts:
    """What every card of one build shares: the data, the tokenizer and the family's names."""

    data: dict[str, Any]
    """`DataSplit.summary()` plus `tokens` per split."""
    tokenizer: dict[str, Any]
    """vocab_size and trained_on_bytes."""
    base_name: str
    draft_name: str
    mtp_name: str
    command: str
    """The command line that built the family."""


def write_lm_card(result: LMResult, config: TrainLMConfig, facts: BuildFacts, role: str) -> Path:
    """The card of the base (`role` "base") or draft (`role` "draft") model."""
    hf_config = json.loads((result.out_dir / "config.json").read_text())
    intro = (
        f"A {result.num_params / 1e6:.1f}M-parameter Llama-architecture causal language model for "
        "Python source code, trained from scratch by specmesh as part of its reference model family "
        f"(base `{facts.base_name}`, draft `{facts.draft_name}`, MTP head `{facts.mtp_name}`). "
        + (
            "It is the *target* model: the one served, whose output speculative decoding must reproduce."
            if role == "base"
            else f"It is a *draft* model for `{facts.base_name}`: same tokenizer, about a fifth of the "
            "depth and width, used by the `draft_model` speculative method."
        )
    )
    sections = [
        _architecture_section(result.num_params, hf_config, config.seq_len),
        _tokenizer_section(facts),
        _data_section(facts),
        _lm_training_section(result, config),
        ACCEPTANCE_PLACEHOLDER,
        _files_section(result.out_dir),
        _lm_usage_section(result.out_dir.name, role, facts),
    ]
    return _write(result.out_dir, result.out_dir.name, intro, sections)


def write_mtp_card(
    result: TrainResult, num_params: int, steps_config: dict[str, Any], facts: BuildFacts
) -> Path:
    """The card of the MTP head trained on the base."""
    intro = (
        f"A DeepSeek-V3-style multi-token-prediction (MTP) draft head ({num_params / 1e6:.2f}M "
        f"parameters of its own) for `{facts.base_name}`, trained by self-distillation from the frozen "
        "base with `training/train_mtp.py`. It reads the base's final hidden state at position i and "
        "the token at i + 1 and drafts the token at i + 2, through the base's own embedding and LM head."
    )
    sections = [
        _table(
            "## Model",
            [
                ("Parameters (own, exact)", f"{num_params:,}"),
                ("Layout", "enorm, hnorm, eh_proj [2 x hidden -> hidden], one decoder layer (Llama)"),
                ("Shared with the base", "embedding, final norm, LM head (not stored here)"),
                ("Base model", f"`{facts.base_name}`"),
                ("Weights", "bfloat16 safetensors"),
            ],
        ),
        _data_section(facts),
        _mtp_training_section(result, steps_config),
        ACCEPTANCE_PLACEHOLDER,
        _files_section(result.out_dir),
        "## Usage\n\n"
        "```bash\n"
        f"specmesh generate --model {facts.base_name} --prompt 'def fib(n):' "
        f'--speculative-config \'{{"method": "mtp", "model": "{result.out_dir.name}"}}\'\n'
        "```\n",
    ]
    return _write(result.out_dir, result.out_dir.name, intro, sections)


# ------------------------------------------------------------------------------------------ sections


def _architecture_section(num_params: int, hf_config: dict[str, Any], seq_len: int) -> str:
    c = hf_config
    return _table(
        "## Model",
        [
            ("Parameters (exact; tied embedding counted once)", f"{num_params:,}"),
            ("Architecture", f"{c['architectures'][0]} (`model_type: {c['model_type']}`)"),
            ("Layers", str(c["num_hidden_layers"])),
            ("Hidden size", str(c["hidden_size"])),
            (
                "Attention heads / KV heads / head dim",
                f"{c['num_attention_heads']} / {c['num_key_value_heads']} / {c['head_dim']}",
            ),
            ("MLP intermediate size (SwiGLU)", str(c["intermediate_size"])),
            ("Vocabulary", str(c["vocab_size"])),
            (
                "Position embeddings",
                f"RoPE, theta {c['rope_theta']:g}; {c['max_position_embeddings']} "
                f"positions (trained on windows of {seq_len} tokens)",
            ),
            ("Tied input / output embeddings", str(c["tie_word_embeddings"]).lower()),
            ("Weights", f"{c['torch_dtype']} safetensors"),
        ],
    )


def _tokenizer_section(facts: BuildFacts) -> str:
    specials = ", ".join(f"`{t}` ({i})" for i, t in enumerate(SPECIAL_TOKENS))
    t = facts.tokenizer
    return _table(
        "## Tokenizer",
        [
            ("Type", "byte-level BPE (`tokenizers`), GPT-2 pre-tokenization"),
            ("Vocabulary", str(t["vocab_size"])),
            ("Special tokens (id)", specials),
            ("EOS / BOS", "`<|endoftext|>` (0) / none"),
            ("Trained on", f"{_mb(t['trained_on_bytes'])} of the train split only"),
            (
                "Chat template",
                "`<|role|>\\n` content `<|endoftext|>\\n` per turn; generation opens `<|assistant|>\\n`",
            ),
        ],
    )


def _data_section(facts: BuildFacts) -> str:
    data = facts.data
    rows = [
        (
            name,
            f"{data[split]['files']:,}",
            _mb(data[split]["bytes"]),
            f"{data['tokens'][split]:,}",
            f"{data[split]['num_packages']:,}",
        )
        for split, name in (("train", "train"), ("validation", "validation"), ("held_out", "held-out"))
    ]
    lines = [
        "## Data",
        "",
        "Python source files (`.py`) of the training machine's interpreter: "
        + ", ".join(f"`{r}`" for r in data["roots"])
        + ". Files over 1 MB, empty or not UTF-8 are skipped, duplicates (by content) kept once, in "
        "the most protected split. Splits are by whole top-level package, never by file.",
        "",
        "| split | files | size | tokens | packages |",
        "|---|---:|---:|---:|---:|",
        *(_row(*row) for row in rows),
        "",
        "Held-out packages (never seen by the tokenizer or any model in training): "
        + ", ".join(f"`{p}`" for p in data["held_out_packages"])
        + " (and the stdlib's tests of them).",
        "",
    ]
    return "\n".join(lines)


def _lm_training_section(result: LMResult, config: TrainLMConfig) -> str:
    stopped = (
        " (stopped by the time budget)"
        if result.stopped_early
        else " (shortened to fit the time budget)"
        if result.shortened
        else ""
    )
    return (
        _table(
            "## Training",
            [
                ("Device", result.device_name),
                ("Wall time (training + evaluation)", f"{result.elapsed_s:.1f} s"),
                ("Steps", f"{result.steps:,} of {result.planned_steps:,} planned{stopped}"),
                ("Batch", f"{config.batch_size} windows x {config.seq_len} tokens"),
                ("Tokens seen", f"{result.tokens_seen:,}"),
                ("Throughput (training loop)", f"{result.tokens_per_s:,.0f} tokens/s"),
                (
                    "Optimizer",
                    f"AdamW (0.9, 0.95), weight decay {config.weight_decay}, peak lr {config.lr:g}, "
                    f"{config.warmup_steps} warm-up steps, cosine to {config.min_lr_ratio:g} x peak, "
                    f"grad clip {config.grad_clip}",
                ),
                ("Final train loss (mean of last 50 steps)", f"{result.final_train_loss:.4f} nats/token"),
                ("Validation loss", f"{result.validation_loss:.4f} nats/token"),
                (
                    "Held-out loss",
                    f"{result.held_out_loss:.4f} nats/token ({result.held_out_tokens:,} tokens)",
                ),
                ("Held-out perplexity", f"{result.held_out_perplexity:.2f}"),
                ("Seed", str(config.seed)),
            ],
        )
        + "\nCurves: `loss.png`; every step: `train_log.json`.\n"
    )


def _mtp_training_section(result: TrainResult, steps_config: dict[str, Any]) -> str:
    return (
        _table(
            "## Training",
            [
                (
                    "Objective",
                    "KL(base's next-token distribution at i + 1 || head's at i), self-distillation",
                ),
                ("Device", str(steps_config.get("device_name", "unknown"))),
                ("Wall time", f"{result.elapsed_s:.1f} s"),
                ("Steps", f"{len(result.losses):,}"),
                ("Batch", f"{steps_config['batch_size']} windows x {steps_config['seq_len']} tokens"),
                ("Final train loss (KL, mean of last 50 steps)", f"{_tail_mean(result.losses):.4f} nats"),
                (
                    "Held-out KL, untrained -> trained",
                    f"{result.initial.kl:.4f} -> {result.final.kl:.4f} nats",
                ),
                (
                    "Held-out top-1 agreement with the base, untrained -> trained",
                    f"{result.initial.agreement:.3f} -> {result.final.agreement:.3f} "
                    f"({result.final.num_rows:,} rows; the first-draft acceptance proxy under greedy)",
                ),
            ],
        )
        + "\nCurves: `loss.png`; every step: `train_log.json`.\n"
    )


def _files_section(model_dir: Path) -> str:
    files = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    return "## Files\n\n" + "\n".join(f"- `{name}`" for name in [*files, CARD_FILE] if name) + "\n"


def _lm_usage_section(name: str, role: str, facts: BuildFacts) -> str:
    if role == "base":
        specmesh = f"specmesh generate --model {name} --prompt 'def fib(n):'"
    else:
        speculative = json.dumps({"method": "draft_model", "model": name})
        specmesh = f"specmesh generate --model {facts.base_name} --prompt 'def fib(n):' --speculative-config '{speculative}'"
    return (
        "## Usage\n\n"
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{name}")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")\n'
        "```\n\n"
        f"With specmesh:\n\n```bash\n{specmesh}\n```\n"
    )


# ----------------------------------------------------------------------------------------- rendering


def _write(model_dir: Path, title: str, intro: str, sections: list[str]) -> Path:
    front_matter = (
        "---\nlicense: apache-2.0\nlibrary_name: transformers\npipeline_tag: text-generation\n"
        "tags: [code, python, specmesh, speculative-decoding]\n---\n"
    )
    text = f"{front_matter}\n# {title}\n\n{intro}\n\n" + "\n".join(sections)
    path = model_dir / CARD_FILE
    path.write_text(text)
    return path


def _table(heading: str, rows: list[tuple[str, str]]) -> str:
    lines = [heading, "", "| | |", "|---|---|", *(_row(key, value) for key, value in rows)]
    return "\n".join(lines) + "\n"


def _row(*cells: str) -> str:
    """A Markdown table row; pipes inside cells (as in `<|endoftext|>`) are escaped, since GitHub
    splits cells on them even inside code spans."""
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB"


def _tail_mean(values: list[float], count: int = 50) -> float:
    tail = values[-count:]
    return sum(tail) / len(tail)
