"""Does "auto" measure each shape as that shape's own engine realizes it? At one concurrency, the realized tokens per
live row per second that the "auto" engine's policy keeps for each shape at the occupancy bucket (its decayed sums
over the chunks it ran of that shape, `stats()["realized_row_rate"]`), beside each fixed engine's own.

    python scripts/engine_shape_rates.py --preset tiny20m --concurrency 8 --requests 32

The drafter is the preset's random draft model: a real drafter, whose switches cost (catch-ups, its own prefills).

The policy chooses on these rates (through its realization factors) and drops a shape on them, so a shape measured
far below its own engine inside "auto" (a trial's first chunks, a switch's cost charged to the wrong shape) is a
wrong choice waiting to happen. Settings run interleaved, `--repeats` times, as in scripts/bench_engine_load.py
(whose workload, `keep_in_flight` and cache sizing this reuses).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import specjax
from bench_engine_load import keep_in_flight
from specjax.bench.ar import PRESETS, machine_info
from specjax.bench.spec import preset_pair
from specjax.decoding.request import batch_bucket, round_cache_length
from specjax.decoding.tree import parse_tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny20m", choices=sorted(PRESETS))
    ap.add_argument("--chains", default="1,2,4")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48, help="mean output tokens (uniform within +-50%)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    chains = [int(k) for k in args.chains.split(",")]
    target, draft_model = preset_pair(args.preset, None, 0, "auto")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, target.cfg.vocab_size, args.prompt_len).tolist() for _ in range(64)]
    low, high = round(args.tokens * 0.5), round(args.tokens * 1.5)
    budgets = rng.integers(low, high + 1, 97).tolist()
    nodes = max(parse_tree(None, k).cache_slots for k in chains)
    max_len = round_cache_length(args.prompt_len + high + 1 + nodes) - nodes
    settings = {"auto": dict(num_draft_tokens="auto", auto_chains=chains), "off": dict(num_draft_tokens="off"),
                **{f"chain:{k}": dict(num_draft_tokens=k) for k in chains}}
    engines = {name: specjax.Engine(target, draft_model, max_slots=args.slots, max_len=max_len, sampling=False, **kw)
               for name, kw in settings.items()}
    for engine in engines.values():
        engine.warmup()
    key = f"{min(batch_bucket(args.concurrency, 1), args.slots)}/"
    runs = []
    for rep in range(args.repeats):
        order = list(engines)
        np.random.default_rng(rep).shuffle(order)
        for name in order:
            tokens, seconds = keep_in_flight(engines[name], prompts, budgets, args.concurrency, total=args.requests)
            rates = {k.removeprefix(key): v for k, v in engines[name].stats()["realized_row_rate"].items()
                     if k.startswith(key)}
            runs.append({"repeat": rep, "engine": name, "tok_s": tokens / seconds, "realized_row_rate": rates})
            print(f"{rep} {name}: {tokens / seconds:.0f} tokens/s; realized per row at bucket {key[:-1]}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()), flush=True)
    last = {r["engine"]: r["realized_row_rate"] for r in runs if r["repeat"] == args.repeats - 1}
    print("\nshape: inside auto / in its own engine (last repeat)")
    for name in engines:
        if name != "auto" and name in last["auto"]:
            print(f"  {name}: {last['auto'][name]:.1f} / {last[name][name]:.1f} = "
                  f"{last['auto'][name] / last[name][name]:.2f}")
    for engine in engines.values():
        engine.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"script": "scripts/engine_shape_rates.py", "args": vars(args), "machine": machine_info(),
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
