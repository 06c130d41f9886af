#!/usr/bin/env python
"""Experts split inside (each expert's width over the devices) against whole experts per device (expert parallel),
on one MoE layer at tensor parallelism 8: measured on 8 fake CPU devices, and the expert bytes a device reads.

    python scripts/bench_expert_split.py --out runs/expert_split.json

For each pass size T (tokens through the layer), both layouts run the same routed MoE (models/moe.py) under jit on a
(1, 8) mesh: "inside" with the default rules (w_gate / w_up [E, D, I] split on I, w_down on its I rows; the sorted
path, XLA's partitioner adds the all-reduce) and "experts" with EXPERT_PARALLEL (split on E; each device runs the
slots routed to its own experts under shard_map, one psum). Timed in interleaved rounds (medians); outputs checked
equal. The 8 fake devices share this machine's cores, so a time is the devices' total work over the cores, not one
GPU's latency: it shows what each layout computes, not what NVLink costs.

Next to it, per device and pass, the expert bytes each layout reads: on the CPU path (a loop over the used blocks,
each reading its expert) and on the accelerator path (every block's expert matrices gathered, used or not: fixed
shapes), for the layer's shape, under uniform routing (the expected count of distinct experts hit, and the blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

DEVICES = 8
if "jax" not in sys.modules and "force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def layer_inputs(tokens: int, experts: int, top_k: int, hidden: int, width: int, seed: int = 0):
    import jax

    from specjax.models.moe import route

    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (tokens, hidden))
    w_gate, w_up = (jax.random.normal(k, (experts, hidden, width)) / hidden ** 0.5 for k in keys[1:3])
    w_down = jax.random.normal(keys[3], (experts, width, hidden)) / width ** 0.5
    weights, ids = route(x, jax.random.normal(keys[4], (hidden, experts)), top_k, True)
    return x, weights, ids, w_gate, w_up, w_down


def expected_bytes(tokens: int, experts: int, top_k: int, hidden: int, width: int, n: int, itemsize: int) -> dict:
    """Expert bytes one device reads per pass, both layouts, both paths (uniform routing; see the docstring)."""
    from specjax.models.moe import block_rows

    expert = 3 * hidden * width * itemsize
    slots = tokens * top_k
    hit = experts * (1 - (1 - top_k / experts) ** tokens)  # distinct experts a pass reaches
    local = experts // n
    hit_local = local * (1 - (1 - top_k / experts) ** tokens)  # of one device's E / n (the mean device)
    blocks_inside = min(slots, -(-slots // block_rows(slots, experts, 295)) + experts)
    blocks_local = min(slots, -(-slots // block_rows(slots, local, 295)) + local)
    return {"cpu_inside": hit * expert / n, "cpu_experts": hit_local * expert,
            "gpu_inside": blocks_inside * expert / n, "gpu_experts": blocks_local * expert}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256, help="a scaled Qwen3-30B-A3B layer (2048 there)")
    parser.add_argument("--width", type=int, default=96, help="expert width (768 there)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from specjax.bench.ar import machine_info
    from specjax.models.moe import expert_parallel_experts, sorted_experts
    from specjax.models.sharding import tensor_parallel_mesh, use_mesh

    mesh = tensor_parallel_mesh(DEVICES)
    specs = {"inside": (P(None, None, "model"), P(None, None, "model"), P(None, "model", None)),
             "experts": (P("model", None, None),) * 3}
    fns = {"inside": jax.jit(sorted_experts),
           "experts": jax.jit(lambda *a: expert_parallel_experts(*a, mesh))}
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x, weights, ids, *w = layer_inputs(tokens, args.experts, args.top_k, args.hidden, args.width)
        placed = {name: [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(w, spec)]
                  for name, spec in specs.items()}
        outs, times = {}, {name: [] for name in fns}
        with use_mesh(mesh):
            for name, fn in fns.items():
                outs[name] = np.asarray(fn(x, weights, ids, *placed[name]))  # compile
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    jax.block_until_ready(fn(x, weights, ids, *placed[name]))
                    times[name].append(time.perf_counter() - start)
        err = float(np.max(np.abs(outs["inside"] - outs["experts"])))
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        model = expected_bytes(tokens, args.experts, args.top_k, args.hidden, args.width, DEVICES, 4)
        rows.append({"tokens": tokens, "inside_ms": ms["inside"], "experts_ms": ms["experts"],
                     "experts_over_inside": ms["experts"] / ms["inside"], "max_abs_diff": err,
                     **{f"{k}_bytes": v for k, v in model.items()}})
    print(f"one MoE layer, E={args.experts}, k={args.top_k}, D={args.hidden}, I={args.width}, fp32, TP {DEVICES} "
          f"(fake CPU devices), medians of {args.repeats} interleaved")
    print("| tokens | inside ms | experts ms | experts / inside | max diff | per-device expert MB, CPU path: inside, "
          "experts | accelerator path: inside, experts |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['inside_ms']:.2f} | {r['experts_ms']:.2f} | {r['experts_over_inside']:.2f} | "
              f"{r['max_abs_diff']:.1e} | {r['cpu_inside_bytes'] / 1e6:.2f}, {r['cpu_experts_bytes'] / 1e6:.2f} | "
              f"{r['gpu_inside_bytes'] / 1e6:.2f}, {r['gpu_experts_bytes'] / 1e6:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
