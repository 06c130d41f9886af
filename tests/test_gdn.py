"""The Gated DeltaNet delta rule in its three forms, against transformers' reference functions (fp32), and the
tree form and commit against the recurrence run along each root-to-node path."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from specjax.decoding.tree import ancestor_mask, parse_tree, spec_arrays
from specjax.models import gdn
from specjax.models.cache import HybridCache, KVCache, NodeResults

B, HK, HV, DK, DV = 2, 2, 4, 16, 8
ATOL = 2e-6


def inputs(t: int, seed: int = 0):
    """q, k [B, T, Hk, DK], v [B, T, Hv, DV], g, beta [B, T, Hv] (g <= 0, beta in (0, 1)), S0 [B, Hv, DK, DV]."""
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(B, t, HK, DK)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(B, t, HV, DV)).astype(np.float32)
    g = (-0.3 * np.abs(rng.normal(size=(B, t, HV)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, t, HV))))).astype(np.float32)
    s0 = (0.1 * rng.normal(size=(B, HV, DK, DV))).astype(np.float32)
    return q, k, v, g, beta, s0


def prepared(q, k):
    """q, k as the layer hands them to the rule: L2-normed, on the value heads, q scaled."""
    qn = gdn.expand_heads(gdn.l2_normalize(jnp.asarray(q)), HV) * DK ** -0.5
    return qn, gdn.expand_heads(gdn.l2_normalize(jnp.asarray(k)), HV)


def reference(fn, q, k, v, g, beta, s0):
    out, state = fn(*(torch.tensor(x) for x in (q, k, v)), g=torch.tensor(g), beta=torch.tensor(beta),
                    initial_state=torch.tensor(s0), output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out.numpy(), state.numpy()


@pytest.mark.parametrize("t", [1, 5, 64, 150])
def test_chunked_rule_equals_transformers_chunked_and_recurrent(t):
    q, k, v, g, beta, s0 = inputs(t)
    qn, kn = prepared(q, k)
    out, state = gdn.chunked_rule(qn, kn, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0))
    for fn in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        ref_out, ref_state = reference(fn, q, k, v, g, beta, s0)
        np.testing.assert_allclose(np.asarray(out), ref_out, atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.asarray(state), ref_state, atol=ATOL, rtol=0)


def test_recurrent_steps_equal_transformers_recurrent():
    q, k, v, g, beta, s0 = inputs(12, seed=1)
    qn, kn = prepared(q, k)
    state, outs = jnp.asarray(s0), []
    for t in range(12):
        o, state = gdn.recurrent_step(qn[:, t], kn[:, t], jnp.asarray(v[:, t]), jnp.asarray(g[:, t]),
                                      jnp.asarray(beta[:, t]), state)
        outs.append(o)
    ref_out, ref_state = reference(torch_recurrent_gated_delta_rule, q, k, v, g, beta, s0)
    np.testing.assert_allclose(np.stack(outs, 1), ref_out, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(state), ref_state, atol=ATOL, rtol=0)


def test_padded_tokens_leave_the_state_alone():
    """beta = 0 and g = 0 past a row's length (right padding): the state after is the state at the length."""
    q, k, v, g, beta, s0 = inputs(40, seed=2)
    qn, kn = prepared(q, k)
    g[:, 25:], beta[:, 25:] = 0.0, 0.0
    _, padded = gdn.chunked_rule(qn, kn, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0))
    _, exact = gdn.chunked_rule(qn[:, :25], kn[:, :25], jnp.asarray(v[:, :25]), jnp.asarray(g[:, :25]),
                                jnp.asarray(beta[:, :25]), jnp.asarray(s0))
    np.testing.assert_allclose(np.asarray(padded), np.asarray(exact), atol=ATOL, rtol=0)


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Each node's root-to-node path of node indices."""
    paths = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
    return paths


TREES = ["chain:5", "kary:2,2,1", [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]]


