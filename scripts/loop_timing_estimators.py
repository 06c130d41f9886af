#!/usr/bin/env python
"""Which estimate of a loop iteration's cost is steadiest on this machine? Raw run times, four estimators.

    python scripts/loop_timing_estimators.py --batches 1,8,32 --rounds 15 --trials 4

`calibration.run_times` (what "auto" plans from) times each loop for 64 tokens and for 16 and takes the median of
the per-round differences over the iterations between them. Here, for the embedded target with the tree replay
drafter (acceptance --alpha) on the manifest's held-out prompts, plain decoding and chains of 2 and 4 are timed the
same way, interleaved, --rounds per trial, and each trial's cost per iteration is estimated four ways: the median of
the differences (run_times'), the difference of the medians, of the minima and of the lower quartiles. An estimator
a plan can trust moves little between trials, above all in its ratios to plain decoding, which set the speedup.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_check import TINY, held_out_prompts, make_drafter  # noqa: E402

from specjax import load  # noqa: E402
from specjax.config import SamplingConfig  # noqa: E402
from specjax.decoding.plain import plain_generate  # noqa: E402
from specjax.decoding.speculative import speculative_generate  # noqa: E402
from specjax.decoding.tree import chain  # noqa: E402

ESTIMATORS = {
    "median of differences": lambda long_s, short_s: np.median(long_s - short_s),
    "difference of medians": lambda long_s, short_s: np.median(long_s) - np.median(short_s),
    "difference of minima": lambda long_s, short_s: long_s.min() - short_s.min(),
    "difference of lower quartiles": lambda long_s, short_s: np.quantile(long_s, 0.25) - np.quantile(short_s, 0.25),
}


def spread(x_TL: np.ndarray) -> str:
    """(max - min) / median across trials, per loop."""
    return " ".join(f"{s:6.1%}" for s in (x_TL.max(0) - x_TL.min(0)) / np.median(x_TL, 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    target = load(TINY / "target")
    lengths = (args.max_new_tokens, args.max_new_tokens // 4)
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = held_out_prompts(batch)
        drafter = make_drafter(f"replay:{args.alpha}", target, prompts, args.max_new_tokens)
        kw = {"sampling": SamplingConfig(), "seed": 0, "eos_token_id": [], "max_len": None, "token_bucket": lengths[0]}
        loops = {"plain": lambda n: plain_generate(target, prompts, max_new_tokens=n, **kw)}
        for k in (2, 4):
            loops[f"chain:{k}"] = lambda n, k=k: speculative_generate(target, prompts, drafter, spec=chain(k),
                                                                      max_new_tokens=n, **kw)
        iterations = {}
        for name, run in loops.items():  # compiles, and the iterations between the two lengths
            long, short = (run(n) for n in lengths)
            iterations[name] = long.stats["rounds"] - short.stats["rounds"]
        estimates = {e: [] for e in ESTIMATORS}  # estimator -> per trial, ms per iteration of each loop
        for trial in range(args.trials):
            times = {name: [] for name in loops}
            for _ in range(args.rounds):
                for name, run in loops.items():
                    times[name].append([run(n).stats["decode_s"] for n in lengths])
            for e, estimate in ESTIMATORS.items():
                estimates[e].append([estimate(*np.asarray(times[name]).T) / iterations[name] * 1e3 for name in loops])
            print(f"batch {batch}, trial {trial}, ms per iteration ({', '.join(loops)}): "
                  + "; ".join(f"{e} " + " ".join(f"{x:.3f}" for x in v[-1]) for e, v in estimates.items()), flush=True)
        print(f"batch {batch}: spread across {args.trials} trials, (max - min) / median, of each loop's cost | of its "
              "ratio to plain")
        for e, v in estimates.items():
            v = np.asarray(v)
            ratio = v[:, 1:] / v[:, :1]
            print(f"  {e:30s} {spread(v)} | {spread(ratio)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
