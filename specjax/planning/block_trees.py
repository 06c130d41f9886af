"""Pricing one-pass block trees (DFlash, DSpark: decoding/block_tree.py) by load.

A block drafter's tree costs one block pass however large it is, so its price is the verify pass of T
nodes against the tokens it adds. Its acceptance model is per depth and rank: p[d][r] = P(the rank-r
token of depth d + 1 is accepted | its parent was), measured with a `caterpillar` calibration tree
(the rank-0 spine, each spine node offering `width` ranks: every (depth, rank) is offered under an
accepted parent, so `calibration.acceptance_from_stats` counts its opportunities exactly).

Expected tau of `dynamic:top_k=K,depth=D,total_tokens=T`: the drafter grows the tree by its own scores;
the model grows it by the measured acceptance (JetSpec's best-first rule on log p instead of the
drafter's log-probabilities), so the T - 1 nodes with the most reach (product of p along the path) are
the tree, and tau = 1 + their reach. This assumes the drafter's ranking per round agrees with its
average acceptance (calibrated scores); a drafter that ranks better per round does better.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

import numpy as np

from specjax.decoding.tree import DynamicTreeSpec, TreeSpec
from specjax.planning.planner import Call, Scored, Shape, expected_tau, score, tokens_per_round

# The grid "auto" and `specjax plan` search: widths (JetSpec's 7 among them) and node budgets (root included).
WIDTHS = (1, 2, 4, 7)
BUDGETS = (8, 16, 32, 64, 128, 256)
CALIBRATION_WIDTH = 4


def caterpillar(width: int, depth: int) -> TreeSpec:
    """The rank-0 spine `depth` deep, each spine node with `width` children (the next spine node first)."""
    if width < 1 or depth < 1:
        raise ValueError(f"a caterpillar needs width >= 1 and depth >= 1, got width={width}, depth={depth}")
    parents, spine = [-1], 0
    for _ in range(depth):
        first = len(parents)
        parents += [spine] * width
        spine = first
    return TreeSpec(tuple(parents))


def expected_template(spec: DynamicTreeSpec, p_DR: np.ndarray) -> TreeSpec:
    """The static tree the best-first rule grows on acceptance p (depth rows beyond p_DR reuse the last; ranks beyond
    it are never accepted): what the model expects `spec` to look like on an average round."""
    p_DR = np.atleast_2d(np.asarray(p_DR, np.float64))
    k, t, levels = spec.top_k, spec.total_tokens, spec.max_depth
    parents, depths, counter = [-1], [0], 0
    heap = [(-0.0, 0, 0)]  # (-log reach, creation order, node)
    logp = np.log(np.maximum(p_DR, 1e-300))
    while heap and len(parents) < t:
        neg, _, node = heapq.heappop(heap)
        d = depths[node]
        if d >= levels:
            continue
        row = logp[min(d, len(logp) - 1)]
        for r in range(min(k, t - len(parents))):
            lp = row[r] if r < row.size else -np.inf
            counter += 1
            heapq.heappush(heap, (neg - lp, counter, len(parents)))
            parents.append(node)
            depths.append(d + 1)
    return TreeSpec(tuple(parents))


def block_tree_shape(spec: DynamicTreeSpec, p_DR: np.ndarray) -> Shape:
    """A planner Shape for a one-pass dynamic tree: its expected tau and tokens per round from `expected_template`."""
    template = expected_template(spec, p_DR)
    return Shape("tree", spec, expected_tau(template, p_DR), tuple(tokens_per_round(template, p_DR)))


def block_tree_specs(max_levels: int, widths: Sequence[int] = WIDTHS,
                     budgets: Sequence[int] = BUDGETS) -> list[DynamicTreeSpec]:
    """The candidate trees: every width and budget, as deep as the block allows (depth = max_levels - 1), where the
    spec is valid (its budget within what its width and depth can hold)."""
    specs = []
    for k in widths:
        for t in budgets:
            try:
                specs.append(DynamicTreeSpec(k, max(max_levels - 1, 1), t))
            except ValueError:
                continue
    return specs


def best_block_tree(p_DR: np.ndarray, batch: int, verify_s: Callable[[int, int], float],
                    draft_s: Callable[[int, int], float], plain_s: Callable[[int], float] | None = None,
                    call: Call | None = None, max_levels: int = 15, widths: Sequence[int] = WIDTHS,
                    budgets: Sequence[int] = BUDGETS) -> Scored | None:
    """The best one-pass tree at this batch by predicted speedup (None: no candidate fits). A block tree's drafting
    is one pass whatever its depth: draft_s(batch, 1)."""
    one_pass = lambda b, d: draft_s(b, 1)  # noqa: E731
    scored = [score(block_tree_shape(s, p_DR), batch, verify_s, one_pass, plain_s, call)
              for s in block_tree_specs(max_levels, widths, budgets)]
    return max(scored, key=lambda c: (c.speedup, -c.shape.nodes), default=None)
