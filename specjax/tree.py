"""Draft trees of a fixed node count.

A tree is a parents array: node 0 is the root (parent -1), every other node's parent
has a smaller index (topological order). A chain of K drafts is parents (-1, 0, 1, ...,
K-1). Static templates are `TreeSpec`s (hashable, fixed at compile time); dynamic trees
are parents arrays built under jit. Masks, depths and positions are computed from
parents under jit either way.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A static tree template: `parents[i]` of node i, root first. Hashable, so static under jit."""

    parents: tuple[int, ...]

    def __post_init__(self):
        p = self.parents
        if not p or p[0] != -1:
            raise ValueError(f"a tree's node 0 is the root with parent -1; got parents {p[:8]}")
        bad = [i for i in range(1, len(p)) if not 0 <= p[i] < i]
        if bad:
            raise ValueError(f"tree nodes {bad[:8]} have a parent that is not an earlier node (parents {p})")

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.parents) - 1))


def chain(num_draft_tokens: int) -> TreeSpec:
    """Root plus a chain of K drafts (N = K + 1 nodes)."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    return TreeSpec(tuple(range(-1, num_draft_tokens)))


def kary(branching: Sequence[int]) -> TreeSpec:
    """Full tree: the root has branching[0] children, each of those branching[1], and so on."""
    if not branching or any(b < 1 for b in branching):
        raise ValueError(f"branching factors must be positive integers, got {list(branching)}")
    parents, frontier = [-1], [0]
    for b in branching:
        nxt = []
        for node in frontier:
            for _ in range(b):
                parents.append(node)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return TreeSpec(tuple(parents))


def from_choices(choices: Sequence[Sequence[int]]) -> TreeSpec:
    """Medusa / EAGLE-1 style: each choice is a path of child ranks from the root, e.g. [0], [1], [0, 0].

    Node order is by depth, then as listed; rank r of a node means the r-th best draft token
    of its parent, so ranks under one parent must be 0..n-1.
    """
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    if not paths or any(len(c) == 0 or min(c) < 0 for c in paths):
        raise ValueError("tree choices must be non-empty paths of non-negative child ranks, e.g. [[0], [1], [0, 0]]")
    index = {(): 0}
    parents = [-1]
    for path in paths:
        if path[:-1] not in index:
            raise ValueError(f"tree choice {list(path)} lacks its parent path {list(path[:-1])}")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
    for parent_path in index:
        ranks = sorted(p[-1] for p in paths if p[:-1] == parent_path)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"children of {list(parent_path)} have ranks {ranks}; they must be 0..{len(ranks) - 1}")
    return TreeSpec(tuple(parents))


def child_ranks(spec: TreeSpec) -> tuple[int, ...]:
    """For each node, its rank among its siblings (root 0): which top-k candidate of its parent it takes."""
    ranks = [0] * spec.num_nodes
    seen: dict[int, int] = {}
    for i in range(1, spec.num_nodes):
        p = spec.parents[i]
        ranks[i] = seen.get(p, 0)
        seen[p] = ranks[i] + 1
    return tuple(ranks)


def parse_tree(spec: str | TreeSpec | Sequence | None, num_draft_tokens: int | None) -> TreeSpec:
    """Resolve the user's tree argument: None -> chain of K, "chain:K", "kary:3,2,1", a choice list, or a TreeSpec."""
    if spec is None:
        return chain(4 if num_draft_tokens is None else num_draft_tokens)
    if isinstance(spec, TreeSpec):
        return spec
    if isinstance(spec, str):
        m = re.fullmatch(r"(chain|kary):([\d,]+)", spec.replace(" ", ""))
        if not m:
            raise ValueError(f"unknown tree spec {spec!r}; use 'chain:K', 'kary:B1,B2,...', a list of choice paths"
                             " or a specjax.tree.TreeSpec")
        nums = [int(x) for x in m.group(2).split(",") if x]
        if m.group(1) == "chain":
            if len(nums) != 1:
                raise ValueError(f"'chain:K' takes one number, got {spec!r}")
            return chain(nums[0])
        return kary(nums)
    if isinstance(spec, Sequence) and all(isinstance(c, Sequence) for c in spec):
        return from_choices(spec)
    raise ValueError(f"unknown tree spec {spec!r}; use 'chain:K', 'kary:B1,B2,...', a choice list or a TreeSpec")


def ancestor_mask(parents_BN: jax.Array) -> jax.Array:
    """bool [B, N, N]: mask[b, i, j] iff node j is node i or one of its ancestors.

    Pointer doubling: start from self + parent edges and square the relation log2(N) times.
    """
    b, n = parents_BN.shape
    eye = jnp.eye(n, dtype=jnp.bool_)
    parent_onehot = (parents_BN[:, :, None] == jnp.arange(n)[None, None, :])
    reach_BNN = eye[None] | parent_onehot
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
        reach_i32 = reach_BNN.astype(jnp.int32)
        reach_BNN = reach_BNN | (jnp.einsum("bij,bjk->bik", reach_i32, reach_i32) > 0)
    return reach_BNN


def depths(mask_BNN: jax.Array) -> jax.Array:
    """int32 [B, N]: number of proper ancestors of each node (root 0)."""
    return jnp.sum(mask_BNN, axis=-1, dtype=jnp.int32) - 1


def spec_arrays(spec: TreeSpec, batch: int) -> jax.Array:
    """The template's parents broadcast to int32 [B, N]."""
    return jnp.broadcast_to(jnp.asarray(np.asarray(spec.parents, np.int32)), (batch, spec.num_nodes))
