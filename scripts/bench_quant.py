"""Quantized targets against bf16 on this machine: the same random weights, quantized (specjax/quant/quantize.py),
side by side in one process, interleaved, medians.

  matmul   x [M, K] @ W [K, N] for M = 1..8: bf16 W against block FP8, INT8 per channel and INT4 per group of 128,
           each dequantized inside the jitted matmul as a loaded checkpoint's weight is
  decode   plain greedy decoding of a random target (a bandwidth-bound step: batch 1, weights far past the caches)
           in bf16 and each format: ms per token, and the weight bytes each holds on the device
  plan     (--plan) the planner's best shape per batch (1..64) for the bf16 and the FP8 target, from verify profiles
           measured here, at the replay drafter's acceptance (0.8 by rank) and a free draft

    python scripts/bench_quant.py --out docs/records/bench_quant_cpu.json
    python scripts/bench_quant.py --preset 8b --matmul 4096,14336 --formats fp8 int4 --tokens 64   (a GPU)

Single runs on a shared 2-core machine vary by +-25%: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.bench.ar import PRESETS, interleaved_medians, machine_info
from specjax.bench.spec import random_model
from specjax.models.target import Target
from specjax.quant.qarray import QuantizedWeight
from specjax.quant.quantize import FORMATS, quantize_params, quantize_weight


def device_bytes(params) -> int:
    """Bytes the params hold on the device (jax's own count of each array)."""
    return sum(x.nbytes for x in jax.tree.leaves(params))


def bench_matmul(k: int, n: int, rows: list[int], formats: list[str], repeats: int) -> list[dict]:
    w = (0.02 * jax.random.normal(jax.random.key(0), (k, n))).astype(jnp.bfloat16)
    weights = {"bf16": w, **{f: jax.block_until_ready(quantize_weight(w, f)) for f in formats}}
    matmul = jax.jit(lambda x, w: x @ w)
    out = []
    for m in rows:
        x = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)
        t = interleaved_medians({name: (lambda w=wt: matmul(x, w)) for name, wt in weights.items()}, repeats)
        row = {"M": m, "K": k, "N": n, **{f"{name}_us": v * 1e6 for name, v in t.items()}}
        out.append(row)
        print(f"matmul [{m}, {k}] x [{k}, {n}]: " + "  ".join(f"{name} {v * 1e6:9.1f} us" for name, v in t.items()),
              flush=True)
    return out


def bench_decode(preset: str, formats: list[str], batch: int, tokens: int, repeats: int) -> dict:
    base = random_model(PRESETS[preset], "bfloat16", seed=0, attn_impl="auto")
    targets = {"bf16": base}
    for f in formats:
        targets[f] = Target(jax.block_until_ready(quantize_params(base.params, f)), base.cfg, base.hf_config,
                            attn_impl=base.attn_impl)
    prompts = np.random.default_rng(0).integers(3, base.cfg.vocab_size, size=(batch, 16)).tolist()

    def run(target):
        return specjax.generate(target, prompts, max_new_tokens=tokens, eos_token_id=[])

    outs = {name: run(t).tokens for name, t in targets.items()}  # compile, and the tokens each format gives
    t = interleaved_medians({name: (lambda tg=tg: run(tg)) for name, tg in targets.items()}, repeats)
    rows = []
    for name, target in targets.items():
        same = np.mean([a == b for ra, rb in zip(outs[name], outs["bf16"]) for a, b in zip(ra, rb)])
        rows.append({"format": name, "ms_per_token": t[name] * 1e3 / tokens, "weight_bytes": device_bytes(
            target.params), "quantized_size": sum(x.nbytes if isinstance(x, QuantizedWeight) else x.nbytes
                                                  for x in jax.tree.leaves(target.params, is_leaf=lambda y: isinstance(
                                                      y, QuantizedWeight))),
            "tokens_equal_to_bf16": float(same)})
        print(f"decode {preset} B={batch}: {name:5s} {rows[-1]['ms_per_token']:8.2f} ms/token, weights on device "
              f"{rows[-1]['weight_bytes'] / 2**20:8.1f} MiB (quantized size {rows[-1]['quantized_size'] / 2**20:8.1f}"
              f" MiB), greedy tokens equal to bf16's: {same:.2f}", flush=True)
    return {"preset": preset, "batch": batch, "tokens": tokens, "params": base.cfg.num_params(), "rows": rows,
            "targets": targets}


