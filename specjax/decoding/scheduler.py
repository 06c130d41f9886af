"""DSpark's hardware-aware prefix scheduler: how much of each row's draft one verify round checks.

A block drafter (DSpark) attaches to each draft node k its confidence c_k = P(node k is
accepted | its prefix is accepted). Row r's j-th draft then lies on the accepted path with
probability a_{r,j} = prod_{i<=j} c_{r,i}, so verifying row r's first L drafts is worth
1 + sum_{j<=L} a_{r,j} tokens in expectation (the 1: the bonus token every round gives).

Algorithm 1 (DSpark, `prefix_schedule`): sort every (r, j) by a descending; start with one
verified token per active row (B = tau = R); admit one (r, j) at a time: B += 1, tau += a,
Theta = tau x SPS(B), SPS = the device's verify steps/s at B verified tokens; stop at the
first admission that does not raise Theta. Cumulative products never rise along a row and
ties are broken by position (stable sort of the row-major order), so each row's admitted
drafts are a prefix 1..len_r.

Losslessness: admission reads only the drafter's confidences (and which rows are active,
decided by earlier rounds), never this round's target outputs. Verifying a shorter prefix
of a chain is ordinary verification of a shorter draft: greedy keeps the target's argmax
path, and rejection sampling with the drafter's q over the admitted nodes is still exact;
nodes past a row's prefix are marked invalid, so verification stops there.

What verification costs. Design (a), kept: the loop compiles a few verify widths (1, 2,
4, 8, ..., N nodes per row) and picks one per round with `lax.switch`; every row of the
padded batch pays that width. A per-row prefix then saves nothing inside the width, and the
round costs verify(batch x width), not verify(verified tokens). `width_schedule` therefore
maximises Algorithm 1's objective (expected tokens x steps/s) at the cost actually paid: for
each compiled width w, tau(w) = sum over active rows of 1 + sum_{j<w} a_{r,j} (every draft
that fits is admitted: more tokens at the same cost), Theta(w) = tau(w) / seconds(batch x w),
and takes the best w. Deviation from Algorithm 1, stated: the admitted set for a width is
"all drafts that fit" rather than a prefix of the a-sorted order, and the search is over
widths rather than stopping at the first single-token non-improvement (with a step cost the
first token that needs a wider pass raises the cost by a whole step, so Algorithm 1's stop
rule would end there even when filling the wider pass pays off). `prefix_schedule` stays the
exact Algorithm 1 and runs in the loop as scheduler="prefix" (width = the smallest compiled
width holding every admitted prefix), which is what a packed verify (design (b): all rows'
admitted tokens packed into one [1, T] pass, each attending to its own row's cache) would pay
for. scripts/bench_scheduler.py measures both rules end to end and the packed forward's
cost against (a)'s padded one at the same admitted totals.

Costs are arrays so the scheduler runs inside the jitted loop: seconds_T[t] = seconds of
one verify round with t tokens in the pass (t = 0 .. T_max; entry 0 unused), tabulated from
a measured `Profile` or a roofline by `cost_table`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def cumulative_confidence(confidence_BK: jax.Array) -> jax.Array:
    """a_BK = prod_{i<=j} c_{r,i}, float32, with c clipped to [0, 1] (NaN counts as 0: never admitted)."""
    c_BK = jnp.clip(jnp.nan_to_num(confidence_BK.astype(jnp.float32), nan=0.0), 0.0, 1.0)
    return jnp.cumprod(c_BK, axis=1)


def prefix_schedule(confidence_BK: jax.Array, active_B: jax.Array, seconds_T: jax.Array) -> jax.Array:
    """Algorithm 1: int32 [B] drafts admitted per row (0..K); finished rows admit nothing and count nothing.

    confidence_BK: the drafter's c for drafts 1..K; active_B: rows still generating;
    seconds_T: [T_max + 1] verify-round seconds at t verified tokens (needs T_max >= B x (K + 1)).
    Theta_i = tau_i / seconds(B_i); admission i is kept iff Theta rose at every step up to i.
    """
    b, k = confidence_BK.shape
    a_BK = cumulative_confidence(confidence_BK)
    active_B = active_B.astype(jnp.bool_)
    eligible_BK = jnp.broadcast_to(active_B[:, None], (b, k))
    # Sort key: a descending, ineligible entries last; stable, so equal a keeps row-major order (j before j+1).
    key_M = jnp.where(eligible_BK, a_BK, -1.0).reshape(-1)
    order_M = jnp.argsort(-key_M, stable=True)
    a_M = a_BK.reshape(-1)[order_M]
    ok_M = eligible_BK.reshape(-1)[order_M]
    rows = jnp.sum(active_B, dtype=jnp.int32)
    tokens_M = rows + 1 + jnp.arange(b * k, dtype=jnp.int32)  # B after admission i
    tau_M = rows.astype(jnp.float32) + jnp.cumsum(jnp.where(ok_M, a_M, 0.0))
    top = seconds_T.shape[0] - 1
    theta_M = tau_M / seconds_T[jnp.minimum(tokens_M, top)]
    theta0 = rows.astype(jnp.float32) / seconds_T[jnp.clip(rows, 1, top)]
    prev_M = jnp.concatenate([theta0[None], theta_M[:-1]])
    improved_M = ok_M & (theta_M > prev_M)
    admitted = jnp.sum(jnp.cumprod(improved_M.astype(jnp.int32)))  # admissions before the first non-improvement
    take_M = jnp.arange(b * k) < admitted
    row_M = order_M // k
    return jnp.zeros((b,), jnp.int32).at[row_M].add(take_M.astype(jnp.int32))


def width_schedule(confidence_BK: jax.Array, active_B: jax.Array, seconds_T: jax.Array,
                   widths: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """Design (a): (index into `widths` [], drafts admitted per row int32 [B]) maximising tau / seconds(B x w).

    widths: the compiled verify widths (nodes per row, root included), ascending, widths[0] = 1.
    Every active row admits min(K, w - 1) drafts; finished rows admit nothing. Ties go to the narrower width.
    """
    b, k = confidence_BK.shape
    a_BK = cumulative_confidence(confidence_BK)
    active_B = active_B.astype(jnp.bool_)
    gain_K = jnp.sum(jnp.where(active_B[:, None], a_BK, 0.0), axis=0)  # expected tokens from position j, all rows
    tau_J = jnp.sum(active_B, dtype=jnp.float32) + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(gain_K)])
    w_W = np.asarray(widths)
    top = seconds_T.shape[0] - 1
    tau_W = tau_J[np.minimum(w_W - 1, k)]
    theta_W = tau_W / seconds_T[np.minimum(b * w_W, top)]
    choice = jnp.argmax(theta_W).astype(jnp.int32)  # first maximum: the narrowest of equals
    len_B = jnp.where(active_B, jnp.minimum(jnp.asarray(w_W)[choice] - 1, k), 0).astype(jnp.int32)
    return choice, len_B


def verify_widths(num_nodes: int) -> tuple[int, ...]:
    """The compiled widths for a chain of num_nodes (root included): 1, 2, 4, ... below it, and num_nodes."""
    if num_nodes < 1:
        raise ValueError(f"a draft has at least its root node, got num_nodes={num_nodes}")
    out, w = [], 1
    while w < num_nodes:
        out.append(w)
        w *= 2
    return tuple(out) + (num_nodes,)


def width_for(len_B: jax.Array, widths: Sequence[int]) -> jax.Array:
    """Index of the smallest width holding every row's root plus admitted prefix (len + 1 nodes)."""
    need = jnp.max(len_B) + 1
    return jnp.sum(jnp.asarray(widths) < need).astype(jnp.int32)


def cost_table(verify_s: Callable[[int, float], float], batch: int, num_nodes: int,
               overhead_s: float = 0.0) -> np.ndarray:
    """float32 [batch x num_nodes + 1]: seconds of one round with t tokens in the verify pass, t = 0..T_max.

    verify_s(batch, nodes) is a cost model's (specjax/planning/profile.py: Roofline, Profile); t tokens at this
    batch are nodes = t / batch per row. overhead_s: the round's cost that does not follow admission
    (drafting the whole block, the loop's bookkeeping); without it a cheap narrow pass looks better than it
    is. Made non-decreasing in t (more tokens never cost less), entry 0 = entry 1 (never used).
    """
    t_T = np.arange(batch * num_nodes + 1)
    secs = np.array([verify_s(batch, max(t, 1) / batch) + overhead_s for t in t_T], np.float64)
    if not np.all(np.isfinite(secs)) or np.any(secs <= 0):
        raise ValueError("a verify cost curve must be positive and finite at every token count")
    return np.maximum.accumulate(secs).astype(np.float32)
