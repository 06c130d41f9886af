"""Measured speedup of draft shapes next to the planner's predictions: the harness behind
scripts/load_curve.py (the load curve on a random target) and scripts/plan_check.py (the planner's
picks on the embedded pair and the replay drafter).

Every configuration is compiled and checked equal to plain greedy decoding first; then each
repeat runs every configuration once, in a fresh random order every repeat (interleaved, so drift on a
shared machine hits all alike, and no configuration always runs after the same one: a small model's
weights stay in the CPU's caches between two runs of the same executable, and under a fixed rotation plain
decoding always ran right after "auto", which measured 0.97x plain in two runs where it decoded
plainly). Speedup = tokens/s over the same repeat's plain decoding; medians and the min..max spread
are reported.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path
from typing import Any, Callable

import numpy as np

from specjax.decoding.tree import chain
from specjax.generate import generate
from specjax.planning.planner import best_trees, score, shape_of

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


def measure_shapes(target, prompts: list, drafter, shapes: list, *, max_new_tokens: int, repeats: int,
                   batch: int, auto: str | None = None, min_time_s: float = 0.0, max_repeats: int = 60,
                   log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Measure plain decoding ("off" must be among `shapes`) and every shape on these prompts, interleaved.

    At least `repeats` rounds, and more (up to max_repeats) until the rounds add up to min_time_s by the
    warm-up's timings: a batch-1 run takes milliseconds, and a few of them are mostly timer noise.

    Repeat i runs every configuration with seed i, so a stochastic drafter's (the replay drafter's) luck is
    averaged over repeats: one fixed seed makes a batch-1 shape's tau a single draw (a chain of 7 at
    acceptance 0.6 measured tau 1.9 to 3.2 over seeds), and the best of a dozen single draws is partly
    the luckiest. Every run is checked equal to plain greedy decoding.

    auto: "tree" or "num_draft_tokens" adds the row `generate(..., <auto>="auto")` (planned at warm-up, then
    run with its cached plan) labelled "auto", with the plan in row["plan"]. EOS is off (every row decodes
    max_new_tokens). Returns one row per configuration: measured tau, median tokens/s, and speedup over the
    same repeat's plain decoding (median, min, max).
    """
    kw = {"max_new_tokens": max_new_tokens, "eos_token_id": []}
    base = generate(target, prompts, **kw)
    runs = {s.label: (s, (lambda seed, s=s: generate(target, prompts, seed=seed, **kw) if s.kind == "off" else
                          generate(target, prompts, drafter=drafter, tree=s.spec, seed=seed, **kw))) for s in shapes}
    if auto:
        runs["auto"] = (None, lambda seed: generate(target, prompts, drafter=drafter, seed=seed, **{auto: "auto"},
                                                    **kw))
    plans, round_s = {}, 0.0
    for label, (_, run) in runs.items():  # warm-up: compile (and plan)
        plans[label] = run(0).stats.get("plan")
        round_s += run(0).stats["decode_s"]  # warm now
    repeats = max(repeats, min(max_repeats, math.ceil(min_time_s / round_s)))
    labels = list(runs)
    tps, taus = {label: [] for label in labels}, {label: [] for label in labels}
    order = np.random.default_rng(0)
    for seed in range(repeats):  # a fresh order every repeat: no configuration always runs after the same one
        for j in order.permutation(len(labels)):
            out = runs[labels[j]][1](seed)
            if out.tokens != base.tokens:
                raise RuntimeError(f"{labels[j]} at batch {batch} (seed {seed}) differs from plain decoding "
                                   f"(fp32 greedy must match)")
            tps[labels[j]].append(out.stats["tokens_per_s"])
            taus[labels[j]].append(out.stats.get("acceptance_length", 1.0))
    rows = []
    for label in labels:
        shape = runs[label][0]
        ratios = [a / b for a, b in zip(tps[label], tps["off"])]
        plan = plans[label] if label == "auto" else None
        rows.append({"batch": batch, "shape": label, "kind": "auto" if shape is None else shape.kind,
                     "parents": list(shape.spec.parents) if shape and shape.spec else None,
                     "nodes": shape.nodes if shape else len(plan.get("parents") or [0]),
                     "depth": None if shape is None else shape.depth,
                     "tau_measured": statistics.fmean(taus[label]),
                     "tau_predicted": plan["predicted_tau"] if plan else shape.tau,
                     "tokens_per_s": statistics.median(tps[label]), "tokens_per_s_all": tps[label],
                     "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
                     "repeats": repeats,
                     "plan": plan})
        what = f"auto -> {plan['shape']}" if plan else label
        row = rows[-1]
        log(f"batch {batch:4d} {what:<24} tau {row['tau_measured']:5.2f} (model {row['tau_predicted']:5.2f})  speedup "
            f"{row['speedup']:5.2f}x [{min(ratios):.2f}..{max(ratios):.2f}] over {repeats} repeats")
    return rows


