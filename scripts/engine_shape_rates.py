"""Does "auto" measure each shape as that shape's own engine realizes it? At one concurrency, what the "auto"
engine's policy believes of each shape at the occupancy bucket (its round cost, tau, realization factor, the
prediction it chooses on, and the realized tokens per live row per second it drops shapes on), beside each fixed
engine's own realized rate and tokens/s.

    python scripts/engine_shape_rates.py --preset tiny20m --drafter treereplay:0.6 --concurrency 8 --requests 24

Drafters as in scripts/bench_engine_load.py (`make_drafter`: the preset's draft model, replay or tree replay), whose
workload (`keep_in_flight`, mixed output lengths) and cache sizing this reuses. Settings run interleaved, a
shuffled order per repeat. A shape predicted above another by the policy but realized below it in its own engine
is a wrong choice the policy will make: this is the tool for finding why (a round cost that misses the host's gap,
a factor shrunk to the model's word, a trial cut short).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

import specjax
from bench_engine_load import engine_settings, keep_in_flight, make_drafter, workload
from specjax.bench.ar import PRESETS, machine_info
from specjax.decoding.request import batch_bucket


def fmt(x: float | None, width: int, digits: int = 1) -> str:
    """A table cell: x right-aligned, or "-" where there is none."""
    return f"{x:>{width}.{digits}f}" if x is not None else f"{'-':>{width}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny20m", choices=sorted(PRESETS))
    ap.add_argument("--drafter", default="draft", help="draft, replay:ALPHA or treereplay:ALPHA")
    ap.add_argument("--chains", default="1,2,4")
    ap.add_argument("--trees", default="", help="';'-separated trees among auto's shapes (a tree-drafting drafter)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48, help="mean output tokens (uniform within +-50%%)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    chains = [int(k) for k in args.chains.split(",")]
    trees = [t for t in args.trees.split(";") if t]
    target, draft_model, prompts, budgets, continuations, max_len = workload(
        args.preset, None, args.prompt_len, args.tokens, 0.5, chains, trees)
    drafter = make_drafter(args.drafter, draft_model, continuations, prompts, target.cfg.vocab_size)
    settings = engine_settings(chains, trees)
    engines = {name: specjax.Engine(target, drafter, max_slots=args.slots, max_len=max_len, sampling=False, **kw)
               for name, kw in settings.items()}
    for engine in engines.values():
        engine.warmup()
    nb = min(batch_bucket(args.concurrency, 1), args.slots)
    runs = []
    for rep in range(args.repeats):
        order = list(engines)
        np.random.default_rng(rep).shuffle(order)
        for name in order:
            engine = engines[name]
            changes_before = len(engine.stats()["shapes_over_time"])
            tokens, seconds = keep_in_flight(engine, prompts, budgets, args.concurrency, total=args.requests)
            stats = engine.stats()
            belief = {label: {key: stats[key].get(f"{nb}/{label}") for key in ("round_ms", "realized_factor",
                                                                                "realized_row_rate")}
                      | {"tau": stats["tau"][label], "predicted_row_rate": engine.policy.predicted(nb, 1, label)}
                      for label in stats["shapes"]}
            ran = [s for _, _, s in stats["shapes_over_time"][max(0, changes_before - 1):]]
            runs.append({"repeat": rep, "engine": name, "tok_s": tokens / seconds, "belief": belief, "ran": ran})
            print(f"{rep} {name}: {tokens / seconds:.0f} tokens/s" + (f", ran {ran}" if name == "auto" else ""),
                  flush=True)
    auto_tok_s = statistics.median(r["tok_s"] for r in runs if r["engine"] == "auto")
    print(f"\nauto: {auto_tok_s:.0f} tokens/s (median). At bucket {nb}: auto's belief after the last repeat | each "
          "fixed engine's own (medians over repeats)")
    print(f"{'shape':>22} {'round ms':>9} {'tau':>5} {'factor':>7} {'predicted':>10} {'realized':>9} | "
          f"{'realized':>9} {'tokens/s':>9}")
    auto = [r for r in runs if r["engine"] == "auto"][-1]["belief"]
    for name in [n for n in engines if n != "auto"]:
        own = [r for r in runs if r["engine"] == name]
        tok_s = statistics.median(r["tok_s"] for r in own)
        # a fixed engine has one shape (a fixed tree's label may spell its spec otherwise than auto's)
        b = auto.get(name, {})
        rates = [rate for r in own if (rate := next(iter(r["belief"].values()))["realized_row_rate"]) is not None]
        mine = statistics.median(rates) if rates else None
        print(f"{name:>22} {fmt(b.get('round_ms'), 9, 2)} {fmt(b.get('tau'), 5, 2)} "
              f"{fmt(b.get('realized_factor'), 7, 2)} {fmt(b.get('predicted_row_rate'), 10)} "
              f"{fmt(b.get('realized_row_rate'), 9)} | {fmt(mine, 9)} {tok_s:>9.0f}")
    for engine in engines.values():
        engine.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"script": "scripts/engine_shape_rates.py", "args": vars(args), "machine": machine_info(),
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
