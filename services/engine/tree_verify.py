"""Verification of a draft tree against the target, and compaction of the accepted path's KV.

A request's verify query is a flattened draft tree (services/engine/spec_decode/tree.py): row `n`
holds the target's logits after node `n`'s token given its ancestors (tree attention). Each row's
*target token* is what the target emits there on its own: the argmax (greedy requests) or its
sample with the noise keyed by (seed, output position = the request's output count + the node's
depth) (kernels/sampling_noise_ref.py).

The acceptance rule walks down from the root: at node `n`, the child whose token equals the target
token of `n` is *accepted* and the walk goes on from it; where no child matches, the target token
of the last accepted node is emitted (the *recovered* token, or the *bonus* token at a leaf).

- greedy: the longest root-to-node path whose tokens equal the target's argmax at their parent.
- sampling: this is recursive rejection sampling over the siblings (SpecInfer, Miao et al. 2024,
  "multi-step speculative sampling"; EAGLE-2's multi-draft rule) with one-hot drafts. Trying child
  `x_1` against the target distribution p accepts it with probability min(1, p(x_1) / 1) = p(x_1);
  rejected, the residual is norm(max(0, p - onehot(x_1))), p without x_1; child `x_2` is then
  accepted with probability p(x_2) / (1 - p(x_1)), and so on; past the last child the token is
  drawn from p without the children's tokens. Altogether child `x_i` is accepted with probability
  p(x_i) and any other token `y` is emitted with probability p(y): exactly the law of one sample
  of p, compared with the children. Sampling p once with the keyed noise and matching it against
  the children is therefore that rule, and every emitted token is the target's own sample at its
  position, as in chain verification: a seeded request's output does not depend on the tree.

*Compaction* (`kernels.compact_path_kv`): the query wrote node `n`'s KV at the slot of position
`root + n`; the accepted path's node at depth `d` belongs at position `root + d`. Its KV is moved
there (at most depth entries per request), so the next step sees a plain cache, as after a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kernels
from kernels.verify_ref import TARGET_MATCH
from services.engine.input_batch import GatheredParams, InputBatch
from services.engine.sequence import Sequence
from services.engine.spec_decode.draft_sampling import sample_each_row


@dataclass
class TreeVerdict:
    token_ids: (
        torch.Tensor
    )  # [num_seqs, max_rows] int32: accepted drafts, then the recovered / bonus token, -1 after
    num_accepted: torch.Tensor  # [num_seqs] int32
    path: (
        torch.Tensor
    )  # [num_seqs, depth + 1] int64: the accepted node at each depth (the last one repeated past it)


def target_tokens(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    params: GatheredParams,  # the rows' requests' parameters, one per row
    row_positions: torch.Tensor,  # [num_rows] int64: output position each row samples
    bitmask: torch.Tensor | None = None,  # [num_rows, num_words] int32 grammar masks
    masked_rows: torch.Tensor | None = None,  # [num_rows] int32, nonzero: apply the row's bitmask
) -> torch.Tensor:  # [num_rows] int64
    """What the target emits at each row on its own (argmax at temperature 0, else its keyed sample):
    the fused verify kernel with every row a request of its own and no draft."""
    return sample_each_row(
        logits, params, row_positions, TARGET_MATCH, bitmask=bitmask, masked_rows=masked_rows
    ).long()


def verify_tree(
    target_ids: torch.Tensor,  # [num_rows] int64: the target token of every row
    draft_ids: torch.Tensor,  # [num_rows] int32: row j of a request holds node j + 1's token, -1 on its last row
    cu_num_rows: torch.Tensor,  # [num_seqs + 1] int32: a request's rows are its tree's nodes
    parents: torch.Tensor,  # [num_seqs, max_rows] int64: each request's parent array (a chain: j - 1), -1 past its rows
) -> TreeVerdict:
    """The accepted path of every request (the module docstring's rule), on the device; token_ids
    and path are `max_rows` wide (`kernels.verify_tree`: one launch on CUDA)."""
    return TreeVerdict(*kernels.verify_tree(target_ids, draft_ids, cu_num_rows, parents))


def tree_parents(shapes: list[list[int] | None], num_rows: list[int], max_rows: int) -> torch.Tensor:
    """[num_seqs, max_rows] int64 parent arrays of a step's requests: the first rows of each one's
    tree shape (its parent array, root included; `spec_decode.tree.tree_shape`), or a chain where
    None; -1 at the root and past each request's rows."""
    parents = np.full((len(num_rows), max_rows), -1, dtype=np.int64)
    chain = np.arange(-1, max_rows - 1)
    for i, (n, shape) in enumerate(zip(num_rows, shapes)):
        parents[i, :n] = chain[:n] if shape is None else shape[:n]
    return torch.from_numpy(parents)


def tree_verifiable(seq: Sequence) -> bool:
    """Whether the tree rule verifies the request: the target token of a row must not depend on
    the rows before it (penalties, min_tokens, a grammar) nor need the torch sampler (logit bias,
    logprobs), and its stop ids fit its slot. Other requests of a tree server draft nothing."""
    p = seq.params
    suppressing = seq.num_output_tokens < p.min_tokens
    changed = p.has_penalties or bool(p.logit_bias) or p.logprobs is not None
    return not (changed or suppressing or seq.grammar is not None) and InputBatch.fits(seq)
