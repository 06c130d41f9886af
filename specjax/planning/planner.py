"""Draft-shape planning: the best tree per node budget, expected acceptance, and the per-batch choice.

The acceptance model (Sequoia's positional acceptance): given that a node was accepted,
its rank-r child (r = 0 is the drafter's best guess, as in `tree.child_ranks`) is
accepted with probability p[r], independently of depth and of what happened elsewhere
in the tree. Siblings are mutually exclusive guesses of the same next token, so
sum(p) <= 1. Under this assumption a node is accepted with the product of p over the
ranks on its root path, and a tree's expected tokens per round (tau, the bonus
included) is the sum of that product over all nodes, the root counting 1.

`TreeTable` is the dynamic program: for every budget n (root included) and depth
limit d, the tree maximising tau; chains are the special case of one rank. `plan`
then picks, per batch size, the shape (off, chain K, or a DP tree) that maximises
expected tokens/s = tau / (draft time + verify time(batch x nodes)), using a cost model
from specjax/planning/profile.py, relative to plain decoding (1 / verify time(batch x 1)).
Measured per-depth acceptance (from a calibration run's statistics) is estimated
in specjax/planning/calibration.py, with the model's predicted tau next to the measured one so the
independence assumption is checked rather than assumed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.drafter import Settings
from specjax.decoding.tree import DynamicTreeSpec, TreeSpec, chain, child_ranks, from_choices, kary
from specjax.models.target import format_count
from specjax.planning.presets import LLAMA3_8B
from specjax.planning.profile import (
    QWEN3_30B_A3B,
    Roofline,
    device_spec,
    relative_draft,
)

NEG = -np.inf


def check_p(p: Sequence[float]) -> np.ndarray:
    """Positional acceptance as float64 [R], or a ValueError naming what is wrong with it."""
    p_R = np.asarray(p, np.float64).reshape(-1)
    if p_R.size == 0:
        raise ValueError("positional acceptance p is empty: give at least p[0], the best child's acceptance")
    if np.any(~np.isfinite(p_R)) or np.any(p_R < 0) or np.any(p_R > 1):
        raise ValueError(f"positional acceptance must be probabilities in [0, 1], got {p_R.tolist()}")
    if p_R.sum() > 1 + 1e-6:
        raise ValueError(f"positional acceptance sums to {p_R.sum():.4f} > 1; sibling guesses are exclusive, "
                         f"so the ranks' probabilities must sum to at most 1 (got {p_R.tolist()})")
    return p_R


# ---------------------------------------------------------------- expected tau of a given tree


def _reach(spec: TreeSpec, p: Sequence[float] | np.ndarray) -> np.ndarray:
    """[N] probability that each node of `spec` is accepted (root 1) under positional acceptance p."""
    p_arr = np.asarray(p, np.float64)
    p_DR = p_arr[None, :] if p_arr.ndim == 1 else p_arr
    if p_DR.ndim != 2 or p_DR.shape[1] == 0:
        raise ValueError(f"p must be [ranks] or [depths, ranks], got shape {p_arr.shape}")
    ranks, depth = child_ranks(spec), spec.depths
    reach = np.ones(spec.num_nodes)
    for i in range(1, spec.num_nodes):
        row = p_DR[min(depth[i], p_DR.shape[0]) - 1]
        reach[i] = reach[spec.parents[i]] * (row[ranks[i]] if ranks[i] < row.size else 0.0)
    return reach


def expected_tau(spec: TreeSpec, p: Sequence[float] | np.ndarray) -> float:
    """Expected tokens per round of `spec` (bonus included) under positional acceptance.

    p: [R] by child rank, or [D, R] by depth (row d-1 for depth d; deeper nodes use the
    last row). A child whose rank has no entry is never accepted.
    """
    return float(_reach(spec, p).sum())


def tokens_per_round(spec: TreeSpec, p: Sequence[float] | np.ndarray) -> np.ndarray:
    """[depth + 1] probability that a round of `spec` emits 1, 2, ... tokens (accepted depth + 1) under positional
    acceptance: the accepted path ends at node i with probability reach[i] minus its children's reach
    (siblings are exclusive guesses of one token)."""
    reach = _reach(spec, p)
    end = reach.copy()
    np.subtract.at(end, np.asarray(spec.parents[1:], np.int64), reach[1:])
    return np.bincount(np.asarray(spec.depths), weights=np.maximum(end, 0.0), minlength=spec.max_depth + 1)


def chain_tau(k: int, p0: float) -> float:
    """tau of a chain of k drafts each accepted with probability p0 given its parent: 1 + p0 + ... + p0^k."""
    return float(sum(p0 ** i for i in range(k + 1)))


# ---------------------------------------------------------------- the dynamic program


@dataclasses.dataclass(frozen=True)
class TreeTable:
    """Best expected tau for every budget n <= max_nodes and depth limit d <= max_depth.

    tau_ND[n, d]: the largest tau of a tree with at most n nodes (root included) and depth
    at most d (n >= 1). Built by `best_trees`; `tree(n, d)` rebuilds the maximising tree.
    """

    p: tuple[float, ...]
    tau_ND: np.ndarray  # float64 [max_nodes + 1, max_depth + 1]; row 0 unused
    children_ND: np.ndarray  # int16 [max_nodes + 1, max_depth + 1]: the root's child count in the best tree
    split_DBM: np.ndarray  # int16 [max_depth + 1, R + 1, max_nodes + 1]: nodes given to rank b-1's subtree

    @property
    def max_nodes(self) -> int:
        return self.tau_ND.shape[0] - 1

    @property
    def max_depth(self) -> int:
        return self.tau_ND.shape[1] - 1

    def tau(self, n: int, d: int | None = None) -> float:
        n, d = self._check(n, d)
        return float(self.tau_ND[n, d])

    def tree(self, n: int, d: int | None = None) -> TreeSpec:
        """The maximising tree for budget n and depth limit d (it may use fewer nodes than n)."""
        n, d = self._check(n, d)
        paths: list[tuple[int, ...]] = []
        self._collect(n, d, (), paths)
        return from_choices(paths) if paths else TreeSpec((-1,))

    def _collect(self, n: int, d: int, prefix: tuple[int, ...], out: list) -> None:
        b = int(self.children_ND[n, d]) if d > 0 else 0
        m = n - 1
        sizes = []
        for rank in range(b, 0, -1):  # the DP added ranks 1..b in order, so peel them off from the last
            y = int(self.split_DBM[d, rank, m])
            sizes.append((rank - 1, y))
            m -= y
        for r, y in sorted(sizes):
            out.append(prefix + (r,))
            self._collect(y, d - 1, prefix + (r,), out)

    def _check(self, n: int, d: int | None) -> tuple[int, int]:
        d = self.max_depth if d is None else d
        if not 1 <= n <= self.max_nodes:
            raise ValueError(f"node budget {n} is outside this table's 1..{self.max_nodes}; build it with "
                             f"best_trees(p, max_nodes>={n})")
        if not 0 <= d <= self.max_depth:
            raise ValueError(f"depth limit {d} is outside this table's 0..{self.max_depth}")
        return n, d


def best_trees(p: Sequence[float], max_nodes: int, max_depth: int | None = None) -> TreeTable:
    """Sequoia's dynamic program over node budget, depth limit and the root's child count.

    F[n, d] = 1 + max_b G_b[n - 1] with G_0[m] = 0 and
    G_b[m] = max_{1 <= y <= m} G_{b-1}[m - y] + p[b-1] F[y, d-1]:
    the root's first b ranked children share m nodes, the rank-(b-1) child's subtree gets y.
    F is over trees with at most n nodes (G_0 leaves budget unused), so it never decreases in n.
    """
    p_R = check_p(p)
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1 (the root), got {max_nodes}")
    max_depth = max_nodes - 1 if max_depth is None else max_depth
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    n1, ranks = max_nodes + 1, p_R.size
    tau_ND = np.zeros((n1, max_depth + 1))
    tau_ND[1:, 0] = 1.0
    children_ND = np.zeros((n1, max_depth + 1), np.int16)
    split_DBM = np.zeros((max_depth + 1, ranks + 1, n1), np.int16)
    m_M1 = np.arange(n1)[:, None]
    y_1Y = np.arange(n1)[None, :]
    usable_MY = (y_1Y >= 1) & (y_1Y <= m_M1)
    rest_MY = np.clip(m_M1 - y_1Y, 0, None)
    for d in range(1, max_depth + 1):
        sub_Y = tau_ND[:, d - 1]  # best subtree value with y nodes, depth <= d - 1 (sub_Y[0] unused)
        g_M = np.zeros(n1)  # G_0: no children, any unused budget
        best_M, best_b_M = g_M.copy(), np.zeros(n1, np.int16)
        for b in range(1, ranks + 1):
            cand_MY = np.where(usable_MY, g_M[rest_MY] + p_R[b - 1] * sub_Y[None, :], NEG)
            split_DBM[d, b] = np.argmax(cand_MY, axis=1)
            g_M = cand_MY.max(axis=1)
            better = g_M > best_M + 1e-12
            best_M = np.where(better, g_M, best_M)
            best_b_M = np.where(better, b, best_b_M)
        tau_ND[1:, d] = 1.0 + best_M[:-1]
        children_ND[1:, d] = best_b_M[:-1]
    return TreeTable(tuple(float(x) for x in p_R), tau_ND, children_ND, split_DBM)


def best_tree(p: Sequence[float], nodes: int, max_depth: int | None = None) -> tuple[TreeSpec, float]:
    """The tree with at most `nodes` nodes (root included) and depth <= max_depth maximising tau, and its tau."""
    table = best_trees(p, nodes, max_depth)
    return table.tree(nodes), table.tau(nodes)


# ---------------------------------------------------------------- brute force (for tests and small budgets)


def _plane_trees(n: int, max_depth: int, ranks: int) -> Iterator[tuple]:
    """Every tree of exactly n nodes as nested tuples of ranked child subtrees, depth and fan-out limited."""
    if n == 1:
        yield ()
        return
    if max_depth == 0:
        return
    for b in range(1, min(ranks, n - 1) + 1):
        for sizes in _compositions(n - 1, b):
            for subs in itertools.product(*[list(_plane_trees(s, max_depth - 1, ranks)) for s in sizes]):
                yield subs


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def _paths(t: tuple, prefix: tuple = ()) -> list[tuple[int, ...]]:
    out = []
    for r, sub in enumerate(t):
        out.append(prefix + (r,))
        out += _paths(sub, prefix + (r,))
    return out


def brute_force_best(p: Sequence[float], nodes: int, max_depth: int | None = None) -> tuple[TreeSpec, float]:
    """Enumerate every tree with at most `nodes` nodes (Catalan many: keep nodes <= ~9) and keep the best tau."""
    p_R = check_p(p)
    max_depth = nodes - 1 if max_depth is None else max_depth
    best_spec, best = TreeSpec((-1,)), 1.0
    for n in range(2, nodes + 1):
        for t in _plane_trees(n, max_depth, p_R.size):
            spec = from_choices(_paths(t))
            tau = expected_tau(spec, p_R)
            if tau > best + 1e-12:
                best_spec, best = spec, tau
    return best_spec, best


# ---------------------------------------------------------------- shapes and the per-batch policy


@dataclasses.dataclass(frozen=True)
class Shape:
    """One draft shape: "off" (plain decoding), a chain, or a tree, with its predicted tau."""

    kind: str  # "off" | "chain" | "tree"
    spec: TreeSpec | DynamicTreeSpec | None
    tau: float
    tokens_p: tuple[float, ...] = (1.0,)  # P(a round emits 1, 2, ... tokens), for a call's slowest row

    @property
    def nodes(self) -> int:
        return 1 if self.spec is None else self.spec.num_nodes

    @property
    def depth(self) -> int:
        return 0 if self.spec is None else self.spec.max_depth

    @property
    def label(self) -> str:
        if self.kind == "off":
            return "off"
        if self.kind == "chain":
            return f"chain:{self.nodes - 1}"
        if isinstance(self.spec, DynamicTreeSpec):  # a block drafter's one-pass tree (planning/block_trees.py)
            return str(self.spec)
        return f"tree:{self.nodes}n/d{self.depth}"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "label": self.label, "nodes": self.nodes, "depth": self.depth, "tau": self.tau,
                "parents": list(self.spec.parents) if isinstance(self.spec, TreeSpec) else None}


def shape_of(spec: TreeSpec | None, p: Sequence[float] | np.ndarray) -> Shape:
    """A Shape for a given tree (None: off), its tau from the acceptance model p."""
    if spec is None or spec.num_nodes == 1:
        return Shape("off", None, 1.0)
    return Shape("chain" if spec.is_chain else "tree", spec, expected_tau(spec, p), tuple(tokens_per_round(spec, p)))


@dataclasses.dataclass(frozen=True)
class Scored:
    """A shape at one batch size: seconds per round, predicted speedup over plain decoding."""

    shape: Shape
    round_s: float
    speedup: float

    def as_dict(self) -> dict[str, Any]:
        return {**self.shape.as_dict(), "round_s": self.round_s, "speedup": self.speedup}


@dataclasses.dataclass(frozen=True)
class Choice:
    """The planner's answer for one batch size: the best shape and the next best candidate."""

    batch: int
    best: Scored
    runner_up: Scored | None

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "best": self.best.as_dict(),
                "runner_up": None if self.runner_up is None else self.runner_up.as_dict()}


