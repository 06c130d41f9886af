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
  kernel   (--fp8-kernel L, a GPU) the fused block-FP8 Pallas kernel against XLA's dequantize-then-dot and bf16 at
           the --matmul shape and --rows, as the decode loop runs them: L distinct weights under lax.scan (past L2,
           dispatch amortised), us per matmul, the weight bytes per second, and the kernel's output against XLA's

    python scripts/bench_quant.py --out docs/records/bench_quant_cpu.json
    python scripts/bench_quant.py --preset 8b --matmul 4096,14336 --formats fp8 int4 --tokens 64 --spec 3 --hlo \
        --fp8-kernel 8     (a GPU: scripts/gpu_checks.sh quant)

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
from specjax.aot.compile import scan_hlo
from specjax.bench.ar import PRESETS, interleaved_medians, machine_info
from specjax.bench.spec import random_model
from specjax.kernels import block_fp8_matmul
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


def bench_fp8_kernel(k: int, n: int, rows: list[int], layers: int, repeats: int) -> list[dict]:
    """x [M, K] @ each of `layers` distinct [K, N] weights under lax.scan (the decode loop's form: every matmul reads
    its weight from HBM, one dispatch for all), per path: bf16, block FP8 through the fused kernel, block FP8
    dequantized by XLA then one dot (what x @ w ran before the kernel; XLA writes the bf16 weight first). us per
    matmul, FP8 weight GB/s (values + scales over the kernel's time), and the kernel's largest difference from the
    dequantize-then-dot output relative to its largest value (bf16 rounding: the two round differently)."""
    w_LKN = (0.02 * jax.random.normal(jax.random.key(0), (layers, k, n))).astype(jnp.bfloat16)
    q = jax.block_until_ready(quantize_weight(w_LKN, "fp8"))

    def over_layers(matmul):
        return jax.jit(lambda x, ws: jax.lax.scan(lambda c, w: (c, matmul(x, w)), None, ws)[1])

    paths = {"bf16": (over_layers(lambda x, w: x @ w), w_LKN),
             "fp8_kernel": (over_layers(lambda x, w: block_fp8_matmul(x, w.q, w.scale, block=w.block)), q),
             "fp8_xla": (over_layers(lambda x, w: x @ w.dequantize(x.dtype)), q)}
    fp8_bytes = (q.q.nbytes + q.scale.nbytes) / layers
    out = []
    for m in rows:
        x = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)
        t = interleaved_medians({name: (lambda f=f, w=w: f(x, w)) for name, (f, w) in paths.items()}, repeats)
        kernel, xla = (np.asarray(paths[p][0](x, paths[p][1]), np.float32) for p in ("fp8_kernel", "fp8_xla"))
        row = {"M": m, "K": k, "N": n, "layers": layers, **{f"{name}_us": v * 1e6 / layers for name, v in t.items()},
               "fp8_kernel_GBps": fp8_bytes * layers / t["fp8_kernel"] / 1e9,
               "kernel_vs_xla_max_rel": float(np.max(np.abs(kernel - xla)) / np.max(np.abs(xla)))}
        out.append(row)
        print(f"kernel [{m}, {k}] x [{k}, {n}]: " + "  ".join(f"{name} {row[name + '_us']:8.1f} us" for name in paths)
              + f"  kernel {row['fp8_kernel_GBps']:.0f} GB/s, vs xla {row['kernel_vs_xla_max_rel']:.1e}", flush=True)
    return out


