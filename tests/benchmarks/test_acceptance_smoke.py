"""`python -m benchmarks.acceptance` on a tiny matrix: it runs in seconds and writes sane numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.acceptance import (
    CARD_SECTION,
    engine_speculative_config,
    main,
    method_matrix,
    replace_section,
)


def test_tiny_matrix_writes_sane_json_and_markdown(tmp_path: Path) -> None:
    out, markdown = tmp_path / "acceptance.json", tmp_path / "acceptance.md"
    argv = ["--methods", "ngram", "mtp", "--ks", "1", "2", "--num-requests", "2", "--max-tokens", "12"]
    argv += [
        "--workloads",
        "code_continuation",
        "--out",
        str(out),
        "--markdown",
        str(markdown),
        "--no-progress",
    ]
    assert main(argv) == 0

    report = json.loads(out.read_text())
    runs = {(r["method"], r["k"]): r for r in report["results"]}
    assert set(runs) == {("ngram", 1), ("ngram", 2), ("mtp", 1), ("mtp", 2)}
    for (_, k), run in runs.items():
        assert run["workload"] == "code_continuation" and run["num_requests"] == 2
        assert 1.0 <= run["mean_accepted_length"] <= k + 1
        assert 1.0 <= run["tokens_per_step"] <= k + 1
        assert len(run["acceptance_per_position"]) <= k
        assert all(0.0 <= rate <= 1.0 for rate in run["acceptance_per_position"])
        assert sum(run["accepted_per_position"]) == run["num_accepted_tokens"]
        assert run["num_outputs_differing"] == 0  # greedy speculation is lossless
    assert runs[("mtp", 1)]["num_verify_steps"] > 0
    goal = report["goal"]
    assert 0.0 <= goal["headline"] <= 1.0 and goal["met"] == (goal["headline"] >= 0.6)
    text = markdown.read_text()
    assert "| method | k | workload |" in text and "MTP first-position acceptance" in text


def test_the_matrix_is_the_one_the_issue_asks_for() -> None:
    configs = method_matrix(["ngram", "suffix", "mtp", "mtp_ngram", "eagle3", "draft_model"], [1, 2, 3, 4, 5])
    by_method: dict[str, list[tuple[int, int | None]]] = {}
    for c in configs:
        by_method.setdefault(c.method, []).append((c.k, c.num_model_steps))
    assert by_method["mtp"] == [(1, 1), (2, 2), (3, 3)]
    assert sorted(by_method["mtp_ngram"]) == [(2, 1), (3, 1), (3, 2), (4, 1), (4, 2), (5, 1), (5, 2)]
    for method in ("ngram", "suffix", "eagle3", "draft_model"):
        assert [k for k, _ in by_method[method]] == [1, 2, 3, 4, 5]


def test_replacing_a_section_keeps_the_others() -> None:
    card = "# model\n\nintro\n\n## Speculative acceptance\n\nold text\n\n## Files\n\n- a\n"
    updated = replace_section(card, CARD_SECTION, "| new | table |")
    assert updated == "# model\n\nintro\n\n## Speculative acceptance\n\n| new | table |\n\n## Files\n\n- a\n"
    assert replace_section(updated, CARD_SECTION, "| new | table |") == updated
    appended = replace_section("# bench\n\n## Other\n\nx\n", "## Acceptance", "y", insert_after_title=True)
    assert appended == "# bench\n\n## Acceptance\n\ny\n\n## Other\n\nx\n"


def test_tree_methods_run_each_tree_at_its_depth() -> None:
    configs = method_matrix(["mtp_tree", "eagle3_tree", "mtp"], [1, 2], [(3, 2, 1), (2, 2)])
    trees = [(c.label, c.k, c.engine_key) for c in configs if c.tree is not None]
    assert trees == [
        ("mtp tree [3, 2, 1]", 3, "mtp_tree_3_2_1"),
        ("mtp tree [2, 2]", 2, "mtp_tree_2_2"),
        ("eagle3 tree [3, 2, 1]", 3, "eagle3_tree_3_2_1"),
        ("eagle3 tree [2, 2]", 2, "eagle3_tree_2_2"),
    ]
    spec = engine_speculative_config("mtp_tree_3_2_1", [configs[0]])
    assert spec.method == "mtp" and spec.tree == (3, 2, 1) and spec.max_num_drafts == 15


def test_trees_with_an_ngram_branch_share_their_budget() -> None:
    configs = method_matrix(["eagle3_tree_ngram"], [3], [(3, 2, 1), (2, 2, 1)], tree_budget=18)
    assert [(c.label, c.k) for c in configs] == [
        ("eagle3 tree [3, 2, 1] + ngram (18 tokens)", 3),
        ("eagle3 tree [2, 2, 1] + ngram (18 tokens)", 3),
    ]
    spec = engine_speculative_config(configs[1].engine_key, [configs[1]])
    assert spec.method == "eagle3" and spec.with_ngram and spec.ngram_branch_drafts == 18 - 1 - 10
    default = method_matrix(["mtp_tree_ngram"], [3], [(2, 2, 1)])[0]
    assert default.label == "mtp tree [2, 2, 1] + ngram (16 tokens)"


def test_bad_tree_shapes_are_refused_on_the_command_line(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--methods", "mtp_tree", "--trees", "3;2"])
    assert "comma-separated" in capsys.readouterr().err