def add_predictions(rows: list[dict], shapes: list, cost, call=None, rescore_tree=None) -> None:
    """Each fixed shape's predicted speedup under `cost` (a profile.CostModel) for `call` (a planner.Call: the
    measured runs are whole generate calls) and the relative error. rescore_tree (Scored -> Scored), when
    given, rescores tree shapes (a draft model's trees: `planner.tree_with_its_drafting`)."""
    by_label = {s.label: s for s in shapes}
    for r in rows:
        if r["shape"] in by_label:
            scored = score(by_label[r["shape"]], r["batch"], cost.verify_s, cost.draft_s, cost.plain_s, call)
            if rescore_tree is not None and scored.shape.kind == "tree":
                scored = rescore_tree(scored)
            r["speedup_predicted"] = scored.speedup
        elif r.get("plan"):
            r["speedup_predicted"] = r["plan"]["predicted_speedup"]
        else:
            continue
        r["error"] = r["speedup_predicted"] / r["speedup"] - 1


def pick_summary(rows: list[dict], picks: dict[int, str]) -> dict[int, dict[str, Any]]:
    """Per batch: the planner's pick (a row's label) against the best measured fixed shape (batches whose pick
    was not measured are left out), with the 90% bootstrap interval of pick / best (`pick_vs_best_interval`)."""
    out = {}
    for b, label in picks.items():
        measured = [r for r in rows if r["batch"] == b]
        mine = next((r for r in measured if r["shape"] == label), None)
        if mine is None:  # the pick was too large a pass to measure here
            continue
        fixed = [r for r in measured if r["kind"] != "auto"]
        best = max(fixed, key=lambda r: r["speedup"])
        shape = mine["plan"]["shape"] if mine.get("plan") else label
        out[b] = {"pick": shape, "pick_predicted": mine.get("speedup_predicted"), "pick_measured": mine["speedup"],
                  "best_measured_shape": best["shape"], "best_measured": best["speedup"],
                  "pick_vs_best": mine["speedup"] / best["speedup"],
                  "pick_vs_best_interval": pick_vs_best_interval(mine, fixed)}
    return out


def pick_vs_best_interval(mine: dict, fixed: list[dict], level: float = 0.9) -> tuple[float, float]:
    """A bootstrap interval of pick / best measured over the repeats: each draw resamples the repeats, takes each
    shape's median speedup over the same repeats' plain decoding and divides the pick's by the best of them. The
    best of a dozen noisy medians is partly the luckiest; how far the interval reaches says whether a pick / best
    below a bar is the pick or the noise."""
    medians_DS = _resampled_median_speedups([mine, *fixed], fixed)
    return _interval(medians_DS[:, 0] / medians_DS[:, 1:].max(axis=1), level)


def speedup_interval(row: dict, rows: list[dict], level: float = 0.9) -> tuple[float, float]:
    """A bootstrap interval of one row's median speedup over plain decoding (the "off" row among `rows`), its
    repeats resampled as in pick_vs_best_interval."""
    return _interval(_resampled_median_speedups([row], rows)[:, 0], level)


