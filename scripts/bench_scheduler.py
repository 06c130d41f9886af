#!/usr/bin/env python
"""The prefix scheduler against fixed block lengths, per batch size, on this machine.

    python scripts/bench_scheduler.py --out runs/bench_scheduler.json
    python scripts/bench_scheduler.py --quick          # a tiny target, seconds (tests run this)

A random target (`--preset tiny20m`: compute-bound on a 2-core CPU from ~13 tokens per pass, so
inside batch 1..64) decodes random prompts greedily with EOS off. Drafts come from the replay
drafter with synthetic confidences: each row's drafts are right with its own probability,
drawn uniformly in [--accept-lo, --accept-hi], and carry that probability (plus
--confidence-noise) as Draft.confidence, as a DSpark confidence head would.

Per batch: chains of 1..K drafts (every node verified every round), and the scheduler
("confidence": best compiled width for expected tokens per second paid; "prefix": DSpark's
Algorithm 1 verbatim) with two cost curves: (i) `synthetic`, this CPU's roofline (compute-bound
past its knee), (ii) `measured`, verify rounds of this target timed here first
(profile.time_verify_round). Every configuration is compiled and checked equal to plain decoding,
then --repeats rounds run each once, in an order rotated every round (interleaved); tokens/s is
the median with its min..max spread. Also per batch, the design (b) prototype: one packed
[1, T] forward of T admitted tokens (row ids and positions, attention per row over its own cache)
against design (a)'s padded [B, w] forward at the same admitted totals.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import generate, replay_drafter
from specjax.bench.ar import MICRO_PRESET, PRESETS, machine_info, random_prompts
from specjax.bench.spec import random_model
from specjax.decoding.request import round_cache_length
from specjax.decoding.scheduler import verify_widths
from specjax.models.cache import init_cache
from specjax.models.decoder import has_layer_list, unstack_layers
from specjax.models.layers import cached_attention, causal_mask, rms_norm, rope_inv_freq
from specjax.models.model import merge
from specjax.planning.profile import DEVICES, CostModel, Profile, Roofline, device_kind, model_name, time_verify_round

MODELS = {**PRESETS, "micro": MICRO_PRESET}


def measured_profile(target, batches: list[int], nodes: list[int], cache_len: int, repeats: int, log) -> Profile:
    """Verify-round seconds of this target at every (batch, nodes), timed here (the measured curve)."""
    rows = []
    for b in batches:
        for n in nodes:
            med, all_s = time_verify_round(target, b, n, cache_len, repeats)
            rows.append({"batch": b, "nodes": n, "cache_len": cache_len, "seconds": med, "all_seconds": all_s})
            log(f"  verify batch {b:3d} nodes {n:2d}: {med * 1e3:8.2f} ms")
    return Profile(device_kind(), model_name(target.cfg), str(target.cfg.dtype), rows)


def run_batch(target, batch: int, k: int, curves: dict, args, log) -> list[dict[str, Any]]:
    """tokens/s of chains 1..k and the scheduler (both rules, both curves) at one batch, interleaved repeats."""
    prompts = random_prompts(batch, args.prompt_len, target.cfg.vocab_size, args.seed + batch).tolist()
    kw = {"max_new_tokens": args.max_new_tokens, "eos_token_id": []}
    base = generate(target, prompts, **kw)
    rates = np.random.default_rng(args.seed + 7 * batch).uniform(args.accept_lo, args.accept_hi, size=batch)
    drafter = replay_drafter(base.tokens, target.cfg.vocab_size, (1.0 - rates).tolist(), confidence=True,
                             confidence_noise=args.confidence_noise)
    configs = {f"chain:{c}": {"num_draft_tokens": c} for c in range(1, k + 1)}
    stats = {}

    def warm(label, extra):  # compile, and check equality with plain decoding
        out = generate(target, prompts, drafter=drafter, **kw, **extra)
        if out.tokens != base.tokens:
            raise RuntimeError(f"{label} at batch {batch} differs from plain decoding")
        stats[label] = out.stats

    for label, extra in configs.items():
        warm(label, extra)
    # The loop's per-round work beyond the verify pass, from the chains' rounds: the measured curve's fixed part.
    prof = curves["measured"]
    over = statistics.median(max(0.0, stats[f"chain:{c}"]["decode_s"] / stats[f"chain:{c}"]["rounds"]
                                 - prof.verify_s(batch, c + 1)) for c in range(1, k + 1))
    measured = CostModel(prof.verify_s, lambda b, d: over, f"{prof.cost().source} + loop overhead "
                                                          f"{over * 1e3:.2f} ms/round from the chain runs")
    for mode in args.modes:
        for name, curve in {**curves, "measured": measured}.items():
            configs[f"sched-{mode}/{name}"] = {"num_draft_tokens": k, "scheduler": mode, "scheduler_profile": curve}
            warm(f"sched-{mode}/{name}", configs[f"sched-{mode}/{name}"])
    tps = {label: [] for label in configs}
    labels = list(configs)
    for r in range(args.repeats):
        for j in range(len(labels)):
            label = labels[(j + r) % len(labels)]
            tps[label].append(generate(target, prompts, drafter=drafter, **kw, **configs[label]).stats["tokens_per_s"])
    best_chain = max((lb for lb in labels if lb.startswith("chain")), key=lambda lb: statistics.median(tps[lb]))
    rows = []
    for label in labels:
        s = stats[label]
        rows.append({"batch": batch, "config": label, "tokens_per_s": statistics.median(tps[label]),
                     "tokens_per_s_all": tps[label], "min": min(tps[label]), "max": max(tps[label]),
                     "tau": s["acceptance_length"], "verified_tokens_per_round": s["verified_tokens_per_round"],
                     "padded_tokens_per_round": s["padded_tokens_per_round"],
                     "widths": s.get("verified_width_rounds"), "cost": (s.get("scheduler") or {}).get("cost"),
                     "vs_best_chain": statistics.median(tps[label]) / statistics.median(tps[best_chain]),
                     "best_chain": best_chain})
        log(f"batch {batch:3d} {label:<28} {rows[-1]['tokens_per_s']:8.1f} tok/s [{min(tps[label]):.1f}.."
            f"{max(tps[label]):.1f}]  tau {s['acceptance_length']:.2f}  verified/round "
            f"{s['verified_tokens_per_round']:6.1f}  paid/round {s['padded_tokens_per_round']:6.1f}")
    return rows


# ---------------------------------------------------------------- design (b): a packed verify, prototype


def packed_forward(params, cfg, tokens_T, row_T, slot_T, cache, width: int, impl: str):
    """Logits [T, V] of T tokens packed into one [1, T] pass: token t belongs to row row_T[t] at slot slot_T[t]
    after that row's prefix. Projections, MLP and lm_head run on the T tokens only; attention scatters
    them into a [B, width] window per row (causal inside it) and reads each row's own cache."""
    model = merge(cfg, params)
    b = cache.lengths.shape[0]
    pos_1T = (cache.lengths[row_T] + slot_T)[None]
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    h_1TD = model.embed[...][tokens_T][None]
    mask_BWW = jnp.broadcast_to(causal_mask(width), (b, width, width))
    k_caches, v_caches = list(cache.k), list(cache.v)
    for i, layer in enumerate(model.layers):
        q, k, v = layer.qkv(h_1TD, pos_1T, inv_freq)
        spread = lambda x: jnp.zeros((b, width, *x.shape[2:]), x.dtype).at[row_T, slot_T].set(x[0])  # noqa: E731
        o_BWHD, k_caches[i], v_caches[i] = cached_attention(spread(q), spread(k), spread(v), k_caches[i],
                                                            v_caches[i], None, cache.lengths, mask_BWW, impl)
        h_1TD = layer.attn_out_and_mlp(h_1TD, o_BWHD[row_T, slot_T][None])
    h_1TD = rms_norm(h_1TD, model.final_norm[...], cfg.rms_norm_eps)
    return model.logits(h_1TD)[0], (tuple(k_caches), tuple(v_caches))


