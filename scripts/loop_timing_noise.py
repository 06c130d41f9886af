#!/usr/bin/env python
"""How steady are the loop timings "auto" plans from? `calibration.run_times` called several times in a row.

    python scripts/loop_timing_noise.py --batch 16 --repeats 3,7

For the embedded target and the tree replay drafter (acceptance --alpha) on the manifest's held-out
prompts: per setting of `repeats`, --trials calls of run_times (plain decoding and auto.TIMED_CHAINS
timed in the loop), each call's medians (ms per plain step and per round) and its noise estimate (the
relative standard error behind "auto"'s margin). Steady medians and a steady noise estimate across
trials are what a plan needs; the spread of the medians across trials is the error a plan inherits.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_check import TINY, held_out_prompts, make_drafter  # noqa: E402

from specjax import load  # noqa: E402
from specjax.planning.auto import TIMED_CHAINS  # noqa: E402
from specjax.planning.calibration import run_times  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--repeats", default="3,7", help="run_times(repeats=...) settings to compare")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    target = load(TINY / "target")
    prompts = held_out_prompts(args.batch)
    drafter = make_drafter(f"replay:{args.alpha}", target, prompts, args.max_new_tokens)
    print(f"batch {args.batch}, replay {args.alpha}, {args.max_new_tokens} tokens; ms per plain step | chains "
          f"{','.join(map(str, TIMED_CHAINS))}")
    for repeats in (int(x) for x in args.repeats.split(",")):
        medians = []
        for trial in range(args.trials):
            start = time.perf_counter()
            rt = run_times(target, drafter, prompts, list(TIMED_CHAINS), max_new_tokens=args.max_new_tokens,
                           eos_token_id=[], repeats=repeats, min_time_s=0.0)
            row = [rt.plain_step_s] + [s for _, _, s in rt.spec_rounds]
            medians.append(row)
            print(f"repeats {repeats} trial {trial}: {' '.join(f'{x * 1e3:6.2f}' for x in row)}  noise "
                  f"{rt.noise:.3f}  ({time.perf_counter() - start:.0f} s)", flush=True)
        m = np.array(medians)
        spread = (m.max(0) - m.min(0)) / np.median(m, 0)
        print(f"repeats {repeats}: spread of medians across trials {' '.join(f'{x:6.1%}' for x in spread)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
