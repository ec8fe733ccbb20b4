"""Chat templates as transformers saves and renders them: where they live, which one is picked,
and the variables a template sees."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shared.errors import ModelConfigError
from shared.tokenizer import NoChatTemplateError, Tokenizer

TURNS = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = "TOOLS:{{ tools | tojson }}|" + TURNS
DOCUMENTS = "{% for d in documents %}[{{ d['title'] }}]{% endfor %}" + TURNS
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def model_dir(make_checkpoint: Callable[..., Path], tmp_path: Path) -> Callable[..., Path]:
    """A copy of the test checkpoint's tokenizer with the given tokenizer_config.json and files."""

    def make(config: dict[str, Any], files: dict[str, str] | None = None) -> Path:
        path = tmp_path / f"model{len(list(tmp_path.iterdir()))}"
        path.mkdir()
        shutil.copy(make_checkpoint("llama") / "tokenizer.json", path)
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", **config}))
        for name, text in (files or {}).items():
            (path / name).write_text(text)
        return path

    return make


def test_chat_template_jinja_is_read_and_wins_over_the_config(model_dir: Callable[..., Path]) -> None:
    tokenizer = Tokenizer(model_dir({"chat_template": "old"}, {"chat_template.jinja": TURNS}))
    assert tokenizer.apply_chat_template(MESSAGES) == "<|user|>hi<|endoftext|><|assistant|>"


def test_named_templates_pick_tool_use_and_rag(model_dir: Callable[..., Path]) -> None:
    named = [
        {"name": "default", "template": TURNS},
        {"name": "tool_use", "template": TOOLS},
        {"name": "rag", "template": DOCUMENTS},
    ]
    tokenizer = Tokenizer(model_dir({"chat_template": named}))
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False) == "<|user|>hi<|endoftext|>"
    tools = [{"type": "function", "function": {"name": "grüß", "parameters": {}}}]
    with_tools = tokenizer.apply_chat_template(MESSAGES, tools=tools)
    assert with_tools.startswith('TOOLS:[{"type": "function", "function": {"name": "grüß"')
    documents = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
    assert tokenizer.apply_chat_template(MESSAGES, documents=documents).startswith("[a][b]<|user|>")


def test_continue_final_message_leaves_the_last_message_open(model_dir: Callable[..., Path]) -> None:
    tokenizer = Tokenizer(model_dir({"chat_template": TURNS}))
    messages = [*MESSAGES, {"role": "assistant", "content": "def add("}]
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered == "<|user|>hi<|endoftext|><|assistant|>def add("
    with pytest.raises(ValueError, match="cannot both be true"):
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_template_kwargs_reach_the_template(model_dir: Callable[..., Path]) -> None:
    template = "{% if enable_thinking %}<think>{% endif %}" + TURNS
    tokenizer = Tokenizer(model_dir({"chat_template": template}))
    assert tokenizer.apply_chat_template(MESSAGES, template_kwargs={"enable_thinking": True}).startswith(
        "<think><|user|>"
    )
    assert tokenizer.apply_chat_template(MESSAGES).startswith("<|user|>")


def test_no_template_is_a_clear_error(model_dir: Callable[..., Path]) -> None:
    tokenizer = Tokenizer(model_dir({}))
    with pytest.raises(NoChatTemplateError, match="chat_template.jinja"):
        tokenizer.apply_chat_template(MESSAGES)
    only_rag = Tokenizer(model_dir({"chat_template": [{"name": "rag", "template": DOCUMENTS}]}))
    with pytest.raises(NoChatTemplateError, match="no default chat template .*rag"):
        only_rag.apply_chat_template(MESSAGES)


def test_a_malformed_template_list_is_refused_at_load(model_dir: Callable[..., Path]) -> None:
    with pytest.raises(ModelConfigError, match="chat_template entries"):
        Tokenizer(model_dir({"chat_template": [{"template": TURNS}]}))
    with pytest.raises(ModelConfigError, match="must be a string or a list"):
        Tokenizer(model_dir({"chat_template": 3}))