def padded_forward(params, cfg, tokens_BW, cache, impl: str):
    """Design (a): logits [B, w, V] of every row's w nodes (the fixed-width pass)."""
    model = merge(cfg, params)
    h, _, cache = model.forward(tokens_BW, cache, attn_impl=impl)
    return model.logits(h), (cache.k, cache.v)


def _time(fn, cache, repeats: int) -> float:
    """Median seconds of fn(cache) -> (out, (k, v)), the cache donated and handed back each call."""
    state = {"c": cache}

    def once():
        out, (k, v) = fn(state["c"])
        state["c"] = type(cache)(k, v, cache.lengths)
        return jax.block_until_ready(out)

    once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def packed_vs_padded(target, batch: int, k: int, cache_len: int, repeats: int, seed: int) -> list[dict[str, Any]]:
    """Forward ms of the packed [1, T] pass vs the padded [B, w] pass for a few admitted-length patterns."""
    cfg, params = target.cfg, target.params
    if not has_layer_list(params):
        params = unstack_layers(params)  # the prototype runs the CPU layout: per-layer weights and caches
    n, widths = k + 1, verify_widths(k + 1)
    rng = np.random.default_rng(seed)
    patterns = {"uniform 0..K": rng.integers(0, k + 1, batch),
                "mostly short": np.minimum(rng.geometric(0.5, batch) - 1, k), "all 1": np.ones(batch, int)}
    s = round_cache_length(cache_len + n + 1)
    lengths_B = jnp.full((batch,), cache_len, jnp.int32)
    impl = target.attn_impl
    out = []
    for name, len_B in patterns.items():
        len_B = np.asarray(len_B, int)
        t = int(np.sum(len_B + 1))
        w = next(x for x in widths if x >= len_B.max() + 1)
        row_T = jnp.asarray(np.repeat(np.arange(batch), len_B + 1), jnp.int32)
        slot_T = jnp.asarray(np.concatenate([np.arange(x + 1) for x in len_B]), jnp.int32)
        tokens_T = jnp.asarray(rng.integers(3, cfg.vocab_size, t), jnp.int32)
        tokens_BW = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, w)), jnp.int32)
        packed = jax.jit(lambda c: packed_forward(params, cfg, tokens_T, row_T, slot_T, c, n, impl),
                         donate_argnums=0)
        padded = jax.jit(lambda c: padded_forward(params, cfg, tokens_BW, c, impl), donate_argnums=0)
        fresh = lambda: dataclasses.replace(init_cache(cfg, batch, s, per_layer=True), lengths=lengths_B)  # noqa
        packed_s = _time(packed, fresh(), repeats)
        padded_s = _time(padded, fresh(), repeats)
        out.append({"batch": batch, "pattern": name, "admitted_tokens": t, "width": w, "padded_tokens": batch * w,
                    "packed_ms": packed_s * 1e3, "padded_ms": padded_s * 1e3,
                    "packed_over_padded": packed_s / padded_s})
    return out


