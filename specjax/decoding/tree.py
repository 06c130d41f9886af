"""Draft trees of a fixed node count.

A tree is a parents array: node 0 is the root (parent -1), every other node's parent
has a smaller index (topological order). A chain of K drafts is parents (-1, 0, 1, ...,
K-1). Static templates are `TreeSpec`s (hashable, fixed at compile time). A
`DynamicTreeSpec` fixes only the shape of an EAGLE-2 dynamic tree (top_k, depth,
total_tokens); the drafter builds each row's parents array under jit every round
(dynamic_tree.py). Masks, depths and positions are computed from parents under jit
either way.
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

    @property
    def cache_slots(self) -> int:
        """Cache positions after a row's prefix one round writes (the N nodes)."""
        return len(self.parents)


@dataclasses.dataclass(frozen=True)
class DynamicTreeSpec:
    """The fixed shape of an EAGLE-2 dynamic draft tree, whose nodes the drafter picks each round.

    As in EAGLE-2 (SafeAILab/EAGLE cnets.py `topK_genrate`): the first draft step gives the
    root's `top_k` best tokens; each of `depth` expansion steps runs the `top_k` best nodes of
    the newest level (by cumulative log-probability over the draft vocabulary) and scores their
    `top_k` children; finally the `total_tokens - 1` best of all `top_k + depth * top_k**2`
    candidates form the tree. `total_tokens` counts the root, so a draft has N = total_tokens
    nodes; paths reach `depth + 1` drafted tokens. Hashable, so static under jit. Block drafters (DFlash,
    DSpark) read the same spec as JetSpec's one-pass tree of that shape (decoding/block_tree.py).
    """

    top_k: int
    depth: int
    total_tokens: int

    def __post_init__(self):
        for name in ("top_k", "depth", "total_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"dynamic tree {name} must be a positive integer, got {value!r}")
        if self.total_tokens < 2:
            raise ValueError(f"dynamic tree total_tokens counts the root, so it must be >= 2 for any draft; "
                             f"got {self.total_tokens}")
        if self.total_tokens - 1 > self.num_candidates:
            raise ValueError(f"dynamic tree total_tokens={self.total_tokens} keeps {self.total_tokens - 1} drafts, "
                             f"but top_k={self.top_k}, depth={self.depth} only yields top_k + depth*top_k^2 = "
                             f"{self.num_candidates} candidates; lower total_tokens or raise top_k/depth")

    @property
    def num_nodes(self) -> int:
        """N: nodes per draft, root included."""
        return self.total_tokens

    @property
    def max_depth(self) -> int:
        """Deepest possible node: the first draft step plus `depth` expansion steps."""
        return self.depth + 1

    @property
    def is_chain(self) -> bool:
        return False

    @property
    def num_candidates(self) -> int:
        """Scored candidates: the root's top_k children plus top_k^2 per expansion step."""
        return self.top_k + self.depth * self.top_k * self.top_k

    @property
    def num_expanded(self) -> int:
        """Nodes a sequential drafter runs while building the tree (top_k per expansion step), root excluded."""
        return self.depth * self.top_k

    @property
    def cache_slots(self) -> int:
        """Cache positions after a row's prefix one round may write: the verify pass's N nodes, or the
        root plus every expanded node in a drafter's own cache, whichever is more."""
        return max(self.num_nodes, 1 + self.num_expanded)

    def __str__(self) -> str:
        return f"dynamic:top_k={self.top_k},depth={self.depth},total_tokens={self.total_tokens}"


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
    children: dict[tuple[int, ...], list[int]] = {}  # grouped in one pass: the planner rebuilds trees of 512 nodes
    for path in paths:
        children.setdefault(path[:-1], []).append(path[-1])
    for parent_path, ranks in children.items():
        ranks = sorted(ranks)
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


def parse_dynamic(text: str) -> DynamicTreeSpec:
    """"dynamic:top_k=K,depth=D,total_tokens=T" (keys in any order, all three required)."""
    body = text.replace(" ", "")[len("dynamic:"):]
    usage = "use 'dynamic:top_k=K,depth=D,total_tokens=T' (e.g. dynamic:top_k=8,depth=5,total_tokens=60)"
    values: dict[str, int] = {}
    for item in filter(None, body.split(",")):
        m = re.fullmatch(r"(top_k|depth|total_tokens)=(\d+)", item)
        if not m:
            raise ValueError(f"bad dynamic tree spec {text!r} at {item!r}; {usage}")
        if m.group(1) in values:
            raise ValueError(f"dynamic tree spec {text!r} gives {m.group(1)} twice; {usage}")
        values[m.group(1)] = int(m.group(2))
    missing = [k for k in ("top_k", "depth", "total_tokens") if k not in values]
    if missing:
        raise ValueError(f"dynamic tree spec {text!r} lacks {', '.join(missing)}; {usage}")
    return DynamicTreeSpec(values["top_k"], values["depth"], values["total_tokens"])


def parse_tree(spec: str | TreeSpec | DynamicTreeSpec | Sequence | None,
               num_draft_tokens: int | None) -> TreeSpec | DynamicTreeSpec:
    """Resolve the user's tree argument: None -> chain of K, "chain:K", "kary:3,2,1",
    "dynamic:top_k=K,depth=D,total_tokens=T", a choice list, a TreeSpec or a DynamicTreeSpec."""
    if spec is None:
        return chain(4 if num_draft_tokens is None else num_draft_tokens)
    if isinstance(spec, (TreeSpec, DynamicTreeSpec)):
        return spec
    if isinstance(spec, str):
        if spec.replace(" ", "").startswith("dynamic:"):
            return parse_dynamic(spec)
        m = re.fullmatch(r"(chain|kary):([\d,]+)", spec.replace(" ", ""))
        if not m:
            raise ValueError(f"unknown tree spec {spec!r}; use 'chain:K', 'kary:B1,B2,...', "
                             "'dynamic:top_k=K,depth=D,total_tokens=T', a list of choice paths"
                             " or a specjax.decoding.tree.TreeSpec")
        nums = [int(x) for x in m.group(2).split(",") if x]
        if m.group(1) == "chain":
            if len(nums) != 1:
                raise ValueError(f"'chain:K' takes one number, got {spec!r}")
            return chain(nums[0])
        return kary(nums)
    if isinstance(spec, Sequence) and all(isinstance(c, Sequence) for c in spec):
        return from_choices(spec)
    raise ValueError(f"unknown tree spec {spec!r}; use 'chain:K', 'kary:B1,B2,...', "
                     "'dynamic:top_k=K,depth=D,total_tokens=T', a choice list or a TreeSpec")


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
    if isinstance(spec, DynamicTreeSpec):
        raise ValueError(f"{spec} is a dynamic tree: its parents are chosen each round, so there is no static "
                         "template (a drafter that supports dynamic trees builds them with specjax.decoding.dynamic_tree)")
    return jnp.broadcast_to(jnp.asarray(np.asarray(spec.parents, np.int32)), (batch, spec.num_nodes))
