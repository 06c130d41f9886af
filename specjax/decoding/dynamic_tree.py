"""EAGLE-2 dynamic draft trees under jit: fixed shapes, batch of rows, any sequential drafter.

The tree is chosen by the drafter's own confidence, as in EAGLE-2 (SafeAILab/EAGLE,
eagle/model/cnets.py `topK_genrate`), for `DynamicTreeSpec(top_k=K, depth=D, total_tokens=T)`:

1. The first draft step (the caller's) gives the root's log-probabilities over the draft
   vocabulary; its K best tokens are the first K candidates, scored by their log-probability.
2. Each of D expansion steps runs the current frontier (K nodes of one level) through the
   drafter (the `step` callback), takes each node's K best children and scores them with the
   cumulative log-probability `score(parent) + log p(child | path)`. These K*K candidates
   are appended; the K best of them are the next frontier.
3. The T-1 best of all C = K + D*K*K candidates, over all depths at once, become the tree.
   Scores fall along a path, so the selection is ancestor-closed (ties go to the lower
   candidate index, which a parent always has: `lax.top_k` returns the lower index first).
4. Node 0 is the root; nodes 1..T-1 are the selected candidates in increasing candidate
   index. This is the original's order (it sorts the selected indices); a parent is always
   an earlier candidate (an earlier block), so the order is topological.

Candidate numbering is the original's: block 0 holds the root's K children in rank order;
block i+1 (expansion step i) holds K*K children at `K + i*K*K + f*K + j`, f the frontier
node's rank at its level, j the child's rank under it. Given the same per-step
distributions the tree (tokens, parents, node order) is the one the original builds.

Expanded slots: frontier node f of step s is the drafter's run number `s*K + f` (of D*K).
A drafter with a KV cache writes node f of step s at slot `s*K + f` after the root, and
`Frontier.ancestors` says which earlier slots each frontier node may attend to (its
ancestors and itself; the root and the committed prefix are visible to all). Every
non-leaf node of the final tree was expanded, so an accepted path's K/V are all in the
drafter's cache except possibly the last node's; `DynamicTree.expanded_slot` maps nodes to slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from specjax.decoding.tree import DynamicTreeSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Frontier:
    """The K nodes one expansion step runs (same for every row's shape; contents differ per row)."""

    tokens: jax.Array  # int32 [B, K]: the nodes' tokens (target ids when `to_token` maps them)
    step: jax.Array  # int32 []: expansion step s = 0 .. D-1; every node here has depth s + 1
    parent: jax.Array  # int32 [B, K]: index of each node's parent in the previous frontier (step 0: 0 = the root)
    ancestors: jax.Array  # bool [B, K, D*K]: expanded slot r is this node or one of its ancestors

    @property
    def slot(self) -> jax.Array:
        """int32 []: the expanded slot of node 0 of this frontier (node f is at slot + f)."""
        return self.step * self.tokens.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A Draft-ready tree per row: node 0 the root, parents earlier than children."""

    tokens: jax.Array  # int32 [B, T]
    parents: jax.Array  # int32 [B, T]; root -1
    scores: jax.Array  # float32 [B, T]: cumulative draft log-probability of the path (root 0)
    depths: jax.Array  # int32 [B, T]: root 0, 1 .. D+1
    candidate: jax.Array  # int32 [B, T]: candidate index (original's numbering); root -1
    expanded_slot: jax.Array  # int32 [B, T]: slot the node ran in (0 .. D*K-1); -1 for the root and unexpanded leaves


StepFn = Callable[[Frontier, Any], tuple[jax.Array, Any]]


def candidate_depths(spec: DynamicTreeSpec) -> jax.Array:
    """int32 [C]: depth of each candidate (block 0 at depth 1, expansion step i's block at i + 2)."""
    k = spec.top_k
    return jnp.concatenate([jnp.ones((k,), jnp.int32)]
                           + [jnp.full((k * k,), i + 2, jnp.int32) for i in range(spec.depth)])


def build_tree(spec: DynamicTreeSpec, root_B: jax.Array, root_logprobs_BV: jax.Array, step: StepFn, state: Any,
               to_token: Callable[[jax.Array], jax.Array] | None = None) -> tuple[DynamicTree, Any]:
    """Build each row's dynamic tree; `step` runs the D expansion steps (traced once, under `lax.scan`).

    root_B: int32 [B], the root token (node 0). root_logprobs_BV: the draft log-probabilities
      after the root (the caller's first draft step), over the draft vocabulary V.
    step(frontier, state) -> (logprobs [B, K, V], state): the draft log-probabilities after
      each frontier node. Scores must be log-probabilities (<= 0); anything above 0 is clipped
      to 0 so the selection stays ancestor-closed whatever is passed.
    to_token: maps draft-vocabulary indices to the tokens written into the tree and fed to
      `step` (e.g. an EAGLE-3 draft vocabulary to target ids); identity when None.
    Returns the tree and the state after the last step.
    """
    k, d, t = spec.top_k, spec.depth, spec.total_tokens
    b, v = root_logprobs_BV.shape
    if k > v:
        raise ValueError(f"dynamic tree top_k={k} is larger than the draft vocabulary ({v} tokens)")
    to_token = to_token or (lambda x: x)
    r = d * k  # expanded slots
    rows_B1 = jnp.arange(b)[:, None]

    def best(logprobs, n):
        return lax.top_k(jnp.minimum(logprobs.astype(jnp.float32), 0.0), n)

    score0_BK, idx0_BK = best(root_logprobs_BV, k)
    token0_BK = to_token(idx0_BK).astype(jnp.int32)
    slots_K = jnp.arange(k, dtype=jnp.int32)
    anc0_BKR = jnp.broadcast_to(jax.nn.one_hot(slots_K, r, dtype=jnp.bool_), (b, k, r))

    def expand(carry, i):
        tokens_BK, scores_BK, cand_BK, parent_BK, anc_BKR, state = carry
        logprobs_BKV, state = step(Frontier(tokens_BK, i, parent_BK, anc_BKR), state)
        child_score_BKK, child_idx_BKK = best(logprobs_BKV, k)
        cum_BC = (child_score_BKK + scores_BK[:, :, None]).reshape(b, k * k)
        child_token_BC = to_token(child_idx_BKK).astype(jnp.int32).reshape(b, k * k)
        next_scores_BK, pick_BK = lax.top_k(cum_BC, k)
        next_parent_BK = (pick_BK // k).astype(jnp.int32)
        next_tokens_BK = jnp.take_along_axis(child_token_BC, pick_BK, axis=1)
        next_cand_BK = (k + i * k * k + pick_BK).astype(jnp.int32)
        # A new frontier node sees its parent's ancestors and its own slot (none after the last step).
        own_BKR = jax.nn.one_hot((i + 1) * k + slots_K, r, dtype=jnp.bool_)[None]
        next_anc_BKR = jnp.take_along_axis(anc_BKR, next_parent_BK[:, :, None], axis=1) | own_BKR
        carry = (next_tokens_BK, next_scores_BK, next_cand_BK, next_parent_BK, next_anc_BKR, state)
        return carry, (cum_BC, child_token_BC, cand_BK)

    carry = (token0_BK, score0_BK, jnp.broadcast_to(slots_K, (b, k)), jnp.zeros((b, k), jnp.int32), anc0_BKR, state)
    carry, (cum_DBC, token_DBC, expanded_DBK) = lax.scan(expand, carry, jnp.arange(d, dtype=jnp.int32))
    state = carry[-1]

    # All candidates, in the original's numbering.
    scores_BC = jnp.concatenate([score0_BK, jnp.moveaxis(cum_DBC, 0, 1).reshape(b, d * k * k)], axis=1)
    tokens_BC = jnp.concatenate([token0_BK, jnp.moveaxis(token_DBC, 0, 1).reshape(b, d * k * k)], axis=1)
    expanded_BR = jnp.moveaxis(expanded_DBK, 0, 1).reshape(b, r)  # candidate run at slot s
    parent_cand_BC = jnp.concatenate([jnp.full((b, k), -1, jnp.int32), jnp.repeat(expanded_BR, k, axis=1)], axis=1)
    c = scores_BC.shape[1]
    slot_of_cand_BC = jnp.full((b, c), -1, jnp.int32).at[rows_B1, expanded_BR].set(jnp.arange(r, dtype=jnp.int32))

    # The T-1 best at once (ancestor-closed), renumbered by candidate index (topological).
    _, chosen_BM = lax.top_k(scores_BC, t - 1)
    chosen_BM = jnp.sort(chosen_BM, axis=1).astype(jnp.int32)
    node_of_cand_BC = jnp.full((b, c), -1, jnp.int32).at[rows_B1, chosen_BM].set(jnp.arange(1, t, dtype=jnp.int32))
    pc_BM = jnp.take_along_axis(parent_cand_BC, chosen_BM, axis=1)
    parents_BM = jnp.where(pc_BM < 0, 0, jnp.take_along_axis(node_of_cand_BC, jnp.maximum(pc_BM, 0), axis=1))

    def with_root(root_value, x_BM):
        return jnp.concatenate([jnp.broadcast_to(jnp.asarray(root_value, x_BM.dtype), (b, 1)), x_BM], axis=1)

    tree = DynamicTree(
        tokens=with_root(0, jnp.take_along_axis(tokens_BC, chosen_BM, axis=1)).at[:, 0].set(root_B.astype(jnp.int32)),
        parents=with_root(-1, parents_BM),
        scores=with_root(0.0, jnp.take_along_axis(scores_BC, chosen_BM, axis=1)),
        depths=with_root(0, candidate_depths(spec)[chosen_BM]),
        candidate=with_root(-1, chosen_BM),
        expanded_slot=with_root(-1, jnp.take_along_axis(slot_of_cand_BC, chosen_BM, axis=1)),
    )
    return tree, state
