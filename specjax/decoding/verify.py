"""Acceptance of a draft tree by the target: greedy, and lossless stochastic.

Input: the draft (tokens, parents, optional draft distributions q, valid mask) and the
target's distribution after every node. Output: the accepted path (node indices from
the root), its length, and the bonus token the target adds after it.

Greedy keeps the deepest node whose whole ancestry matches the target's argmax, so the
output equals plain greedy decoding. Stochastic acceptance is recursive rejection
sampling: at the current node try its children in index order, accept child c with
probability min(1, p(x_c) / q_c(x_c)); on rejection replace p by norm(max(0, p - q_c))
(for a deterministic draft q_c is one-hot and this zeroes p(x_c)); when no child is
accepted, sample the bonus from what is left of p. This keeps the target's distribution
exactly, for chains and trees alike.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from specjax.config import SamplingConfig
from specjax.decoding.sampling import RowSampling, sample_rows, sampling_probs, split_rows, uniform_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Draft:
    """A fixed-shape draft. Node 0 is the root: the last chosen token, not yet in the target's cache."""

    tokens: jax.Array  # int32 [B, N]
    parents: jax.Array  # int32 [B, N]; root -1, others an earlier node
    valid: jax.Array  # bool [B, N]; a row may use fewer than N nodes (root always valid)
    q: jax.Array | None = None  # float32 [B, N, V]: distribution node i was drawn from; None = deterministic
    confidence: jax.Array | None = None  # float32 [B, N]: drafter's P(accept node | its prefix accepted)
    # float32 [B, N, V]: the logits node i was chosen from (target vocabulary, -inf outside a reduced draft
    # vocabulary; node 0 unused). Only drafts proposed with Settings(record_logits=True) carry them.
    logits: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verdict:
    path: jax.Array  # int32 [B, N]: accepted node indices, path[:, 0] = 0 (root); entries >= num_accepted are 0
    num_accepted: jax.Array  # int32 [B]: nodes on the path including the root (1 = no draft accepted)
    bonus: jax.Array  # int32 [B]: the target's token after the last accepted node


def path_to_node(mask_BNN: jax.Array, node_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Root-to-node path as node indices [B, N] (padded with 0) and its length [B], from the ancestor mask."""
    n = mask_BNN.shape[-1]
    on_path_BN = jnp.take_along_axis(mask_BNN, node_B[:, None, None], axis=1)[:, 0]
    length_B = jnp.sum(on_path_BN, axis=-1, dtype=jnp.int32)
    # Ancestors have smaller indices than descendants, so sorting the on-path indices gives root -> node.
    keys_BN = jnp.where(on_path_BN, jnp.arange(n), n)
    path_BN = jnp.sort(keys_BN, axis=-1)
    return jnp.where(path_BN == n, 0, path_BN).astype(jnp.int32), length_B


def verify_greedy(draft: Draft, mask_BNN: jax.Array, target_logits_BNV: jax.Array) -> Verdict:
    """Accept the deepest node whose ancestors all equal the target's argmax at their parents."""
    choice_BN = jnp.argmax(target_logits_BNV, axis=-1).astype(jnp.int32)
    parent_choice_BN = jnp.take_along_axis(choice_BN, jnp.maximum(draft.parents, 0), axis=1)
    ok_BN = (draft.tokens == parent_choice_BN) & draft.valid
    ok_BN = ok_BN.at[:, 0].set(True)
    # A node is accepted iff every node on its root path is ok.
    accepted_BN = jnp.all(jnp.where(mask_BNN, ok_BN[:, None, :], True), axis=-1)
    depth_BN = jnp.sum(mask_BNN, axis=-1)
    best_B = jnp.argmax(jnp.where(accepted_BN, depth_BN, -1), axis=-1).astype(jnp.int32)  # first deepest
    path_BN, length_B = path_to_node(mask_BNN, best_B)
    bonus_B = jnp.take_along_axis(choice_BN, best_B[:, None], axis=1)[:, 0]
    return Verdict(path_BN, length_B, bonus_B)


def verify_sampled(draft: Draft, mask_BNN: jax.Array, target_logits_BNV: jax.Array,
                   sampling: SamplingConfig | RowSampling,
                   keys_B: jax.Array) -> Verdict:
    """Recursive rejection sampling over the tree in node order (children follow their parent).

    keys_B: one PRNG key per row, so a row's verdict depends on its own key only.
    """
    b, n, _ = target_logits_BNV.shape
    p_BNV = sampling_probs(target_logits_BNV, sampling)
    u_keys_B, bonus_keys_B = split_rows(keys_B, 2)
    u_BN = uniform_rows(u_keys_B, (b, n))
    rows = jnp.arange(b)

    def step(carry, j):
        cur_B, p_BV = carry
        tok_B = draft.tokens[:, j]
        is_child_B = (draft.parents[:, j] == cur_B) & draft.valid[:, j]
        p_tok_B = p_BV[rows, tok_B]
        if draft.q is None:
            ratio_B = p_tok_B
            residual_BV = p_BV.at[rows, tok_B].set(0.0)
        else:
            q_BV = draft.q[:, j]
            ratio_B = p_tok_B / jnp.maximum(q_BV[rows, tok_B], 1e-30)
            residual_BV = jnp.maximum(p_BV - q_BV, 0.0)
        mass_B = jnp.sum(residual_BV, axis=-1, keepdims=True)
        # Rejection has probability ~0 when the residual mass is ~0; keep p rather than divide by 0.
        residual_BV = jnp.where(mass_B > 1e-9, residual_BV / jnp.maximum(mass_B, 1e-30), p_BV)
        accept_B = is_child_B & (u_BN[:, j] < ratio_B)
        reject_B = is_child_B & ~accept_B
        new_p_BV = jnp.where(accept_B[:, None], p_BNV[:, j], jnp.where(reject_B[:, None], residual_BV, p_BV))
        return (jnp.where(accept_B, j, cur_B), new_p_BV), None

    (last_B, p_BV), _ = lax.scan(step, (jnp.zeros((b,), jnp.int32), p_BNV[:, 0]), jnp.arange(1, n))
    bonus_B = sample_rows(bonus_keys_B, p_BV)
    path_BN, length_B = path_to_node(mask_BNN, last_B)
    return Verdict(path_BN, length_B, bonus_B)


def verify(draft: Draft, mask_BNN: jax.Array, target_logits_BNV: jax.Array, sampling: SamplingConfig | RowSampling,
           keys_B: jax.Array) -> Verdict:
    """Greedy acceptance for a greedy SamplingConfig (the compiled greedy path), else rejection sampling against
    each row's own sampling distribution (a greedy row's is one-hot at its argmax, so it accepts exactly the
    greedy drafts)."""
    if isinstance(sampling, SamplingConfig) and sampling.greedy:
        return verify_greedy(draft, mask_BNN, target_logits_BNV)
    return verify_sampled(draft, mask_BNN, target_logits_BNV, sampling, keys_B)
