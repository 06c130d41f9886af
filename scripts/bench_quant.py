"""Quantized targets against bf16 on this machine: the same random weights, quantized (specjax/quant/quantize.py),
side by side in one process, interleaved, medians.

  matmul   x [M, K] @ W [K, N] for M = 1..8: bf16 W against block FP8, INT8 per channel and INT4 per group of 128,
           each dequantized inside the jitted matmul as a loaded checkpoint's weight is
  decode   plain greedy decoding of a random target (a bandwidth-bound step: batch 1, weights far past the caches)
           in bf16 and each format: ms per token, and the weight bytes each holds on the device
  plan     (--plan) the planner's best shape per batch (1..64) for the bf16 and the FP8 target, from verify profiles
           measured here, at the replay drafter's acceptance (0.8 by rank) and a free draft
  spec     (--spec K) replay-drafter chains of K on the bf16 and the FP8 target: output equal to plain, ms per token
  hlo      (--hlo) whether XLA fuses each format's dequantization into the GEMM (the compiled HLO, kept beside --out)

    python scripts/bench_quant.py --out docs/records/bench_quant_cpu.json
    python scripts/bench_quant.py --preset 8b --matmul 4096,14336 --formats fp8 int4 --tokens 64 --spec 3 --hlo
        (a GPU: scripts/gpu_checks.sh quant)

Single runs on a shared 2-core machine vary by +-25%: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import re
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


def fusion_report(k: int, n: int, fmt: str) -> dict:
    """Whether XLA fuses the dequantization into the matmul: the compiled HLO of x [1, K] @ W [K, N] in `fmt`,
    and whether one fused computation holds both the quantized type and the dot (else the dequantized weight is
    written out in full before the GEMM reads it again)."""
    w = quantize_weight((0.02 * jax.random.normal(jax.random.key(0), (k, n))).astype(jnp.bfloat16), fmt)
    x = jnp.ones((1, k), jnp.bfloat16)
    compiled = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    text = compiled.as_text()
    return {"format": fmt, "K": k, "N": n, "convert_fused_into_gemm": gemm_reads_quantized(text, fmt),
            "backend": jax.default_backend(), "hlo": text}


def gemm_reads_quantized(hlo: str, fmt: str) -> bool:
    """True when some matmul of the compiled HLO (a dot, a cuBLAS / cuBLASLt GEMM custom call, or a Triton GEMM
    fusion) takes an operand of the quantized type itself, i.e. the dequantization happens inside the GEMM and no
    dequantized copy of the weight is written to memory first."""
    qtype = {"fp8": "f8e4m3fn", "int8": "s8", "int4": "s4"}[fmt]
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    for line in hlo.splitlines():
        call = re.search(r" (dot|custom-call|fusion)\(([^)]*)\)", line)
        if call is None:
            continue
        is_gemm = call.group(1) == "dot" or ("custom-call" == call.group(1) and re.search(
            r"gemm|matmul", line)) or (call.group(1) == "fusion" and "kind=kCustom" in line and "gemm" in line)
        operands = re.findall(r"%([\w.\-]+)", call.group(2))
        if is_gemm and any(types.get(o) == qtype for o in operands):
            return True
    return False


def bench_spec(targets: dict, prompts, tokens: int, k: int, accept: float, repeats: int) -> list[dict]:
    """Speculation on each target: the replay drafter at `accept` (the target's own greedy continuation, each draft
    token corrupted with probability 1 - accept), chains of k: tokens equal plain decoding's, time per token."""
    rows, fns, plain = [], {}, {}
    for name, target in targets.items():
        plain[name] = specjax.generate(target, prompts, max_new_tokens=tokens, eos_token_id=[]).tokens
        drafter = specjax.replay_drafter(plain[name], target.cfg.vocab_size, 1 - accept)
        fns[name] = lambda t=target, d=drafter: specjax.generate(t, prompts, max_new_tokens=tokens, eos_token_id=[],
                                                                  drafter=d, num_draft_tokens=k)
    outs = {name: fn() for name, fn in fns.items()}
    t = interleaved_medians(fns, repeats)
    for name in targets:
        rows.append({"format": name, "ms_per_token": t[name] * 1e3 / tokens, "equal_to_plain":
                     outs[name].tokens == plain[name], "acceptance_length": outs[name].stats["acceptance_length"]})
        print(f"spec   {name:5s} replay chain:{k} @{accept}: {rows[-1]['ms_per_token']:8.2f} ms/token, tau "
              f"{rows[-1]['acceptance_length']:.2f}, equal to plain: {rows[-1]['equal_to_plain']}", flush=True)
    return rows


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
            "targets": targets, "prompts": prompts}


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
    if result.get("spec"):
        lines += ["", "| replay chain:3 @0.8 | ms / token | tau | equal to plain |", "|---|---|---|---|"]
        lines += [f"| {r['format']} | {r['ms_per_token']:.1f} | {r['acceptance_length']:.2f} | {r['equal_to_plain']} |"
                  for r in result["spec"]]
    if result.get("hlo"):
        lines += ["", "dequantization fused into the GEMM (" + result["hlo"][0]["backend"] + "): " + ", ".join(
            f"{r['format']} {'yes' if r['convert_fused_into_gemm'] else 'no'}" for r in result["hlo"])]
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
    ap.add_argument("--spec", type=int, default=0, help="also speculate with replay chains of this length")
    ap.add_argument("--hlo", action="store_true", help="also report whether XLA fuses each format's dequantization "
                    "into the matmul (compiled HLO of the --matmul shape at M = 1)")
    ap.add_argument("--out", help="write the JSON record here")
    args = ap.parse_args(argv)
    result = {"machine": machine_info(), "argv": sys.argv[1:]}
    if args.matmul:
        k, n = (int(x) for x in args.matmul.split(","))
        result["matmul"] = bench_matmul(k, n, [int(m) for m in args.rows.split(",")], args.formats, args.repeats)
    decode = bench_decode(args.preset, args.formats, args.batch, args.tokens, args.repeats)
    targets, prompts = decode.pop("targets"), decode.pop("prompts")
    result["decode"] = decode
    if args.spec:
        result["spec"] = bench_spec({k: targets[k] for k in ("bf16", "fp8") if k in targets}, prompts, args.tokens,
                                    args.spec, 0.8, args.repeats)
    if args.hlo and args.matmul:
        k, n = (int(x) for x in args.matmul.split(","))
        reports = [fusion_report(k, n, f) for f in args.formats]
        for r in reports:
            print(f"hlo    {r['format']}: convert fused into the GEMM: {r['convert_fused_into_gemm']} ({r['backend']})")
            if args.out:
                Path(args.out).with_suffix(f".{r['format']}.hlo.txt").write_text(r["hlo"])
        result["hlo"] = [{k: v for k, v in r.items() if k != "hlo"} for r in reports]
    if args.plan:
        result["plan"] = bench_plan(targets, [1, 8, 32, 64], [1, 4, 16], 256, 2)
    print(table_md(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
