"""Time jax's all-reduce of a [tokens, hidden] bf16 activation over 2, 4, ... of this machine's devices, next to the
ring model `specjax plan --tensor-parallel` charges for it (profile.DeviceSpec.allreduce_s: NCCL's small-message
latency + 2 (n - 1) / n x bytes / 450 GB/s).

Each measurement is a psum under shard_map (every device holds a [tokens, hidden] partial sum, as after a row-split
o_proj or down_proj), `--inner` of them chained in one jitted fori_loop (each scaled by 1 / n so values stay put),
the call's median over `--repeats` divided by `--inner`. On one device there is nothing to reduce: it says so, writes
no figures and exits 0.

    python scripts/bench_allreduce.py --hidden 8192 --tokens 1,16,64,256,1024 --out runs/bench_allreduce.json
    (scripts/gpu_checks.sh tp runs it on a machine with more than one GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.planning.profile import DEVICES, device_kind, local_device


def time_allreduce(devices: list, tokens: int, hidden: int, repeats: int, inner: int) -> float:
    """Median seconds of one all-reduce of [tokens, hidden] bf16 over `devices`."""
    n = len(devices)
    mesh = Mesh(np.asarray(devices), ("model",))

    def chained(x_TD):
        return jax.lax.fori_loop(0, inner, lambda i, acc: jax.lax.psum(acc, "model") * (1.0 / n), x_TD)

    run = jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=P("model"), out_specs=P("model"), check_vma=False))
    x = jax.device_put(jnp.ones((n * tokens, hidden), jnp.bfloat16), NamedSharding(mesh, P("model")))
    jax.block_until_ready(run(x))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / inner


def device_counts(available: int) -> list[int]:
    """2, 4, 8, ... up to the devices there are, and their count itself."""
    counts = [n for n in (2, 4, 8, 16) if n <= available]
    return sorted(set(counts + ([available] if available > 1 else [])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=8192, help="the activation's width (Llama-3.3-70B: 8192)")
    p.add_argument("--tokens", default="1,16,64,256,1024", help="tokens per pass (the activation's rows)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--inner", type=int, default=20, help="all-reduces chained in one call")
    p.add_argument("--out", default="runs/bench_allreduce.json")
    args = p.parse_args(argv)
    devices = jax.devices()
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    spec = DEVICES[local_device()]
    rows = []
    if len(devices) < 2:
        print(f"one device ({devices[0].device_kind}): an all-reduce needs more than one; nothing measured (the "
              "planner keeps the nccl-tests figures in profile.DeviceSpec)")
    for n in device_counts(len(devices)):
        for t in tokens:
            nbytes = t * args.hidden * 2
            measured = time_allreduce(devices[:n], t, args.hidden, args.repeats, args.inner)
            model = spec.allreduce_s(n, nbytes) if spec.link_bandwidth else None
            rows.append({"devices": n, "tokens": t, "hidden": args.hidden, "bytes": nbytes, "measured_s": measured,
                         "model_s": model, "measured_over_model": measured / model if model else None})
            print(f"{n} devices, [{t}, {args.hidden}] bf16 ({nbytes / 2**10:.1f} KiB): {measured * 1e6:8.1f} us"
                  + (f", model {model * 1e6:8.1f} us ({measured / model:.2f}x)" if model else ""), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device_kind": device_kind(), "device_count": len(devices), "model_device": spec.name,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
