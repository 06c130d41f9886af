"""Benchmark the Pallas tree-attention kernel against the XLA reference on a GPU.

Llama-3-8B head layout (Hq=32, Hkv=8, D=128), bf16, B in {1,8,32} x N in {1,16,64} x
S in {1k,4k,16k}, every row holding a full prefix (lengths = S - N). Each configuration is
first checked against the reference on the device, then timed: the op runs `reps` times
inside one jitted fori_loop (so launch overhead of Python dispatch is excluded), median of
--repeats after a warm-up. For N = 1 jax's own Pallas decode kernel is timed too, both via
`decode_attention.gqa` (which transposes the whole cache to [B, Hkv, S, D] on every call)
and on a pre-transposed cache (kernel only). Bandwidth = bytes of K/V the op must read
(rows' lengths + N, all kv heads) / time; the fraction is against --roofline-bw, and a
measured device-copy bandwidth is reported alongside.

  python scripts/bench_kernel.py --out runs/bench_kernel.json        # on a GPU
  JAX_PLATFORMS=cpu python scripts/bench_kernel.py --allow-cpu --small  # tiny interpret smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kernels import plan_blocks, tree_attention, tree_attention_reference

FULL = dict(q_heads=32, kv_heads=8, head_dim=128, batch=(1, 8, 32), num_new=(1, 16, 64),
            max_len=(1024, 4096, 16384))
SMALL = dict(q_heads=8, kv_heads=2, head_dim=64, batch=(1, 2), num_new=(1, 4),
             max_len=(64, 128))
BF16_ATOL = 3e-2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--roofline-bw", type=float, default=4.3e12,
                   help="bytes/s the fraction is taken against (default: H200, measured)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per op (median)")
    p.add_argument("--target-ms", type=float, default=20.0,
                   help="wall time of one timed run; sets the in-graph repetition count")
    p.add_argument("--small", action="store_true", help="tiny shapes (smoke test)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="with --small, run on CPU in Pallas interpret mode")
    return p.parse_args(argv)


def make_inputs(key, batch, num_new, q_heads, kv_heads, head_dim, max_len, dtype):
    """Random q/k/v on device, full prefixes (lengths = S - N), a causal chain mask."""
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, num_new, q_heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, max_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (batch, max_len, kv_heads, head_dim), dtype)
    lengths = jnp.full((batch,), max_len - num_new, jnp.int32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((num_new, num_new), bool)),
                            (batch, num_new, num_new))
    return q, k, v, lengths, mask


def kv_bytes(lengths, num_new, kv_heads, head_dim, itemsize):
    """Bytes of K and V that attention has to read: positions < lengths + N of every row."""
    return int(np.sum(np.asarray(lengths) + num_new)) * kv_heads * head_dim * 2 * itemsize


def time_op(fn, q, k, v, lengths, mask, *, repeats, target_s):
    """Median seconds per call of fn(q, k, v, lengths, mask), repeated inside one jit.

    Each iteration feeds a NaN check of its output back into `lengths` (adds 0) so XLA can
    neither hoist the call out of the loop nor drop it.
    """
    cap = k.shape[1] - q.shape[1]

    @jax.jit
    def looped(reps, q, k, v, lengths, mask):
        def body(_, lengths):
            out = fn(q, k, v, lengths, mask)
            bump = jnp.isnan(out[0, 0, 0, 0].astype(jnp.float32)).astype(jnp.int32)
            return jnp.minimum(lengths + bump, cap)
        return lax.fori_loop(0, reps, body, lengths)

    def run(reps):
        start = time.perf_counter()
        looped(jnp.int32(reps), q, k, v, lengths, mask).block_until_ready()
        return time.perf_counter() - start

    run(1)  # compile + warm-up
    one = max(run(1), 1e-6)
    reps = int(min(1000, max(3, target_s / one)))
    run(reps)  # warm-up at the chosen count
    return statistics.median(run(reps) / reps for _ in range(repeats)), reps


def copy_bandwidth(num_bytes, repeats):
    """Device bandwidth of an elementwise copy (read + write), bytes/s."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    step = jax.jit(lambda x: x + 1.0)
    step(x).block_until_ready()
    times = []
    for _ in range(max(3, repeats)):
        start = time.perf_counter()
        step(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / statistics.median(times)


def jax_decode_ops(sm_scale, interpret):
    """jax's Pallas decode kernels for N = 1 as fn(q, k, v, lengths, mask), or {} if absent."""
    try:
        from jax.experimental.pallas.ops.gpu import decode_attention as da
    except ImportError:
        return {}
    ops = {}

    def gqa(q, k, v, lengths, mask):
        del mask
        k_splits = max(1, min(16, k.shape[1] // 64))  # 16 (its default) from S = 1024 up
        out = da.gqa(q[:, 0], k, v, kv_seq_len=lengths + 1, sm_scale=sm_scale,
                     k_splits=k_splits, interpret=interpret)
        return out[:, None]
    ops["jax_decode_gqa"] = gqa

    if hasattr(da, "decode_attn_unbatched"):
        def kernel_only(q, k_BKSD, v_BKSD, lengths, mask):
            """decode_attention's kernel on a cache already laid out [B, Hkv, S, D]."""
            del mask
            batch, _, q_heads, head_dim = q.shape
            kv_heads, max_len = k_BKSD.shape[1], k_BKSD.shape[2]
            k_splits = max(1, min(16, max_len // 64))  # as in gqa above
            inner = functools.partial(
                da.decode_attn_unbatched, sm_scale=sm_scale, block_h=16,
                block_k=min(128, max_len // k_splits), k_splits=k_splits, num_warps=None,
                num_stages=2,
                grid=None, interpret=interpret, debug=False, return_residuals=False,
                normalize_output=True)
            q_BKGD = q[:, 0].reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
            seq_BK = jnp.broadcast_to((lengths + 1)[:, None], (batch, kv_heads))
            out = jax.vmap(jax.vmap(inner))(q_BKGD, k_BKSD, v_BKSD, None, seq_BK)
            return out.reshape(batch, 1, q_heads, head_dim)
        ops["jax_decode_kernel_only"] = kernel_only
    return ops


def bench_config(key, batch, num_new, max_len, shape, args, interpret):
    """Check then time every implementation on one configuration; one dict per impl."""
    q_heads, kv_heads, head_dim = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    q, k, v, lengths, mask = make_inputs(key, batch, num_new, q_heads, kv_heads, head_dim,
                                         max_len, jnp.bfloat16)
    sm_scale = 1.0 / math.sqrt(head_dim)
    ref_fn = functools.partial(tree_attention_reference, sm_scale=sm_scale)
    pallas_fn = functools.partial(tree_attention, sm_scale=sm_scale, interpret=interpret)
    impls = {"pallas": (pallas_fn, k, v), "xla": (ref_fn, k, v)}
    if num_new == 1:
        for name, fn in jax_decode_ops(sm_scale, interpret).items():
            if name == "jax_decode_kernel_only":
                impls[name] = (fn, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
            else:
                impls[name] = (fn, k, v)
    ref = np.asarray(ref_fn(q, k, v, lengths, mask).astype(jnp.float32))
    nbytes = kv_bytes(lengths, num_new, kv_heads, head_dim, 2)
    plan = plan_blocks(batch=batch, num_new=num_new, group=q_heads // kv_heads,
                       kv_heads=kv_heads, max_len=max_len, head_dim=head_dim)
    rows = []
    for name, (fn, k_in, v_in) in impls.items():
        row = dict(impl=name, batch=batch, num_new=num_new, max_len=max_len,
                   q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, kv_bytes=nbytes)
        if name == "pallas":
            row["plan"] = dict(block_m=plan.block_m, block_k=plan.block_k,
                               num_m_blocks=plan.num_m_blocks, num_splits=plan.num_splits)
        try:
            out = np.asarray(jax.jit(fn)(q, k_in, v_in, lengths, mask).astype(jnp.float32))
            row["max_abs_err"] = float(np.max(np.abs(out - ref)))
            row["correct"] = bool(np.isfinite(out).all() and row["max_abs_err"] <= BF16_ATOL)
            if not row["correct"]:
                row["error"] = f"mismatch vs reference: max abs err {row['max_abs_err']:.3g}"
            else:
                seconds, reps = time_op(fn, q, k_in, v_in, lengths, mask, repeats=args.repeats,
                                        target_s=args.target_ms / 1e3)
                row.update(time_us=seconds * 1e6, reps=reps, bandwidth=nbytes / seconds,
                           roofline_frac=nbytes / seconds / args.roofline_bw)
        except Exception as e:  # one failing impl must not hide the others' numbers
            row.update(correct=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print_row(row)
    return rows


def print_row(row):
    if "time_us" in row:
        print(f"{row['batch']:>4} {row['num_new']:>4} {row['max_len']:>6}  {row['impl']:<24}"
              f"{row['time_us']:>10.1f} {row['bandwidth'] / 1e9:>9.1f} "
              f"{row['roofline_frac']:>7.1%}  {row['max_abs_err']:.2e}", flush=True)
    else:
        print(f"{row['batch']:>4} {row['num_new']:>4} {row['max_len']:>6}  {row['impl']:<24}"
              f"  FAILED: {row.get('error', '?')}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    if not on_gpu and not (args.allow_cpu and args.small):
        sys.exit(f"bench_kernel.py times the Pallas GPU kernel, but JAX's backend is "
                 f"{backend!r}. Run it on a GPU, or pass --allow-cpu --small for a tiny "
                 "interpret-mode smoke run (its timings mean nothing).")
    interpret = not on_gpu
    shape = SMALL if args.small else FULL
    device = jax.devices()[0]
    copy_bw = copy_bandwidth((1 << 30) if on_gpu and not args.small else (1 << 22),
                             args.repeats)
    print(f"device: {device.device_kind} ({backend}), jax {jax.__version__}, "
          f"interpret={interpret}")
    print(f"device copy bandwidth (read+write): {copy_bw / 1e9:.1f} GB/s; "
          f"roofline used for the fraction: {args.roofline_bw / 1e9:.1f} GB/s")
    print(f"layout: Hq={shape['q_heads']} Hkv={shape['kv_heads']} D={shape['head_dim']} bf16, "
          "lengths = S - N")
    print(f"{'B':>4} {'N':>4} {'S':>6}  {'impl':<24}{'time_us':>10} {'GB/s':>9} "
          f"{'roof':>7}  max_err")
    results = []
    key = jax.random.key(0)
    start = time.perf_counter()
    for max_len in shape["max_len"]:
        for batch in shape["batch"]:
            for num_new in shape["num_new"]:
                key, sub = jax.random.split(key)
                results += bench_config(sub, batch, num_new, max_len, shape, args, interpret)
    elapsed = time.perf_counter() - start
    summary = dict(device=device.device_kind, backend=backend, jax_version=jax.__version__,
                   interpret=interpret, small=args.small, roofline_bw=args.roofline_bw,
                   copy_bw=copy_bw, wall_s=elapsed, results=results)
    failed = [r for r in results if r["impl"] == "pallas" and not r.get("correct")]
    print(f"done in {elapsed:.0f}s; pallas failures: {len(failed)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
