"""`python -m training.build_reference` builds a reference family (tiny preset, CPU) that both specmesh
and transformers load alike, that never trains on held-out packages, that packs and unpacks byte
for byte, and that a second run with the same seed reproduces exactly."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.model import load_model
from shared.model.mtp import load_mtp_head
from shared.tokenizer import Tokenizer
from training.build_reference import (
    BASE_DIR,
    CORPUS_DIR,
    DATA_SPLIT,
    DRAFT_DIR,
    MANIFEST,
    MAX_MODELS_BYTES,
    MODEL_DIRS,
    MTP_DIR,
    PACKED_PATHS,
    PRESETS,
    TOKENIZER_DIR,
    main,
)
from training.data import HELD_OUT_PACKAGES, MAX_FILE_BYTES, package_of, split_corpus
from training.model_card import ACCEPTANCE_HEADING
from training.pack import MAX_PACK_FILE_BYTES, MAX_PACK_FILES, unpack_reference
from training.tokenizer import EOS_TOKEN, EOS_TOKEN_ID, SPECIAL_TOKENS
from training.train_lm import SHAPES, StepPlan, TokenStreams, train_lm

TRAIN_PACKAGES = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
REAL_STDLIB_MODULES = ("textwrap.py", "colorsys.py", "bisect.py", "heapq.py")
CODE_SAMPLES = [
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "class Point:\n\tdef __init__(self, x, y):\r\n\t\tself.x, self.y = x, y  # tabs and CRLF\r\n",
    "GREETING = 'héllo wörld ✓ 你好 🐍'\nprint(f'{GREETING!r:>40}')\n",
    "    \n\n\n   trailing spaces   \n",
]


@dataclass
class Builds:
    sources: Path
    first: Path
    second: Path
    pack: Path


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A source root: synthetic packages, a few real stdlib modules and the stdlib's json package
    (held out), plus files the collector must skip or deduplicate."""
    root = tmp_path_factory.mktemp("sources")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    shutil.copytree(stdlib / "json", root / "json", ignore=shutil.ignore_patterns("__pycache__"))
    for name in REAL_STDLIB_MODULES:
        shutil.copyfile(stdlib / name, root / name)
    rng = random.Random(0)
    for package in (*TRAIN_PACKAGES, "email"):
        (root / package).mkdir()
        for i in range(5):
            (root / package / f"mod_{i}.py").write_text(_synthetic_module(rng, f"{package}.mod_{i}"))
    (root / "test").mkdir()
    (root / "test" / "test_json.py").write_text(_synthetic_module(rng, "test_json"))
    shutil.copyfile(root / "json" / "decoder.py", root / "alpha" / "vendored_decoder.py")  # duplicate
    (root / "beta" / "latin1.py").write_bytes(b"NAME = '\xe9t\xe9'\n")  # not UTF-8
    (root / "gamma" / "table.py").write_text("X = 1\n" * (MAX_FILE_BYTES // 6 + 1))  # too large
    return root


def _synthetic_module(rng: random.Random, name: str) -> str:
    lines = [f'"""Helpers of {name}."""', "", "import os", ""]
    for j in range(10):
        verb, noun = (
            rng.choice(["get", "load", "parse", "count"]),
            rng.choice(["item", "row", "node", "path"]),
        )
        lines += [
            f"def {verb}_{noun}_{j}(values, limit={rng.randint(1, 99)}):",
            f'    """Return the {noun}s of `values` up to `limit`."""',
            "    result = []",
            "    for index, value in enumerate(values):",
            "        if index >= limit:",
            "            break",
            f"        result.append(value * {rng.randint(2, 9)})",
            "    return result",
            "",
        ]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def builds(sources: Path, tmp_path_factory: pytest.TempPathFactory) -> Builds:
    out = tmp_path_factory.mktemp("builds")
    common = ["--preset", "tiny", "--seed", "3", "--roots", str(sources), "--device", "cpu", "--no-progress"]
    assert main(["--out", str(out / "first"), "--pack", str(out / "pack"), *common]) == 0
    assert main(["--out", str(out / "second"), *common]) == 0
    return Builds(sources, out / "first", out / "second", out / "pack")


def test_the_family_is_complete_and_small(builds: Builds) -> None:
    manifest = json.loads((builds.first / MANIFEST).read_text())
    assert set(manifest["family"].values()) == set(MODEL_DIRS)
    for name in MODEL_DIRS:
        card = (builds.first / name / "README.md").read_text()
        assert ACCEPTANCE_HEADING in card
        assert card.split(ACCEPTANCE_HEADING)[1].split("\n## ")[0].count("|") == 0  # no table, no numbers
        for file_name, entry in manifest["files"][name].items():
            assert _sha256(builds.first / name / file_name) == entry["sha256"]
    assert manifest["models_total_bytes"] <= MAX_MODELS_BYTES
    assert (builds.first / BASE_DIR / "model.safetensors.index.json").is_file()  # the tiny base is sharded
    assert set(manifest["phases_s"]) >= {"data", "tokenizer", "corpus", "base", "draft", "mtp", "cards"}


@pytest.mark.parametrize("name", [BASE_DIR, DRAFT_DIR])
def test_specmesh_and_transformers_load_the_same_model(builds: Builds, name: str) -> None:
    import transformers

    model_dir = builds.first / name
    token_ids = torch.tensor([Tokenizer(model_dir).encode(CODE_SAMPLES[0] + CODE_SAMPLES[1])[:48]])
    ours = load_model(model_dir, torch.float32, torch.device("cpu"), max_positions=64)
    dtype_kwarg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **{dtype_kwarg: torch.float32})
    with torch.no_grad():
        our_logits = ours.compute_logits(ours.forward_dense(token_ids))
        their_logits = theirs.eval()(token_ids).logits.float()
    assert our_logits.shape == their_logits.shape == (1, token_ids.shape[1], SHAPES["tiny"].vocab_size)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-3, rtol=0)


