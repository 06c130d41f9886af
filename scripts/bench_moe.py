"""What experts do to verification, measured on this machine, side by side in one process, interleaved, medians:

  paths     one sparse MLP (the moe_cpu preset's: 32 experts of 512, 4 per token) by every expert path (gather,
            sorted blocks, ragged_dot) and the sorted blocks in their accelerator formulation (gathered expert
            matrices + batched matmul, "sorted_gathered"), 1..256 tokens: where they cross (models/moe.py
            GATHER_MAX_SLOTS) and what the CPU's in-place loop saves
  curve     one verify round (forward, lm_head, acceptance, commit) of a chain of T tokens, T = 1..256, for a
            random dense model (moe_cpu_dense) and a random MoE with the same active parameters (moe_cpu),
            next to the roofline's prediction on this CPU (uniform routing, and the routing measured on
            random prompts)
  plan      the planner's best shape per batch (1..64) for both, from verify profiles measured here, at the replay
            drafter's acceptance (TreeReplayDrafter at alpha 0.8: p = 0.8 (0.2)^r by rank) and its cost (a table
            lookup: drafting free), in one table and one plot

    python scripts/bench_moe.py --out runs/bench_moe.json --plot runs/bench_moe.png
    python scripts/bench_moe.py --paths-only --preset qwen3_30b_a3b --dtype bfloat16 --tokens 1,8,64,512,4096
        (the expert paths alone on one Qwen3-30B-A3B layer's shape: scripts/gpu_checks.sh moe)

Single runs on a shared 2-core machine vary by +-25%: read the ratios. --quick shrinks every sweep (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels
from specjax.bench.ar import PRESETS, interleaved_medians, machine_info
from specjax.bench.spec import random_model
from specjax.config import ModelConfig
from specjax.models.moe import EXPERT_PATHS, GATHER_MAX_SLOTS, block_rows, route
from specjax.planning.planner import format_plan, geometric_acceptance, plan
from specjax.planning.profile import DEVICES, Roofline, profile, routing_curve, time_verify_round


def bench_paths(cfg: ModelConfig, tokens: list[int], repeats: int, max_gather_slots: int = 2048) -> list[dict]:
    """Every expert path on one sparse layer's weights (random, the config's dtype), tokens per pass along `tokens`.
    The gather path copies each slot's expert matrices: past `max_gather_slots` it is not run."""
    moe, dtype = cfg.moe, jnp.dtype(cfg.dtype)
    d, e, i = cfg.hidden_size, moe.num_experts, moe.expert_size
    ks = jax.random.split(jax.random.key(0), 5)
    w_gate, w_up = ((0.02 * jax.random.normal(k, (e, d, i))).astype(dtype) for k in ks[:2])
    w_down = (0.02 * jax.random.normal(ks[2], (e, i, d))).astype(dtype)
    router = (jax.random.normal(ks[3], (d, e)) / d ** 0.5).astype(dtype)
    rows = []
    for n in tokens:
        x = jax.random.normal(ks[4], (n, d)).astype(dtype)
        weights, experts = route(x, router, moe.top_k, moe.norm_topk_prob)
        paths = {k: v for k, v in EXPERT_PATHS.items() if k != "gather" or n * moe.top_k <= max_gather_slots}
        fns = {name: (lambda f=jax.jit(fn): f(x, weights, experts, w_gate, w_up, w_down)) for name, fn in paths.items()}
        if jax.default_backend() == "cpu":  # the accelerator formulation of the blocks (gathered weights), here
            # its own function object: jit's trace cache is keyed on the function, and the CPU path traces the same one
            sorted_again = lambda *a: EXPERT_PATHS["sorted"](*a)  # noqa: E731
            gathered = as_on_accelerator(jax.jit(sorted_again), x, weights, experts, w_gate, w_up, w_down)
            fns["sorted_gathered"] = lambda: gathered(x, weights, experts, w_gate, w_up, w_down)
        t = interleaved_medians(fns, repeats)
        rows.append({"tokens": n, "slots": n * moe.top_k, "block_rows": block_rows(n * moe.top_k, e),
                     **{f"{k}_ms": v * 1e3 for k, v in t.items()}, "faster": min(t, key=t.get)})
        print(f"paths  tokens {n:5d} ({n * moe.top_k:6d} slots): "
              + "  ".join(f"{k} {v * 1e3:9.2f} ms" for k, v in t.items()), flush=True)
    return rows