def _resampled_median_speedups(shapes: list[dict], rows: list[dict], draws: int = 2000, seed: int = 0) -> np.ndarray:
    """[draws, shapes]: each shape's median speedup over plain decoding (measure_shapes' "off" row) on resampled
    repeats, one index for every configuration per draw (they ran interleaved, repeat i all together)."""
    plain = next(r for r in rows if r["kind"] == "off")
    speedup_SR = np.asarray([r["tokens_per_s_all"] for r in shapes], float) / np.asarray(plain["tokens_per_s_all"])
    draws_DR = np.random.default_rng(seed).integers(0, speedup_SR.shape[1], (draws, speedup_SR.shape[1]))
    return np.median(speedup_SR[:, draws_DR], axis=2).T


def _interval(x_D: np.ndarray, level: float) -> tuple[float, float]:
    low, high = np.quantile(x_D, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def format_table(rows: list[dict], picks: dict) -> str:
    """Markdown: every measured row with its prediction, then the planner's pick per batch against the best."""
    pct = lambda x: "" if x is None else f"{x:+.0%}"  # noqa: E731
    times = lambda x: "" if x is None else f"{x:.2f}x"  # noqa: E731
    lines = ["| batch | shape | tau meas. | tau model | speedup meas. (min..max) | predicted | error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        label = f"auto ({r['plan']['shape']})" if r.get("plan") else r["shape"]
        lines.append(f"| {r['batch']} | {label} | {r['tau_measured']:.2f} | {r['tau_predicted']:.2f} | "
                     f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}..{r['speedup_max']:.2f}) | "
                     f"{times(r.get('speedup_predicted'))} | {pct(r.get('error'))} |")
    lines += ["", "| batch | planner's pick | predicted | measured | best measured | pick / best |",
              "|---|---|---|---|---|---|"]
    for b, k in picks.items():
        lines.append(f"| {b} | {k['pick']} | {times(k['pick_predicted'])} | {k['pick_measured']:.2f}x | "
                     f"{k['best_measured_shape']} {k['best_measured']:.2f}x | {k['pick_vs_best']:.2f} |")
    return "\n".join(lines)


def format_grid(rows: list[dict], predicted: dict[str, list[float]], batches: list[int],
                picks: dict[int, tuple[str, float]]) -> str:
    """Markdown, one line per batch: each shape's measured speedup (its prediction in brackets; "-" where it was
    not measured), the planner's pick with its prediction and measurement, and the best measured shape."""
    measured = {(r["batch"], r["shape"]): r["speedup"] for r in rows if r["kind"] != "auto"}
    lines = ["| batch | " + " | ".join(predicted) + " | planner's pick (predicted) | best measured |",
             "|---" * (len(predicted) + 3) + "|"]
    for i, b in enumerate(batches):
        cells = [f"{measured[b, label]:.2f}x" if (b, label) in measured else "-" for label in predicted]
        cells = [f"{c} ({predicted[label][i]:.2f})" for c, label in zip(cells, predicted)]
        label, speedup = picks[b]
        got = measured.get((b, label))
        pick = f"{label} {speedup:.2f}x, " + ("not measured" if got is None else f"measured {got:.2f}x")
        here = [(v, k) for (bb, k), v in measured.items() if bb == b]
        best = "-" if not here else f"{max(here)[1]} {max(here)[0]:.2f}x"
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {pick} | {best} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, batches: list[int], predicted: dict[str, list[float]], title: str) -> None:
    """Speedup vs batch size per shape: measured medians with min..max bars (solid), predictions at every batch
    (dashed, `predicted[label][i]` at batches[i]; shapes too large to measure at a batch appear only dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.get_cmap("tab10").colors
    labels = list(dict.fromkeys([*predicted, *(r["shape"] for r in rows if r["kind"] != "auto")]))
    for i, label in enumerate(labels):
        c = colors[i % 10]
        rs = [r for r in rows if r["shape"] == label]
        if rs:
            xs, ys = [r["batch"] for r in rs], [r["speedup"] for r in rs]
            err = [[y - r["speedup_min"] for y, r in zip(ys, rs)], [r["speedup_max"] - y for y, r in zip(ys, rs)]]
            ax.errorbar(xs, ys, yerr=err, color=c, marker="o", capsize=3, label=f"{label} measured")
        if label in predicted:
            ax.plot(batches, predicted[label], color=c, linestyle="--", alpha=0.7,
                    label=None if rs else f"{label} predicted")
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
