#!/usr/bin/env python
"""The load curve measured end to end: speedup of chains and trees vs batch size, predicted next to measured.

    python scripts/load_curve.py --out runs/load_curve.json --plot runs/load_curve.png

A random target (`--preset 300m`: 246M params, big enough that this CPU turns compute-bound
inside batch 1..128) decodes random prompts greedily with EOS disabled. Drafts come from a
tree replay drafter (specjax/drafters/replay.py): the target's own greedy continuation, where under every node
the true next token is the rank-r child with probability alpha (1 - alpha)^r (and missing when
the node has no rank-r child), every other child a random wrong token. Greedy verification
then accepts exactly as the planner's positional model says (p[r] = alpha (1 - alpha)^r; for
a chain: each draft right with probability alpha), so measured vs predicted isolates the cost
model. Drafting is free here.

Per batch: plain decoding, chains of --chains, the planner's DP trees of --trees nodes, and the
planner's own pick, each measured when its verify pass holds at most --max-pass-tokens tokens (larger
passes take minutes on a CPU and are predicted only; the plot's dashed lines show them); every
configuration is compiled and checked equal to plain decoding first,
then --repeats rounds run every configuration once each, in a fresh random order every round
(interleaved, so drift on a shared machine hits all alike). Speedup = tokens/s over the same
round's plain decoding; the median and the min..max spread are reported. Predictions come
from a profile measured here first (`--cost profile`) or a roofline (`--cost cpu|h100|h200`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specjax import generate
from specjax.bench.ar import MICRO_PRESET, PRESETS, machine_info, random_prompts
from specjax.bench.plan import (
    add_predictions,
    format_grid,
    format_table,
    measure_shapes,
    pick_summary,
    plot,
    shapes_for,
)
from specjax.bench.spec import random_model
from specjax.decoding.tree import TreeSpec
from specjax.drafters.replay import tree_replay
from specjax.models.target import format_count
from specjax.planning.planner import Call, geometric_acceptance, plan, shape_curve, shape_of
from specjax.planning.profile import Profile, cost_model, profile

MODELS = {**PRESETS, "micro": MICRO_PRESET}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="300m", choices=sorted(MODELS))
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--chains", default="1,2,4,8")
    ap.add_argument("--trees", default="8,16,32", help="DP tree budgets (nodes, root included)")
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-pass-tokens", type=int, default=512,
                    help="measure only shapes whose verify pass holds at most this many tokens (batch x nodes); "
                         "larger ones are predicted only (on this CPU they take minutes per pass)")
    ap.add_argument("--cost", default="profile", help="profile (measured here first) | cpu | h100 | h200")
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows-from", type=Path, default=None,
                    help="reuse the measured rows of an earlier run's JSON (same arguments) and redo only the profile "
                         "and the predictions, e.g. when the profile was taken on a busy machine")
    ap.add_argument("--profile-from", type=Path, default=None,
                    help="take the profile from an earlier run's JSON (or a profile JSON) instead of measuring it")
    ap.add_argument("--out", default="runs/load_curve.json")
    ap.add_argument("--plot", default="runs/load_curve.png")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    batches, chains, trees = ints(args.batches), ints(args.chains), ints(args.trees)
    if not 0 < args.alpha <= 1 or args.repeats < 1:
        raise SystemExit("--alpha must be in (0, 1] and --repeats >= 1")
    log = lambda m: print(m, flush=True)  # noqa: E731
    target = random_model(MODELS[args.preset], "float32", args.seed, "auto")
    p = geometric_acceptance(args.alpha)
    shapes = shapes_for(p, chains, trees, args.max_depth)
    log(f"target {args.preset}: {target.cfg.num_params() / 1e6:.1f}M params; alpha {args.alpha}; shapes "
        f"{[s.label for s in shapes]}")
    cache = args.prompt_len + args.max_new_tokens // 2
    if args.profile_from:
        saved = json.loads(args.profile_from.read_text())
        prof = Profile.from_dict(saved.get("profile", saved))
        cost, profile_dict = prof.cost(cache), prof.to_dict()
    elif args.cost == "profile":
        nodes = sorted({s.nodes for s in shapes})
        prof = profile(target, None, batches, nodes, (cache,), repeats=args.profile_repeats, log=log,
                       max_tokens=args.max_pass_tokens)
        cost = prof.cost(cache)
        profile_dict = prof.to_dict()
    else:
        cost, profile_dict = cost_model(args.cost, target.cfg, None, cache, 0.0), None
    # Each measurement is a whole generate call: the prefill (modelled as a pass of prompt-length rows) and the
    # batch's slowest row count, as they do for `generate(..., "auto")`.
    call = Call(args.max_new_tokens, lambda b: cost.verify_s(b, args.prompt_len))
    choices = plan(p, batches, cost.verify_s, cost.draft_s, max_nodes=max(s.nodes for s in shapes),
                   max_depth=args.max_depth, call=call)
    chosen = {c.batch: c.best.shape for c in choices}
    predicted = shape_curve(shapes, batches, cost.verify_s, cost.draft_s, call=call)
    result = {"script": "scripts/load_curve.py", "argv": sys.argv[1:] if argv is None else list(argv),
              "machine": machine_info(), "preset": args.preset, "params": target.cfg.num_params(),
              "alpha": args.alpha, "cost": cost.source, "profile": profile_dict,
              "plans": {c.batch: c.as_dict() for c in choices}, "predicted_speedup": predicted}
    rows = []
    earlier = json.loads(args.rows_from.read_text()) if args.rows_from else None
    # The earlier run measured its own picks too: predict those rows as well (older runs' rows lack parents).
    plans_before = [c["best"]["parents"] for c in (earlier or {}).get("plans", {}).values()]
    parents = plans_before + [r.get("parents") for r in (earlier or {}).get("rows", [])]
    earlier_picks = [shape_of(TreeSpec(tuple(x)), p) for x in dict.fromkeys(map(tuple, filter(None, parents)))]
    for b in batches:  # the planner's pick is measured too, when it is not one of the fixed shapes
        if earlier is not None:
            keep = ("speedup_predicted", "error")
            rows += [{k: v for k, v in r.items() if k not in keep} for r in earlier["rows"] if r["batch"] == b]
        else:
            extra = [chosen[b]] if all(s.spec != chosen[b].spec for s in shapes) else []
            here = [s for s in shapes + extra if s.kind == "off" or b * s.nodes <= args.max_pass_tokens]
            prompts = random_prompts(b, args.prompt_len, target.cfg.vocab_size, args.seed + b).tolist()
            base = generate(target, prompts, max_new_tokens=args.max_new_tokens, eos_token_id=[])
            drafter = tree_replay(base.tokens, target.cfg.vocab_size, args.alpha)
            rows += measure_shapes(target, prompts, drafter, here, max_new_tokens=args.max_new_tokens,
                                   repeats=args.repeats, batch=b, log=log)
        add_predictions(rows, shapes + list(chosen.values()) + earlier_picks, cost, call=call)
        picks = pick_summary(rows, {bb: s.label for bb, s in chosen.items() if bb <= b})
        result |= {"rows": rows, "picks": picks, "table": format_table(rows, picks)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))  # after every batch: a cut run keeps it
    result["grid"] = format_grid(rows, {k: v for k, v in predicted.items() if k != "off"}, batches,
                                 {c.batch: (c.best.shape.label, c.best.speedup) for c in choices})
    print(result["table"] + "\n\n" + result["grid"])
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {args.out}")
    if args.plot:
        title = (f"{args.preset} ({format_count(target.cfg.num_params())}), replay alpha {args.alpha}, median of "
                 f"{args.repeats} interleaved; {cost.source}")
        plot(rows, args.plot, batches, predicted, title)
        log(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
