"""One-pass block trees vs chains: the embedded DFlash and DSpark heads, budgets 15 / 63 / 255 drafts, batch 1..32.

    python scripts/bench_block_trees.py --out docs/records/block_trees_cpu.json

For each head (checkpoints/tiny/dflash, checkpoints/tiny/dspark) and batch (the held-out prompts, cycled):
plain greedy decoding, the chain of the whole block, and JetSpec's tree (`dynamic:top_k=7,depth=D,
total_tokens=N`, D + 1 = the block's drafts, N - 1 = 15, 63, 255 drafts) from the same single block pass.
Every speculative output is checked equal to plain greedy decoding. Per run: tau, and tokens/s of a second
(compiled) call. Shapes whose verify pass holds more than --max-tokens tokens (batch x nodes) are recorded as
skipped: on this 2-core CPU a 255-draft tree at batch 32 runs at about one token a second. DSpark's trees are run with the Markov step per parent ("parent", the default) and along the
greedy chain ("chain") at every budget, on the 8 held-out prompts (tau does not depend on the batch).

The planner's pick per batch: acceptance calibrated per depth and rank on a caterpillar (as "auto" does for
block drafters), priced by the roofline of this machine's device and of an H100 (planning/block_trees.py and
the static-tree DP, planning/planner.py), as `specjax plan --device` does. A JSON record goes to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

import specjax
from specjax.decoding.tree import DynamicTreeSpec, chain
from specjax.planning.block_trees import CALIBRATION_WIDTH, best_block_tree, caterpillar
from specjax.planning.calibration import calibrate
from specjax.planning.planner import plan
from specjax.planning.profile import cost_model, local_device

ROOT = Path(__file__).resolve().parent.parent
DRAFTS = (15, 63, 255)


def run(target, prompts, new, **kw):
    """(output of a second call, its tokens/s): the first call compiles."""
    specjax.generate(target, prompts, max_new_tokens=new, eos_token_id=[], **kw)
    start = time.perf_counter()
    out = specjax.generate(target, prompts, max_new_tokens=new, eos_token_id=[], **kw)
    return out, out.stats.get("tokens_per_s") or len(prompts) * new / (time.perf_counter() - start)


def picks(target, drafter, cal, batches, device: str) -> list[dict]:
    """The planner's best shape per batch on `device`'s roofline, from a caterpillar calibration `cal`."""
    depth = drafter.max_draft_tokens
    p_DR = np.where(np.isnan(cal.p_depth_rank), np.asarray(cal.p_rank)[None, :], cal.p_depth_rank)
    cm = cost_model(device, target.cfg, drafter, 512, None)
    rows = []
    for c in plan(cal.p_rank, batches, cm.verify_s, cm.draft_s, max_nodes=64, max_depth=depth, max_chain=depth):
        block = best_block_tree(p_DR, c.batch, cm.verify_s, cm.draft_s, max_levels=depth)
        best = block if block is not None and block.speedup > c.best.speedup else c.best
        rows.append({"batch": c.batch, "pick": best.shape.label, "predicted_tau": best.shape.tau,
                     "predicted_speedup": best.speedup, "static_best": c.best.shape.label,
                     "block_tree_best": None if block is None else block.shape.label,
                     "block_tree_speedup": None if block is None else block.speedup})
    return rows


def table(record: dict) -> str:
    """Markdown: per head and batch, tau and tokens/s (x plain) of the chain and each tree, and the planner's picks."""
    shapes = ["chain", *(f"tree{n}" for n in DRAFTS)]
    lines = ["| head | batch | plain tok/s | " + " | ".join(f"{s} tau, tok/s (x plain)" for s in shapes)
             + " | pick (" + ", ".join(next(iter(record["picks"].values()))) + ") |",
             "|---|---|---|" + "---|" * len(shapes) + "---|"]
    for name, by_dev in record["picks"].items():
        for b in record["batches"]:
            runs = {r["shape"]: r for r in record["runs"] if r["drafter"] == name and r["batch"] == b}
            cells = ["skipped" if "skipped" in runs[s] else
                     f"{runs[s]['tau']:.2f}, {runs[s]['tokens_per_s']:.0f} ({runs[s]['speedup']:.2f}x)" for s in shapes]
            pick = ", ".join(next(p["pick"] for p in rows if p["batch"] == b) for rows in by_dev.values())
            lines.append(f"| {name} | {b} | {runs['plain']['tokens_per_s']:.0f} | " + " | ".join(cells) + f" | {pick} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=str(ROOT / "checkpoints" / "tiny"))
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--new", type=int, default=32, help="new tokens per row")
    ap.add_argument("--max-tokens", type=int, default=1024,
                    help="skip (and record as skipped) shapes whose verify pass holds more than this many tokens")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None, metavar="JSON", help="only print the markdown table of a record")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    ckpt = Path(args.ckpt)
    held = [x["text"] for x in json.loads((ckpt / "manifest.json").read_text())["held_out_prompts"]]
    batches = [int(b) for b in args.batches.split(",")]
    target = specjax.load(ckpt / "target")
    record = {"machine": f"{platform.machine()} {platform.processor() or ''} (this VM: 2 cores, no GPU)".strip(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=ROOT).stdout.strip(),
              "jax": __import__("jax").__version__, "new_tokens": args.new, "batches": batches, "runs": [],
              "picks": {}}
    for name in ("dflash", "dspark"):
        drafter = specjax.load_drafter(ckpt / name, target)
        levels = drafter.max_draft_tokens
        shapes = [("chain", chain(levels))] + [
            (f"tree{n}", DynamicTreeSpec(7, levels - 1, n + 1)) for n in DRAFTS]
        for b in batches:
            prompts = (held * (b // len(held) + 1))[:b]
            plain, plain_tps = run(target, prompts, args.new)
            record["runs"].append({"drafter": name, "batch": b, "shape": "plain", "tau": 1.0, "tokens_per_s": plain_tps})
            for label, spec in shapes:
                if b * spec.num_nodes > args.max_tokens:  # this CPU's time: say so in the record, not a number
                    record["runs"].append({"drafter": name, "batch": b, "shape": label, "spec": str(spec),
                                           "skipped": f"batch x nodes {b * spec.num_nodes} > {args.max_tokens}"})
                    continue
                out, tps = run(target, prompts, args.new, drafter=drafter, tree=spec)
                assert out.tokens == plain.tokens, f"{name} {spec} batch {b}: differs from plain greedy decoding"
                row = {"drafter": name, "batch": b, "shape": label, "spec": str(spec),
                       "tau": out.stats["acceptance_length"], "tokens_per_s": tps, "speedup": tps / plain_tps}
                record["runs"].append(row)
                print(json.dumps(row), flush=True)
        if name == "dspark":
            prompts = held
            plain = specjax.generate(target, prompts, max_new_tokens=args.new, eos_token_id=[])
            for mode in ("parent", "chain"):
                for n in DRAFTS:
                    spec = DynamicTreeSpec(7, levels - 1, n + 1)
                    out = specjax.generate(target, prompts, max_new_tokens=args.new, eos_token_id=[], tree=spec,
                                           drafter=dataclasses.replace(drafter, tree_markov=mode))
                    assert out.tokens == plain.tokens
                    row = {"drafter": "dspark", "tree_markov": mode, "batch": len(prompts), "spec": str(spec),
                           "tau": out.stats["acceptance_length"]}
                    record.setdefault("dspark_tree_markov", []).append(row)
                    print(json.dumps(row), flush=True)
        cal = calibrate(target, drafter, held, caterpillar(CALIBRATION_WIDTH, levels), max_new_tokens=48)
        record.setdefault("calibration", {})[name] = cal.as_dict()
        record["picks"][name] = {dev: picks(target, drafter, cal, batches, dev)
                                 for dev in dict.fromkeys([local_device(), "h100"])}
        print(json.dumps(record["picks"][name]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    print(table(record))


if __name__ == "__main__":
    main()
