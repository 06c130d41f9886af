#!/usr/bin/env python
"""A verify round timed as the profile times it, next to a plain step timed inside the loop.

    python scripts/profile_vs_loop.py            # tiny20m, batch 32, 1000 cached positions

Rounds of 1, 2 and 5 nodes timed by `profile.time_verify_round` as the loop runs them (8 rounds per
jitted fori_loop call) and one round per call (steps=1, the profile's old way: each call pays its own
dispatch, and on the CPU a commit that copies the whole cache). The plain step comes from the loop
itself: two runs of different lengths, the difference in time over the difference in steps.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from specjax import generate
from specjax.bench.ar import PRESETS
from specjax.bench.spec import random_model
from specjax.planning.profile import time_verify_round


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny20m", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cache-len", type=int, default=1000)
    args = ap.parse_args(argv)
    target = random_model(PRESETS[args.preset], "float32", 0, "auto")
    b, c = args.batch, args.cache_len
    for n in (1, 2, 5):
        loop_style = time_verify_round(target, b, n, c, repeats=3)[0]
        one_per_call = time_verify_round(target, b, n, c, repeats=3, steps=1)[0]
        print(f"verify round, {n} nodes: {loop_style * 1e3:7.2f} ms as the loop runs it, "
              f"{one_per_call * 1e3:7.2f} ms one per call", flush=True)
    prompts = np.random.default_rng(0).integers(3, target.cfg.vocab_size, size=(b, c - 10)).tolist()
    long_short = [generate(target, prompts, max_new_tokens=n, eos_token_id=[]) for n in (40, 10) * 3]
    steps = [(lo.stats["decode_s"] - sh.stats["decode_s"]) / 30 for lo, sh in zip(long_short[2::2], long_short[3::2])]
    print(f"plain step inside the loop: {statistics.median(steps) * 1e3:7.2f} ms "
          f"(cache buffer {long_short[0].stats['cache_len']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
