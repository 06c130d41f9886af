"""`generate(..., num_draft_tokens="auto")`: measure this call's acceptance and costs, then plan its shape.

The pure planning is specjax/planning/planner.py; this module runs the measurements it plans from
(calibration.py for acceptance and loop timings, profile.py for pass costs) and caches them per
(target, drafter, batch bucket).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
import weakref
from typing import Any

import numpy as np
from tqdm import TqdmWarning

from specjax.decoding.request import batch_bucket, prompt_ids, timing_context
from specjax.decoding.tree import DynamicTreeSpec, TreeSpec, chain, kary, parse_tree
from specjax.models.sharding import axis_size
from specjax.multihost import agreed, agreed_json
from specjax.planning.block_trees import CALIBRATION_WIDTH, best_block_tree, caterpillar
from specjax.planning.calibration import RUN_MAX_REPEATS, RUN_MIN_TIME_S, RUN_REPEATS, calibrate, run_times
from specjax.planning.planner import Call, Scored, Shape, drafter_takes_trees, drafts_with_a_model, plan, score
from specjax.planning.profile import pass_costs, time_propose, with_loop_times

with warnings.catch_warnings():  # in a notebook kernel without ipywidgets tqdm.auto warns, then uses the text bar
    warnings.simplefilter("ignore", TqdmWarning)
    from tqdm.auto import tqdm

CALIBRATION_TREE = (4, 2, 1, 1)  # kary: ranks 0..3 at depth 1, ranks 0..1 below, four levels deep
CALIBRATION_CHAIN = 4
CALIBRATION_TOKENS = 64  # a row's last round is cut by its budget: short runs bias acceptance low
CALIBRATION_MIN_TOKENS = 256  # small batches calibrate over more seeds until this many tokens were emitted
# Chains timed inside the loop next to plain decoding (profile.in_loop). Every chain up to 4, the shapes
# loaded batches pick: at batch 16 on this CPU a chain of 3 (64 tokens per pass) measured 1.38-1.47x in
# three runs against 1.30-1.33x for chains of 2 and 4, a dip no interpolation between them can see.
TIMED_CHAINS = (1, 2, 3, 4, 8)
# "auto" speculates only when the prediction beats plain decoding by this much, or by twice the relative
# standard error of the loop timings behind it (plain steps, and the timed chain nearest the shape in nodes)
# when that is larger: at batch 1 a round takes a fraction of a millisecond and the timings move by several
# percent. A near-tie is not worth running slower.
AUTO_MIN_GAIN = 0.02
# A plan whose best shape gains more than AUTO_MIN_GAIN but less than the noise margin is undecided, not a loss: the
# loops are timed again, RETIME_FACTOR times longer (the error of a median falls as 1/sqrt(runs)), and planned from
# those timings. plan_check at replay 0.6, batch 8: chain:2 predicted 1.075x under a margin of 8.5%, so "auto" decoded
# plainly (0.99x) where chain:1 measured 1.09x.
RETIME_FACTOR = 4
# `specjax plan`'s default (quick=True): a bounded measurement per batch, the loops timed QUICK_REPEATS rounds of
# QUICK_TIMING_TOKENS and never again, chains of QUICK_CHAINS (every one a compile), a gain inside the noise reported
# as such (the plan's "undecided") rather than chased; `specjax plan --full` and generate(..., "auto") measure as
# above. docs/planning.md's `specjax plan --drafter checkpoints/tiny/eagle3 --concurrency 1,8,32 --tokens 64` took over
# 15 minutes in full on this 2-core machine under load (stopped there); quick, 100 s of CPU time (timing over 64
# tokens, its compiles cached) and 144 s (over 32, compiled afresh), 7 and 12 minutes of wall time at load 15-19.
QUICK_REPEATS = 3
QUICK_CHAINS = (1, 2, 4)
QUICK_TIMING_TOKENS = 32  # the loops timed over this many tokens (and a quarter of it), not CALIBRATION_TOKENS
# Target -> {key: AutoMeasurements}: per Target object (a target loaded on another mesh is another object, measured
# on its own mesh; its loops' compile keys hold their arguments' shardings, request.params_signature)
_AUTO_PLANS: weakref.WeakKeyDictionary | None = None


@dataclasses.dataclass
class AutoMeasurements:
    """What "auto" measured for one (drafter, batch bucket, trees, sampling), and the plans made from it per
    token budget (the budget changes the plan, through the prefill's share and the slowest row, but not
    what was measured)."""

    params: Any  # the drafter params measured with: other params are another drafter
    p_rank: tuple[float, ...]
    p_depth_rank: Any  # float64 [D, R] per-depth acceptance (unmeasured cells: p_rank's), for one-pass block trees
    calibration: dict[str, Any]
    base: Any  # profile.CostModel: the pass costs timed on their own
    cost: Any  # profile.CostModel: `base` corrected to the rounds timed in the loop
    prefill_s: float
    times: Any  # profile.RunTimes: the loop timings, whose noise sets the margin
    retimed_from: float | None = None  # the margin before the loops were timed again (None: timed once)
    quick: bool = False  # measured quickly (QUICK_REPEATS, QUICK_CHAINS): never timed again
    plans: dict[int, tuple[TreeSpec | DynamicTreeSpec | None, dict[str, Any]]] = dataclasses.field(default_factory=dict)


def auto_shape(target, drafter, prompts, *, trees: bool, sampling, seed, eos_token_id,
               max_new_tokens: int, quick: bool = False) -> tuple[TreeSpec | DynamicTreeSpec | None, dict[str, Any]]:
    """The draft shape for this call: planned from measurements cached per (target, drafter, batch bucket),
    made now when there are none.

    Measuring: a short calibration run on these prompts for acceptance (a 4,2,1,1 tree, or a chain of 4
    when trees=False or the drafter proposes chains only; repeated over seeds until CALIBRATION_MIN_TOKENS
    tokens, for a stochastic drafter or sampling at small batches); chains of TIMED_CHAINS timed next to plain
    decoding on the same prompts; pass costs from `profile.pass_costs` (measured here, or $SPECJAX_PROFILE),
    corrected to the rounds timed in the loop (`profile.with_loop_times`). Planning: `plan` at this batch bucket
    for this call (its prefill, and its slowest row after max_new_tokens); a gain inside the timings' noise times
    the loops again (RETIME_FACTOR). A block drafter (DFlash, DSpark: `one_pass_trees`) calibrates on a
    caterpillar (every depth's ranks offered: per-depth acceptance) and also weighs one-pass dynamic trees
    (planning/block_trees.py). Returns (None for "off", the TreeSpec or DynamicTreeSpec) and the record that
    goes into out.stats["plan"]. quick: measure as `specjax plan` does by default (QUICK_REPEATS, QUICK_CHAINS, no
    retiming); its measurements are cached like the others, so a generate(..., "auto") after it plans from them.
    """
    global _AUTO_PLANS
    if _AUTO_PLANS is None:
        _AUTO_PLANS = weakref.WeakKeyDictionary()
    ids = prompt_ids(target, prompts)
    batch = batch_bucket(len(ids), axis_size(getattr(target, "mesh", None), "data"))  # the rows the loops run
    trees = trees and drafter_takes_trees(drafter, target)
    # Block drafters (DFlash, DSpark) draft at most one block per round: chains never longer than that.
    max_chain = min(16, getattr(drafter, "max_draft_tokens", 16))
    key = (drafter, batch, trees, sampling)
    cached = _AUTO_PLANS.setdefault(target, {})
    measured = cached.get(key)
    context = timing_context(ids, max_new_tokens)
    start = time.perf_counter()
    run = {"max_new_tokens": min(CALIBRATION_TOKENS, max_new_tokens), "sampling": sampling, "seed": seed,
           "eos_token_id": eos_token_id}  # the calibration and timing runs
    if measured is None or measured.params is not drafter.params:
        sibling = cached.get((drafter, batch, not trees, sampling))  # the same loops timed for the other kind
        timed = None if sibling is None or sibling.params is not drafter.params else sibling
        measured = cached[key] = _measure_for_auto(target, drafter, prompts, batch, trees, max_chain, context, run,
                                                   timed, quick)
    if max_new_tokens in measured.plans:
        spec, info = measured.plans[max_new_tokens]
        return spec, {**info, "cached": True, "plan_s": time.perf_counter() - start}
    call = Call(max_new_tokens, lambda b: measured.prefill_s)
    choice, best, margin = _best_shape(measured, target, drafter, batch, trees, max_chain, context, call)
    undecided = 1 + AUTO_MIN_GAIN <= best.speedup < 1 + margin and measured.retimed_from is None
    # one decision across a multi-host job: the timing runs are collectives; a quick measurement reports the noise
    if agreed(np.asarray(undecided and not measured.quick)):
        measured = cached[key] = _retimed(measured, target, drafter, prompts, batch, run, best, margin)
        choice, best, margin = _best_shape(measured, target, drafter, batch, trees, max_chain, context, call)
    chosen = best.shape
    if best.speedup < 1 + margin:  # within the timings' error of plain decoding: run plain
        chosen = Shape("off", None, 1.0)
    info = {"shape": chosen.label, "kind": chosen.kind, "batch_bucket": batch, "tokens": max_new_tokens,
            "predicted_tau": chosen.tau, "predicted_speedup": best.speedup if chosen.spec else 1.0,
            "best_predicted": best.shape.label, "best_predicted_speedup": best.speedup,
            "best_predicted_tau": best.shape.tau,
            "runner_up": None if choice.runner_up is None else choice.runner_up.shape.label,
            "runner_up_tau": None if choice.runner_up is None else choice.runner_up.shape.tau,
            "runner_up_speedup": None if choice.runner_up is None else choice.runner_up.speedup,
            "p_rank": list(measured.p_rank), **measured.calibration, "prefill_s": measured.prefill_s,
            "margin": margin, "margin_before_retiming": measured.retimed_from,
            "undecided": bool(1 + AUTO_MIN_GAIN <= best.speedup < 1 + margin), "quick": measured.quick,
            "cost": measured.cost.source, "parents": chosen.as_dict()["parents"], "cached": False}
    # Each process of a multi-host job timed its own loops: all of them run the plan process 0 made.
    dynamic = isinstance(chosen.spec, DynamicTreeSpec)  # a block drafter's one-pass tree: its spec string
    decided = agreed_json({"parents": info["parents"], "dynamic": str(chosen.spec) if dynamic else None, "info": info})
    spec = None if decided["parents"] is None else TreeSpec(tuple(decided["parents"]))
    if decided["dynamic"] is not None:
        spec = parse_tree(decided["dynamic"], None)
    info = decided["info"]
    measured.plans[max_new_tokens] = (spec, info)
    # Measuring and planning (their loops' compiles included): the call's own compile_s is then ~0.
    return spec, {**info, "plan_s": time.perf_counter() - start}


def _best_shape(measured: AutoMeasurements, target, drafter, batch: int, trees: bool, max_chain: int, context: int,
                call: Call):
    """(the planner's choice, its best shape scored for this call, the noise margin that shape must beat)."""
    choice = plan(measured.p_rank, [batch], measured.cost.verify_s, measured.cost.draft_s, max_nodes=64,
                  max_depth=min(12, max_chain), tree_ok=trees, max_chain=max_chain, plain_s=measured.cost.plain_s,
                  call=call)[0]
    if trees and one_pass_trees(drafter):
        block = best_block_tree(measured.p_depth_rank, batch, measured.cost.verify_s, measured.cost.draft_s,
                                measured.cost.plain_s, call, max_levels=max_chain)
        if block is not None and block.speedup > choice.best.speedup:
            choice = dataclasses.replace(choice, best=block, runner_up=choice.best)
    best = choice.best
    if best.shape.kind == "tree" and drafts_with_a_model(drafter, best.shape.spec):
        best = max([tree_with_its_drafting(best, target, drafter, batch, context, measured.cost, call),
                    choice.runner_up], key=lambda c: -1.0 if c is None else c.speedup)
    return choice, best, max(AUTO_MIN_GAIN, 2 * measured.times.noise_at(best.shape.nodes))


def _retimed(measured: AutoMeasurements, target, drafter, prompts, batch: int, run: dict[str, Any], best: Scored,
             margin: float) -> AutoMeasurements:
    """`measured` with its loops timed again, RETIME_FACTOR times longer and pooled with the first timings, and the
    cost model corrected to them (acceptance and the pass costs are kept)."""
    chains = [depth for _, depth, _ in measured.times.spec_rounds]  # the chains timed the first time
    with tqdm(total=1, desc=f"specjax auto (batch {batch}): {best.shape.label} gains {best.speedup - 1:.1%}, inside "
              f"the timings' noise ({margin:.1%}): timing again", leave=False, file=sys.stderr) as bar:
        times = run_times(target, drafter, prompts, chains, repeats=RETIME_FACTOR * RUN_REPEATS,
                          min_time_s=RETIME_FACTOR * RUN_MIN_TIME_S, max_repeats=RETIME_FACTOR * RUN_MAX_REPEATS,
                          earlier=measured.times, **run)
        bar.update()
    return dataclasses.replace(measured, cost=with_loop_times(measured.base, times, batch), prefill_s=times.prefill_s,
                               times=times, retimed_from=margin, plans={})


def _measure_for_auto(target, drafter, prompts, batch: int, trees: bool, max_chain: int, context: int,
                      run: dict[str, Any], timed: AutoMeasurements | None = None,
                      quick: bool = False) -> AutoMeasurements:
    """Acceptance from a calibration run, and the cost model corrected to rounds timed in the loop (taken from
    `timed`, the same drafter's measurements at this batch for the other kind of shape, when there are some:
    the timed loops are chains either way)."""
    spec = chain(min(CALIBRATION_CHAIN, max_chain))
    if trees:  # a block drafter's tree costs one pass at any depth: measure every depth of its block, 4 ranks wide
        spec = caterpillar(CALIBRATION_WIDTH, max_chain) if one_pass_trees(drafter) else kary(CALIBRATION_TREE)
    chains = sorted({min(k, max_chain) for k in (QUICK_CHAINS if quick else TIMED_CHAINS)})
    budget = {"repeats": QUICK_REPEATS, "min_time_s": 0.0, "max_repeats": QUICK_REPEATS,
              "max_new_tokens": min(QUICK_TIMING_TOKENS, run["max_new_tokens"])} if quick else {}
    # The first "auto" call for a batch bucket compiles and times a dozen loops (tens of seconds on a CPU): say so.
    with tqdm(total=1 if timed else 3, desc=f"specjax auto (batch {batch}): calibrating acceptance", leave=False,
              file=sys.stderr) as bar:
        cal = calibrate(target, drafter, prompts, spec, min_tokens=CALIBRATION_MIN_TOKENS, **run)
        bar.update()
        if timed is None:
            bar.set_description(f"specjax auto (batch {batch}): timing chains {','.join(map(str, chains))} and plain")
            # Rounds are timed on chains, whose drafting the profile's draft_s(batch, depth) models exactly.
            times = run_times(target, drafter, prompts, chains, **{**run, **budget})
            bar.update()
            bar.set_description(f"specjax auto (batch {batch}): timing verify passes and drafting")
            base = pass_costs(target, drafter, batch, context)
            bar.update()
        else:
            times, base = timed.times, timed.base
    p_DR = np.asarray(cal.p_depth_rank, np.float64)
    p_DR = np.where(np.isnan(p_DR), np.asarray(cal.p_rank)[None, :], p_DR)
    return AutoMeasurements(drafter.params, tuple(cal.p_rank), p_DR,
                            {"calibration_shape": spec.num_nodes, "calibration_rounds": cal.rounds,
                             "calibration_tau_measured": cal.measured_tau,
                             "calibration_tau_predicted": cal.predicted_tau},
                            base, with_loop_times(base, times, batch), times.prefill_s, times,
                            None if timed is None else timed.retimed_from,
                            quick=quick if timed is None else timed.quick)


def one_pass_trees(drafter) -> bool:
    """Whether the drafter draws a whole tree from one pass (DFlash, DSpark): its trees are priced as such."""
    return bool(getattr(drafter, "one_pass_trees", False))


def tree_with_its_drafting(tree: Scored, target, drafter, batch: int, cache_len: int, cost,
                           call: Call | None = None) -> Scored:
    """Rescore a planned tree with its own drafting time: a draft model runs every level's whole frontier, so a
    tree's propose costs more than the chain of the same depth that the cost model's draft_s measured."""
    spec = tree.shape.spec
    tree_s, _ = time_propose(target, drafter, batch, spec, cache_len, repeats=3)
    chain_s, _ = time_propose(target, drafter, batch, spec.max_depth, cache_len, repeats=3)
    extra = max(0.0, tree_s - chain_s)
    return score(tree.shape, batch, cost.verify_s, lambda b, d: cost.draft_s(b, d) + extra, cost.plain_s, call)


def auto_cost(target, drafter, batch: int):
    """The cost model (profile.CostModel) the last "auto" plan for (target, drafter, batch bucket) used, or None.

    For benchmarks that put the planner's predictions for every shape next to measurements.
    """
    for (d, b, _, _), measured in ((_AUTO_PLANS or {}).get(target) or {}).items():
        if d == drafter and b == batch and measured.params is drafter.params:
            return measured.cost
    return None
