"""A request's own suffix index: a suffix automaton over its tokens, with occurrence counts.

It drafts exactly as a `suffix_tree.SuffixTree` holding the same one sequence (same counts, same
greedy rule, same scores; the terms are defined there), at a bounded cost per token. A trie of
substrings updates one node per *active* suffix (every suffix that occurred before, up to
`max_depth` of them) on each token; on text that copies earlier text that is tens of nodes.

A suffix automaton (Blumer et al. 1985, "The smallest automaton recognizing the subwords of a
text"; the online construction of Crochemore & Hancart, "Automata for matching patterns", 1997)
groups the substrings by their set of end positions: one *state* per group, holding the substrings
whose lengths lie in `(length[link[v]], length[v]]`, each a suffix of the longest. Every substring
of a state occurs exactly where the others do, so one state's count and greedy continuation serve
all of them: the active suffixes of a copied span fall into a few states. States, suffix links,
lengths, counts and best children live in integer lists; only transitions are dicts.

Per appended token: the automaton's own construction (amortised O(1) transitions and clones), then
one count increment per state holding a suffix of length <= `max_depth` and one best-child update
per state holding a suffix of length < `max_depth` (the states of longer strings are never read):
O(min(states on the suffix chain, max_depth)). A draft walks the chain from the longest repeated
suffix down, with each state's greedy continuation computed once per call.
"""

from __future__ import annotations

from services.engine.spec_decode.suffix_tree import SuffixDraft, check_tree_params, draft_limit

NO_TOKEN = -1
"""`best` of a state without transitions."""
ROOT = 0


class SuffixAutomaton:
    """Every substring of one growing token sequence, with occurrence counts up to `max_depth`."""

    def __init__(self, max_depth: int) -> None:
        check_tree_params(max_depth)
        self.max_depth = max_depth
        self.num_tokens = 0
        self._next: list[dict[int, int]] = [{}]
        """Per state: token -> the state of its substrings followed by that token."""
        self._link = [-1]
        """Per state: the state of its longest suffix that occurs in more places (-1: the root's)."""
        self._length = [0]
        """Per state: the length of its longest substring."""
        self._count = [0]
        """Per state: occurrences of its substrings; exact where it holds one of <= max_depth tokens."""
        self._best = [NO_TOKEN]
        """Per state: the transition token whose state has the highest count (ties: smallest id);
        exact where the state holds a substring shorter than max_depth."""
        self._last = ROOT
        """The state of the whole sequence."""
        self._tail = ROOT
        """The state of the sequence's suffix of min(len, max_depth - 1) tokens."""

    def extend(self, token_ids: list[int]) -> None:
        """Appends `token_ids`: per token, the construction's new state (`_add_state`), one more
        occurrence for the new suffix of min(len, max_depth) tokens and the states of its suffixes,
        and the best continuation of the old tail and its suffixes' states brought up to date. One
        loop with the lists bound once: it runs for every token every request emits."""
        next_, link, length, count, best = self._next, self._link, self._length, self._count, self._best
        max_depth = self.max_depth
        for token_id in token_ids:
            old_tail = self._tail
            self.num_tokens += 1
            self._add_state(token_id)
            # the old tail may have been split: its suffix of max_depth - 1 tokens is then in the split-off part
            tail_len = min(self.num_tokens - 1, max_depth - 1)
            while old_tail != ROOT and length[link[old_tail]] >= tail_len:
                old_tail = link[old_tail]
            deep = next_[old_tail][token_id]  # the state of the new suffix of min(len, max_depth) tokens
            state = deep
            while state != -1:  # the new end position: one more occurrence for it and its suffixes
                count[state] += 1
                state = link[state]
            state = old_tail
            while state != -1:  # each gained one occurrence of token_id after it
                current = best[state]
                if current == NO_TOKEN:
                    best[state] = token_id
                elif current != token_id:
                    gained, held = count[next_[state][token_id]], count[next_[state][current]]
                    if gained > held or (gained == held and token_id < current):
                        best[state] = token_id
                state = link[state]
            if length[link[deep]] >= max_depth - 1:
                deep = link[deep]
            self._tail = deep

    def speculate(self, max_spec_tokens: int, max_spec_factor: float, min_token_prob: float) -> SuffixDraft:
        """The best-scored draft after the sequence, over every suffix of it that occurred before
        (match length m < max_depth, longest first; at most floor(max_spec_factor * m) tokens).

        Branch and bound as in `SuffixTree`: a draft scores at most its length, so once the best
        score reaches the next match's length limit no shorter match can beat it; ties keep the
        longer match. The match lengths of one state share one continuation: once a draft was not
        cut short by the depth bound, its state's shorter matches give no longer one."""
        if not self.num_tokens:
            return SuffixDraft()
        length, link = self._length, self._link
        state = self._tail if self._tail != self._last else link[self._last]  # the whole sequence occurs once
        longest = min(self.num_tokens, self.max_depth - 1, length[state])
        best: tuple[_GreedyPath, int, int] | None = None  # (path, draft length, match length)
        best_score = 0.0
        path = None
        match_len = longest
        while match_len > 0:
            if length[link[state]] >= match_len:
                state = link[state]
                path = None
            max_len = draft_limit(match_len, max_spec_tokens, max_spec_factor)
            if max_len <= best_score:
                break
            if path is None:
                path = _GreedyPath(state)
            num_drafts = path.grow(self, min(max_len, self.max_depth - match_len), min_token_prob)
            if path.scores[num_drafts] > best_score:
                best, best_score = (path, num_drafts, match_len), path.scores[num_drafts]
            if num_drafts == max_len or num_drafts < self.max_depth - match_len:
                match_len = length[link[state]]  # on to the next state
            else:
                match_len -= 1
        return SuffixDraft() if best is None else best[0].draft(*best[1:])

    def path_counts(self) -> dict[tuple[int, ...], int]:
        """Every substring of at most `max_depth` tokens with its count; O(substrings), for tests."""
        counts: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], int]] = [((), ROOT)]
        while stack:
            path, state = stack.pop()
            if path:
                counts[path] = self._count[state]
            if len(path) < self.max_depth:
                stack.extend((path + (t,), target) for t, target in self._next[state].items())
        return counts

    def _add_state(self, token_id: int) -> None:
        """The suffix automaton's online construction: a state for the whole new sequence, the
        transitions into it, and a clone where a state's substrings stop sharing end positions."""
        next_, link, length = self._next, self._link, self._length
        last = self._last
        cur = len(length)
        next_.append({})
        link.append(ROOT)
        length.append(length[last] + 1)
        self._count.append(0)
        self._best.append(NO_TOKEN)
        state = last
        while state != -1 and token_id not in next_[state]:
            next_[state][token_id] = cur
            state = link[state]
        if state != -1:
            target = next_[state][token_id]
            if length[state] + 1 == length[target]:
                link[cur] = target
            else:
                clone = self._new_state(
                    length[state] + 1,
                    link[target],
                    dict(next_[target]),
                    self._count[target],
                    self._best[target],
                )
                while state != -1 and next_[state].get(token_id) == target:
                    next_[state][token_id] = clone
                    state = link[state]
                link[target] = link[cur] = clone
        self._last = cur

    def _new_state(self, length: int, link: int, next_: dict[int, int], count: int, best: int) -> int:
        self._next.append(next_)
        self._link.append(link)
        self._length.append(length)
        self._count.append(count)
        self._best.append(best)
        return len(self._length) - 1


