"""Acceptance from a calibration run: positional and per-depth acceptance estimated from `out.stats`.

The planner's model (specjax/planning/planner.py) says a rank-r child is accepted with probability
p[r] given its parent was, whatever the depth. A calibration run with a known static shape
gives, per depth, how often each rank was accepted (`verified_child_rank`); dividing by how
often that rank was offered under an accepted parent estimates p, pooled over depths (the
model) and per depth (to see how far the model's independence assumption is from the data).
Both models' tau for the calibration shape are reported next to the measured tau.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import numpy as np

from specjax.config import SamplingConfig
from specjax.decoding.plain import plain_generate
from specjax.decoding.speculative import speculative_generate
from specjax.decoding.tree import TreeSpec, chain, child_ranks
from specjax.multihost import agreed
from specjax.planning.planner import expected_tau
from specjax.planning.profile import RunTimes


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Acceptance estimated from one speculative run of a known shape, and the independence check.

    p_rank[r]: positional acceptance pooled over depths (the DP's model); p_depth_rank[d][r]: the
    same per depth (NaN where never offered); measured_tau vs predicted_tau (positional model) and
    predicted_tau_by_depth (per-depth model) for the calibration shape: when the positional
    prediction is far from the measurement, acceptance depends on depth and the DP's trees are
    only approximately optimal.
    """

    shape: TreeSpec
    p_rank: tuple[float, ...]
    p_depth_rank: tuple[tuple[float, ...], ...]
    opportunities_depth_rank: tuple[tuple[float, ...], ...]
    rounds: int
    measured_tau: float
    predicted_tau: float
    predicted_tau_by_depth: float

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape.parents)
        d["p_depth_rank"] = [[None if np.isnan(x) else x for x in row] for row in self.p_depth_rank]
        return d


def opportunities(spec: TreeSpec, verified_DR: np.ndarray, rounds: float) -> np.ndarray:
    """[D, R] how often the draft of rank r at depth d + 1 was offered under an accepted parent, over `rounds`
    row-rounds of the static tree `spec` whose verified (accepted by the target) drafts per (depth, rank) are
    verified_DR [D, R]: rank r at depth 1 is offered every round the root has more than r children; at depth d,
    whenever the accepted depth-(d-1) node had more than r children. The counts give the accepted node's rank at
    each depth, not its index, so nodes of one (depth, rank) are taken to have equally many children on average
    (exact for chains, k-ary trees and caterpillars)."""
    depth_n, rank_n = verified_DR.shape
    share_DQR = _children_share(spec, depth_n, rank_n)
    opp_DR = np.zeros((depth_n, rank_n))
    opp_DR[0] = rounds * share_DQR[0, 0]
    opp_DR[1:] = np.einsum("dq,dqr->dr", np.asarray(verified_DR, np.float64)[:-1], share_DQR[1:])
    return opp_DR


@functools.lru_cache(maxsize=64)
def _children_share(spec: TreeSpec, depth_n: int, rank_n: int) -> np.ndarray:
    """[D, Q, R]: over the nodes at depth d of sibling rank q (the root: d = 0, q = 0), the share with more than r
    children (0 where no such node)."""
    ranks, depths = child_ranks(spec), spec.depths
    kids = np.zeros(spec.num_nodes, np.int64)
    for i in range(1, spec.num_nodes):
        kids[spec.parents[i]] += 1
    share = np.zeros((depth_n, rank_n, rank_n))
    for d in range(min(depth_n, spec.max_depth)):
        for q in range(rank_n):
            nodes = [i for i in range(spec.num_nodes) if depths[i] == d and (ranks[i] == q or i == 0)]
            if nodes:
                share[d, q] = [np.mean(kids[nodes] > r) for r in range(rank_n)]
    return share


