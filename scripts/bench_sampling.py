#!/usr/bin/env python
"""What sampling costs next to greedy decoding: plain and speculative loops, batch 1 and 8, on this machine.

    python scripts/bench_sampling.py --out runs/sampling.json

For the embedded target (checkpoints/tiny/target, vocabulary 4096) and its draft model (chain of 4): greedy,
temperature 1 with top_k=50, with top_p=0.95, and with both, each decoding --tokens tokens per row (EOS off) from
the manifest's held-out prompts. Every configuration is compiled first, then timed in --repeats interleaved
rounds (round i runs every configuration once, in turn); the table gives each one's median decode seconds
(`out.stats["decode_s"]`, compile excluded), its spread, and the ratio to greedy in the same loop and batch,
then the same per loop iteration (a speculative round; a sampled draft is accepted less often than a greedy
one, so a sampled call runs more rounds: the per-iteration ratio is what sampling itself costs).
Also timed alone: `sampling_probs` + one draw on [batch, vocab] logits (the part of a step sampling adds), and
the filter's parts on [40, vocab]: lax.top_k at the candidate count and at 256, and the radix search's cut.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import specjax
from specjax.bench.ar import machine_info
from specjax.config import SamplingConfig
from specjax.decoding.sampling import as_rows, choose_token, row_keys

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"greedy": {}, "top_k=50": {"temperature": 1.0, "top_k": 50},
            "top_p=0.95": {"temperature": 1.0, "top_p": 0.95},
            "top_k=50,top_p=0.95": {"temperature": 1.0, "top_k": 50, "top_p": 0.95}}


def held_out(count: int) -> list[str]:
    texts = [p["text"] for p in json.loads((ROOT / "checkpoints/tiny/manifest.json").read_text())["held_out_prompts"]]
    return [texts[i % len(texts)] for i in range(count)]


def time_sampler(batch: int, vocab: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of one jitted choose_token on random [batch, vocab] logits, per setting. The values go in
    as data (RowSampling arguments), as the loops pass them: folded as constants, XLA:CPU rewrites lax.top_k at
    batch 1 into a sort of the vocabulary, which the loops never run."""
    logits = jax.random.normal(jax.random.key(0), (batch, vocab)) * 3.0
    keys = row_keys(jnp.arange(batch, dtype=jnp.uint32), jnp.zeros(batch, jnp.int32))
    out = {}
    for name, kw in SETTINGS.items():
        cfg = SamplingConfig(**kw)
        if cfg.greedy:  # the compiled greedy path: an argmax
            fn, args = jax.jit(lambda k, x, c=cfg: choose_token(k, x, c)), (keys, logits)
        else:
            fn, args = jax.jit(choose_token), (keys, logits, as_rows(cfg, batch))
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        out[name] = 1e3 * statistics.median(times)
    return out


def time_parts(rows: int, vocab: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of the filter's parts on random [rows, vocab] logits (rows: a verify pass's batch x
    nodes): lax.top_k at the candidate count and at 256, and the radix search's cut (the fallback)."""
    from specjax.decoding import sampling

    logits = jax.random.normal(jax.random.key(1), (rows, vocab))
    mass = jax.nn.softmax(logits, axis=-1)
    key = sampling._float_order_key(logits)
    limit = jnp.full((rows,), 0.05)
    fns = {f"top_k {sampling.CANDIDATES}": (lambda x: jax.lax.top_k(x, sampling.CANDIDATES), (logits,)),
           "top_k 256": (lambda x: jax.lax.top_k(x, 256), (logits,)),
           "radix cut": (sampling._largest_key_below, (key, mass, limit))}
    out = {}
    for name, (fn, args) in fns.items():  # arrays as arguments: closed-over constants would be folded at compile
        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(jitted(*args))
            times.append(time.perf_counter() - start)
        out[name] = 1e3 * statistics.median(times)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    target = specjax.load(ROOT / "checkpoints/tiny/target")
    draft = specjax.load_drafter(ROOT / "checkpoints/tiny/draft", target)
    batches = [int(b) for b in args.batches.split(",")]
    configs = [(mode, b, name) for mode in ("plain", "spec") for b in batches for name in SETTINGS]

    def run(mode, b, name, seed):
        extra = {"drafter": draft, "num_draft_tokens": 4} if mode == "spec" else {}
        return specjax.generate(target, held_out(b), max_new_tokens=args.tokens, eos_token_id=[], seed=seed,
                                **SETTINGS[name], **extra)

    compile_s = {}
    for c in configs:
        compile_s[c] = run(*c, seed=0).stats["compile_s"]
        print(f"compiled {c}: {compile_s[c]:.1f} s", file=sys.stderr, flush=True)
    times = {c: [] for c in configs}
    rounds = {c: [] for c in configs}
    for i in range(args.repeats):
        for c in configs:
            stats = run(*c, seed=i + 1).stats
            times[c].append(stats["decode_s"])
            rounds[c].append(stats["rounds"])
    rows = []
    for mode, b, name in configs:
        med = statistics.median(times[(mode, b, name)])
        greedy = statistics.median(times[(mode, b, "greedy")])
        ts = times[(mode, b, name)]
        per_round = statistics.median(t / r for t, r in zip(ts, rounds[(mode, b, name)]))
        greedy_round = statistics.median(t / r for t, r in zip(times[(mode, b, "greedy")], rounds[(mode, b, "greedy")]))
        rows.append({"loop": mode, "batch": b, "sampling": name, "median_ms": 1e3 * med, "min_ms": 1e3 * min(ts),
                     "max_ms": 1e3 * max(ts), "vs_greedy": med / greedy, "round_ms": 1e3 * per_round,
                     "round_vs_greedy": per_round / greedy_round, "rounds": statistics.median(rounds[(mode, b, name)]),
                     "compile_s": compile_s[(mode, b, name)]})
    sampler = {b: time_sampler(b, target.cfg.vocab_size, 50) for b in batches}
    parts = time_parts(40, target.cfg.vocab_size, 50)
    print(f"{args.tokens} tokens per row, embedded target (vocab {target.cfg.vocab_size}), draft model chain of 4 for "
          f"spec; median of {args.repeats} interleaved runs; {machine_info()['device']}, jax {jax.__version__}")
    print("| loop | batch | sampling | decode ms (median) | min-max | vs greedy | loop iterations | ms per iteration "
          "| per iteration vs greedy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['loop']} | {r['batch']} | {r['sampling']} | {r['median_ms']:.1f} | "
              f"{r['min_ms']:.0f}-{r['max_ms']:.0f} | {r['vs_greedy']:.2f}x | {r['rounds']:.0f} | "
              f"{r['round_ms']:.2f} | {r['round_vs_greedy']:.2f}x |")
    print("\none choose_token on [batch, vocab] logits, median ms of 50:")
    for b, per in sampler.items():
        print(f"  batch {b}: " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()))
    print("the filter's parts on [40, vocab] logits (batch 8 x a chain's 5 nodes), median ms of 50: "
          + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine_info(), "tokens": args.tokens, "repeats": args.repeats,
                                        "rows": rows, "choose_token_ms": sampler,
                                        "filter_parts_ms_40_rows": parts}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