@pytest.mark.parametrize("tree", TREES, ids=["chain", "kary", "irregular"])
def test_tree_block_follows_each_path_and_commit_takes_the_accepted_one(tree):
    """Every node's output is the recurrence's along its path; commit's state and conv window after an accepted
    path are the recurrence's and the conv's after that path's tokens."""
    spec = parse_tree(tree, None)
    parents_BN = spec_arrays(spec, B)
    mask_BNN = ancestor_mask(parents_BN)
    n = parents_BN.shape[1]
    q, k, v, g, beta, s0 = inputs(n, seed=3)
    qn, kn = prepared(q, k)
    out, v_new, cum = gdn.masked_block(qn, kn, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0),
                                       mask_BNN)
    rng = np.random.default_rng(4)
    c, kernel = 6, 4
    x_BNC = rng.normal(size=(B, n, c)).astype(np.float32)
    window_BKC = rng.normal(size=(B, kernel - 1, c)).astype(np.float32)
    w_KC = rng.normal(size=(kernel, c)).astype(np.float32)
    conv = np.asarray(gdn.conv_tree(jnp.asarray(x_BNC), jnp.asarray(window_BKC), jnp.asarray(w_KC), mask_BNN))
    paths = tree_paths(np.asarray(parents_BN[0]).tolist())
    for node, path in enumerate(paths):
        sub = [x[:, path] for x in (q, k, v, g, beta)]
        ref_out, ref_state = reference(torch_recurrent_gated_delta_rule, *sub, s0)
        np.testing.assert_allclose(np.asarray(out[:, node]), ref_out[:, -1], atol=ATOL, rtol=0)
        # the conv along the path, as transformers runs it over window ++ path tokens
        seq = np.concatenate([window_BKC, x_BNC[:, path]], axis=1).transpose(0, 2, 1)
        ref_conv = causal_conv1d_fn(torch.tensor(seq), torch.tensor(w_KC.T), activation="silu").numpy()
        np.testing.assert_allclose(conv[:, node], ref_conv[:, :, -1], atol=1e-5, rtol=0)
        # commit of this path
        path_BN = jnp.asarray([path + [0] * (n - len(path))] * B, jnp.int32)
        num_B = jnp.full((B,), len(path), jnp.int32)
        cache = HybridCache(KVCache((jnp.zeros((B, 8, 1, 2)),), (jnp.zeros((B, 8, 1, 2)),), jnp.zeros(B, jnp.int32)),
                            (jnp.asarray(window_BKC),), (jnp.asarray(s0),),
                            (NodeResults(jnp.asarray(x_BNC), kn.transpose(0, 2, 1, 3), v_new, cum),))
        committed = cache.commit(path_BN, num_B)
        np.testing.assert_allclose(np.asarray(committed.state[0]), ref_state, atol=ATOL, rtol=0)
        full = np.concatenate([window_BKC, x_BNC[:, path]], axis=1)
        np.testing.assert_array_equal(np.asarray(committed.conv[0]), full[:, -(kernel - 1):])
        assert committed.nodes is None and np.asarray(committed.lengths).tolist() == [len(path)] * B


def test_commit_of_nothing_keeps_the_state():
    """A finished row (nothing accepted) keeps its state and conv window."""
    n = 3
    q, k, v, g, beta, s0 = inputs(n, seed=5)
    qn, kn = prepared(q, k)
    mask = ancestor_mask(jnp.asarray([[-1, 0, 1]] * B, jnp.int32))
    _, v_new, cum = gdn.masked_block(qn, kn, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0), mask)
    window = jnp.ones((B, 3, 6))
    cache = HybridCache(KVCache((jnp.zeros((B, 8, 1, 2)),), (jnp.zeros((B, 8, 1, 2)),), jnp.zeros(B, jnp.int32)),
                        (window,), (jnp.asarray(s0),), (NodeResults(jnp.zeros((B, n, 6)), kn.transpose(0, 2, 1, 3),
                                                                    v_new, cum),))
    committed = cache.commit(jnp.asarray([[0, 1, 2], [0, 0, 0]], jnp.int32), jnp.asarray([3, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(committed.state[0][1]), s0[1])
    np.testing.assert_array_equal(np.asarray(committed.conv[0][1]), np.ones((3, 6)))
    assert not np.allclose(np.asarray(committed.state[0][0]), s0[0])