def as_on_accelerator(fn, *args):
    """`fn` compiled for `args` with models/moe.py's expert_matmuls taking its accelerator branch (gathered expert
    matrices, one batched matmul) although this is the CPU: the two formulations side by side."""
    real = kernels.on_gpu
    kernels.on_gpu = lambda: True
    try:
        return fn.lower(*args).compile()
    finally:
        kernels.on_gpu = real


def bench_curve(dense, moe, tokens: list[int], cache_len: int, repeats: int) -> list[dict]:
    cpu = DEVICES["cpu"]
    roofs = {name: Roofline.for_config(t.cfg, cpu, cache_len) for name, t in (("dense", dense), ("moe", moe))}
    ids = np.random.default_rng(3).integers(0, moe.cfg.vocab_size, size=(8, 128)).tolist()
    measured_routing = routing_curve(moe, ids, tokens)
    routed_roof = roofs["moe"].with_routing(measured_routing)
    rows = []
    for t in tokens:
        row = {"tokens": t}
        for name, target in (("dense", dense), ("moe", moe)):  # interleaved point by point
            med, _ = time_verify_round(target, 1, t, cache_len, repeats)
            row[f"{name}_ms"] = med * 1e3
            row[f"{name}_roofline_ms"] = roofs[name].verify_s(1, t) * 1e3
        row["moe_routed_roofline_ms"] = routed_roof.verify_s(1, t) * 1e3
        row["experts_read_uniform"] = roofs["moe"].experts_read(t)
        row["experts_read_measured"] = routed_roof.experts_read(t)
        rows.append(row)
        print(f"curve  T {t:4d}: dense {row['dense_ms']:8.2f} ms (roofline {row['dense_roofline_ms']:7.2f})  "
              f"moe {row['moe_ms']:8.2f} ms (roofline {row['moe_roofline_ms']:7.2f}, measured routing "
              f"{row['moe_routed_roofline_ms']:7.2f}; experts {row['experts_read_measured']:.1f} of "
              f"{moe.cfg.moe.num_experts})", flush=True)
    return rows


def bench_plan(dense, moe, batches: list[int], nodes: list[int], cache_len: int, repeats: int, max_tokens: int):
    """Verify profiles of both targets, and the plans they give at the replay drafter's acceptance (0.8 by rank)."""
    p = geometric_acceptance(0.8)
    out = {}
    for name, target in (("dense", dense), ("moe", moe)):
        prof = profile(target, None, batches=batches, nodes=nodes, cache_lens=(cache_len,), repeats=repeats,
                       max_tokens=max_tokens, log=lambda m, n=name: print(f"plan   {n}: {m}", flush=True))
        cm = prof.cost(cache_len)
        choices = plan(p, batches, cm.verify_s, cm.draft_s, max_nodes=max(nodes), max_depth=12)
        print(format_plan(choices))
        out[name] = {"profile": prof.to_dict(), "choices": [c.as_dict() for c in choices]}
    rows = []
    for d, m in zip(out["dense"]["choices"], out["moe"]["choices"]):
        rows.append({"batch": d["batch"], "dense": d["best"]["label"], "dense_nodes": d["best"]["nodes"],
                     "dense_speedup": d["best"]["speedup"], "moe": m["best"]["label"], "moe_nodes": m["best"]["nodes"],
                     "moe_speedup": m["best"]["speedup"]})
    return {"p_rank": list(p), **out, "table": rows}


