"""Speculative decoding benchmark: plain decoding vs each drafter, and a replay sweep.

Part 1, drafters: for each batch size, plain greedy decoding and each drafter (draft
model chain, draft model tree, n-gram) on the same prompts; tau, per-position
acceptance, tokens/s and speedup over plain decoding, all measured side by side in
one run (median of repeats, compile excluded and reported separately).

Part 2, replay sweep: the `replay` benchmarking drafter proposes the target's own
continuation corrupted at a chosen rate, so acceptance is controlled; sweeping
acceptance rate x draft length x batch size shows where speculation stops paying on
the machine it runs on (drafting is free there, so this is the verify side's cost).

Used by `scripts/bench.py spec`; prints tables and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .bench_ar import machine_info
from .drafters import NgramDrafter, load_drafter, replay_drafter
from .generate import generate
from .target import Target, load

DEFAULT_TARGET = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny" / "target"
DEFAULT_DRAFT = DEFAULT_TARGET.parent / "draft"


def bench_prompts(target: Target, n: int, seed: int = 0) -> list:
    """Held-out prompts from the embedded checkpoint's manifest when present, else random ids."""
    manifest = Path(target.path or "").parent / "manifest.json"
    if manifest.is_file() and target.tokenizer is not None:
        texts = [p["text"] for p in json.loads(manifest.read_text()).get("held_out_prompts") or []]
        if texts:
            return [texts[i % len(texts)] for i in range(n)]
    rng = np.random.default_rng(seed)
    return [rng.integers(3, target.cfg.vocab_size, size=32).tolist() for _ in range(n)]


def timed(run: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """One warm-up call (compiles), then the median of `repeats` calls."""
    first = run()
    outs = [run() for _ in range(repeats)]
    tps = [o.stats["tokens_per_s"] for o in outs]
    stats = dict(outs[-1].stats)
    stats.update(tokens_per_s=statistics.median(tps), tokens_per_s_all=tps, compile_s=first.stats["compile_s"])
    return {"tokens": outs[-1].tokens, "stats": stats}


def run_drafters(target: Target, drafters: dict[str, tuple[Any, dict]], batches: list[int], max_new: int,
                 repeats: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        prompts = bench_prompts(target, b)
        base = timed(lambda: generate(target, prompts, max_new_tokens=max_new), repeats)
        rows.append(dict(batch=b, method="plain", **_summary(base, base)))
        log(_row_text(rows[-1]))
        for name, (drafter, kwargs) in drafters.items():
            res = timed(lambda: generate(target, prompts, max_new_tokens=max_new, drafter=drafter, **kwargs),
                        repeats)
            if res["tokens"] != base["tokens"]:
                raise AssertionError(f"{name} at batch {b}: greedy speculative output differs from plain decoding")
            rows.append(dict(batch=b, method=name, **_summary(res, base)))
            log(_row_text(rows[-1]))
    return rows


def run_replay_sweep(target: Target, batches: list[int], ks: list[int], accepts: list[float], max_new: int,
                     repeats: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        prompts = bench_prompts(target, b, seed=1)
        base = timed(lambda: generate(target, prompts, max_new_tokens=max_new), repeats)
        for k in ks:
            for a in accepts:
                drafter = replay_drafter(base["tokens"], target.cfg.vocab_size, corrupt_prob=1.0 - a)
                res = timed(lambda: generate(target, prompts, max_new_tokens=max_new, drafter=drafter,
                                             num_draft_tokens=k), repeats)
                rows.append(dict(batch=b, k=k, accept_rate=a, **_summary(res, base)))
                log(f"replay batch {b:3d} K {k:2d} accept {a:.2f}: tau {rows[-1]['tau']:.2f} "
                    f"speedup {rows[-1]['speedup']:.2f}x")
    return rows


def _summary(res: dict, base: dict) -> dict[str, Any]:
    s = res["stats"]
    return dict(tau=s["acceptance_length"], per_position=[round(x, 3) for x in s.get("per_position_acceptance", [])],
                tokens_per_s=s["tokens_per_s"], speedup=s["tokens_per_s"] / base["stats"]["tokens_per_s"],
                compile_s=s["compile_s"], rounds=s["rounds"], drafter_calls=s["drafter_calls"])


def _row_text(r: dict) -> str:
    pos = " ".join(f"{x:.2f}" for x in r["per_position"])
    return (f"| {r['batch']:5d} | {r['method']:<18} | {r['tau']:5.2f} | {r['tokens_per_s']:9.1f} | "
            f"{r['speedup']:6.2f}x | {r['compile_s']:6.1f} | {pos}")


def format_tables(result: dict[str, Any]) -> str:
    lines = ["| batch | method             |   tau |     tok/s | speedup | compile s | per-position acceptance",
             "|---|---|---|---|---|---|---|"]
    lines += [_row_text(r) for r in result["drafters"]]
    sweep = result.get("replay_sweep") or []
    if sweep:
        accepts = sorted({r["accept_rate"] for r in sweep})
        lines += ["", "replay sweep: speedup over plain decoding (tau in brackets)",
                  "| batch | K | " + " | ".join(f"accept {a:.2f}" for a in accepts) + " |",
                  "|---|---|" + "---|" * len(accepts)]
        for b in sorted({r["batch"] for r in sweep}):
            for k in sorted({r["k"] for r in sweep}):
                cells = [next(r for r in sweep if (r["batch"], r["k"], r["accept_rate"]) == (b, k, a))
                         for a in accepts]
                lines.append(f"| {b} | {k} | " + " | ".join(f"{c['speedup']:.2f}x ({c['tau']:.2f})" for c in cells)
                             + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=str(DEFAULT_TARGET), help="target checkpoint (default: embedded tiny)")
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT), help="draft-model checkpoint ('' to skip)")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--tree", default="kary:2,2,1", help="tree for the draft-model tree row ('' to skip)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="also run the replay sweep")
    parser.add_argument("--sweep-k", default="1,2,4,8")
    parser.add_argument("--sweep-accept", default="0.3,0.6,0.9")
    parser.add_argument("--sweep-batches", default="1,4,16")
    parser.add_argument("--attn-impl", choices=["auto", "xla", "pallas"], default="auto")
    parser.add_argument("--out", default=None, help="write the JSON result here")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(args: argparse.Namespace) -> int:
    target = load(args.target, attn_impl=args.attn_impl)
    k = args.num_draft_tokens
    drafters: dict[str, tuple[Any, dict]] = {}
    if args.draft:
        draft = load_drafter(args.draft, target)
        drafters[f"draft chain:{k}"] = (draft, {"num_draft_tokens": k})
        if args.tree:
            drafters[f"draft {args.tree}"] = (draft, {"tree": args.tree})
    drafters[f"ngram chain:{k}"] = (NgramDrafter(), {"num_draft_tokens": k})
    result: dict[str, Any] = {"machine": machine_info(), "target": args.target, "draft": args.draft,
                              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    print(f"target {args.target}: {target.cfg.num_params() / 1e6:.2f}M params on {result['machine']}")
    result["drafters"] = run_drafters(target, drafters, _ints(args.batches), args.max_new_tokens, args.repeats, print)
    if args.sweep:
        result["replay_sweep"] = run_replay_sweep(target, _ints(args.sweep_batches), _ints(args.sweep_k),
                                                  [float(a) for a in args.sweep_accept.split(",")],
                                                  args.max_new_tokens, args.repeats, print)
    print(format_tables(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0
