"""The two alternatives to the default block-FP8 matmul, measured here: speed, HLO, and re-quantization's error.

  blocks       (default) x @ W with W dequantized inside the jit: each 128 x 128 block times its scale, one dot
  ktile        one dot per 128-row input block on the FP8 values cast to the compute dtype, each [M, N] partial
               product times its blocks' scales, summed (quant/qarray.py ktile_matmul)
  per_channel  the FP8 block weight re-quantized at load to FP8 with one scale per output column (the scale
               commutes with the dot, as tpu-inference does for TPUs): changes the numbers, so opt-in
               (`specjax.load(..., quantized_matmul="per_channel")`)

For each [M, K] x [K, N]: the median time of each (calls interleaved, bf16 as the baseline), the error of each
output against the exact weights' (the block weight dequantized in fp32, x in fp32), and for per_channel the
weight's own error against the exact weights (max and RMS, relative to max |w|). Random N(0, 0.02) weights make
every block's scale alike; --outlier-blocks scales some blocks up (as trained weights have), where one scale per
column must cover a block 10x larger than its neighbours and the error grows.

    python scripts/bench_quant_alternatives.py --out docs/records/bench_quant_alternatives_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench.ar import interleaved_medians, machine_info
from specjax.quant.quantize import quantize_weight, with_matmul


def weight(k: int, n: int, outlier_blocks: float) -> jax.Array:
    """A [K, N] bf16 weight, N(0, 0.02), with a share `outlier_blocks` of its 128 x 128 blocks scaled by 10."""
    rng = np.random.default_rng(0)
    w = 0.02 * rng.standard_normal((k, n))
    if outlier_blocks:
        gi, go = -(-k // 128), -(-n // 128)
        big = np.repeat(np.repeat(rng.random((gi, go)) < outlier_blocks, 128, 0), 128, 1)[:k, :n]
        w = np.where(big, 10 * w, w)
    return jnp.asarray(w, jnp.bfloat16)


def rel(a, b, scale) -> tuple[float, float]:
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return float(np.abs(d).max() / scale), float(np.sqrt(np.mean(d ** 2)) / scale)


def bench(k: int, n: int, rows: list[int], repeats: int, outlier_blocks: float) -> dict:
    original = weight(k, n, outlier_blocks)
    blocks = jax.block_until_ready(quantize_weight(original, "fp8"))
    exact = np.asarray(blocks.dequantize(jnp.float32))
    original = np.asarray(original, np.float32)
    weights = {"bf16": blocks.dequantize(jnp.bfloat16), "blocks": blocks,
               "ktile": with_matmul(blocks, "ktile"), "per_channel": with_matmul(blocks, "per_channel")}
    moved = np.asarray(weights["per_channel"].dequantize(jnp.float32))
    w_max, w_rms = rel(moved, exact, np.abs(exact).max())
    matmul = jax.jit(lambda x, w: x @ w)
    b_max, b_rms = rel(exact, original, np.abs(original).max())  # block FP8's own rounding, for scale
    p_max, p_rms = rel(moved, original, np.abs(original).max())
    out = {"K": k, "N": n, "outlier_blocks": outlier_blocks,
           "per_channel_weight_error_vs_exact": {"max_rel": w_max, "rms_rel": w_rms},
           "block_fp8_error_vs_bf16_original": {"max_rel": b_max, "rms_rel": b_rms},
           "per_channel_error_vs_bf16_original": {"max_rel": p_max, "rms_rel": p_rms}, "rows": []}
    print(f"[{k}, {n}] outlier blocks {outlier_blocks}: per-channel re-quantized weight vs exact: max {w_max:.2e}, "
          f"rms {w_rms:.2e} (of max |w|); vs the bf16 original: block FP8 rms {b_rms:.2e}, per channel rms "
          f"{p_rms:.2e}", flush=True)
    for m in rows:
        x = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)
        want = np.asarray(x, np.float32) @ exact
        t = interleaved_medians({name: (lambda w=w: matmul(x, w)) for name, w in weights.items()}, repeats)
        scale = np.abs(want).max()
        errors = {name: rel(matmul(x, w), want, scale)[0] for name, w in weights.items()}
        out["rows"].append({"M": m, **{f"{name}_us": v * 1e6 for name, v in t.items()},
                            **{f"{name}_max_rel_error": e for name, e in errors.items()}})
        print(f"  M={m}: " + "  ".join(f"{name} {t[name] * 1e6:8.1f} us (err {errors[name]:.1e})" for name in t),
              flush=True)
    return out


def hlo_report(k: int, n: int) -> dict:
    """Per mode, the compiled HLO's fusions: whether a fusion writes out a bf16 / f32 array of the weight's K x N
    elements (the dequantized weight, or ktile's cast values reshaped [K / 128, 128, N]) before the dot reads it."""
    w = quantize_weight(weight(k, n, 0.0), "fp8")
    x = jnp.ones((1, k), jnp.bfloat16)
    out = {}
    for mode in ("blocks", "ktile", "per_channel"):
        text = jax.jit(lambda x, w: x @ w).lower(x, with_matmul(w, mode)).compile().as_text()
        full = any(math.prod(int(d) for d in m.group(2).split(",")) == k * n
                   for line in text.splitlines() if " fusion(" in line
                   and (m := re.search(r"= (bf16|f32)\[([\d,]+)\]", line)))
        out[mode] = {"weight_sized_bf16_or_f32_written": full, "hlo_lines": len(text.splitlines())}
        print(f"  HLO {mode}: a bf16 / f32 array of the weight's {k} x {n} elements written by a fusion: {full}",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matmul", default="1024,2816", help="K,N")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--outlier-blocks", type=float, nargs="*", default=[0.0, 0.05])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    k, n = (int(v) for v in args.matmul.split(","))
    rows = [int(v) for v in args.rows.split(",")]
    record = {"machine": machine_info(), "command": "python scripts/bench_quant_alternatives.py " +
              f"--matmul {k},{n} --rows {args.rows} --repeats {args.repeats}",
              "runs": [bench(k, n, rows, args.repeats, o) for o in args.outlier_blocks], "hlo": hlo_report(k, n)}
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