def table_md(result: dict) -> str:
    lines = ["| T | dense ms (roofline) | MoE ms (roofline; measured routing) | experts read (uniform; measured) |",
             "|---|---|---|---|"]
    for r in result["curve"]:
        lines.append(f"| {r['tokens']} | {r['dense_ms']:.1f} ({r['dense_roofline_ms']:.1f}) | {r['moe_ms']:.1f} "
                     f"({r['moe_roofline_ms']:.1f}; {r['moe_routed_roofline_ms']:.1f}) | "
                     f"{r['experts_read_uniform']:.1f}; {r['experts_read_measured']:.1f} |")
    lines += ["", "| batch | dense best (nodes, speedup) | MoE best (nodes, speedup) |", "|---|---|---|"]
    for r in result["plan"]["table"]:
        lines.append(f"| {r['batch']} | {r['dense']} ({r['dense_nodes']}, {r['dense_speedup']:.2f}x) | {r['moe']} "
                     f"({r['moe_nodes']}, {r['moe_speedup']:.2f}x) |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    curve = result["curve"]
    t = [r["tokens"] for r in curve]
    for name, color in (("dense", "tab:blue"), ("moe", "tab:red")):
        ax1.plot(t, [r[f"{name}_ms"] for r in curve], "o-", color=color, label=f"{name} measured")
        ax1.plot(t, [r[f"{name}_roofline_ms"] for r in curve], "--", color=color, label=f"{name} roofline")
    ax1.plot(t, [r["moe_routed_roofline_ms"] for r in curve], ":", color="tab:red",
             label="moe roofline, measured routing")
    ax1.set(xscale="log", yscale="log", xlabel="tokens per verify pass", ylabel="ms per verify round",
            title="verify cost vs tokens per pass (this CPU)")
    ax1.legend(fontsize=7)
    rows = result["plan"]["table"]
    b = [r["batch"] for r in rows]
    ax2.plot(b, [r["dense_nodes"] for r in rows], "o-", color="tab:blue", label="dense: best nodes per row")
    ax2.plot(b, [r["moe_nodes"] for r in rows], "o-", color="tab:red", label="MoE: best nodes per row")
    ax2.set(xscale="log", yscale="log", xlabel="batch (concurrency)", ylabel="nodes verified per row",
            title="planner's best shape (measured profiles, acceptance 0.8)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--plot", default=None, help="write the curve and the plans as a PNG")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache-len", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="short sweeps (a smoke run, not a measurement)")
    ap.add_argument("--paths-only", action="store_true", help="only the expert paths, on --preset's layer shape")
    ap.add_argument("--preset", default="moe_cpu", choices=[k for k, v in PRESETS.items() if "num_experts" in v])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", default=None, help="tokens per pass, comma-separated (default 1..256 by powers of 2)")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else \
        [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    if args.paths_only:
        cfg = ModelConfig.from_hf(PRESETS[args.preset], dtype=args.dtype)
        result = {"machine": machine_info(), "preset": args.preset, "dtype": args.dtype, "repeats": args.repeats,
                  "gather_max_slots": GATHER_MAX_SLOTS, "paths": bench_paths(cfg, tokens, args.repeats)}
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))
            print(f"wrote {args.out}")
        return 0
    batches = [1, 4] if args.quick else [1, 2, 4, 8, 16, 32, 64]
    nodes = [1, 2, 4] if args.quick else [1, 2, 4, 8, 16, 32, 64]
    dense = random_model(PRESETS["moe_cpu_dense"], "float32", 0, "auto")
    moe = random_model(PRESETS["moe_cpu"], "float32", 0, "auto")
    result = {"machine": machine_info(), "presets": {"dense": "moe_cpu_dense", "moe": "moe_cpu"},
              "params": {"dense": dense.cfg.num_params(), "moe": moe.cfg.num_params(),
                         "moe_active": moe.cfg.num_params(active=True)},
              "gather_max_slots": GATHER_MAX_SLOTS, "repeats": args.repeats, "cache_len": args.cache_len}
    result["paths"] = bench_paths(moe.cfg, tokens, args.repeats)
    result["curve"] = bench_curve(dense, moe, tokens, args.cache_len, args.repeats)
    result["plan"] = bench_plan(dense, moe, batches, nodes, args.cache_len, max(2, args.repeats // 2), max_tokens=512)
    print(table_md(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