@dataclasses.dataclass(frozen=True)
class Call:
    """One generate call: a prefill of prefill_s(batch) seconds, then every row decodes `tokens` and the loop
    runs until the batch's slowest row is done. Without a Call, rows are refilled as they finish (a server)
    and speedup is tokens per round over round time."""

    tokens: int
    prefill_s: Callable[[int], float] = lambda batch: 0.0


def rounds_for_batch(shape: Shape, tokens: int, rows: int) -> float:
    """Expected rounds until the slowest of `rows` rows has emitted `tokens`, each round emitting x tokens with
    probability shape.tokens_p[x - 1], independently (the positional model)."""
    return _rounds_for_batch(shape.tokens_p, tokens, rows)


@functools.lru_cache(maxsize=4096)
def _rounds_for_batch(tokens_p: tuple[float, ...], tokens: int, rows: int) -> float:
    """E[max over rows of R] = sum over r >= 0 of P(some row needs more than r rounds), with each row's
    tokens after r rounds (capped at the budget) carried as an exact distribution."""
    step = np.concatenate([[0.0], tokens_p])  # step[x]: a round emits x tokens
    emitted = np.zeros(tokens + 1)  # emitted[t]: P(a row has t tokens after r rounds), t = tokens meaning done
    emitted[0] = 1.0
    expected = 0.0
    for _ in range(tokens):  # a round emits at least one token: every row is done after `tokens` rounds
        unfinished = 1.0 - emitted[tokens] ** rows
        if unfinished < 1e-12:
            break
        expected += unfinished
        moved = np.convolve(emitted[:tokens], step)
        emitted = np.concatenate([moved[:tokens], [emitted[tokens] + moved[tokens:].sum()]])
    return expected