def acceptance_from_stats(stats: dict[str, Any], spec: TreeSpec) -> Calibration:
    """Estimate positional acceptance from `out.stats` of a run that used the static tree `spec`.

    verified_child_rank[d][r] counts drafts at depth d+1 that verification accepted and that were
    rank r among their siblings, emitted or not: a row's last round, cut by its token budget or an
    EOS, still says how often the target agreed (counting only emitted drafts, accepted_child_rank,
    biases p low on short runs). Their opportunities: rank r at depth d was offered whenever the path
    reached a depth-(d-1) node with more than r children. The statistics give the accepted node's rank
    at each depth, not its index, so nodes of one (depth, rank) are assumed to have equally many
    children on average (exact for chains and k-ary trees).
    """
    rows = stats.get("row_rounds")
    if rows is None or "verified_child_rank" not in stats:
        raise ValueError("these statistics lack row_rounds / verified_child_rank: pass out.stats of a speculative "
                         "generate() call (with a drafter), not of plain decoding")
    rounds = int(sum(rows))
    acc_DR = np.asarray(stats["verified_child_rank"], np.float64)
    depth_n, rank_n = spec.max_depth, int(max(child_ranks(spec))) + 1
    if acc_DR.shape[0] < depth_n:
        raise ValueError(f"statistics cover depth {acc_DR.shape[0]} but the shape is {depth_n} deep: pass the "
                         f"tree the run actually used")
    acc_DR = acc_DR[:depth_n, :rank_n]
    opp_DR = opportunities(spec, acc_DR, rounds)
    with np.errstate(invalid="ignore", divide="ignore"):
        p_DR = np.where(opp_DR > 0, acc_DR / np.maximum(opp_DR, 1e-300), np.nan)
        p_R = acc_DR.sum(0) / np.maximum(opp_DR.sum(0), 1e-300)
    p_R = np.where(opp_DR.sum(0) > 0, p_R, 0.0)
    p_R = p_R * min(1.0, 1.0 / max(p_R.sum(), 1e-300))  # sampling noise must not break sum(p) <= 1
    filled_DR = np.where(np.isnan(p_DR), p_R[None, :], p_DR)
    return Calibration(spec, tuple(float(x) for x in p_R), tuple(tuple(float(x) for x in row) for row in p_DR),
                       tuple(tuple(float(x) for x in row) for row in opp_DR), rounds,
                       float(stats["acceptance_length"]), expected_tau(spec, p_R), expected_tau(spec, filled_DR))


def calibrate(target, drafter, prompts, spec: TreeSpec, max_new_tokens: int = 32, sampling=None,
              seed: int = 0, eos_token_id=None, min_tokens: int = 0, max_runs: int = 8) -> Calibration:
    """Run the speculative loop with `spec` on these prompts and estimate acceptance from its statistics.

    One run of a few rows is one draw of the drafter's luck: a single 64-token row at acceptance 0.9 has
    estimated p anywhere from 0.82 to 0.98 over seeds. So the run is repeated with the next seeds (same
    executable) and the statistics pooled until `min_tokens` tokens were emitted in all, at most max_runs
    runs; a run whose statistics equal the previous one's ends it (a deterministic drafter under greedy
    verification: more seeds draw nothing new).
    """
    runs: list[dict[str, Any]] = []
    while len(runs) < max(1, max_runs):
        out = speculative_generate(target, prompts, drafter, max_new_tokens=max_new_tokens,
                                   sampling=sampling or SamplingConfig(), seed=seed + len(runs), spec=spec,
                                   eos_token_id=eos_token_id, max_len=None)
        if runs and _same_draws(out.stats, runs[-1]):
            break
        runs.append(out.stats)
        if sum(_emitted(r) for r in runs) >= min_tokens:
            break
    return acceptance_from_stats(pool_stats(runs), spec)


def _emitted(stats: dict[str, Any]) -> float:
    return stats["acceptance_length"] * sum(stats["row_rounds"])