def fusion_report(k: int, n: int, fmt: str) -> dict:
    """Whether XLA fuses the dequantization into the matmul: the compiled HLO of x [1, K] @ W [K, N] dequantized in
    the trace (`w.dequantize`, XLA's own form), and whether one fused computation holds both the quantized type and
    the dot (else the dequantized weight is written out in full before the GEMM reads it again). Beside it, what
    `x @ w` compiles to (on a GPU a block-FP8 weight runs the fused Pallas kernel): its Pallas kernels and the
    dequantized weights it writes (specjax/aot/compile.py scan_hlo)."""
    w = quantize_weight((0.02 * jax.random.normal(jax.random.key(0), (k, n))).astype(jnp.bfloat16), fmt)
    x = jnp.ones((1, k), jnp.bfloat16)
    text = jax.jit(lambda x, w: x @ w.dequantize(x.dtype)).lower(x, w).compile().as_text()
    used = scan_hlo(jax.jit(lambda x, w: x @ w).lower(x, w).compile().as_text())
    return {"format": fmt, "K": k, "N": n, "convert_fused_into_gemm": gemm_reads_quantized(text, fmt),
            "matmul_pallas_kernels": used["pallas_kernels"], "matmul_dequantized_weights": used["dequantized_weights"],
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
    d = result.get("decode", {"rows": []})
    if d["rows"]:
        lines += [f"| {d['preset']} decode, batch {d['batch']} | ms / token | weights on device MiB | quantized size "
                  "MiB | greedy tokens = bf16 |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['format']} | {r['ms_per_token']:.1f} | {r['weight_bytes'] / 2**20:.0f} | "
                     f"{r['quantized_size'] / 2**20:.0f} | {r['tokens_equal_to_bf16']:.2f} |")
    if result.get("spec"):
        lines += ["", "| replay chain:3 @0.8 | ms / token | tau | equal to plain |", "|---|---|---|---|"]
        lines += [f"| {r['format']} | {r['ms_per_token']:.1f} | {r['acceptance_length']:.2f} | {r['equal_to_plain']} |"
                  for r in result["spec"]]
    if result.get("hlo"):
        lines += ["", "dequantization fused into the GEMM by XLA (" + result["hlo"][0]["backend"] + "): " + ", ".join(
            f"{r['format']} {'yes' if r['convert_fused_into_gemm'] else 'no'}" for r in result["hlo"]),
                  "x @ w's Pallas kernels / dequantized weights written: " + ", ".join(
            f"{r['format']} {r['matmul_pallas_kernels'] or '-'} / {r['matmul_dequantized_weights']}"
            for r in result["hlo"])]
    if result.get("fp8_kernel"):
        lines += ["", "| M x K x N (over L weights) | bf16 us | FP8 kernel us | FP8 XLA dequantize + dot us | kernel GB/s "
                  "| kernel vs XLA |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['M']} x {r['K']} x {r['N']} (L {r['layers']}) | {r['bf16_us']:.1f} | {r['fp8_kernel_us']:.1f} | "
                  f"{r['fp8_xla_us']:.1f} | {r['fp8_kernel_GBps']:.0f} | {r['kernel_vs_xla_max_rel']:.1e} |"
                  for r in result["fp8_kernel"]]
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
    ap.add_argument("--fp8-kernel", type=int, default=0, metavar="L",
                    help="on a GPU, also time the fused block-FP8 kernel against XLA's dequantize-then-dot and bf16 "
                         "over L distinct weights of the --matmul shape at --rows (skipped off GPU: the kernel is "
                         "compiled for GPUs only)")
    ap.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                    help="decode the --preset target in bf16 and each format (--no-decode: the matmul parts only)")
    ap.add_argument("--out", help="write the JSON record here")
    args = ap.parse_args(argv)
    if not args.decode and (args.spec or args.plan):
        raise ValueError("--spec and --plan run on the decoded targets: drop --no-decode")
    result = {"machine": machine_info(), "argv": sys.argv[1:]}
    if args.matmul:
        k, n = (int(x) for x in args.matmul.split(","))
        result["matmul"] = bench_matmul(k, n, [int(m) for m in args.rows.split(",")], args.formats, args.repeats)
    if args.fp8_kernel and args.matmul:
        if jax.default_backend() == "gpu":
            k, n = (int(x) for x in args.matmul.split(","))
            result["fp8_kernel"] = bench_fp8_kernel(k, n, [int(m) for m in args.rows.split(",")], args.fp8_kernel,
                                                    args.repeats)
        else:
            print("kernel skipped: the block-FP8 kernel runs on a GPU only (here: " + jax.default_backend() + ")")
    if args.decode:
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
            print(f"hlo    {r['format']}: XLA fuses the convert into the GEMM: {r['convert_fused_into_gemm']}; x @ w runs "
                  f"kernels {r['matmul_pallas_kernels']}, writes {r['matmul_dequantized_weights']} dequantized "
                  f"weights ({r['backend']})")
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