def score(shape: Shape, batch: int, verify_s: Callable[[int, int], float],
          draft_s: Callable[[int, int], float], plain_s: Callable[[int], float] | None = None,
          call: Call | None = None) -> Scored:
    """Predicted speedup over plain decoding at this batch.

    Without a call: (tau / (draft(batch, depth) + verify(batch, nodes))) / (1 / plain step). With one:
    (prefill + tokens x plain step) / (prefill + rounds for the slowest row x round). The plain step is
    plain_s(batch) when measured, else verify(batch, 1).
    """
    plain = plain_step(verify_s, plain_s, batch)
    if shape.kind == "off":
        return Scored(shape, plain, 1.0)
    round_s = draft_s(batch, shape.depth) + verify_s(batch, shape.nodes)
    if call is None:
        return Scored(shape, round_s, shape.tau * plain / round_s)
    prefill = call.prefill_s(batch)
    rounds = rounds_for_batch(shape, call.tokens, batch)
    return Scored(shape, round_s, (prefill + call.tokens * plain) / (prefill + rounds * round_s))


def plain_step(verify_s: Callable[[int, int], float], plain_s: Callable[[int], float] | None, batch: int) -> float:
    """Seconds per plain decoding step: measured (plain_s) when given, else one verify pass of one node per row."""
    return verify_s(batch, 1) if plain_s is None else plain_s(batch)


