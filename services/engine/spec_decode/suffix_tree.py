"""Depth-bounded suffix trees over token ids, the index behind SuffixDecoding drafts.

SuffixDecoding (Oliaro et al. 2024, "SuffixDecoding: A Model-Free Approach to Speeding Up Large
Language Model Inference", arXiv:2411.04975) drafts tokens by matching the end of a request's
context against earlier text and proposing what followed there.

Terms used throughout:

- *path*: a token sequence read from the root; the tree holds every substring of the indexed
  sequences up to `max_depth` tokens long.
- *count* of a path: how many times it occurs (as a substring) in the indexed sequences.
- *match length* `m`: the length of a suffix of the context that is a path of the tree.
- *draft*: the tokens grown greedily from a matched path, each the most frequent continuation.
  A token's *probability* is `count(path + token) / count(path)`; its *cumulative probability*
  is the product of the probabilities from the match to it. The *score* of a draft is the sum of
  its cumulative probabilities (the expected number of accepted tokens, as in the paper).

A plain trie of all substrings holds about `n * max_depth` nodes for `n` tokens, nearly all of
them on count-1 chains (text that occurred once). So a path that occurred once is not stored
node by node: a *leaf* stands for the whole rest of its single occurrence, `seq[start:]` cut at
`max_depth`, and is turned into an ordinary node (*materialised*) when a second occurrence
arrives. Nodes with count >= 2 are *explicit*; memory is O(explicit nodes + n). Nodes are ints
indexing lists of ints and of int-to-int dicts, which the garbage collector does not track: a
tree of a thousand outputs is a handful of tracked objects, not one or two per node, so full
collections do not walk it.

Complexity, with `D = max_depth`, `k` draft tokens:
- appending a token to a sequence: O(K + 1) dict operations, where `K < D` is the length of the
  longest suffix of the sequence that occurred before (its *active* suffixes are kept);
- removing a sequence of `n` tokens: O(n * (K + 1)), walking each start down to its leaf;
- speculating from a context: O(D log D) to find the longest match by binary search, then the
  shorter matches by suffix links, longest first, until no shorter match can score higher: O(1)
  per match length through explicit nodes, O(leaf part) where the longer match ended in a leaf,
  and O(k) to grow a draft where the match's count differs from the longer match's (equal counts
  mean every occurrence of the shorter match extends to the longer one: the same continuation).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

DEFAULT_MAX_TREE_DEPTH = 64
DEFAULT_MAX_CACHED_REQUESTS = 1000


ROOT = 0
"""The root's node id: the empty path, explicit; its count is the number of indexed tokens."""
NO_NODE = -1
"""`link` of the root and of leaves."""
NO_TOKEN = -1
"""`best` of a node whose best child is not known (it has none, or it went stale)."""


@dataclass
class SuffixDraft:
    """A drafted continuation; plain lists so that it serialises as it is (msgpack, JSON)."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    """Per-token probability `count(path + token) / count(path)`, not cumulative."""
    match_len: int = 0
    score: float = 0.0
    """Sum of the cumulative probabilities along the draft."""


@dataclass
class IndexedSequence:
    """A sequence held by a tree; its leaves refer to `token_ids`, so it only ever grows."""

    token_ids: list[int]
    active: list[int]
    """The explicit nodes of the sequence's suffixes, indexed by suffix length (0: the root)."""


def check_tree_params(max_tree_depth: int, max_cached_requests: int = 0) -> None:
    if max_tree_depth < 1:
        raise ValueError(f"max_tree_depth must be >= 1, got {max_tree_depth}")
    if max_cached_requests < 0:
        raise ValueError(
            f"max_cached_requests must be >= 0 (0 disables the cache), got {max_cached_requests}"
        )


def check_spec_params(max_spec_tokens: int, max_spec_factor: float, min_token_prob: float) -> None:
    if max_spec_tokens < 0:
        raise ValueError(f"max_spec_tokens must be >= 0, got {max_spec_tokens}")
    if not max_spec_factor > 0:
        raise ValueError(f"max_spec_factor must be > 0, got {max_spec_factor}")
    if not 0.0 <= min_token_prob <= 1.0:
        raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")


def draft_limit(match_len: int, max_spec_tokens: int, max_spec_factor: float) -> int:
    """Most draft tokens after a match of `match_len`: longer matches earn longer drafts."""
    return min(max_spec_tokens, math.floor(max_spec_factor * match_len))


