#!/usr/bin/env python
"""The CPU measurements behind docs/architecture.md's measured design decisions, side by side in one run.

1. Memory read bandwidth: a numpy sum and a jitted 384 x 32000 matvec (the roofline batch-1 decode faces).
2. Six 384x1024 + 1024x384 matvec layers: weights stacked (scanned) vs one array per layer.
3. XLA attention at S = 16k (Hkv 2, D 64): masking V (any cache) vs finite_cache=True (specjax's caches).
4. Eight decode steps of 4 layers' cache write + attention at S = 16k: stacked cache vs one buffer per layer.
5. Decode step time of the embedded tiny target as the cache length grows.

  python scripts/bench_cpu_notes.py
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import specjax
from specjax.demo import EMBEDDED
from specjax.kernels import tree_attention_reference


def ms(fn, *args, n=50) -> float:
    """Median wall time of one call in milliseconds, after a warm-up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bandwidth() -> None:
    x = np.ones(100_000_000, np.float32)
    t = ms(lambda: x.sum(), n=5)
    print(f"numpy sum of 400 MB: {x.nbytes / t / 1e6:.1f} GB/s")
    w = jnp.asarray(np.random.default_rng(0).standard_normal((384, 32000), np.float32))
    t = ms(jax.jit(lambda h, w: h @ w), jnp.ones((1, 384)), w)
    print(f"jitted 384x32000 fp32 matvec: {t:.2f} ms = {w.nbytes / t / 1e6:.1f} GB/s")


def stacked_vs_list() -> None:
    rng = np.random.default_rng(0)
    up = jnp.asarray(rng.standard_normal((6, 384, 1024), np.float32) * 0.01)
    down = jnp.asarray(rng.standard_normal((6, 1024, 384), np.float32) * 0.01)

    def scanned(h, up, down):
        return lax.scan(lambda h, w: (h + jnp.tanh(h @ w[0]) @ w[1], None), h, (up, down))[0]

    def listed(h, ups, downs):
        for a, b in zip(ups, downs):
            h = h + jnp.tanh(h @ a) @ b
        return h

    h = jnp.ones((1, 384))
    print(f"6 MLP layers, stacked + scan: {ms(jax.jit(scanned), h, up, down):.2f} ms; one array per layer: "
          f"{ms(jax.jit(listed), h, list(up), list(down)):.2f} ms")


def attention_masking() -> None:
    b, s, n, kv, g, d = 1, 16384, 1, 2, 2, 64
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, n, kv * g, d))
    k, v = (jax.random.normal(key, (b, s, kv, d)) for key in keys[1:])
    lengths, mask = jnp.array([s - n - 3]), jnp.ones((b, n, n), bool)
    masked = ms(jax.jit(lambda *a: tree_attention_reference(*a)), q, k, v, lengths, mask)
    finite = ms(jax.jit(lambda *a: tree_attention_reference(*a, finite_cache=True)), q, k, v, lengths, mask)
    print(f"XLA attention, S=16k: {masked:.2f} ms masking V, {finite:.2f} ms with finite_cache=True")


def stacked_vs_per_layer_cache() -> None:
    layers, b, s, kv, d = 4, 1, 16384, 2, 64
    q, new = jnp.ones((b, 1, 2 * kv, d)), jnp.ones((kv, d))
    lengths, mask = jnp.array([s - 10]), jnp.ones((b, 1, 1), bool)

    def attend(k, v):
        return tree_attention_reference(q, k, v, lengths, mask, finite_cache=True)

    def stacked(k, v):
        def step(carry, _):
            k, v, acc = carry
            for i in range(layers):
                k, v = k.at[i, 0, lengths[0]].set(new), v.at[i, 0, lengths[0]].set(new)
                acc = acc + attend(k[i], v[i])
            return (k, v, acc), None
        return lax.scan(step, (k, v, jnp.zeros_like(q)), None, length=8)[0][2]

    def per_layer(ks, vs):
        def step(carry, _):
            ks, vs, acc = carry
            ks, vs = list(ks), list(vs)
            for i in range(layers):
                ks[i], vs[i] = ks[i].at[0, lengths[0]].set(new), vs[i].at[0, lengths[0]].set(new)
                acc = acc + attend(ks[i], vs[i])
            return (tuple(ks), tuple(vs), acc), None
        return lax.scan(step, (ks, vs, jnp.zeros_like(q)), None, length=8)[0][2]

    cache = jnp.zeros((layers, b, s, kv, d))
    print(f"decode step (4 layers, S=16k): stacked cache {ms(jax.jit(stacked), cache, cache, n=10) / 8:.2f} ms, "
          f"per-layer buffers {ms(jax.jit(per_layer), tuple(cache), tuple(cache), n=10) / 8:.2f} ms")


def step_vs_cache_length() -> None:
    target = specjax.load(EMBEDDED / "target")
    prompt = ["def read_lines(path):\n    "]
    for cache_len in (256, 1024, 4096, 16384):
        run = lambda: specjax.generate(target, prompt, max_new_tokens=128, eos_token_id=[], max_len=cache_len)
        run()
        per_token = statistics.median(1e3 / run().stats["tokens_per_s"] for _ in range(3))
        print(f"tiny target decode, cache {cache_len:6d}: {per_token:.2f} ms/token")


if __name__ == "__main__":
    print(f"jax {jax.__version__} on {jax.default_backend()}")
    bandwidth()
    stacked_vs_list()
    attention_masking()
    stacked_vs_per_layer_cache()
    step_vs_cache_length()
