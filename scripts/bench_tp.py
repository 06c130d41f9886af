#!/usr/bin/env python
"""Tensor parallelism on the GPUs of this machine: a random Llama-3-8B-shaped bf16 target on one GPU and split over
N, plain decoding and a replay chain, tokens compared and decode times side by side.

    python scripts/bench_tp.py --out runs/bench_tp.json            # N: every local GPU (needs 2 or more)

The target is built once on one device and copied to the mesh (`specjax.models.sharding.place` by the rules, as
`specjax.load(..., tensor_parallel=N)` splits a checkpoint), so both runs hold the same weights. Per batch, plain
decoding and a replay drafter's chain (plain decoding's own tokens, each right with probability --accept) run on one
GPU and on N, interleaved (--repeats rounds, medians of decode seconds, compile excluded). Tokens: the share of rows
whose N-GPU tokens equal one GPU's (bf16 sums in another order may flip a near-tie of a random model's logits, so
this is reported, not asserted). What the planner predicts for the same split: `specjax plan --model-only
--device h100 --tensor-parallel N`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import jax

import specjax
from specjax.bench.ar import PRESETS, machine_info, random_prompts
from specjax.bench.spec import random_model, replay
from specjax.loading.target import placed
from specjax.models.sharding import tensor_parallel_mesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="8b", choices=sorted(PRESETS))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--accept", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    n = jax.local_device_count()
    if n < 2:
        raise SystemExit(f"tensor parallelism needs 2 or more devices; this process sees {n} "
                         f"({jax.devices()[0].platform})")

    one = random_model(PRESETS[args.preset], "bfloat16", 0, "auto")
    mesh = tensor_parallel_mesh(n)
    split = dataclasses.replace(one, params=placed(one.params, one.cfg, mesh), compiled={}, mesh=mesh)
    kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=[])
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = random_prompts(batch, args.prompt_len, one.cfg.vocab_size, seed=batch).tolist()
        base = {"tokens": specjax.generate(one, prompts, **kw).tokens}
        chain = f"replay chain:{args.num_draft_tokens}"
        methods = {"plain": (None, {}),
                   chain: (replay(one, base, args.accept), {"num_draft_tokens": args.num_draft_tokens})}
        targets = {"tp1": one, f"tp{n}": split}
        fns = {(name, tp): (lambda t=target, d=drafter, dk=dk: specjax.generate(t, prompts, drafter=d, **dk, **kw))
               for name, (drafter, dk) in methods.items() for tp, target in targets.items()}
        outs = {key: fn() for key, fn in fns.items()}  # compile
        times = {key: [] for key in fns}
        for _ in range(args.repeats):
            for key, fn in fns.items():
                out = fn()
                times[key].append(out.stats["decode_s"])
                outs[key] = out
        for name in methods:
            t1, tn = (statistics.median(times[(name, t)]) for t in ("tp1", f"tp{n}"))
            same = sum(a == b for a, b in zip(outs[(name, "tp1")].tokens, outs[(name, f"tp{n}")].tokens))
            rows.append({"batch": batch, "method": name, "tp1_decode_s": t1, f"tp{n}_decode_s": tn,
                         "speedup": t1 / tn, "rows_equal": same, "rows": batch,
                         "compile_s": outs[(name, f"tp{n}")].stats.get("compile_s")})
            print(f"batch {batch:>3} {name:<18} TP1 {1e3 * t1:8.1f} ms  TP{n} {1e3 * tn:8.1f} ms  "
                  f"{t1 / tn:5.2f}x  rows equal {same}/{batch}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine_info(), "devices": n, "args": vars(args) | {"out": str(
            args.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
