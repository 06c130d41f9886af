"""Speculative-decoding statistics: a pytree the jitted loop updates every round, and its summary.

Only what a row actually emits is counted: drafts accepted after an EOS, or past the row's
token budget, are cut from the output and so are not acceptance either. Per depth the loop
records nodes offered and accepted and the accepted node's rank among its siblings (the
inputs of the planner's acceptance model), and the verified tokens (valid nodes of active
rows). Padded tokens (what the fixed-shape pass ran) and drafter passes are fixed per loop
iteration, so `summarize` derives them from the iteration count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding.verify import Draft, Verdict


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecStats:
    rounds_B: jax.Array  # int32 [B]: rounds in which the row was active
    emitted_B: jax.Array  # int32 [B]: tokens the row emitted in those rounds (prefill's token excluded)
    accepted_B: jax.Array  # int32 [B]: emitted tokens that were drafts
    offered_D: jax.Array  # int32 [D]: valid draft nodes at depth d+1 offered to active rows
    accepted_D: jax.Array  # int32 [D]: accepted (and emitted) drafts at depth d+1
    accepted_rank_DR: jax.Array  # int32 [D, R]: accepted drafts at depth d+1 that were their parent's r-th child
    verified_tokens: jax.Array  # int32 []: valid nodes (root included) of active rows, summed over rounds
    loop_rounds: jax.Array  # int32 []: iterations of the round loop (padded tokens and drafter passes follow)
    # int32 [N + 1]: with the prefix scheduler, iterations whose verify pass ran w nodes per row (index w);
    # all zero without it (every iteration then runs N).
    width_rounds_W: jax.Array
    # int32 [D, R]: as accepted_rank_DR, but every draft verification accepted, emitted or not (a row's last
    # round cut by its budget or an EOS still tells how often the target agreed): the planner's estimator.
    verified_rank_DR: jax.Array

    @classmethod
    def zeros(cls, batch: int, max_depth: int, num_nodes: int) -> "SpecStats":
        z = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
        return cls(z(batch), z(batch), z(batch), z(max_depth), z(max_depth), z(max_depth, num_nodes), z(), z(),
                   z(num_nodes + 1), z(max_depth, num_nodes))


def sibling_ranks(parents_BN: jax.Array, valid_BN: jax.Array) -> jax.Array:
    """int32 [B, N]: each node's rank among its valid siblings (earlier valid nodes with the same parent)."""
    n = parents_BN.shape[1]
    same_BNN = parents_BN[:, :, None] == parents_BN[:, None, :]
    earlier_NN = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]
    return jnp.sum(same_BNN & earlier_NN[None] & valid_BN[:, None, :], axis=-1, dtype=jnp.int32)


def record_round(stats: SpecStats, draft: Draft, depth_BN: jax.Array, verdict: Verdict, active_B: jax.Array,
                 emit_B: jax.Array) -> SpecStats:
    """Add one round. verdict.num_accepted counts the root; emit_B is what the row emitted after cuts."""
    max_depth, ranks = stats.accepted_rank_DR.shape
    drafts_B = jnp.where(active_B, jnp.minimum(verdict.num_accepted - 1, emit_B), 0)  # emitted drafts
    d_D = jnp.arange(1, max_depth + 1)
    offered_BN = draft.valid & active_B[:, None]
    offered_D = jnp.sum(offered_BN[:, :, None] & (depth_BN[:, :, None] == d_D), axis=(0, 1), dtype=jnp.int32)
    # Accepted path node j (j = 1..drafts) sits at depth j; its rank among its siblings.
    kept_BD = d_D[None, :] <= drafts_B[:, None]
    path_BD = verdict.path[:, 1: max_depth + 1]
    path_BD = jnp.pad(path_BD, ((0, 0), (0, max_depth - path_BD.shape[1])))
    rank_BD = jnp.take_along_axis(sibling_ranks(draft.parents, draft.valid), path_BD, axis=1)
    rank_BDR = rank_BD[:, :, None] == jnp.arange(ranks)
    verified_BD = d_D[None, :] <= jnp.where(active_B, verdict.num_accepted - 1, 0)[:, None]
    return SpecStats(
        rounds_B=stats.rounds_B + active_B,
        emitted_B=stats.emitted_B + jnp.where(active_B, emit_B, 0),
        accepted_B=stats.accepted_B + drafts_B,
        offered_D=stats.offered_D + offered_D,
        accepted_D=stats.accepted_D + jnp.sum(kept_BD, axis=0, dtype=jnp.int32),
        accepted_rank_DR=stats.accepted_rank_DR + jnp.sum(kept_BD[:, :, None] & rank_BDR, axis=0, dtype=jnp.int32),
        verified_tokens=stats.verified_tokens + jnp.sum(offered_BN, dtype=jnp.int32),
        loop_rounds=stats.loop_rounds + 1,
        width_rounds_W=stats.width_rounds_W,
        verified_rank_DR=stats.verified_rank_DR + jnp.sum(verified_BD[:, :, None] & rank_BDR, axis=0,
                                                          dtype=jnp.int32),
    )


