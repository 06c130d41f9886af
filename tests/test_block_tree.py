"""One-pass block trees (decoding/block_tree.py) where children depend on their parent (DSpark's Markov step).

JetSpec's own code is the reference for per-depth children (tests/test_jetspec.py); its heap assumes them.
Here each node's children come from a table indexed by (depth, parent token), and the jit-friendly beam must
still pick what a best-first heap over that tree picks (same expansion rule as JetSpec's `_build_from_topk`).
"""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding.block_tree import build_block_tree, levels
from specjax.decoding.tree import DynamicTreeSpec

V = 12


def heap_tree(root: int, lp_LVV: np.ndarray, k: int, budget: int, n_levels: int):
    """Best-first expansion: pop the best node, add its top-k children (per its own token), until budget nodes."""
    tokens, parents, depths, scores = [root], [-1], [0], [0.0]
    heap, counter = [(0.0, 0, 0)], 0
    while heap and len(tokens) < budget:
        neg, _, i = heapq.heappop(heap)
        if depths[i] >= n_levels:
            continue
        row = lp_LVV[depths[i], tokens[i]]
        for j in np.argsort(-row, kind="stable")[:min(k, budget - len(tokens))]:
            counter += 1
            heapq.heappush(heap, (neg - row[j], counter, len(tokens)))
            tokens.append(int(j)), parents.append(i), depths.append(depths[i] + 1), scores.append(-neg + row[j])
    return tokens, parents, depths, scores


@pytest.mark.parametrize("k, depth, total", [(3, 3, 20), (2, 4, 19), (4, 2, 30), (1, 3, 5)])
def test_parent_conditioned_children_match_a_best_first_heap(k, depth, total):
    spec = DynamicTreeSpec(k, depth, total)
    n_levels = levels(spec)
    lp_BLVV = jax.nn.log_softmax(2.0 * jax.random.normal(jax.random.key(k * 100 + depth), (2, n_levels, V, V)), -1)

    def children(level, parents_BE):
        table_BVV = jax.lax.dynamic_index_in_dim(lp_BLVV, level, axis=1, keepdims=False)
        rows_BEV = jnp.take_along_axis(table_BVV, parents_BE[:, :, None], axis=1)
        return jax.lax.top_k(rows_BEV, k)

    tree = jax.jit(lambda r: build_block_tree(spec, r, children))(jnp.array([3, 7]))
    for b, root in enumerate((3, 7)):
        tokens, parents, depths, scores = heap_tree(root, np.asarray(lp_BLVV[b]), k, total, n_levels)
        np.testing.assert_array_equal(tree.tokens[b], tokens)
        np.testing.assert_array_equal(tree.parents[b], parents)
        np.testing.assert_array_equal(tree.depths[b], depths)
        np.testing.assert_allclose(tree.scores[b], scores, atol=1e-5)


def test_a_256_node_block_tree_verifies_with_the_pallas_kernel_as_with_xla():
    """JetSpec's budget (K 7, 15 depths, 256 nodes): the tree's ancestor mask through the Pallas tree-attention
    kernel (interpret mode on CPU, compiled on a GPU) equals the XLA reference."""
    from specjax.decoding.block_tree import per_depth_children
    from specjax.decoding.tree import ancestor_mask
    from specjax.kernels import tree_attention, tree_attention_reference

    spec = DynamicTreeSpec(top_k=7, depth=14, total_tokens=256)
    lp_BLV = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (1, levels(spec), 64)), -1)
    tree = build_block_tree(spec, jnp.array([1]), per_depth_children(lp_BLV, 7))
    mask_BNN = ancestor_mask(tree.parents)
    assert int(tree.depths.max()) > 3 and mask_BNN.shape == (1, 256, 256)
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (1, 256, 2, 16))
    k, v = jax.random.normal(kk, (1, 288, 1, 16)), jax.random.normal(kv, (1, 288, 1, 16))
    lengths = jnp.array([29], jnp.int32)
    out = tree_attention(q, k, v, lengths, mask_BNN, interpret=jax.default_backend() != "gpu")
    np.testing.assert_allclose(out, tree_attention_reference(q, k, v, lengths, mask_BNN), atol=1e-5, rtol=1e-5)


# ---- pricing (planning/block_trees.py) -------------------------------------------------------------------------


def test_expected_template_is_the_best_first_tree_on_acceptance():
    from specjax.planning.block_trees import caterpillar, expected_template
    from specjax.planning.planner import expected_tau

    p_DR = np.array([[0.8, 0.1], [0.5, 0.3]])
    # Root's 2 children (reach .8, .1); expand .8: children .4, .24; then .4 (depth 2 = the last level: not
    # expanded... it is depth 2 of 2 levels), so the next pop with depth < 2 is .1: its children .05, .03.
    tree = expected_template(DynamicTreeSpec(2, 1, 7), p_DR)
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 2)
    assert expected_tau(tree, p_DR) == pytest.approx(1 + .8 + .1 + .4 + .24 + .05 + .03)
    assert caterpillar(2, 3).parents == (-1, 0, 0, 1, 1, 3, 3)


def test_one_pass_trees_grow_at_light_load_and_give_way_under_load():
    """A roofline-shaped verify cost (flat until batch x nodes passes a knee, then linear): the planner picks a
    wide tree of JetSpec's budget at batch 1, smaller ones as the batch grows, and a short chain beats them all at
    batch 64."""
    from specjax.planning.block_trees import best_block_tree
    from specjax.planning.planner import plan

    p_DR = np.array([[0.7, 0.12, 0.05, 0.03]] * 15)
    verify_s = lambda b, n: 1e-3 * max(1.0, b * n / 256)  # noqa: E731
    draft_s = lambda b, d: 2e-4 * max(1.0, b / 16)  # noqa: E731
    trees = [best_block_tree(p_DR, b, verify_s, draft_s) for b in (1, 4, 16, 64)]
    assert [t.shape.nodes for t in trees] == [256, 64, 16, 8]  # JetSpec's budget alone, then shrinking
    assert trees[0].shape.spec.top_k == 7 and trees[0].speedup > 4
    chain_under_load = plan(p_DR[0], [64], verify_s, draft_s, tree_ok=False, max_chain=15)[0].best
    assert chain_under_load.shape.label == "chain:3" and chain_under_load.speedup > trees[-1].speedup
