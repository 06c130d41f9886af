"""Continuous batching against static batches: `Engine.generate` over N prompts with mixed output lengths against
`specjax.generate` in static batches of the same size, on the same prompts and budgets (greedy; tokens checked
equal). A static batch runs until its longest row is done; the engine refills a slot as soon as its row finishes.

    python scripts/bench_engine.py [--prompts 256] [--slots 32] [--drafter draft|none] [--repeats 2] [--out JSON]

Repeats are interleaved (static, engine, static, engine, ...); medians are reported. Compile time is excluded from
both (the engine is warmed up; each static batch shape is run once before timing).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import numpy as np

import specjax


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--drafter", default="none", help="none, or an embedded drafter name (draft, eagle3, ...)")
    ap.add_argument("--num-draft-tokens", default="auto")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    target = specjax.load(specjax.embedded("target"))
    drafter = None if args.drafter == "none" else specjax.load_drafter(specjax.embedded(args.drafter), target)
    rng = np.random.default_rng(args.seed)
    # prompts: windows of the embedded model's held-out validation tokens (never trained on), 8..48 tokens
    ids = sum(json.loads((specjax.embedded("target").parent / "eval_slice.json").read_text())["tokens"], [])
    prompts = [ids[s: s + int(rng.integers(8, 48))] for s in rng.integers(0, len(ids) - 64, args.prompts)]
    budgets = np.exp(rng.uniform(np.log(8), np.log(192), args.prompts)).astype(int).tolist()
    k = args.num_draft_tokens if args.num_draft_tokens in ("auto", "off") else int(args.num_draft_tokens)

    def static() -> tuple[float, list]:
        tokens, start = [], time.perf_counter()
        for i in range(0, len(prompts), args.slots):
            batch, budget = prompts[i: i + args.slots], budgets[i: i + args.slots]
            # one budget per batch is generate's contract: the batch runs to its largest, rows cut to their own
            out = specjax.generate(target, batch, max_new_tokens=max(budget), drafter=drafter,
                                   num_draft_tokens=None if drafter is None or k == "auto" else k,
                                   eos_token_id=[])
            tokens += [t[:b] for t, b in zip(out.tokens, budget)]
        return time.perf_counter() - start, tokens

    engine = specjax.Engine(target, drafter, max_slots=args.slots, max_len=args.max_len,
                            num_draft_tokens=k if drafter is not None else "auto", sampling=False)
    warmup_s = engine.warmup()

    def continuous() -> tuple[float, list]:
        start = time.perf_counter()
        out = engine.generate(prompts, max_new_tokens=budgets, eos_token_id=[], temperature=0.0)
        return time.perf_counter() - start, out.tokens

    static()  # compile every static batch shape once
    rows = []
    for r in range(args.repeats):
        s_s, s_tok = static()
        e_s, e_tok = continuous()
        n = sum(budgets)
        rows.append({"repeat": r, "static_s": s_s, "engine_s": e_s, "static_tok_s": n / s_s, "engine_tok_s": n / e_s})
        print(f"repeat {r}: static {n / s_s:.1f} tok/s ({s_s:.1f} s), engine {n / e_s:.1f} tok/s ({e_s:.1f} s)")
    same = sum(a == b[:len(a)] for a, b in zip(e_tok, s_tok))
    stats = engine.stats()
    engine.close()
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    record = {
        "script": "scripts/bench_engine.py", "args": vars(args), "machine": f"{platform.machine()} "
        f"{platform.processor() or ''} {__import__('os').cpu_count()} cores, JAX {__import__('jax').__version__}",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d"), "tokens": sum(budgets), "warmup_s": warmup_s,
        "static_tok_s": med("static_tok_s"), "engine_tok_s": med("engine_tok_s"),
        "ratio": med("engine_tok_s") / med("static_tok_s"), "repeats": rows,
        "requests_equal_to_static": f"{same}/{len(prompts)}",
        "engine": {k: stats[k] for k in ("compiles", "compile_s", "shapes_over_time", "round_ms", "dropped",
                                         "acceptance_at_depth") if k in stats},
    }
    print(f"engine / static: {record['ratio']:.2f}x ({record['engine_tok_s']:.1f} vs {record['static_tok_s']:.1f} "
          f"tok/s); outputs equal {same}/{len(prompts)}; warmup {warmup_s:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