def record_width(stats: SpecStats, width: jax.Array) -> SpecStats:
    """Count one iteration whose verify pass ran `width` nodes per row (the prefix scheduler's choice)."""
    return dataclasses.replace(stats, width_rounds_W=stats.width_rounds_W.at[width].add(1))


def emitted_only(stats: SpecStats, round_BO: np.ndarray, depth_BO: np.ndarray, kept_B: np.ndarray) -> SpecStats:
    """The acceptance statistics of a run whose rows keep only their first kept_B tokens (a stop string cut on
    the host after the loop emitted more): per row rounds, emitted tokens and accepted drafts, and per depth the
    accepted drafts, counted from the tokens kept (each one's round and draft depth). What the loop did (nodes
    offered and verified, iterations, sibling ranks) stays as it ran."""
    s = jax.tree.map(np.asarray, stats)
    batch, out_len = round_BO.shape
    kept_B = np.pad(np.asarray(kept_B), (0, batch - len(kept_B)))  # padding rows emit nothing
    kept_BO = np.arange(out_len)[None, :] < kept_B[:, None]
    round_BO = np.where(kept_BO, round_BO, 0)
    depth_BO = np.where(kept_BO, depth_BO, 0)
    rounds_B = np.asarray([len(np.unique(r[r > 0])) for r in round_BO], np.int32)
    max_depth = s.accepted_D.shape[0]
    accepted_D = np.asarray([(depth_BO == d).sum() for d in range(1, max_depth + 1)], np.int32)
    return dataclasses.replace(s, rounds_B=rounds_B, emitted_B=(round_BO > 0).sum(axis=1).astype(np.int32),
                               accepted_B=(depth_BO > 0).sum(axis=1).astype(np.int32), accepted_D=accepted_D)


def summarize(stats: SpecStats, n_rows: int, calls_per_round: int) -> dict[str, Any]:
    """JSON-friendly figures for `out.stats` (real prompts only; padding rows never emit).

    Every loop iteration verifies B x N tokens (fixed shapes) and runs the drafter `calls_per_round`
    times, so those totals follow from the iteration count. With the prefix scheduler an iteration
    pays B x its chosen width instead: padded_tokens_per_round is then the mean over iterations, and
    verified_width_rounds says how many iterations ran each width.

    acceptance_length (tau) = tokens emitted per round, the bonus included; per-position
    acceptance = P(the draft at depth d was emitted) per round; acceptance_rate_at_depth =
    accepted / offered at that depth (for trees: any node at that depth).
    """
    s = jax.tree.map(np.asarray, stats)
    rounds = max(int(s.rounds_B[:n_rows].sum()), 1)
    emitted = int(s.emitted_B[:n_rows].sum())
    loops = max(int(s.loop_rounds), 1)
    batch, num_nodes = s.rounds_B.shape[0], s.accepted_rank_DR.shape[1]
    drafter_calls = int(s.loop_rounds) * calls_per_round
    widths = {w: int(c) for w, c in enumerate(s.width_rounds_W) if c}
    padded = batch * num_nodes if s.loop_rounds else 0
    if widths:
        padded = batch * sum(w * c for w, c in widths.items()) / loops
    extra = {"verified_width_rounds": widths} if widths else {}
    return {
        "acceptance_length": emitted / rounds,
        "per_position_acceptance": (s.accepted_D / rounds).tolist(),
        "acceptance_rate_at_depth": (s.accepted_D / np.maximum(s.offered_D, 1)).tolist(),
        "offered_at_depth": s.offered_D.tolist(),
        "accepted_at_depth": s.accepted_D.tolist(),
        "accepted_child_rank": s.accepted_rank_DR.tolist(),
        "verified_child_rank": s.verified_rank_DR.tolist(),
        "rounds": int(s.loop_rounds),
        "row_rounds": s.rounds_B[:n_rows].tolist(),
        "accepted_drafts": int(s.accepted_B[:n_rows].sum()),
        "verified_tokens_per_round": int(s.verified_tokens) / loops,
        "padded_tokens_per_round": padded,
        "drafter_calls": drafter_calls,
        # One drafter pass serves every row: passes per token of one row.
        "drafter_calls_per_token": drafter_calls * n_rows / max(emitted, 1),
        **extra,
    }
