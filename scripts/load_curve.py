#!/usr/bin/env python
"""The load curve measured end to end: speedup of chains and trees vs batch size, predicted next to measured.

    python scripts/load_curve.py --out runs/load_curve.json --plot runs/load_curve.png

A random target (`--preset 300m`: 246M params, big enough that this CPU turns compute-bound
inside batch 1..128) decodes random prompts greedily with EOS disabled. Drafts come from a
tree replay drafter (below): the target's own greedy continuation, where under every node
the true next token is the rank-r child with probability alpha (1 - alpha)^r (and missing when
the node has no rank-r child), every other child a random wrong token. Greedy verification
then accepts exactly as the planner's positional model says (p[r] = alpha (1 - alpha)^r; for
a chain: each draft right with probability alpha), so measured vs predicted isolates the cost
model. Drafting is free here.

Per batch: plain decoding, chains of --chains, the planner's DP trees of --trees nodes, and the
planner's own pick; every configuration is compiled and checked equal to plain decoding first,
then --repeats rounds run every configuration once each, in an order rotated every round
(interleaved, so drift on a shared machine hits all alike). Speedup = tokens/s over the same
round's plain decoding; the median and the min..max spread are reported. Predictions come
from a profile measured here first (`--cost profile`) or a roofline (`--cost cpu|h100|h200`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import generate
from specjax.bench_ar import PRESETS, machine_info, random_prompts
from specjax.bench_spec import random_model
from specjax.drafters.base import PrefillContext, Settings
from specjax.planner import best_trees, geometric_acceptance, plan, score, shape_of
from specjax.profile import cost_model, profile
from specjax.request import bucket
from specjax.sampling import split_rows, uniform_rows
from specjax.target import format_count
from specjax.tree import chain, child_ranks, spec_arrays
from specjax.verify import Draft, Verdict

# A tiny preset for tests of this script: two layers, 64 wide.
MICRO = {**PRESETS["tiny20m"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
MODELS = {**PRESETS, "micro": MICRO}


@dataclasses.dataclass(frozen=True)
class TreeReplayDrafter:
    """Benchmarking drafter: replays a reference continuation into any static tree at positional acceptance
    alpha (1 - alpha)^r by child rank. params: {"reference": int32 [B, M], "alpha": float32 []}."""

    vocab_size: int
    params: Any = dataclasses.field(default=None, compare=False, repr=False)
    settings: Settings | None = None
    name: str = "tree-replay"
    feature_layers: tuple[int, ...] = ()

    def configure(self, settings: Settings) -> "TreeReplayDrafter":
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        return 0

    def init(self, params, ctx: PrefillContext):
        if params["reference"].shape[0] != ctx.prompt.shape[0]:
            raise ValueError(f"reference has {params['reference'].shape[0]} rows, the padded batch "
                             f"{ctx.prompt.shape[0]}: build it from plain decoding of these prompts")
        return jnp.ones((ctx.prompt.shape[0],), jnp.int32)  # reference index of the token after the root

    def propose(self, params, state, root_B, keys_B):
        spec = self.settings.tree
        ref_BM, alpha = params["reference"], params["alpha"]
        b, m = ref_BM.shape
        n, depth, ranks = spec.num_nodes, spec.depths, child_ranks(spec)
        idx_BD = state[:, None] + jnp.arange(max(spec.max_depth, 1))[None, :]
        true_BD = jnp.take_along_axis(ref_BM, jnp.clip(idx_BD, 0, m - 1), axis=1)
        k_rank_B, k_tok_B = split_rows(keys_B, 2)
        u_BN = uniform_rows(k_rank_B, (b, n))
        # Rank of the true token among each node's children: geometric, P(R = r) = alpha (1 - alpha)^r.
        log_miss = jnp.log1p(-jnp.minimum(alpha, 1.0 - 1e-7))
        true_rank_BN = jnp.where(alpha > 0, jnp.floor(jnp.log(jnp.maximum(u_BN, 1e-30)) / log_miss), 1e6)
        offset_BN = jax.vmap(lambda k: jax.random.randint(k, (n,), 1, self.vocab_size))(k_tok_B)
        cols = [root_B]
        for i in range(1, n):
            truth_B = true_BD[:, depth[i] - 1]
            hit_B = true_rank_BN[:, spec.parents[i]] == ranks[i]
            cols.append(jnp.where(hit_B, truth_B, (truth_B + offset_BN[:, i]) % self.vocab_size))
        tokens_BN = jnp.stack(cols, axis=1).astype(jnp.int32)
        valid_BN = (state[:, None] + jnp.asarray(depth)[None, :] - 1 < m) | (jnp.arange(n) == 0)[None, :]
        return Draft(tokens_BN, spec_arrays(spec, b), valid_BN), state

    def update(self, params, state, draft: Draft, verdict: Verdict, features):
        return state + verdict.num_accepted


def tree_replay(continuations: list[list[int]], vocab: int, alpha: float) -> TreeReplayDrafter:
    rows, width = bucket(len(continuations), minimum=1), max(1, max(len(c) for c in continuations))
    ref = np.zeros((rows, width), np.int32)
    for i, c in enumerate(continuations):
        ref[i, : len(c)] = c
    return TreeReplayDrafter(vocab, params={"reference": jnp.asarray(ref), "alpha": jnp.float32(alpha)})


# ---------------------------------------------------------------- the measurement


def shapes_for(p, chains: list[int], trees: list[int], max_depth: int) -> list:
    table = best_trees(p, max(trees + [2]), max_depth)
    out = [shape_of(None, p)] + [shape_of(chain(k), p) for k in chains] + [shape_of(table.tree(n), p) for n in trees]
    seen, unique = set(), []
    for s in out:
        if s.spec not in seen:
            seen.add(s.spec)
            unique.append(s)
    return unique


def run_batch(target, batch: int, shapes: list, args, log) -> list[dict[str, Any]]:
    """Measure every shape at one batch size, interleaved over repeats; speedups paired with the same round's plain."""
    prompts = random_prompts(batch, args.prompt_len, target.cfg.vocab_size, args.seed + batch).tolist()
    kw = {"max_new_tokens": args.max_new_tokens, "eos_token_id": []}
    base = generate(target, prompts, **kw)
    drafter = tree_replay(base.tokens, target.cfg.vocab_size, args.alpha)

    def run(shape):
        if shape.kind == "off":
            return generate(target, prompts, **kw)
        return generate(target, prompts, drafter=drafter, tree=shape.spec, **kw)

    taus = {}
    for s in shapes:  # warm-up: compile, and check the output equals plain decoding
        out = run(s)
        if out.tokens != base.tokens:
            raise RuntimeError(f"{s.label} at batch {batch} differs from plain decoding (fp32 greedy must match)")
        taus[s.label] = out.stats["acceptance_length"]
    tps = {s.label: [] for s in shapes}
    for r in range(args.repeats):
        for j in range(len(shapes)):
            s = shapes[(j + r) % len(shapes)]
            tps[s.label].append(run(s).stats["tokens_per_s"])
    rows = []
    for s in shapes:
        ratios = [a / b for a, b in zip(tps[s.label], tps["off"])]
        rows.append({"batch": batch, "shape": s.label, "kind": s.kind, "nodes": s.nodes, "depth": s.depth,
                     "tau_measured": taus[s.label], "tau_predicted": s.tau,
                     "tokens_per_s": statistics.median(tps[s.label]), "tokens_per_s_all": tps[s.label],
                     "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios)})
        log(f"batch {batch:4d} {s.label:<16} tau {taus[s.label]:5.2f} (model {s.tau:5.2f})  speedup "
            f"{rows[-1]['speedup']:5.2f}x [{min(ratios):.2f}..{max(ratios):.2f}]")
    return rows


def predictions(rows: list[dict], shapes: list, cost, chosen: dict) -> dict[int, dict[str, Any]]:
    """Predicted speedup per row, and per batch how the planner's pick fared against the best measured shape."""
    by_label = {s.label: s for s in shapes}
    for r in rows:
        r["speedup_predicted"] = score(by_label[r["shape"]], r["batch"], cost.verify_s, cost.draft_s).speedup
        r["error"] = r["speedup_predicted"] / r["speedup"] - 1
    picks = {}
    for b, shape in chosen.items():
        measured = [r for r in rows if r["batch"] == b]
        best = max(measured, key=lambda r: r["speedup"])
        mine = next(r for r in measured if r["shape"] == shape.label)
        picks[b] = {"pick": shape.label, "pick_predicted": mine["speedup_predicted"], "pick_measured": mine["speedup"],
                    "best_measured_shape": best["shape"], "best_measured": best["speedup"],
                    "pick_vs_best": mine["speedup"] / best["speedup"]}
    return picks


def format_table(rows: list[dict], picks: dict) -> str:
    lines = ["| batch | shape | nodes | tau meas. | tau model | speedup meas. (min..max) | predicted | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['shape']} | {r['nodes']} | {r['tau_measured']:.2f} | "
                     f"{r['tau_predicted']:.2f} | {r['speedup']:.2f}x ({r['speedup_min']:.2f}..{r['speedup_max']:.2f}) "
                     f"| {r['speedup_predicted']:.2f}x | {r['error']:+.0%} |")
    lines += ["", "| batch | planner's pick | predicted | measured | best measured | pick / best |",
              "|---|---|---|---|---|---|"]
    for b, k in picks.items():
        lines.append(f"| {b} | {k['pick']} | {k['pick_predicted']:.2f}x | {k['pick_measured']:.2f}x | "
                     f"{k['best_measured_shape']} {k['best_measured']:.2f}x | {k['pick_vs_best']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.get_cmap("tab10").colors
    for i, label in enumerate(dict.fromkeys(r["shape"] for r in rows)):
        rs = [r for r in rows if r["shape"] == label]
        xs = [r["batch"] for r in rs]
        ys = [r["speedup"] for r in rs]
        err = [[y - r["speedup_min"] for y, r in zip(ys, rs)], [r["speedup_max"] - y for y, r in zip(ys, rs)]]
        c = colors[i % 10]
        ax.errorbar(xs, ys, yerr=err, color=c, marker="o", capsize=3, label=f"{label} measured")
        ax.plot(xs, [r["speedup_predicted"] for r in rs], color=c, linestyle="--", alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("\n".join(textwrap.wrap(title + "; solid: measured (min..max), dashed: predicted", 110)), fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="300m", choices=sorted(MODELS))
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--chains", default="1,2,4,8")
    ap.add_argument("--trees", default="8,16,32", help="DP tree budgets (nodes, root included)")
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cost", default="profile", help="profile (measured here first) | cpu | h100 | h200")
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/load_curve.json")
    ap.add_argument("--plot", default="runs/load_curve.png")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    batches, chains, trees = ints(args.batches), ints(args.chains), ints(args.trees)
    if not 0 < args.alpha <= 1 or args.repeats < 1:
        raise SystemExit("--alpha must be in (0, 1] and --repeats >= 1")
    log = lambda m: print(m, flush=True)  # noqa: E731
    target = random_model(MODELS[args.preset], "float32", args.seed, "auto")
    p = geometric_acceptance(args.alpha)
    shapes = shapes_for(p, chains, trees, args.max_depth)
    log(f"target {args.preset}: {target.cfg.num_params() / 1e6:.1f}M params; alpha {args.alpha}; shapes "
        f"{[s.label for s in shapes]}")
    cache = args.prompt_len + args.max_new_tokens // 2
    if args.cost == "profile":
        nodes = sorted({s.nodes for s in shapes})
        prof = profile(target, None, batches, nodes, (cache,), repeats=args.profile_repeats, log=log)
        cost = prof.cost(cache)
        profile_dict = prof.to_dict()
    else:
        cost, profile_dict = cost_model(args.cost, target.cfg, None, cache, 0.0), None
    chosen = {c.batch: c.best.shape for c in plan(p, batches, cost.verify_s, cost.draft_s,
                                                   max_nodes=max(s.nodes for s in shapes), max_depth=args.max_depth)}
    rows = []
    for b in batches:  # the planner's pick is measured too, when it is not one of the fixed shapes
        extra = [chosen[b]] if all(s.spec != chosen[b].spec for s in shapes) else []
        rows += run_batch(target, b, shapes + extra, args, log)
    picks = predictions(rows, shapes + list(chosen.values()), cost, chosen)
    text = format_table(rows, picks)
    print(text)
    result = {"script": "scripts/load_curve.py", "argv": sys.argv[1:] if argv is None else list(argv),
              "machine": machine_info(), "preset": args.preset, "params": target.cfg.num_params(),
              "alpha": args.alpha, "cost": cost.source, "rows": rows, "picks": picks, "profile": profile_dict,
              "table": text}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {args.out}")
    if args.plot:
        plot(rows, args.plot, f"{args.preset} ({format_count(target.cfg.num_params())}), replay alpha {args.alpha}, "
                              f"median of {args.repeats} interleaved; {cost.source}")
        log(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