class SuffixTree:
    """All substrings (up to `max_depth` tokens) of the sequences it indexes, with counts.

    A node is an int indexing per-node lists, explicit (`_children[node]` a dict) or a leaf
    (`_children[node]` None, `_seq[node]` set, count 1). A leaf stands for the single occurrence
    `seq[start:]` of its path: the token after depth `d` is `seq[start + d]`, and the chain grows
    with `seq` up to the depth bound. Node ids of removed paths are reused.
    """

    def __init__(self, max_depth: int = DEFAULT_MAX_TREE_DEPTH) -> None:
        check_tree_params(max_depth)
        self.max_depth = max_depth
        self._children: list[dict[int, int] | None] = [{}]
        """Per node: token -> child node (untracked by the garbage collector: ints only); None for a leaf."""
        self._count: list[int] = [0]
        """Per node: occurrences of its path."""
        self._best: list[int] = [NO_TOKEN]
        """Per node: the child token with the highest count (ties: smallest id), NO_TOKEN when not yet known."""
        self._link: list[int] = [NO_NODE]
        """Explicit nodes below the root: the node of the path without its first token (its
        *suffix link*), explicit too, as it occurs wherever this path does."""
        self._seq: list[list[int] | None] = [None]
        """Leaves: the token list of the sequence the leaf's occurrence is in."""
        self._start: list[int] = [0]
        """Leaves: where the leaf's occurrence starts in `_seq[node]`."""
        self._free: list[int] = []
        """Ids of removed nodes, reused by new ones."""
        self.num_nodes = 0
        """Nodes below the root, explicit and leaves (the tree's memory, for metrics)."""

    @property
    def num_tokens(self) -> int:
        """Tokens indexed (the root's count)."""
        return self._count[ROOT]

    def count(self, node: int) -> int:
        """Occurrences of the path of `node` (1 for a leaf)."""
        return self._count[node]

    def children(self, node: int) -> dict[int, int]:
        """token -> child node of an explicit node; empty for a leaf."""
        return self._children[node] or {}

    def new_sequence(self) -> IndexedSequence:
        return IndexedSequence(token_ids=[], active=[ROOT])

    def extend(self, seq: IndexedSequence, token_ids: Iterable[int]) -> None:
        """Appends tokens to `seq`, counting every new substring; O(K + 1) per token."""
        for token_id in token_ids:
            self._append(seq, token_id)

    def remove(self, seq: IndexedSequence) -> None:
        """Uncounts every substring of `seq`; paths left with count 0 are deleted, so removal is exact."""
        for start in range(len(seq.token_ids)):
            self._remove_occurrence(seq.token_ids, start)
        self._count[ROOT] -= len(seq.token_ids)

    def speculate(
        self, context: list[int], max_spec_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> SuffixDraft:
        """The best-scored draft over every suffix of `context` that is a path."""
        context = context[-self.max_depth :]
        return self._best_draft(self._suffix_nodes(context), max_spec_tokens, max_spec_factor, min_token_prob)

    def speculate_sequence(
        self, seq: IndexedSequence, max_spec_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> SuffixDraft:
        """`speculate` on a sequence of this tree, from its kept active suffixes (no matching).

        Longer suffixes are leaves whose only occurrence is the sequence's end: nothing follows them.
        """
        candidates = ((m, seq.active[m]) for m in range(len(seq.active) - 1, 0, -1))
        return self._best_draft(candidates, max_spec_tokens, max_spec_factor, min_token_prob)

    def find(self, path: list[int]) -> int | None:
        """The explicit node of `path`, or the leaf whose chain contains it; None if absent."""
        node = ROOT
        for depth, token_id in enumerate(path):
            children = self._children[node]
            if children is None:
                return node if self._leaf_continues(node, depth, path[depth:]) else None
            child = children.get(token_id)
            if child is None:
                return None
            node = child
        return node

    def longest_match(self, context: list[int]) -> int:
        """Largest `m` with `context[-m:]` a path (at most `max_depth`)."""
        return self._match_end(context)[0]

    def path_counts(self) -> dict[tuple[int, ...], int]:
        """Every path with its count, leaves expanded; O(paths), for tests and debugging."""
        counts: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], int]] = [((), ROOT)]
        while stack:
            path, node = stack.pop()
            children = self._children[node]
            if children is None:
                counts.update(dict.fromkeys(self._leaf_paths(path, node), 1))
                continue
            if path:
                counts[path] = self._count[node]
            stack.extend((path + (t,), child) for t, child in children.items())
        return counts

    def _match_end(self, context: list[int]) -> tuple[int, int, int, int]:
        """(m, node, explicit, depth): the longest suffix `context[-m:]` that is a path, its node as
        `find` gives it, and the deepest explicit node on it with its depth.

        Matching statistics (as in Chang & Lawler 1994): left to right, the longest path ending at
        each token is the longest one ending before it, shortened by suffix links until the token
        extends it. O(len(context)) look-ups, plus a walk within a leaf where a leaf is shortened."""
        children_of, seq_of, start_of = self._children, self._seq, self._start
        node, explicit, depth, length = ROOT, ROOT, 0, 0
        for end, token_id in enumerate(context):
            while True:
                if length < self.max_depth:
                    children = children_of[node]
                    if children is not None:
                        child = children.get(token_id)
                        if child is not None:
                            node, length = child, length + 1
                            if children_of[child] is not None:
                                explicit, depth = child, length
                            break
                    else:
                        seq = seq_of[node]
                        assert seq is not None
                        at = start_of[node] + length
                        if at < len(seq) and seq[at] == token_id:
                            length += 1
                            break
                if length == 0:
                    break  # the token is in no indexed sequence
                node, explicit, depth = self._shorter(node, explicit, depth, context[end - length + 1 : end])
                length -= 1
        return length, node, explicit, depth

    def _shorter(self, node: int, explicit: int, depth: int, path: list[int]) -> tuple[int, int, int]:
        """(node, explicit, depth) of `path`, from those of the path one token longer before it: by
        the longer path's suffix link where it is explicit, else by its deepest explicit node's
        link and a walk down the rest (within a leaf)."""
        if self._children[node] is not None:
            link = self._link[node]
            assert link != NO_NODE
            return link, link, len(path)
        if depth == 0:  # a leaf below the root
            return self._walk(ROOT, 0, path)
        assert self._link[explicit] != NO_NODE
        return self._walk(self._link[explicit], depth - 1, path)

    def _walk(self, node: int, depth: int, path: list[int]) -> tuple[int, int, int]:
        """From the explicit `node` of `path[:depth]`, down `path` (a path of the tree) to its node or
        the leaf containing it: (that node, the deepest explicit node passed, its depth)."""
        explicit, explicit_depth = node, depth
        for token_id in path[depth:]:
            children = self._children[node]
            if children is None:
                break
            node = children[token_id]
            depth += 1
            if self._children[node] is not None:
                explicit, explicit_depth = node, depth
        return node, explicit, explicit_depth

    def _suffix_nodes(self, context: list[int]) -> Iterator[tuple[int, int]]:
        """(m, the node `find(context[-m:])` gives) for every suffix of `context` that is a path,
        longest first, each from the one before by a suffix link."""
        longest, node, explicit, depth = self._match_end(context)
        for match_len in range(longest, 0, -1):
            if match_len < longest:
                node, explicit, depth = self._shorter(node, explicit, depth, context[-match_len:])
            yield match_len, node

    def _append(self, seq: IndexedSequence, token_id: int) -> None:
        children_of, count, link, best = self._children, self._count, self._link, self._best
        seq.token_ids.append(token_id)
        count[ROOT] += 1
        end = len(seq.token_ids)
        active = [ROOT]
        shorter = ROOT  # the node of the new suffix one token shorter than the current one
        deepest = self.max_depth - 1  # an active node is shorter than max_depth
        for length, node in enumerate(seq.active):
            children = children_of[node]
            assert children is not None
            child = children.get(token_id)
            if child is None:
                # a new path, so are all longer ones: each gets a leaf for this occurrence
                children[token_id] = self._new_leaf(seq.token_ids, end - length - 1)
                self._bump_best(node, token_id)
                continue
            if children_of[child] is None:
                self._materialise(child, length + 1)
                link[child] = shorter  # counted one more time just before: explicit already
            shorter = child
            count[child] += 1
            if best[node] != token_id:  # where it is, it stays the best: no call
                self._bump_best(node, token_id)
            if length < deepest:
                active.append(child)
        seq.active = active

    def _new_leaf(self, seq: list[int], start: int) -> int:
        """A leaf for the occurrence `seq[start:]`, in a freed node's place where there is one."""
        self.num_nodes += 1
        if self._free:
            node = self._free.pop()
            self._children[node], self._count[node], self._best[node] = None, 1, NO_TOKEN
            self._link[node], self._seq[node], self._start[node] = NO_NODE, seq, start
            return node
        self._children.append(None)
        self._count.append(1)
        self._best.append(NO_TOKEN)
        self._link.append(NO_NODE)
        self._seq.append(seq)
        self._start.append(start)
        return len(self._count) - 1

    def _materialise(self, leaf: int, depth: int) -> None:
        """Turns a leaf at `depth` into an explicit node whose one child continues its occurrence."""
        seq, start = self._seq[leaf], self._start[leaf]
        assert seq is not None
        next_index = start + depth
        children: dict[int, int] = {}
        self._children[leaf], self._seq[leaf] = children, None
        if depth < self.max_depth and next_index < len(seq):
            children[seq[next_index]] = self._new_leaf(seq, start)
            self._best[leaf] = seq[next_index]

    def _remove_occurrence(self, token_ids: list[int], start: int) -> None:
        node = ROOT
        for token_id in token_ids[start : start + self.max_depth]:
            children = self._children[node]
            assert children is not None
            child = children[token_id]
            if self._count[child] == 1:
                # this occurrence was the path's last: drop it with everything below it
                assert self._children[child] is not None or (
                    self._seq[child] is token_ids and self._start[child] == start
                )
                del children[token_id]
                self._forget_best(node, token_id)
                self._free_chain(child)
                return
            self._count[child] -= 1
            self._forget_best(node, token_id)
            node = child

    def _free_chain(self, node: int) -> None:
        """Frees `node` and the nodes below it; a path of count 1 has one occurrence, so below it is a chain."""
        while True:
            children = self._children[node]
            self._children[node] = self._seq[node] = None
            self._free.append(node)
            self.num_nodes -= 1
            if not children:
                return
            (node,) = children.values()

    def _best_draft(
        self,
        candidates: Iterable[tuple[int, int | None]],
        max_spec_tokens: int,
        max_spec_factor: float,
        min_token_prob: float,
    ) -> SuffixDraft:
        """The best-scored draft among `candidates` (match length, node), longest match first.

        Branch and bound: a draft's score is at most its length, so once the best score reaches
        the length limit of the next (shorter) match, no shorter match can beat it. Ties keep the
        longer match. A match whose count equals the longer match's occurs only inside it: its
        continuation is the same (same counts below it), so its draft is no longer unless the
        longer one's was cut short by the depth bound, and it is not grown.
        """
        best = SuffixDraft()
        longer_count, longer_at_depth = 0, True
        for match_len, node in candidates:
            max_len = draft_limit(match_len, max_spec_tokens, max_spec_factor)
            if max_len <= best.score:
                break
            assert node is not None
            if self._count[node] == longer_count and not longer_at_depth:
                continue
            draft = self._grow_draft(node, match_len, max_len, min_token_prob)
            longer_count = self._count[node]
            longer_at_depth = match_len + len(draft.token_ids) >= self.max_depth
            if draft.score > best.score:
                best = draft
        return best

    def _grow_draft(self, node: int, depth: int, max_len: int, min_token_prob: float) -> SuffixDraft:
        """Greedy draft from the path `node` at `depth`: the most frequent continuation each step."""
        seq = self._seq[node]
        if seq is not None:  # a leaf: the rest of its one occurrence, every token certain
            begin = self._start[node] + depth
            token_ids = seq[begin : begin + min(max_len, self.max_depth - depth)]
            return SuffixDraft(token_ids, [1.0] * len(token_ids), depth, float(len(token_ids)))
        draft = SuffixDraft(match_len=depth)
        cum_prob = 1.0
        for token_id, prob, _ in self._greedy_path(node, depth):
            cum_prob *= prob
            if len(draft.token_ids) == max_len or cum_prob < min_token_prob:
                break
            draft.token_ids.append(token_id)
            draft.probs.append(prob)
            draft.score += cum_prob
        return draft

    def _greedy_path(self, node: int, depth: int) -> Iterator[tuple[int, float, int]]:
        """(token, probability, node after it) along the most frequent continuation of a path."""
        while depth < self.max_depth:
            children = self._children[node]
            if children is None:
                seq = self._seq[node]
                assert seq is not None
                at = self._start[node] + depth
                if at >= len(seq):
                    return
                yield seq[at], 1.0, node
            else:
                token_id = self._best_token(node)
                if token_id == NO_TOKEN:
                    return
                child = children[token_id]
                yield token_id, self._count[child] / self._count[node], child
                node = child
            depth += 1

    def _leaf_paths(self, path: tuple[int, ...], leaf: int) -> Iterator[tuple[int, ...]]:
        seq, start = self._seq[leaf], self._start[leaf]
        assert seq is not None
        end = min(start + self.max_depth, len(seq))
        for stop in range(start + len(path), end + 1):
            yield tuple(seq[start:stop])

    def _leaf_continues(self, leaf: int, depth: int, rest: list[int]) -> bool:
        """Whether the leaf's occurrence goes on with `rest` after its first `depth` tokens."""
        seq = self._seq[leaf]
        assert seq is not None
        begin = self._start[leaf] + depth
        return seq[begin : begin + len(rest)] == rest

    def _best_token(self, node: int) -> int:
        """The most frequent child token (ties: smallest id), recomputed only after it went stale;
        NO_TOKEN without children."""
        children = self._children[node]
        if self._best[node] == NO_TOKEN and children:
            count = self._count
            self._best[node] = min(children, key=lambda t: (-count[children[t]], t))
        return self._best[node]

    def _bump_best(self, node: int, token_id: int) -> None:
        """Keeps `best` exact after the child `token_id` gained one count; O(1)."""
        children = self._children[node]
        assert children is not None
        best = self._best[node]
        if best == token_id:
            return
        if best == NO_TOKEN:
            if len(children) == 1:
                self._best[node] = token_id
            return
        count, best_count = self._count[children[token_id]], self._count[children[best]]
        if count > best_count or (count == best_count and token_id < best):
            self._best[node] = token_id

    def _forget_best(self, node: int, token_id: int) -> None:
        """The child `token_id` lost counts: if it was the best, the best is unknown until asked."""
        if self._best[node] == token_id:
            self._best[node] = NO_TOKEN


