"""Shared fixtures: small random Hugging Face checkpoints that transformers itself writes, and a
real redis-server (with a fresh key namespace and bus per test)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.serve import free_port
from shared.bus import Bus, RedisSettings, connect

VOCAB_SIZE = 384
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé tëxt ✓ 你好\n",
] * 20


@pytest.fixture(scope="session")
def byte_level_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    return tokenizer


CheckpointFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def make_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, byte_level_tokenizer: Tokenizer
) -> CheckpointFactory:
    """Writes a random checkpoint with `transformers.save_pretrained` plus a tokenizer; cached by arguments."""
    made: dict[str, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        key = json.dumps([arch, seed, overrides], sort_keys=True)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{arch}-ckpt")
            _write_checkpoint(path, arch, seed, overrides, byte_level_tokenizer)
            made[key] = path
        return made[key]

    return make


def _write_checkpoint(
    path: Path, arch: str, seed: int, overrides: dict[str, Any], tokenizer: Tokenizer
) -> None:
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    eos_id = tokenizer.token_to_id(EOS)
    settings: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    if arch in ("qwen3", "phi3", "gemma2", "gemma3"):
        # norms start at the identity, where a norm that dropped its weight (or Gemma's offset) would pass
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "chat_template": CHAT_TEMPLATE, "model_max_length": 512})
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))


# ---- a real redis-server ------------------------------------------------------------------------------


def start_redis_server(binary: str) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server on a free loopback port, without persistence, answering PING."""
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = redis.Redis(port=port)
    try:
        for _ in range(100):
            try:
                probe.ping()
                return server, port
            except redis.ConnectionError:
                time.sleep(0.05)
        server.terminate()
        pytest.fail(f"redis-server did not start on port {port}")
    finally:
        probe.close()


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    return binary


@pytest.fixture(scope="session")
def redis_port() -> Iterator[int]:
    """One throwaway redis-server for the session."""
    server, port = start_redis_server(_redis_binary())
    yield port
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture
def redis_server() -> Iterator[Callable[[], tuple[subprocess.Popen[bytes], RedisSettings]]]:
    """Starts private redis-servers a test may kill; stops those still running at the end."""
    binary = _redis_binary()
    servers: list[subprocess.Popen[bytes]] = []

    def start() -> tuple[subprocess.Popen[bytes], RedisSettings]:
        server, port = start_redis_server(binary)
        servers.append(server)
        return server, RedisSettings(port=port)

    yield start
    for server in servers:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=10)


@pytest.fixture
def redis_settings(redis_port: int) -> RedisSettings:
    """Each test its own topic: no keys shared between tests."""
    return RedisSettings(port=redis_port, topic=f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def bus(redis_settings: RedisSettings) -> AsyncIterator[Bus]:
    client = await connect(redis_settings)
    yield Bus(client, redis_settings.keys)
    await client.aclose()
