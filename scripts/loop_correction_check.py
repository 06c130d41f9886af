#!/usr/bin/env python
"""Which loop correction predicts measured speedups best? The shipped `profile.in_loop` against the
least-squares line it replaced, from the same timings, next to measured runs.

    python scripts/loop_correction_check.py --alpha 0.6 --batches 1,4

For the embedded target and the tree replay drafter: acceptance from a pooled calibration run, loop timings
(`calibration.run_times` of auto.TIMED_CHAINS) and verify passes (`profile.cost_for_run`), as "auto"
measures them; then plain decoding, chains 1..8 and the DP's trees of 8, 9 and 16 nodes measured
interleaved (`bench_plan.measure_shapes`), each predicted for the call under both corrections. Prints
every shape and the median |predicted - measured| / measured per correction.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_check import TINY, held_out_prompts, make_drafter  # noqa: E402

from specjax import load  # noqa: E402
from specjax.bench.plan import measure_shapes  # noqa: E402
from specjax.decoding.tree import chain, kary  # noqa: E402
from specjax.planning.auto import CALIBRATION_MIN_TOKENS, CALIBRATION_TREE, TIMED_CHAINS
from specjax.planning.calibration import calibrate, run_times  # noqa: E402
from specjax.planning.planner import Call, best_trees, score, shape_of
from specjax.planning.profile import CostModel, cost_for_run, in_loop  # noqa: E402


def least_squares_line(base: CostModel, times, batch: int) -> CostModel:
    """The replaced correction: every round pays a least-squares line in nodes through what the timed rounds
    took beyond their modelled pass and drafting, held flat outside the timed range."""
    n_R = np.array([n for n, _, _ in times.spec_rounds], float)
    rest_R = np.array([t - base.verify_s(batch, n) - base.draft_s(batch, d) for n, d, t in times.spec_rounds])
    slope, intercept = np.polyfit(n_R, rest_R, 1)
    rest = lambda n: float(intercept + slope * np.clip(n, n_R.min(), n_R.max()))  # noqa: E731
    return CostModel(lambda b, n: max(times.plain_step_s, base.verify_s(b, n) + rest(n)), base.draft_s,
                     "least-squares line", lambda b: times.plain_step_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--min-time", type=float, default=20.0)
    args = ap.parse_args(argv)
    target = load(TINY / "target")
    tokens = args.max_new_tokens
    for b in (int(x) for x in args.batches.split(",")):
        prompts = held_out_prompts(b)
        drafter = make_drafter(f"replay:{args.alpha}", target, prompts, tokens)
        run = {"max_new_tokens": tokens, "eos_token_id": []}
        p = calibrate(target, drafter, prompts, kary(CALIBRATION_TREE), min_tokens=CALIBRATION_MIN_TOKENS,
                      **run).p_rank
        times = run_times(target, drafter, prompts, list(TIMED_CHAINS), **run)
        base = cost_for_run(target, drafter, b, max(len(r) for r in prompts) + tokens // 2)
        models = {"interpolated (shipped)": in_loop(base, times, b),
                  "least-squares line": least_squares_line(base, times, b)}
        table = best_trees(p, 16, 8)
        specs = [None, *(chain(k) for k in range(1, 9)), *(table.tree(n) for n in (8, 9, 16))]
        shapes = list({s.label: s for s in (shape_of(spec, p) for spec in specs)}.values())
        rows = measure_shapes(target, prompts, drafter, shapes, max_new_tokens=tokens, repeats=5, batch=b,
                              min_time_s=args.min_time, log=lambda m: None)
        call = Call(tokens, lambda _b: times.prefill_s)
        errors = {name: [] for name in models}
        for row, shape in zip(rows, shapes):
            preds = {name: score(shape, b, m.verify_s, m.draft_s, m.plain_s, call).speedup
                     for name, m in models.items()}
            for name, pred in preds.items():
                errors[name].append(abs(pred / row["speedup"] - 1))
            print(f"batch {b:3d} {shape.label:<14} measured {row['speedup']:.3f}x  " +
                  "  ".join(f"{name} {pred:.3f}x" for name, pred in preds.items()), flush=True)
        medians = ", ".join(f"{name} {np.median(e):.1%}" for name, e in errors.items())
        print(f"batch {b:3d} median |error|: {medians}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