class _GreedyPath:
    """The most frequent continuation of one state's substrings, shared by every match length in
    it: (token, probability, score so far) per step, grown as far as a draft asks."""

    __slots__ = ("cum_prob", "probs", "scores", "state", "stopped", "token_ids")

    def __init__(self, state: int) -> None:
        self.state = state
        """Where the continuation has got to."""
        self.cum_prob = 1.0
        self.token_ids: list[int] = []
        self.probs: list[float] = []
        self.scores: list[float] = [0.0]
        """scores[i]: the sum of the first i cumulative probabilities (score of an i-token draft)."""
        self.stopped = False

    def draft(self, num_drafts: int, match_len: int) -> SuffixDraft:
        return SuffixDraft(
            self.token_ids[:num_drafts], self.probs[:num_drafts], match_len, self.scores[num_drafts]
        )

    def grow(self, index: SuffixAutomaton, max_len: int, min_token_prob: float) -> int:
        """Grows the path to `max_len` tokens where it goes on (stopping where it ends or falls
        below `min_token_prob`); the length of the draft it then gives, at most `max_len`."""
        next_, count, best = index._next, index._count, index._best
        while not self.stopped and len(self.token_ids) < max_len:
            token_id = best[self.state]
            if token_id == NO_TOKEN:
                self.stopped = True
                break
            child = next_[self.state][token_id]
            prob = count[child] / count[self.state]
            cum_prob = self.cum_prob * prob
            if cum_prob < min_token_prob:
                self.stopped = True
                break
            self.cum_prob = cum_prob
            self.token_ids.append(token_id)
            self.probs.append(prob)
            self.scores.append(self.scores[-1] + cum_prob)
            self.state = child
        return min(max_len, len(self.token_ids))