def plan(p: Sequence[float], batches: Sequence[int], verify_s: Callable[[int, int], float],
         draft_s: Callable[[int, int], float], max_nodes: int = 128, max_depth: int = 16,
         max_chain: int = 16, tree_ok: bool = True, table: TreeTable | None = None,
         plain_s: Callable[[int], float] | None = None, call: Call | None = None) -> list[Choice]:
    """For each batch size, the shape maximising predicted tokens/s, and the runner-up of another kind.

    Candidates: off, chains of 1..max_chain drafts (tau from p[0] alone), and (tree_ok) the DP's
    best tree for every budget 2..max_nodes and depth 1..max_depth (only the best of these per batch
    is a candidate, so the runner-up is never the same tree one node smaller). verify_s(batch, nodes)
    and draft_s(batch, depth) are the cost model (see specjax/planning/profile.py; draft_s holds everything a round
    costs besides the verify pass), plain_s(batch) a measured plain step (default: verify_s(batch, 1)); with
    a `call`, speedups are of that whole generate call (its prefill, and its slowest row).
    """
    p_R = check_p(p)
    if not batches or min(batches) < 1:
        raise ValueError(f"batch sizes must be positive integers, got {list(batches)}")
    chains = [shape_of(chain(k), p_R) for k in range(1, max_chain + 1)]
    if tree_ok and table is None:
        table = best_trees(p_R, max_nodes, max_depth)
    choices = []
    shapes: dict[tuple[int, int], Shape] = {}  # the DP's trees rebuilt once for all batches (n, depth) -> Shape
    for b in batches:
        cands = [score(s, b, verify_s, draft_s, plain_s, call) for s in [Shape("off", None, 1.0), *chains]]
        if tree_ok:
            tree = _best_tree_at(table, b, verify_s, draft_s, p_R, plain_s, call, shapes)
            if all(c.shape.spec != tree.shape.spec for c in cands):  # the DP's best may be one of the chains
                cands.append(tree)
        cands.sort(key=lambda s: -s.speedup)
        choices.append(Choice(b, cands[0], cands[1] if len(cands) > 1 else None))
    return choices