class GlobalSuffixIndex:
    """The suffix tree over whole earlier sequences (request outputs), shared by all requests.

    Holds at most `max_cached_requests` sequences, evicting the oldest whole sequence (exactly:
    every count it added is taken back). Inputs and outputs are plain ids, lists and floats, so a
    separate suffix-cache process can serve it. A sequence is indexed whole, in one call: a leaf
    of a sequence still growing would miss continuations another sequence made explicit meanwhile.

    This is the in-process `GlobalIndex` of `suffix.SuffixProposer`; `max_spec_factor` and
    `min_token_prob` are the draft limits `speculate_batch` applies.
    """

    def __init__(
        self,
        max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH,
        max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        check_tree_params(max_tree_depth, max_cached_requests)
        check_spec_params(0, max_spec_factor, min_token_prob)
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.tree = SuffixTree(max_tree_depth)
        self._sequences: dict[str, IndexedSequence] = {}
        """In insertion order, which is eviction order."""

    def __len__(self) -> int:
        return len(self._sequences)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._sequences

    def add_sequence(self, seq_id: str, token_ids: list[int]) -> None:
        """Indexes `token_ids` under `seq_id` (replacing an earlier one), evicting the oldest if full."""
        for _ in self.add_sequence_steps(seq_id, token_ids, max(len(token_ids), 1)):
            pass

    def add_sequence_steps(self, seq_id: str, token_ids: list[int], chunk_tokens: int) -> Iterator[None]:
        """`add_sequence`, `chunk_tokens` tokens at a time: pauses after each chunk, where the caller
        may look up (what is indexed so far) but must not add or remove another sequence."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if self.max_cached_requests == 0:
            return
        self.remove_sequence(seq_id)
        seq = self.tree.new_sequence()
        for start in range(0, len(token_ids), chunk_tokens):
            self.tree.extend(seq, token_ids[start : start + chunk_tokens])
            yield
        self._sequences[seq_id] = seq
        while len(self._sequences) > self.max_cached_requests:
            self.remove_sequence(next(iter(self._sequences)))

    def remove_sequence(self, seq_id: str) -> bool:
        """Uncounts a sequence; False if it is not (or no longer) indexed."""
        seq = self._sequences.pop(seq_id, None)
        if seq is None:
            return False
        self.tree.remove(seq)
        return True

    def speculate(
        self,
        context: list[int],
        max_spec_tokens: int,
        max_spec_factor: float | None = None,
        min_token_prob: float | None = None,
    ) -> SuffixDraft:
        """The best-scored draft continuing `context` (only its last `max_tree_depth` tokens matter);
        the limits default to the index's own."""
        factor = self.max_spec_factor if max_spec_factor is None else max_spec_factor
        min_prob = self.min_token_prob if min_token_prob is None else min_token_prob
        check_spec_params(max_spec_tokens, factor, min_prob)
        return self.tree.speculate(context, max_spec_tokens, factor, min_prob)

    def speculate_batch(self, queries: list[tuple[list[int], int]]) -> list[SuffixDraft | None]:
        """`speculate` for each (context, max_spec_tokens), with the index's limits; never None here."""
        return [self.speculate(context, max_spec_tokens) for context, max_spec_tokens in queries]
