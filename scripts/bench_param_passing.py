"""How a model's weights should cross a jit boundary: a plain dict, an nnx.State or the nnx.Module itself.

jit flattens its arguments on every call. A plain dict of arrays flattens in C++; an nnx.State or a
Module is a Python-registered pytree. This times flattening and a trivial jitted call for each, on a
Decoder of the given depth (random tiny weights: only the tree matters), side by side, interleaved.

    python scripts/bench_param_passing.py --layers 32
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
from flax import nnx

from specjax.config import ModelConfig
from specjax.models.decoder import Decoder
from specjax.models.state import to_params


def per_call_us(fn, arg, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(arg)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=args.layers, num_heads=2,
                      num_kv_heads=1, head_dim=8, qk_norm=True)
    model = Decoder(cfg, rngs=nnx.Rngs(0), per_layer=True)
    trees = {"dict": to_params(model), "nnx.State": nnx.state(model), "nnx.Module": model}
    first_leaf = jax.jit(lambda tree: jax.tree.leaves(tree)[0] + 1)
    for tree in trees.values():
        first_leaf(tree).block_until_ready()
    flat, call = {k: [] for k in trees}, {k: [] for k in trees}
    for _ in range(args.repeats):  # interleaved: each repeat times every kind once
        for name, tree in trees.items():
            flat[name].append(per_call_us(jax.tree.flatten, tree, args.calls))
            call[name].append(per_call_us(first_leaf, tree, args.calls))
    print(f"{platform.processor() or platform.machine()}, jax {jax.__version__}; Decoder with {args.layers} "
          f"per-layer modules, {len(jax.tree.leaves(trees['dict']))} arrays; medians of {args.repeats} repeats")
    print("| weights passed as | flatten (us) | jitted call (us) | call vs dict |")
    print("|---|---|---|---|")
    base = statistics.median(call["dict"])
    for name in trees:
        c = statistics.median(call[name])
        print(f"| {name} | {statistics.median(flat[name]):.0f} | {c:.0f} | {c / base:.1f}x |")


if __name__ == "__main__":
    main()