def format_table(rows: list[dict], packed: list[dict]) -> str:
    lines = ["| batch | config | tokens/s (min..max) | vs best chain | tau | verified tok/round | paid tok/round |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['config']} | {r['tokens_per_s']:.1f} ({r['min']:.1f}..{r['max']:.1f}) | "
                     f"{r['vs_best_chain']:.2f} | {r['tau']:.2f} | {r['verified_tokens_per_round']:.1f} | "
                     f"{r['padded_tokens_per_round']:.1f} |")
    lines += ["", "| batch | admitted pattern | admitted tokens T | (a) width x batch | packed [1, T] ms | "
              "padded [B, w] ms | packed / padded |", "|---|---|---|---|---|---|---|"]
    for p in packed:
        lines.append(f"| {p['batch']} | {p['pattern']} | {p['admitted_tokens']} | {p['width']} x {p['batch']} = "
                     f"{p['padded_tokens']} | {p['packed_ms']:.2f} | {p['padded_ms']:.2f} | "
                     f"{p['packed_over_padded']:.2f} |")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny20m", choices=sorted(MODELS))
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--k", type=int, default=6, help="draft block length K: chains 1..K; the scheduler gets K")
    ap.add_argument("--modes", default="confidence,prefix")
    ap.add_argument("--accept-lo", type=float, default=0.5)
    ap.add_argument("--accept-hi", type=float, default=0.95)
    ap.add_argument("--confidence-noise", type=float, default=0.05)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="micro target, batches 1,4, K 3, one repeat: seconds")
    ap.add_argument("--out", default="runs/bench_scheduler.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.batches, args.k, args.repeats, args.profile_repeats = "micro", "1,4", 3, 1, 1
        args.max_new_tokens, args.prompt_len = 16, 8
    args.modes = [m for m in args.modes.split(",") if m]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    batches = [int(x) for x in args.batches.split(",") if x]
    log = lambda m: print(m, flush=True)  # noqa: E731
    target = random_model(MODELS[args.preset], "float32", args.seed, "auto")
    cache_len = args.prompt_len + args.max_new_tokens // 2
    roof = Roofline.for_config(target.cfg, DEVICES["cpu"], cache_len)
    log(f"target {args.preset}: {target.cfg.num_params() / 1e6:.1f}M params; roofline knee {roof.knee:.0f} tokens")
    log("measuring the verify curve:")
    nodes = sorted(set(range(1, args.k + 2)) | set(verify_widths(args.k + 1)))
    prof = measured_profile(target, batches, nodes, cache_len, args.profile_repeats, log)
    curves = {"synthetic": "roofline", "measured": prof}
    rows, packed = [], []
    for b in batches:
        rows += run_batch(target, b, args.k, curves, args, log)
        packed += packed_vs_padded(target, b, args.k, cache_len, max(args.repeats, 3), args.seed + b)
        for p in packed[-3:]:
            log(f"batch {b:3d} packed {p['pattern']:<13} T={p['admitted_tokens']:4d}: {p['packed_ms']:.2f} ms vs "
                f"padded {p['width']}x{b}: {p['padded_ms']:.2f} ms")
    text = format_table(rows, packed)
    print(text)
    result = {"script": "scripts/bench_scheduler.py", "argv": sys.argv[1:] if argv is None else list(argv),
              "machine": machine_info(), "preset": args.preset, "params": target.cfg.num_params(), "k": args.k,
              "accept": [args.accept_lo, args.accept_hi], "confidence_noise": args.confidence_noise,
              "roofline": roof.device.name, "profile": prof.to_dict(), "rows": rows, "packed": packed, "table": text}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