def _same_draws(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["verified_child_rank"] == b["verified_child_rank"] and a["row_rounds"] == b["row_rounds"]


def pool_stats(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The statistics `acceptance_from_stats` reads, pooled over runs of one shape: counts summed, rows
    concatenated, tau weighted by rounds."""
    rounds = sum(sum(r["row_rounds"]) for r in runs)
    return {"row_rounds": [n for r in runs for n in r["row_rounds"]],
            "verified_child_rank": np.sum([np.asarray(r["verified_child_rank"]) for r in runs], axis=0).tolist(),
            "acceptance_length": sum(_emitted(r) for r in runs) / max(rounds, 1)}


RUN_REPEATS, RUN_MIN_TIME_S, RUN_MAX_REPEATS = 7, 2.0, 30  # run_times' defaults: see its docstring


def run_times(target, drafter, prompts, chains: Sequence[int], max_new_tokens: int = 64, sampling=None,
              seed: int = 0, eos_token_id=None, repeats: int = RUN_REPEATS, min_time_s: float = RUN_MIN_TIME_S,
              max_repeats: int = RUN_MAX_REPEATS, earlier: RunTimes | None = None) -> RunTimes:
    """Median seconds per plain step and per speculative round of each chain length, and the prefill.

    Each loop runs for max_new_tokens and for a quarter of that; the difference in time over the
    difference in loop iterations is one iteration's cost (the prefill, which on short runs with long
    prompts is much of the time, cancels), and what the longer plain run took beyond its steps is the
    prefill. Plain and speculative runs alternate, so drift on a shared machine hits all alike; the first
    round of runs compiles and is not counted. At least `repeats` rounds, more (up to max_repeats) until
    the timed ones add up to min_time_s: small batches run in milliseconds, where a few runs are noise.
    Three rounds (the old default) were too few on this 2-core machine: at batch 16, three calls in a row
    once gave plain-step medians 2.47, 3.22 and 2.97 ms and noise estimates (a MAD of three) from 0.8% to
    21%; `python scripts/loop_timing_noise.py` compares settings side by side. `earlier`: timings of the same
    loops to pool these rounds with (medians and noise over both), so timing again adds to what was measured.
    """
    kw = {"sampling": sampling or SamplingConfig(), "seed": seed, "eos_token_id": eos_token_id, "max_len": None}
    lengths = (max_new_tokens, max(1, max_new_tokens // 4))
    if earlier is not None and [d for _, d, _ in earlier.spec_rounds] != list(chains):
        raise ValueError(f"earlier timings are of chains {[d for _, d, _ in earlier.spec_rounds]}, not {list(chains)}")

    def per_iteration(run) -> tuple[float, float]:
        """(seconds per loop iteration, seconds of the longer run beyond its iterations)."""
        long, short = (run(n) for n in lengths)
        iterations = long.stats["rounds"] - short.stats["rounds"]
        if iterations <= 0:  # every row stopped early (EOS): no difference to take
            return long.stats["decode_s"] / max(long.stats["rounds"], 1), 0.0
        step = (long.stats["decode_s"] - short.stats["decode_s"]) / iterations
        return step, max(0.0, long.stats["decode_s"] - step * long.stats["rounds"])

    # Both lengths run one executable per loop (shaped for the longer): half the compiles, and the difference
    # of the two runs is then the iterations alone.
    kw["token_bucket"] = lengths[0]

    def one_round() -> tuple[float, ...]:
        """(plain step, the plain run's prefill, a round of each chain)."""
        plain = per_iteration(lambda n: plain_generate(target, prompts, max_new_tokens=n, **kw))
        return plain + tuple(per_iteration(lambda n: speculative_generate(target, prompts, drafter, spec=chain(k),
                                                                          max_new_tokens=n, **kw))[0] for k in chains)

    one_round()  # compiles (or warms up): not counted
    samples = []
    start = time.perf_counter()
    # How long to go on is decided from this process's clock: every process of a multi-host job runs process 0's
    # count of rounds (each round's loops are collectives), and takes its timings (specjax/multihost.py agreed).
    while len(samples) < repeats or agreed(np.asarray(time.perf_counter() - start < min_time_s
                                                      and len(samples) < max_repeats)):
        samples.append(one_round())
    return summarise(chains, (earlier.samples if earlier is not None else ()) + tuple(samples))


def summarise(chains: Sequence[int], samples: tuple[tuple[float, ...], ...]) -> RunTimes:
    """RunTimes from timed rounds, each (plain step, prefill, a round of each chain): medians, and per chain the
    relative standard error of its median and the plain step's together; agreed across a multi-host job."""
    x_NC = np.asarray(samples, float)
    plain_error = relative_error(x_NC[:, 0])
    noise = np.asarray([np.hypot(plain_error, relative_error(x_NC[:, 2 + i])) for i in range(len(chains))])
    medians = agreed((np.median(x_NC, axis=0), noise))
    (step_s, prefill_s, *chain_s), noise = medians
    return RunTimes(float(step_s), tuple((k + 1, k, float(t)) for k, t in zip(chains, chain_s)), float(prefill_s),
                    tuple(float(e) for e in noise), tuple(tuple(float(v) for v in row) for row in samples))


def relative_error(x: Sequence[float]) -> float:
    """Relative standard error of the median of x: 1.25 x (1.4826 x MAD) / sqrt(n) / median (normal data)."""
    x = np.asarray(x, float)
    med = np.median(x)
    if x.size < 2 or med <= 0:
        return 0.0
    return float(1.25 * 1.4826 * np.median(np.abs(x - med)) / np.sqrt(x.size) / med)
