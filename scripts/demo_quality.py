#!/usr/bin/env python
"""Does the embedded target write plausible code? Its continuations of the held-out prompts, per decoding setting.

    python scripts/demo_quality.py --out runs/demo_quality.json

The manifest's held-out prompts (checkpoints/tiny/manifest.json: files of the test split, never trained on and
never picked for the demo), --tokens new tokens each (the demo's 48), EOS off. Settings: greedy, and sampling
at a few temperatures with top_p 0.95 over --seeds seeds. Per setting: the mean and lowest distinct-4-gram ratio
(specjax/bench/quality.py), the longest run of one repeated line, and how many continuations meet the demo's bar
(distinct 4-grams >= 0.7 and no line three times running).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import specjax
from specjax.bench.quality import distinct_ngram_ratio, longest_line_run

ROOT = Path(__file__).resolve().parent.parent
BAR_DISTINCT, BAR_RUN = 0.7, 3


def held_out_prompts() -> list[str]:
    return [p["text"] for p in json.loads((ROOT / "checkpoints/tiny/manifest.json").read_text())["held_out_prompts"]]


def measure(target, prompts: list[str], tokens: int, seeds: list[int], **sampling) -> dict:
    """Quality figures of every continuation of every prompt under one setting (greedy: one seed)."""
    outs = []
    for seed in seeds if sampling else [0]:
        out = specjax.generate(target, prompts, max_new_tokens=tokens, eos_token_id=[], seed=seed, **sampling)
        outs += list(zip(out.tokens, out.texts))
    distinct = [distinct_ngram_ratio(t) for t, _ in outs]
    runs = [longest_line_run(text) for _, text in outs]
    ok = sum(d >= BAR_DISTINCT and r < BAR_RUN for d, r in zip(distinct, runs))
    return {"continuations": len(outs), "distinct4_mean": statistics.mean(distinct), "distinct4_min": min(distinct),
            "longest_line_run": max(runs), "meet_bar": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--temperatures", default="0.6,0.8,1.0")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    target = specjax.load(ROOT / "checkpoints/tiny/target")
    prompts = held_out_prompts()
    seeds = list(range(args.seeds))
    settings = {"greedy": {}}
    for t in (float(x) for x in args.temperatures.split(",")):
        settings[f"temperature {t:g}, top_p 0.95"] = {"temperature": t, "top_p": 0.95}
    rows = {name: measure(target, prompts, args.tokens, seeds, **kw) for name, kw in settings.items()}
    print(f"embedded target, {len(prompts)} held-out prompts, {args.tokens} tokens each, {args.seeds} seeds when "
          f"sampled; bar: distinct 4-grams >= {BAR_DISTINCT}, no line {BAR_RUN} times running")
    print("| decoding | continuations | distinct-4 mean | distinct-4 min | longest line run | meet the bar |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['continuations']} | {r['distinct4_mean']:.2f} | {r['distinct4_min']:.2f} | "
              f"{r['longest_line_run']} | {r['meet_bar']}/{r['continuations']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"tokens": args.tokens, "seeds": args.seeds, "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
