"""One-pass draft trees for block drafters (DFlash, DSpark): JetSpec's best-first tree under jit.

JetSpec (hao-ai-lab/JetSpec, `jetspec/tree/baselines/accum_logp.py`, `_build_from_topk`) grows a
tree from a block's per-depth distributions: every node at depth d gets the top K tokens of the
depth-(d+1) distribution as children, and a heap pops nodes in decreasing cumulative
log-probability, each popped node (of depth below the deepest) adding its K children (the last
one only as many as the budget leaves), until the tree has `budget` nodes. Nodes are numbered in
creation order: the root, then the children of the 1st, 2nd, ... popped node.

The same tree without a heap, for `DynamicTreeSpec(top_k=K, depth=D, total_tokens=T)` (the spec
EAGLE-3's dynamic trees use; paths reach L = D + 1 drafted tokens, as there):
- E = ceil((T - 1) / K) nodes are expanded, and scores fall along a path (log-probabilities <= 0),
  so the expanded nodes are the E best nodes of depth < L: what the heap pops, in that order.
- A level-wise beam of E finds them: the E best nodes of depth d are children of the E best of
  depth d - 1 (a node's parent scores at least as much as the node, and every parent at depth
  d - 1 that beats it has a child that beats the node: with per-depth children, its rank-0 child;
  with per-parent children (DSpark's Markov step, `children` below) the argument is the heap's
  own: E better nodes at depth d - 1 give E better candidates). So L beams of E, then the E
  best of those L * E, sorted by score (ties: lower depth, then beam rank: parents first).
- Expanded node i's children are nodes 1 + i*K + j (j < K, and < T): the heap's numbering. A
  parent is always popped before its child, so node order is topological.
Given the same per-depth top-K tokens and log-probabilities the tree (tokens, parents, depths,
cumulative log-probabilities, node order) is JetSpec's; only exact score ties may order differently.

Shapes are fixed (T nodes every round); with `total_tokens - 1 <= top_k + depth * top_k**2` (the
spec's own check) the full K-ary tree of depth L always has enough nodes, so every node is real.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from specjax.decoding.tree import DynamicTreeSpec, TreeSpec, child_ranks

# children(level, parent_tokens_BE) -> (child log-probabilities [B, E, K] in decreasing order, child tokens [B, E, K])
# for nodes at depth `level` (a traced int32); the children sit at depth level + 1.
ChildrenFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockTree:
    """A Draft-ready tree per row: node 0 the root, parents earlier than children."""

    tokens: jax.Array  # int32 [B, T]
    parents: jax.Array  # int32 [B, T]; root -1
    scores: jax.Array  # float32 [B, T]: cumulative draft log-probability (root 0)
    depths: jax.Array  # int32 [B, T]: root 0


def num_expanded(spec: DynamicTreeSpec) -> int:
    """E: nodes that get children (the last one possibly fewer than top_k)."""
    return -(-(spec.total_tokens - 1) // spec.top_k)


def levels(spec: DynamicTreeSpec) -> int:
    """L: the deepest node's depth (depth + 1, as for EAGLE-3's dynamic trees); a block must draft this many."""
    return spec.depth + 1


def per_depth_children(logprobs_BLV: jax.Array, k: int) -> ChildrenFn:
    """Children that depend only on depth (DFlash; JetSpec's accum_logp): the top k of each depth's distribution.

    logprobs_BLV: log-probabilities of depths 1..L (row d - 1 is depth d)."""
    lp_BLK, tok_BLK = lax.top_k(logprobs_BLV.astype(jnp.float32), k)

    def children(level, parents_BE):
        e = parents_BE.shape[1]
        lp_BK = lax.dynamic_index_in_dim(lp_BLK, level, axis=1, keepdims=False)
        tok_BK = lax.dynamic_index_in_dim(tok_BLK, level, axis=1, keepdims=False)
        b = lp_BK.shape[0]
        return (jnp.broadcast_to(lp_BK[:, None], (b, e, k)),
                jnp.broadcast_to(tok_BK[:, None], (b, e, k)).astype(jnp.int32))

    return children


def build_block_tree(spec: DynamicTreeSpec, root_B: jax.Array, children: ChildrenFn) -> BlockTree:
    """Each row's tree of spec.total_tokens nodes (see the module docstring); `children` is traced once (a scan)."""
    k, t = spec.top_k, spec.total_tokens
    e, n_levels = num_expanded(spec), levels(spec)
    b = root_B.shape[0]
    neg_inf = jnp.float32(-jnp.inf)
    rows_B1 = jnp.arange(b)[:, None]

    def level_step(beam, level):
        tok_BE, score_BE = beam
        lp_BEK, child_BEK = children(level, tok_BE)
        lp_BEK = jnp.minimum(lp_BEK.astype(jnp.float32), 0.0)  # scores must fall along a path
        cum_BC = (score_BE[:, :, None] + lp_BEK).reshape(b, e * k)
        next_score_BE, pick_BE = lax.top_k(cum_BC, e)
        next_tok_BE = jnp.take_along_axis(child_BEK.reshape(b, e * k), pick_BE, axis=1)
        out = (tok_BE, score_BE, lp_BEK, child_BEK, (pick_BE // k).astype(jnp.int32), (pick_BE % k).astype(jnp.int32))
        return (next_tok_BE, next_score_BE), out

    tok0_BE = jnp.zeros((b, e), jnp.int32).at[:, 0].set(root_B.astype(jnp.int32))
    score0_BE = jnp.full((b, e), neg_inf).at[:, 0].set(0.0)
    _, (tok_LBE, score_LBE, lp_LBEK, child_LBEK, parent_LBE, rank_LBE) = lax.scan(
        level_step, (tok0_BE, score0_BE), jnp.arange(n_levels, dtype=jnp.int32))

    # Candidates c = level * E + beam index. A level's beam picks came from the previous level's beam.
    def flat(x_LB_, tail=()):
        return jnp.moveaxis(x_LB_, 0, 1).reshape((b, x_LB_.shape[0] * e) + tail)

    score_BC = flat(score_LBE)
    lp_BCK, child_BCK = flat(lp_LBEK, (k,)), flat(child_LBEK, (k,))
    level_C = jnp.repeat(jnp.arange(n_levels, dtype=jnp.int32), e)
    # Beam entry (level l + 1, i) is child rank_{l}[i] of beam entry (l, parent_{l}[i]): the scan's out at l.
    parent_cand_BC = jnp.concatenate(
        [jnp.full((b, e), -1, jnp.int32),
         flat(parent_LBE[:-1] + (jnp.arange(n_levels - 1, dtype=jnp.int32) * e)[:, None, None])],
        axis=1)
    rank_BC = jnp.concatenate([jnp.zeros((b, e), jnp.int32), flat(rank_LBE[:-1])], axis=1)

    # The E best candidates, best first (lax.top_k: ties to the lower index, a parent's).
    _, expanded_BE = lax.top_k(score_BC, e)
    expanded_BE = expanded_BE.astype(jnp.int32)
    order_of_cand_BC = jnp.full((b, n_levels * e), -1, jnp.int32).at[rows_B1, expanded_BE].set(
        jnp.arange(e, dtype=jnp.int32))
    pc_BE = jnp.take_along_axis(parent_cand_BC, expanded_BE, axis=1)
    parent_order_BE = jnp.take_along_axis(order_of_cand_BC, jnp.maximum(pc_BE, 0), axis=1)
    node_BE = jnp.where(pc_BE < 0, 0, 1 + parent_order_BE * k + jnp.take_along_axis(rank_BC, expanded_BE, axis=1))

    def of_expanded(x_BC, tail):
        idx = expanded_BE.reshape((b, e) + (1,) * len(tail))
        return jnp.take_along_axis(x_BC, idx, axis=1)

    child_tok_BM = of_expanded(child_BCK, (k,)).reshape(b, e * k)[:, :t - 1]
    child_score_BM = (of_expanded(score_BC, ())[:, :, None] + of_expanded(lp_BCK, (k,))).reshape(b, e * k)[:, :t - 1]
    child_depth_BM = jnp.repeat(level_C[expanded_BE] + 1, k, axis=1)[:, :t - 1]
    child_parent_BM = jnp.repeat(node_BE, k, axis=1)[:, :t - 1]

    def with_root(value, x_BM):
        return jnp.concatenate([jnp.broadcast_to(jnp.asarray(value, x_BM.dtype), (b, 1)), x_BM], axis=1)

    return BlockTree(
        tokens=with_root(0, child_tok_BM).at[:, 0].set(root_B.astype(jnp.int32)),
        parents=with_root(-1, child_parent_BM),
        scores=with_root(0.0, child_score_BM),
        depths=with_root(0, child_depth_BM),
    )


def static_block_tree(spec: TreeSpec, root_B: jax.Array, children: ChildrenFn) -> jax.Array:
    """int32 [B, N]: a static template's tokens from one block pass: node i is its parent's rank-r child (r its rank
    among its siblings), level by level (a parent's token is known before its children's). The chain is the
    rank-0 spine; `calibration` uses such templates to measure per-depth, per-rank acceptance."""
    ranks, depths = child_ranks(spec), spec.depths
    width = max(ranks) + 1
    tokens = {0: root_B.astype(jnp.int32)}
    for d in range(1, spec.max_depth + 1):
        level = [i for i in range(spec.num_nodes) if depths[i] == d]
        parents_BM = jnp.stack([tokens[spec.parents[i]] for i in level], axis=1)
        _, tok_BMW = children(jnp.int32(d - 1), parents_BM)
        if tok_BMW.shape[-1] < width:
            raise ValueError(f"tree {spec.parents} gives a node {width} children; the drafter scored {tok_BMW.shape[-1]}")
        for m, i in enumerate(level):
            tokens[i] = tok_BMW[:, m, ranks[i]]
    return jnp.stack([tokens[i] for i in range(spec.num_nodes)], axis=1)
