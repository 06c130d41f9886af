#!/usr/bin/env python
"""Verify cost against nodes per row on this device for a random target of a bench preset (`specjax profile`'s
measurement without a checkpoint on disk), optionally with the preset's MTP layer as the drafter.

    python scripts/profile_preset.py --preset qwen35_9b --batches 1,8 --nodes 1,4,16,64 --out runs/gpu/profile.json

Prints seconds per verify round (forward + acceptance + commit, timed as the loop runs them) and writes the
profile JSON `specjax plan --device <file>` reads.
"""

from __future__ import annotations

import argparse
import sys

from specjax.bench.ar import PRESETS
from specjax.bench.spec import random_model, random_mtp
from specjax.planning.profile import profile, save_profile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--nodes", default="1,4,16,64")
    ap.add_argument("--cache-lens", default="1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mtp", action="store_true", help="time the random MTP layer's drafting too (hybrid presets)")
    ap.add_argument("--out", default="runs/profile_preset.json")
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    target = random_model(PRESETS[args.preset], args.dtype, 0, "auto")
    drafter = random_mtp(target) if args.mtp else None
    prof = profile(target, drafter, ints(args.batches), ints(args.nodes), ints(args.cache_lens), repeats=args.repeats,
                   log=lambda m: print(m, flush=True))
    print(f"wrote {save_profile(prof, args.out)} (key {prof.key})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