def _best_tree_at(table: TreeTable, batch: int, verify_s, draft_s, p_R: np.ndarray, plain_s=None,
                  call: Call | None = None, shapes: dict | None = None) -> Scored:
    """The best tree at this batch: per node budget the DP cell (depth) with the most tau per round time, each
    rebuilt and rescored as it really is (it may use fewer nodes or levels than its cell; with a call, its
    slowest row depends on more than tau), and the best of those. shapes: the cells' trees rebuilt so far, by
    (n, depth), shared by a plan's batches."""
    shapes = {} if shapes is None else shapes
    plain = plain_step(verify_s, plain_s, batch)
    verify_N = np.array([np.inf, np.inf] + [verify_s(batch, n) for n in range(2, table.max_nodes + 1)])
    draft_D = np.array([draft_s(batch, d) for d in range(table.max_depth + 1)])
    speed_ND = table.tau_ND * plain / (verify_N[:, None] + draft_D[None, :])
    speed_ND[:, 0] = -np.inf
    cells = [(n, int(np.argmax(speed_ND[n]))) for n in range(2, table.max_nodes + 1)]
    for cell in cells:
        if cell not in shapes:
            shapes[cell] = shape_of(table.tree(*cell), p_R)
    unique = {shapes[cell].spec: shapes[cell] for cell in cells}
    scored = [score(shape, batch, verify_s, draft_s, plain_s, call) for shape in unique.values()]
    return max(scored, key=lambda c: (c.speedup, -c.shape.nodes))


def shape_curve(shapes: Sequence[Shape], batches: Sequence[int], verify_s, draft_s,
                plain_s=None, call: Call | None = None) -> dict[str, list[float]]:
    """Predicted speedup of fixed shapes at each batch size (for plots and tables)."""
    return {s.label: [score(s, b, verify_s, draft_s, plain_s, call).speedup for b in batches] for s in shapes}