def test_the_mtp_head_loads_for_the_base(builds: Builds) -> None:
    base = load_model(builds.first / BASE_DIR, torch.float32, torch.device("cpu"), max_positions=64)
    head = load_mtp_head(builds.first / MTP_DIR, base, torch.float32, torch.device("cpu"))
    assert head.config.hidden_size == base.config.hidden_size


def test_the_tokenizer_round_trips_code(builds: Builds) -> None:
    import transformers

    model_dir = builds.first / BASE_DIR
    ours = Tokenizer(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in CODE_SAMPLES:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        assert theirs.decode(theirs.encode(text)) == text
        assert theirs.encode(text) == ids
    assert [ours.backend.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert ours.eos_token_ids == {EOS_TOKEN_ID} and ours.bos_token is None
    prompt = ours.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert prompt == f"<|system|>\nBe brief.{EOS_TOKEN}\n<|user|>\nhi{EOS_TOKEN}\n<|assistant|>\n"


def test_held_out_packages_never_reach_training(builds: Builds) -> None:
    split = json.loads(gzip.decompress((builds.first / DATA_SPLIT).read_bytes()))
    train = [entry.split(":", 1) for entry in split["train"]]
    held_out = [entry.split(":", 1) for entry in split["held_out"]]
    assert not {package for package, _ in train} & set(HELD_OUT_PACKAGES)
    assert {package for package, _ in held_out} == {"json", "email"}
    assert "test/test_json.py" in {path for _, path in held_out}
    held_out_digests = {_sha256(builds.sources / path) for _, path in held_out}
    assert not {_sha256(builds.sources / path) for _, path in train} & held_out_digests
    assert not {path for _, path in train} & {"alpha/vendored_decoder.py", "beta/latin1.py", "gamma/table.py"}


def test_splits_are_whole_packages_and_repeatable(sources: Path) -> None:
    split = split_corpus([sources], seed=5, validation_fraction=0.1)
    packages = {name: {f.package for f in split.files(name)} for name in ("train", "validation", "held_out")}
    assert packages["validation"] and not packages["train"] & packages["validation"]
    assert not (packages["train"] | packages["validation"]) & packages["held_out"]
    again = split_corpus([sources], seed=5, validation_fraction=0.1)
    assert split.file_lists() == again.file_lists()
    assert package_of("test/test_email/test_parser.py") == "email"
    assert package_of("test/test_xml_etree.py") == "xml"
    assert package_of("test/test_textwrap.py") == "test"
    assert package_of("textwrap.py") == "textwrap"


def test_pack_then_unpack_restores_every_file_byte_for_byte(builds: Builds, tmp_path: Path) -> None:
    packed = sorted(builds.pack.iterdir())
    assert len(packed) <= MAX_PACK_FILES
    assert all(p.stat().st_size <= MAX_PACK_FILE_BYTES for p in packed)
    unpack_reference(builds.pack, tmp_path)
    expected = _tree(builds.first, PACKED_PATHS)
    assert _tree(tmp_path, PACKED_PATHS) == expected
    assert any(name.endswith(".safetensors") for name in expected)


def test_the_same_seed_gives_the_same_family(builds: Builds) -> None:
    for name in MODEL_DIRS:
        for path in sorted((builds.first / name).glob("*.safetensors")):
            assert path.read_bytes() == (builds.second / name / path.name).read_bytes(), path
    for name in (BASE_DIR, DRAFT_DIR):
        first, second = (
            json.loads((b / name / "train_log.json").read_text()) for b in (builds.first, builds.second)
        )
        assert first["history"]["loss"] == second["history"]["loss"]
    assert (builds.first / BASE_DIR / "tokenizer.json").read_bytes() == (
        builds.second / BASE_DIR / "tokenizer.json"
    ).read_bytes()


def test_the_time_limit_stops_training_early_and_still_saves(builds: Builds, tmp_path: Path) -> None:
    streams = TokenStreams(
        *(
            torch.from_numpy(np.load(builds.first / CORPUS_DIR / f"{n}.npy"))
            for n in ("train", "validation", "held_out")
        )
    )
    config = PRESETS["tiny"].draft.model_copy(update={"time_limit_s": 1e-6, "progress": False})
    result = train_lm(
        "limited", SHAPES["tiny-draft"], streams, builds.first / TOKENIZER_DIR, tmp_path, config
    )
    assert result.stopped_early and result.steps == 1 and len(result.evals) == 1
    assert (tmp_path / "model.safetensors").is_file()


def test_a_plan_shortened_to_fit_the_time_limit_still_decays_fully() -> None:
    plan = StepPlan(total_steps=1000, warmup_steps=50, min_lr_ratio=0.1)
    assert not plan.fit_to_time(step=100, seconds_per_step=0.01, seconds_left=20.0)  # 900 steps fit
    assert plan.fit_to_time(step=100, seconds_per_step=0.1, seconds_left=20.0)
    assert plan.shortened and plan.planned_steps == 1000
    assert 100 < plan.total_steps <= 100 + 20.0 / 0.1
    assert plan.lr_multiplier(plan.total_steps) == pytest.approx(0.1)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(root: Path, paths: list[str]) -> dict[str, str]:
    files = [
        p for name in paths for p in ([root / name] if (root / name).is_file() else (root / name).rglob("*"))
    ]
    return {p.relative_to(root).as_posix(): _sha256(p) for p in files if p.is_file()}