def bench_plan(targets: dict, batches: list[int], nodes: list[int], cache_len: int, repeats: int) -> dict:
    from specjax.planning.planner import format_plan, geometric_acceptance, plan
    from specjax.planning.profile import profile

    p = geometric_acceptance(0.8)
    out = {}
    for name in ("bf16", "fp8"):
        prof = profile(targets[name], None, batches=batches, nodes=nodes, cache_lens=(cache_len,), repeats=repeats,
                       log=lambda m, n=name: print(f"plan   {n}: {m}", flush=True))
        cm = prof.cost(cache_len)
        choices = plan(p, batches, cm.verify_s, cm.draft_s, max_nodes=max(nodes), max_depth=12)
        print(format_plan(choices))
        out[name] = [c.as_dict()["best"] for c in choices]
    return {"batches": batches, **{k: [{"label": b["label"], "nodes": b["nodes"], "speedup": b["speedup"]}
                                       for b in v] for k, v in out.items()}}


def table_md(result: dict) -> str:
    lines = []
    if result.get("matmul"):
        names = [k[:-3] for k in result["matmul"][0] if k.endswith("_us")]
        lines += ["| M x K x N | " + " | ".join(f"{n} us" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
        for r in result["matmul"]:
            lines.append(f"| {r['M']} x {r['K']} x {r['N']} | " + " | ".join(f"{r[n + '_us']:.0f}" for n in names)
                         + " |")
        lines.append("")
    d = result["decode"]
    lines += [f"| {d['preset']} decode, batch {d['batch']} | ms / token | weights on device MiB | quantized size MiB | "
              "greedy tokens = bf16 |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['format']} | {r['ms_per_token']:.1f} | {r['weight_bytes'] / 2**20:.0f} | "
                     f"{r['quantized_size'] / 2**20:.0f} | {r['tokens_equal_to_bf16']:.2f} |")
    if result.get("plan"):
        pl = result["plan"]
        lines += ["", "| batch | bf16 best (nodes, speedup) | fp8 best (nodes, speedup) |", "|---|---|---|"]
        for b, x, y in zip(pl["batches"], pl["bf16"], pl["fp8"]):
            lines.append(f"| {b} | {x['label']} ({x['nodes']}, {x['speedup']:.2f}x) | {y['label']} ({y['nodes']}, "
                         f"{y['speedup']:.2f}x) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="300m", choices=sorted(PRESETS))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--matmul", default="2048,5632", help="K,N of the matmul sweep ('' to skip)")
    ap.add_argument("--rows", default="1,2,4,8", help="M of the matmul sweep")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded per timed call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plan", action="store_true", help="also profile bf16 and fp8 and plan batches 1..64")
    ap.add_argument("--out", help="write the JSON record here")
    args = ap.parse_args(argv)
    result = {"machine": machine_info(), "argv": sys.argv[1:]}
    if args.matmul:
        k, n = (int(x) for x in args.matmul.split(","))
        result["matmul"] = bench_matmul(k, n, [int(m) for m in args.rows.split(",")], args.formats, args.repeats)
    decode = bench_decode(args.preset, args.formats, args.batch, args.tokens, args.repeats)
    targets = decode.pop("targets")
    result["decode"] = decode
    if args.plan:
        result["plan"] = bench_plan(targets, [1, 8, 32, 64], [1, 4, 16], 256, 2)
    print(table_md(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