def format_plan(choices: Sequence[Choice]) -> str:
    """A plain-text table: per batch, the best shape, its tau and speedup, and the runner-up."""
    lines = ["| concurrency | best shape | tau | speedup | runner-up (tau, speedup) |", "|---|---|---|---|---|"]
    for c in choices:
        r = c.runner_up
        other = "-" if r is None else f"{r.shape.label} ({r.shape.tau:.2f}, {r.speedup:.2f}x)"
        lines.append(f"| {c.batch} | {c.best.shape.label} | {c.best.shape.tau:.2f} | {c.best.speedup:.2f}x | {other} |")
    return "\n".join(lines)


def drafts_with_a_model(drafter, spec: TreeSpec) -> bool:
    """Whether drafting `spec` runs a model (calls per round > 0): a draft model runs every level's whole
    frontier, so a tree's drafting costs more than the chain of its depth that draft_s(batch, depth) times."""
    return drafter.configure(Settings(spec, SamplingConfig(), 256, 16)).calls_per_round() > 0


def drafter_takes_trees(drafter, target) -> bool:
    """Whether the drafter proposes trees (chain-only drafters refuse a tree in configure)."""
    try:
        drafter.configure(Settings(kary([2, 1]), SamplingConfig(), 256, 16))
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- the published model


def geometric_acceptance(alpha: float, ranks: int = 8) -> tuple[float, ...]:
    """p[r] = alpha (1 - alpha)^r: the drafter's best guess is right with probability alpha, and each
    next-ranked guess is right with probability alpha given the better ones were wrong.

    This is the published model's "right 80% of the time at every position" carried to siblings:
    the true token's rank among the drafter's candidates is geometric, so sibling probabilities
    sum to 1 - (1 - alpha)^ranks. (The published text gives alpha only; this sibling decay is our
    stated assumption, and it is what makes its 64-node tree reach tau ~ 7.4.)
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha is a probability in [0, 1], got {alpha}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return tuple(alpha * (1 - alpha) ** r for r in range(ranks))


def published_moe_model(alpha: float = 0.8, cost: float = 0.05, device: str = "h100", tensor_parallel: int = 1,
                        sampled: bool = False):
    """(p, dense CostModel, MoE CostModel): the published settings on Qwen3-30B-A3B by roofline (its experts read
    per pass under uniform routing) and on a dense bf16 model of the same active parameters (3.3B), both split
    over `tensor_parallel` devices alike (the same collectives)."""
    cfg = ModelConfig.from_hf(QWEN3_30B_A3B)
    moe = Roofline.for_config(cfg, device_spec(device), 0, tensor_parallel, sampled)
    dense = dataclasses.replace(moe, weight_bytes=2 * moe.params, expert_bytes=0.0, experts=None, routing=())
    what = f"drafter right w.p. {alpha:g}, draft {cost:g} x target step per level"
    active = format_count(cfg.num_params(active=True))
    cms = [r.cost(relative_draft(r.verify_s, cost), f"{name}, {what}")
           for r, name in ((dense, f"dense {active} bf16"),
                           (moe, f"Qwen3-30B-A3B ({format_count(cfg.num_params())}, {active} active)"))]
    return geometric_acceptance(alpha), cms[0], cms[1]


def published_model(alpha: float = 0.8, cost: float = 0.05, device: str = "h100", tensor_parallel: int = 1,
                    sampled: bool = False):
    """(p, CostModel) of the published load model: Meta-Llama-3-8B (bf16, 8.03B) on `device` by roofline (no KV
    term: knee ~295 tokens/pass on an H100), split over `tensor_parallel` devices, a drafter right with
    probability alpha, drafting costing `cost` x one target step (at the same batch) per drafted level."""
    roof = Roofline.for_config(ModelConfig.from_hf(LLAMA3_8B), device_spec(device), 0, tensor_parallel, sampled)
    return geometric_acceptance(alpha), roof.cost(relative_draft(roof.verify_s, cost),
                                                  f"published model: 8B bf16, drafter right w.p. {alpha:g}, "
                                                  f"draft {cost:g} x target step per level")
