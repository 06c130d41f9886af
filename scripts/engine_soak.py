"""Reliability: many requests with random arrivals, lengths, sampling settings and aborts through one warmed-up
engine; afterwards no slot or queue entry is left, nothing compiled after warmup, and every request that was not
aborted ended with "stop" or "length" and its full text.

    python scripts/engine_soak.py [--requests 1000] [--slots 8] [--drafter draft] [--abort 0.15] [--out JSON]

Greedy requests are also checked against `specjax.generate` of their prompt alone (every --check-every-th).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time

import specjax
from specjax.bench.ar import machine_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--drafter", default="draft")
    ap.add_argument("--abort", type=float, default=0.15, help="share of requests aborted at a random moment")
    ap.add_argument("--check-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    target = specjax.load(specjax.embedded("target"))
    drafter = specjax.load_drafter(specjax.embedded(args.drafter), target) if args.drafter != "none" else None
    rng = random.Random(args.seed)
    engine = specjax.Engine(target, drafter, max_slots=args.slots, max_len=args.max_len, logprobs=2, penalties=True)
    warmup_s = engine.warmup()
    compiles = engine.stats()["compiles"]
    print(f"warmup {warmup_s:.1f} s, {compiles} executables")
    words = ["def ", "class ", "import ", "return ", "for ", "(", ")", ":\n    ", "x", "self", " = ", "[", "]"]
    handles, plan = [], []
    start = time.perf_counter()
    for i in range(args.requests):
        prompt = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        settings = {"max_new_tokens": rng.randint(1, 48)}
        if rng.random() < 0.4:
            settings.update(temperature=rng.choice([0.5, 0.8, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=i)
        if rng.random() < 0.2:
            settings.update(stop=["\n"])
        if rng.random() < 0.2:
            settings.update(logprobs=True, top_logprobs=rng.randint(0, 2))
        if rng.random() < 0.1:
            settings.update(presence_penalty=0.5)
        handles.append(engine.submit(prompt, **settings))
        plan.append((prompt, settings))
        if rng.random() < args.abort:
            victim = rng.randrange(len(handles))
            time.sleep(rng.random() * 0.01)
            engine.abort(handles[victim])
        if rng.random() < 0.05:
            time.sleep(rng.random() * 0.2)  # a lull: occupancy falls
    outs = [h.result(timeout=1800) for h in handles]
    seconds = time.perf_counter() - start
    deadline = time.time() + 30
    while engine.stats()["occupancy"] and time.time() < deadline:
        time.sleep(0.05)
    stats = engine.stats()
    reasons = {r: sum(o.finish_reason == r for o in outs) for r in ("stop", "length", "abort")}
    checked = mismatched = 0
    for i, ((prompt, settings), out) in enumerate(zip(plan, outs)):
        if i % args.check_every or out.finish_reason == "abort" or settings.get("temperature"):
            continue
        ref = specjax.generate(target, [prompt], **settings)
        checked += 1
        mismatched += ref.tokens[0] != out.tokens
    engine.close()
    record = {"script": "scripts/engine_soak.py", "args": vars(args), "machine": machine_info(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(), "date": time.strftime("%Y-%m-%d"),
              "warmup_s": warmup_s, "executables": compiles, "compiles_after_warmup": stats["compiles"] - compiles,
              "seconds": seconds, "finish_reasons": reasons, "slots_left": stats["occupancy"],
              "queue_left": stats["queue_length"], "greedy_checked": checked, "greedy_mismatched": mismatched,
              "tokens": sum(len(o.tokens) for o in outs), "shape_changes": len(stats["shapes_over_time"])}
    print(json.dumps({k: v for k, v in record.items() if k not in ("machine", "args")}, indent=1))
    ok = not record["compiles_after_warmup"] and not record["slots_left"] and not record["queue_left"] \
        and not mismatched
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
