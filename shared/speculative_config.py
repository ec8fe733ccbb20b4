"""Speculative decoding configuration, FastDeploy-style (`--speculative-config '{json}'`).

Terms used across specmesh: a *draft* token is proposed by a cheap method; the *target* model
verifies all drafts of a request in one forward over `1 + k` tokens. *Accepted* drafts are kept,
the first rejected one is replaced by a *recovered* token sampled from the target, and when all
`k` are accepted a *bonus* token comes from the target's last row.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.errors import describe_validation_error
from shared.json_types import INTEGRAL

Method = Literal["naive", "ngram", "suffix", "mtp", "eagle3", "draft_model"]
MODEL_FREE_METHODS: tuple[str, ...] = ("naive", "ngram", "suffix")
MODEL_BASED_METHODS: tuple[str, ...] = ("mtp", "eagle3", "draft_model")
MAX_MODEL_FREE_TOKENS = 15
MAX_MODEL_BASED_TOKENS = 5
TREE_METHODS: tuple[str, ...] = ("mtp", "eagle3")
MAX_TREE_NODES = 64
"""The most nodes of a draft tree, its root included (kernels.attention_ref.MAX_TREE_NODES: the
bits of a tree-attention mask; shared/ does not import kernels/)."""
DEFAULT_NGRAM_BRANCH_TOKENS = 5
"""A tree's n-gram branch (with_ngram) without a tree_budget: the n-gram method's default k."""
DEFAULT_NUM_SPECULATIVE_TOKENS = {
    "naive": 0,
    "ngram": 5,
    "suffix": 8,
    "mtp": 1,
    "eagle3": 3,
    "draft_model": 3,
}


class SpeculativeConfig(BaseModel):
    """How drafts are proposed and verified. Every field is checked; bad combinations say what to change."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    method: Method = "naive"
    """naive (the speculative path with no drafts), ngram, suffix, mtp, eagle3 or draft_model."""
    num_speculative_tokens: int | None = Field(default=None, ge=0, le=MAX_MODEL_FREE_TOKENS)
    """k: most draft tokens per request per step (model-based methods: at most 5). Defaults per
    method: naive 0, ngram 5, suffix 8, mtp 1, eagle3 3, draft_model 3."""
    num_model_steps: int | None = Field(default=None, ge=1, le=MAX_MODEL_BASED_TOKENS)
    """mtp: how many times the MTP head is chained per step (defaults to k)."""
    mtp_strategy: Literal["default", "with_ngram"] = "default"
    """with_ngram: after the MTP drafts, n-gram drafts fill the remaining slots up to k."""
    model: str | None = None
    """Checkpoint directory of the MTP head, the EAGLE-3 head or the draft model."""
    eagle3_layers: tuple[int, int, int] | None = None
    """eagle3: the target layers whose entering streams the head reads (low, mid, high); None:
    the head's config.json, else EAGLE-3's default (2, L / 2, L - 3 of L layers)."""
    prompt_lookup_max: int = Field(
        default=4, ge=1, le=64, validation_alias=AliasChoices("prompt_lookup_max", "max_ngram_size")
    )
    """ngram: longest suffix (in tokens) tried first."""
    prompt_lookup_min: int = Field(
        default=1, ge=1, le=64, validation_alias=AliasChoices("prompt_lookup_min", "min_ngram_size")
    )
    """ngram: shortest suffix tried before giving up."""
    suffix_decoding_max_tree_depth: int = Field(default=64, ge=1, le=1024)
    suffix_decoding_max_cached_requests: int = Field(default=10000, ge=0)
    """Requests whose outputs stay in the global suffix tree (0: per-request indexes only)."""
    suffix_decoding_max_spec_factor: float = Field(default=1.0, gt=0.0)
    """Draft length is at most this times the matched suffix length."""
    suffix_decoding_min_token_prob: float = Field(default=0.1, ge=0.0, le=1.0)
    """Drafts stop where the estimated probability of the path falls below this."""
    verify_strategy: Literal["rejection", "greedy", "topp", "target_match"] = "rejection"
    """rejection (lossless, Leviathan et al. 2023), greedy, target_match, or topp (lossy)."""
    accept_policy: Literal["normal", "accept_all", "reject_all"] = "normal"
    """Debugging bounds: accept_all keeps every draft, reject_all keeps none."""
    adaptive: bool = True
    """Per-request k follows observed acceptance; speculation shrinks when the batch makes it a loss."""
    adaptive_min_acceptance: float = Field(default=0.05, ge=0.0, le=1.0)
    """Below this estimated acceptance rate a request stops drafting (it probes again now and then)."""
    allow_request_override: bool = True
    """Whether a request may choose its own method / k / turn speculation off (never above k)."""
    tree: tuple[int, ...] | None = None
    """mtp / eagle3: draft a static tree instead of a chain, with this many children per node at
    each depth (`[3, 2, 1]`: 3 at depth 1, 2 under each of those, 1 under each of those: 15
    drafts), verified in one target forward with tree attention. num_speculative_tokens is then
    the tree's depth (defaults to it; a request's smaller k cuts the tree at that depth), and the
    per-request token budget is the tree's node count (adaptive speculation picks the depth, pricing
    a tree by its nodes)."""
    with_ngram: bool = False
    """tree: an n-gram branch beside the head's tree, verified in the same forward: the n-gram
    drafts (prompt_lookup_min / max) hang from the root, merged into the head's nodes as far as
    they agree and grafted as a chain where they part, so that no token is drafted twice."""
    tree_budget: int | None = Field(default=None, ge=2, le=MAX_TREE_NODES)
    """with_ngram: the most tokens of a request's tree query, its root included; the n-gram
    branch gets what the head's tree leaves (default: the head's tree and 5 n-gram drafts)."""

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.num_speculative_tokens is None:
            default = len(self.tree) if self.tree else DEFAULT_NUM_SPECULATIVE_TOKENS[self.method]
            object.__setattr__(self, "num_speculative_tokens", default)
        if self.tree is not None:
            self._check_tree(self.tree)
        k = self.k
        if self.method == "naive" and k:
            raise ValueError(
                "method 'naive' proposes no drafts: set num_speculative_tokens to 0 or pick a method"
            )
        if self.method != "naive" and k == 0:
            raise ValueError(f"method {self.method!r} needs num_speculative_tokens >= 1")
        if self.method in MODEL_BASED_METHODS:
            if k > MAX_MODEL_BASED_TOKENS:
                raise ValueError(
                    f"method {self.method!r} allows at most {MAX_MODEL_BASED_TOKENS} speculative tokens, not {k}"
                )
            if not self.model:
                raise ValueError(
                    f"method {self.method!r} needs 'model': the checkpoint directory of the {_what(self.method)}"
                )
        elif self.model:
            raise ValueError(f"'model' is only used by mtp, eagle3 and draft_model, not by {self.method!r}")
        if self.eagle3_layers is not None and self.method != "eagle3":
            raise ValueError("eagle3_layers applies to method 'eagle3' only")
        if self.eagle3_layers is not None and min(self.eagle3_layers) < 0:
            raise ValueError(f"eagle3_layers {list(self.eagle3_layers)} must be layer indices (0 or more)")
        if self.num_model_steps is not None and self.method != "mtp":
            raise ValueError("num_model_steps applies to method 'mtp' only")
        if self.mtp_strategy != "default" and self.method != "mtp":
            raise ValueError("mtp_strategy applies to method 'mtp' only")
        if self.with_ngram and self.tree is None:
            raise ValueError(
                "with_ngram adds an n-gram branch to a draft tree: set 'tree' (an MTP chain takes "
                "mtp_strategy: with_ngram)"
            )
        if self.tree_budget is not None and not self.with_ngram:
            raise ValueError(
                "tree_budget is the budget a draft tree shares with its n-gram branch: set with_ngram"
            )
        if self.num_model_steps is not None and self.num_model_steps > k:
            raise ValueError(
                f"num_model_steps ({self.num_model_steps}) cannot exceed num_speculative_tokens ({k})"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self

    def _check_tree(self, tree: tuple[int, ...]) -> None:
        if not tree or any(b < 1 for b in tree):
            raise ValueError(
                f"tree branching factors must be >= 1 per depth, at least one depth; got {list(tree)}"
            )
        if self.method not in TREE_METHODS:
            raise ValueError(f"tree drafting needs method mtp or eagle3, not {self.method!r}")
        if self.num_speculative_tokens != len(tree):
            raise ValueError(
                f"with a tree, num_speculative_tokens is its depth: {len(tree)} for tree {list(tree)}, "
                f"not {self.num_speculative_tokens}"
            )
        if self.num_model_steps not in (None, len(tree)):
            raise ValueError("tree drafting chains the head to the tree's depth: drop num_model_steps")
        if self.mtp_strategy != "default":
            raise ValueError("a draft tree takes n-gram drafts as a branch: use with_ngram, not mtp_strategy")
        if self.verify_strategy not in ("rejection", "target_match") or self.accept_policy != "normal":
            raise ValueError(
                "tree drafting verifies losslessly: verify_strategy rejection or target_match, accept_policy normal"
            )
        head_tokens = self.head_tree_drafts + 1
        if head_tokens > MAX_TREE_NODES:
            raise ValueError(
                f"tree {list(tree)} has {head_tokens} nodes with its root; at most {MAX_TREE_NODES}"
            )
        if self.with_ngram and self.tree_budget is None:
            object.__setattr__(
                self, "tree_budget", min(head_tokens + DEFAULT_NGRAM_BRANCH_TOKENS, MAX_TREE_NODES)
            )
        if self.tree_budget is not None and self.tree_budget <= head_tokens:
            raise ValueError(
                f"tree {list(tree)} takes {head_tokens} of tree_budget {self.tree_budget} tokens (its root "
                "included), leaving the n-gram branch none: use a smaller tree or a larger tree_budget"
            )

    @property
    def head_tree_drafts(self) -> int:
        """The drafts of the head's tree: its nodes past the root (0 without a tree)."""
        total, width = 0, 1
        for branching in self.tree or ():
            width *= branching
            total += width
        return total

    @property
    def ngram_branch_drafts(self) -> int:
        """The most drafts of a tree's n-gram branch (with_ngram): what the head's tree leaves of
        tree_budget; 0 without one."""
        return self.tree_budget - 1 - self.head_tree_drafts if self.tree_budget is not None else 0

    @property
    def max_num_drafts(self) -> int:
        """The most drafts one request brings to a step: k, or a tree's nodes past its root (its
        n-gram branch's included)."""
        if self.tree is None:
            return self.k
        return self.head_tree_drafts + self.ngram_branch_drafts

    @property
    def k(self) -> int:
        """num_speculative_tokens, resolved."""
        return self.num_speculative_tokens or 0

    @property
    def enabled(self) -> bool:
        return self.method != "naive"

    @property
    def mtp_steps(self) -> int:
        """MTP chain length: num_model_steps, or k (with_ngram fills the rest of k with n-gram drafts)."""
        return self.num_model_steps or self.k

    @classmethod
    def from_json(cls, text: str | None) -> SpeculativeConfig:
        """Parses `--speculative-config`; errors name the field and what is wrong."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(f"--speculative-config: {describe_validation_error(exc)}") from None


class SpeculativeOverride(BaseModel):
    """What one request may change about speculation (within the operator's limits). Strict, as
    the gateway's request bodies are: `"3"` is not a number of tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = True
    """False turns speculation off for this request."""
    method: Method | None = None
    """Another method among those the server has loaded (model-free methods are always available)."""
    num_speculative_tokens: Annotated[int, Field(ge=0, le=MAX_MODEL_FREE_TOKENS), INTEGRAL] | None = None
    """A smaller k (never above the server's)."""


def _what(method: str) -> str:
    return {"mtp": "MTP head", "eagle3": "EAGLE-3 head"}.get(method, "draft model")
