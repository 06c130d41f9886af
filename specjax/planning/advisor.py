"""`specjax plan` and `specjax profile`: the load-aware advisor's command-line front ends, and its plot.

plan: for each concurrency (rows verified together), the best draft shape, its predicted tau
and speedup over plain decoding, and the runner-up, from an acceptance model (the published
model with --model-only, else a calibration run of the target and drafter) and a cost model
(measured on this machine as generate(..., tree="auto") measures, a device's roofline, or a profile JSON).
profile: measure that JSON on this device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specjax.config import ModelConfig, SamplingConfig, text_config
from specjax.convert.hf_files import read_hf_config, read_json
from specjax.convert.quantized import read_scheme
from specjax.decoding.tree import chain, parse_tree
from specjax.drafters import NgramDrafter
from specjax.loading.drafter import load_drafter
from specjax.loading.embedded import EMBEDDED_DIR
from specjax.loading.prompts import bench_prompts
from specjax.loading.target import load
from specjax.planning.auto import auto_shape, one_pass_trees
from specjax.planning.block_trees import CALIBRATION_WIDTH, best_block_tree, caterpillar
from specjax.planning.calibration import calibrate
from specjax.planning.memory import SERVED_CASES, Draft, checkpoint_draft, format_memory, memory_plan
from specjax.planning.planner import (
    Call,
    Choice,
    Shape,
    best_trees,
    drafter_takes_trees,
    format_plan,
    plan,
    published_model,
    published_moe_model,
    shape_curve,
    shape_of,
)
from specjax.planning.presets import SERVED
from specjax.planning.profile import (
    DEVICES,
    CostModel,
    cost_model,
    local_device,
    profile,
    routing_curve,
    save_profile,
)

DEFAULT_TARGET = EMBEDDED_DIR / "target"


def ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers like 1,8,32,128, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} must be positive integers like 1,8,32,128, got {text!r}")
    return values


# ---------------------------------------------------------------- plan


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-only", action="store_true",
                   help="the published load model: 8B target by roofline, drafter right w.p. --alpha, costing --cost")
    p.add_argument("--moe", action="store_true",
                   help="--model-only: plan Qwen3-30B-A3B (an MoE: the experts a pass reads grow with its tokens) "
                        "beside a dense model of the same active size, and compare their best shapes")
    p.add_argument("--alpha", type=float, default=0.8, help="--model-only: the drafter's per-position acceptance")
    p.add_argument("--cost", type=float, default=None,
                   help="draft cost per level as a fraction of one target step (--model-only default 0.05)")
    p.add_argument("--target", default=None, help="target checkpoint (default with a drafter: embedded tiny)")
    p.add_argument("--drafter", default=None,
                   help="a drafter directory of any family (draft model, EAGLE-3, MTP, DFlash, DSpark), or 'ngram'")
    p.add_argument("--concurrency", default="1,8,32,128", help="batch sizes to plan for")
    p.add_argument("--device", default=None,
                   help="h100 | h200 | cpu (their rooflines) or a profile JSON; default: measure on this machine as "
                        "generate(..., tree='auto') does (with --target/--drafter)")
    p.add_argument("--roofline", action="store_true", help="plan this machine by its roofline instead of measuring")
    p.add_argument("--context", type=int, default=512, help="cached tokens per row for the KV term (roofline)")
    p.add_argument("--full", action="store_true",
                   help="measure as generate(..., tree='auto') does in full: chains 1,2,3,4,8 timed for at least 2 s "
                        "a batch, again 4x longer when a gain is inside the timings' noise (minutes a batch on a "
                        "CPU); default: a quick measurement (chains 1,2,4, three timed rounds, the noise reported)")
    p.add_argument("--calibrate-tree", default=None,
                   help="shape of the calibration run (default kary:4,2,1,1, or chain:4 for chain-only drafters)")
    p.add_argument("--calibrate-prompts", type=int, default=8)
    p.add_argument("--calibrate-tokens", type=int, default=48)
    p.add_argument("--tokens", type=int, default=None,
                   help="score one generate call per concurrency: every row decodes this many tokens, the batch "
                        "waits for its slowest row, the prefill is paid once (default: a server, rows refilled)")
    p.add_argument("--prompt-len", type=int, default=128,
                   help="--tokens: prompt tokens per row; the prefill is modelled as a pass of that many per row")
    p.add_argument("--max-nodes", type=int, default=None, help="largest tree considered (default 512 / 64)")
    p.add_argument("--max-depth", type=int, default=24)
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="price the target split over this many devices of --device (h100 | h200, NVLink, at most "
                        "8): one device's weights, KV and FLOPs plus each pass's all-reduces (the drafter whole)")
    p.add_argument("--sampled", action="store_true",
                   help="--tensor-parallel: verification samples (temperature > 0), so the vocabulary-split logits "
                        "are all-gathered instead of reduced to each token's argmax")
    p.add_argument("--memory", action="store_true",
                   help="print the memory plan per device instead: weights, KV per token, recurrent state, the "
                        "draft's share and what is free for --batch rows of --context tokens (no --target: "
                        "Llama-3.3-70B at TP 8, Qwen3.5-27B at TP 2, Qwen3.5-122B-A10B at TP 8 on H100 and H200)")
    p.add_argument("--batch", type=int, default=32, help="--memory: rows held at --context cached tokens each")
    p.add_argument("--compiled", action="store_true",
                   help="--memory: also compile each case's plain loop for its device (deviceless without one; needs "
                        "the cuda12 extra) and give the compiler's figure and the free memory it leaves")
    p.add_argument("--plot", default=None, help="write a PNG of predicted speedup vs concurrency")
    p.add_argument("--json", default=None, help="write the plan as JSON")


def plan_main(args: argparse.Namespace) -> int:
    batches = ints(args.concurrency, "--concurrency")
    if args.plot and find_spec("matplotlib") is None:  # say so before minutes of calibration, not after
        raise ValueError("--plot needs matplotlib: pip install -e '.[plot]', or drop --plot")
    if args.memory:
        return memory_main(args)
    report: dict[str, Any] = {"concurrency": batches, "tensor_parallel": args.tensor_parallel}
    if args.moe:
        if not args.model_only:
            raise ValueError("--moe compares the published settings on a dense and an MoE model: add --model-only")
        return plan_moe_vs_dense(args, batches, report)
    if args.model_only:
        if args.target or args.drafter:
            raise ValueError("--model-only plans the published model; drop --target/--drafter, or drop --model-only")
        device = args.device or "h100"
        cost = 0.05 if args.cost is None else args.cost
        p, cm = published_model(args.alpha, cost, device, args.tensor_parallel, args.sampled)
        tree_ok, max_nodes, p_depth_rank, max_chain = True, args.max_nodes or 512, None, 16
        print(f"acceptance: rank r accepted w.p. alpha (1 - alpha)^r, alpha {args.alpha:g} "
              f"(p = {', '.join(f'{x:.3g}' for x in p[:4])}, ...)")
    else:
        if not args.drafter:
            raise ValueError("pass --drafter D (a drafter directory of any family, or 'ngram') to plan for a pair, "
                             "or --model-only for the published model")
        if args.device is None and not args.roofline and args.tensor_parallel != 1:
            raise ValueError(f"--tensor-parallel {args.tensor_parallel} prices a split target by roofline; this "
                             "machine's measurement runs on one device: add --device h100 or --device h200")
        target, drafter = load_pair(args.target or str(DEFAULT_TARGET), args.drafter)
        if args.device is None and not args.roofline:
            return plan_measured(args, target, drafter, batches, report)
        tree_ok = drafter_takes_trees(drafter, target)
        default = ("kary:4,2,1,1" if tree_ok else "chain:4")
        spec = caterpillar(CALIBRATION_WIDTH, drafter.max_draft_tokens) if one_pass_trees(drafter) and \
            not args.calibrate_tree else parse_tree(args.calibrate_tree or default, None)
        prompts = calibration_prompts(target, args.calibrate_prompts)
        cal = calibrate(target, drafter, prompts, spec, max_new_tokens=args.calibrate_tokens)
        p = cal.p_rank
        p_depth_rank, max_chain = None, min(16, getattr(drafter, "max_draft_tokens", 16))  # a block's drafts at most
        if one_pass_trees(drafter) and tree_ok:
            p_depth_rank = np.where(np.isnan(cal.p_depth_rank), np.asarray(p)[None, :], cal.p_depth_rank)
            args.max_depth = min(args.max_depth, drafter.max_draft_tokens)  # static trees: one block deep too
        report["calibration"] = cal.as_dict()
        print(f"calibration ({len(prompts)} prompts, {cal.rounds} rounds, shape {len(spec.parents)} nodes): "
              f"p by rank {', '.join(f'{x:.3f}' for x in p)}; tau measured {cal.measured_tau:.3f}, "
              f"predicted {cal.predicted_tau:.3f} (positional model), {cal.predicted_tau_by_depth:.3f} (per depth)")
        routing = routing_curve(target, prompts) if target.cfg.moe is not None else None
        if routing:
            print("routing measured on the calibration prompts: distinct experts per sparse layer at "
                  + ", ".join(f"{t} tokens {e:.1f}" for t, e in routing) + f" of {target.cfg.moe.num_experts}")
            report["routing"] = routing
        cm = cost_model(args.device or local_device(), target.cfg, drafter, args.context, args.cost, routing,
                        args.tensor_parallel, args.sampled)
        if args.device is None:
            print(f"planning by the roofline of this device ({local_device()}), not by measurement (--roofline)")
        max_nodes = args.max_nodes or 64
    print(f"cost: {cm.source}")
    call = None
    if args.tokens is not None:
        if args.tokens < 1 or args.prompt_len < 1:
            raise ValueError(f"--tokens and --prompt-len must be >= 1, got {args.tokens} and {args.prompt_len}")
        call = Call(args.tokens, lambda b: cm.verify_s(b, args.prompt_len))
        print(f"scored as one call per concurrency: {args.tokens} tokens per row after a {args.prompt_len}-token "
              f"prompt, until the slowest row is done")
        report["call"] = {"tokens": args.tokens, "prompt_len": args.prompt_len}
    table = best_trees(p, max_nodes, args.max_depth) if tree_ok else None
    choices = plan(p, batches, cm.verify_s, cm.draft_s, max_nodes=max_nodes, max_depth=args.max_depth,
                   tree_ok=tree_ok, table=table, call=call, max_chain=max_chain)
    if p_depth_rank is not None:  # a block drafter: its one-pass trees priced too (planning/block_trees.py)
        choices = [with_block_tree(c, p_depth_rank, cm, call, drafter.max_draft_tokens) for c in choices]
    print(format_plan(choices))
    report |= {"p_rank": list(p), "cost": cm.source, "choices": [c.as_dict() for c in choices]}
    if args.tensor_parallel > 1:
        report["collectives"] = collective_shares(choices, cm)
        print(format_shares(args.tensor_parallel, report["collectives"]))
    if args.plot:
        plot_speedups(p, cm, choices, table, args.plot, title=cm.source, call=call)
        print(f"wrote {args.plot}")
    if args.json:
        write_report(report, args.json)
    return 0


def with_block_tree(choice: Choice, p_DR, cm: CostModel, call, max_levels: int) -> Choice:
    """The choice with a block drafter's best one-pass tree in it when that is predicted faster."""
    block = best_block_tree(p_DR, choice.batch, cm.verify_s, cm.draft_s, None, call, max_levels=max_levels)
    if block is None or block.speedup <= choice.best.speedup:
        return choice
    return dataclasses.replace(choice, best=block, runner_up=choice.best)


def write_report(report: dict[str, Any], path: str) -> None:
    """The plan as JSON at `path` (values JSON cannot hold, as their str)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {path}")


def plan_moe_vs_dense(args: argparse.Namespace, batches: list[int], report: dict[str, Any]) -> int:
    """The published settings planned on Qwen3-30B-A3B and on a dense model of its active size, side by side."""
    cost = 0.05 if args.cost is None else args.cost
    p, dense, moe = published_moe_model(args.alpha, cost, args.device or "h100", args.tensor_parallel, args.sampled)
    max_nodes = args.max_nodes or 512
    table = best_trees(p, max_nodes, args.max_depth)
    plans = {}
    for name, cm in (("dense", dense), ("moe", moe)):
        print(f"cost ({name}): {cm.source}")
        plans[name] = plan(p, batches, cm.verify_s, cm.draft_s, max_nodes=max_nodes, max_depth=args.max_depth,
                           table=table)
        print(format_plan(plans[name]))
        if args.tensor_parallel > 1:
            report.setdefault("collectives", {})[name] = collective_shares(plans[name], cm)
            print(format_shares(args.tensor_parallel, report["collectives"][name]))
    print(format_comparison(plans["dense"], plans["moe"]))
    report |= {"p_rank": list(p), "costs": {"dense": dense.source, "moe": moe.source},
               "choices": {k: [c.as_dict() for c in v] for k, v in plans.items()}}
    if args.json:
        write_report(report, args.json)
    return 0


def collective_shares(choices: Sequence[Choice], cm: CostModel) -> list[dict[str, Any]]:
    """Per concurrency, the best shape's verify pass: its tokens, its time, and the time and share of it its
    collectives (tensor parallelism's all-reduces) take."""
    rows = []
    for c in choices:
        nodes = c.best.shape.nodes
        verify, collective = cm.verify_s(c.batch, nodes), cm.collective_s(c.batch, nodes)
        rows.append({"batch": c.batch, "shape": c.best.shape.label, "tokens": c.batch * nodes, "verify_s": verify,
                     "collective_s": collective, "allreduce_share": collective / verify})
    return rows


def format_shares(n: int, rows: Sequence[dict[str, Any]]) -> str:
    """collective_shares as a table, headed by the degree."""
    lines = [f"tensor parallel {n}: each best shape's verify pass, and its all-reduces",
             "| concurrency | best shape | tokens/pass | verify pass | all-reduces | share |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['shape']} | {r['tokens']} | {r['verify_s'] * 1e3:.2f} ms | "
              f"{r['collective_s'] * 1e3:.2f} ms | {r['allreduce_share']:.0%} |" for r in rows]
    return "\n".join(lines)


def format_comparison(dense: Sequence[Choice], moe: Sequence[Choice]) -> str:
    """Per concurrency: each model's best shape (nodes verified per row) and speedup, and which drafts longer."""
    lines = ["| concurrency | dense best (nodes, speedup) | MoE best (nodes, speedup) | MoE's draft |",
             "|---|---|---|---|"]
    for d, m in zip(dense, moe):
        dn, mn = d.best.shape.nodes, m.best.shape.nodes
        verdict = "same size" if dn == mn else (f"{dn / mn:.1f}x shorter" if mn < dn else f"{mn / dn:.1f}x longer")
        lines.append(f"| {d.batch} | {d.best.shape.label} ({dn}, {d.best.speedup:.2f}x) | "
                     f"{m.best.shape.label} ({mn}, {m.best.speedup:.2f}x) | {verdict} |")
    return "\n".join(lines)


def plan_measured(args: argparse.Namespace, target, drafter, batches: list[int], report: dict[str, Any]) -> int:
    """The plan for this device, measured as generate(..., tree="auto") measures it: per concurrency, a calibration
    run on that many held-out prompts for acceptance, the loop's rounds timed next to plain decoding, pass costs
    timed here; each concurrency planned for one call of --tokens tokens per row (default 128). What "auto" would
    run is the pick; "best predicted" is the planner's best shape before auto's margin over plain decoding."""
    tokens = args.tokens or 128
    how = ("in full (--full)" if args.full else
           "quickly (chains 1,2,4, three timed rounds; --full measures as 'auto' does, minutes a batch on a CPU)")
    print(f"measuring on this device ({local_device()}) {how}: per concurrency a calibration run, loop timings and "
          f"pass costs; scored as one call of {tokens} tokens per row on the held-out prompts (--device "
          f"h100|h200|cpu|PROFILE.json plans by a model instead)", flush=True)
    rows = []
    for batch in batches:
        start = time.perf_counter()
        _, info = auto_shape(target, drafter, calibration_prompts(target, batch), trees=True, sampling=SamplingConfig(),
                             seed=0, eos_token_id=None, max_new_tokens=tokens, quick=not args.full)
        rows.append({"batch": batch, **{k: v for k, v in info.items() if k != "cached"},
                     "measure_s": time.perf_counter() - start})
        print(f"concurrency {batch}: measured in {rows[-1]['measure_s']:.0f} s", flush=True)
    lines = ["| concurrency | pick (what 'auto' runs) | predicted speedup | best predicted (tau, speedup) | "
             "runner-up (tau, speedup) | margin |", "|---|---|---|---|---|---|"]
    for r in rows:
        other = "-" if r["runner_up"] is None else \
            f"{r['runner_up']} ({r['runner_up_tau']:.2f}, {r['runner_up_speedup']:.2f}x)"
        lines.append(f"| {r['batch']} | {r['shape']} | {r['predicted_speedup']:.2f}x | {r['best_predicted']} "
                     f"({r['best_predicted_tau']:.2f}, {r['best_predicted_speedup']:.2f}x) | {other} | "
                     f"{r['margin']:.1%}{' (undecided)' if r['undecided'] else ''} |")
    print("\n".join(lines))
    if any(r["undecided"] for r in rows):
        print("undecided: the best shape's predicted gain is inside the timings' noise (the margin), so 'auto' "
              "runs plain decoding there" + ("" if args.full else "; --full times such loops again, longer"))
    print(f"cost: {rows[-1]['cost']}")
    report |= {"model": "measured", "tokens": tokens, "choices": rows}
    if args.plot:
        print("--plot draws a cost model's curves: pass --device (h100, h200, cpu or a profile JSON) with it")
    if args.json:
        write_report(report, args.json)
    return 0


def memory_cases(args: argparse.Namespace) -> list[tuple[ModelConfig, str, str, int, int]]:
    """What `plan --memory` plans: (config, name, device, tensor parallelism, MTP layers) per row: --target's config
    at --tensor-parallel on --device (default: H100 and H200), or the six served cases at their own degrees."""
    devices = [args.device] if args.device else ["h100", "h200"]
    unknown = [d for d in devices if d not in DEVICES]
    if unknown:
        raise ValueError(f"--memory plans a device of DEVICES ({sorted(DEVICES)}), got --device {unknown[0]!r}")
    if args.target:
        path = Path(args.target)
        hf = read_json(path) if path.is_file() else read_hf_config(path)
        cfg, mtp = ModelConfig.from_hf(hf), int(text_config(hf).get("mtp_num_hidden_layers", 0))
        name = path.parent.resolve().name if path.is_file() else path.name  # DIR/config.json: the model is DIR
        return [(cfg, name, d, args.tensor_parallel, mtp) for d in devices]
    if args.tensor_parallel != 1:
        raise ValueError("--memory without --target plans the served cases at their own degrees (TP 8, 2, 8): "
                         "drop --tensor-parallel, or pass --target with it")
    mtp = {name: int(text_config(SERVED[name]).get("mtp_num_hidden_layers", 0)) for name, _ in SERVED_CASES}
    return [(ModelConfig.from_hf(SERVED[name]), name, d, n, mtp[name]) for name, n in SERVED_CASES for d in devices]


def memory_main(args: argparse.Namespace) -> int:
    """`specjax plan --memory`: the memory plan per device (planning/memory.py) as a table, and as JSON with --json.
    (With --compiled, specjax/cli.py hands the same cases to specjax/aot/memory.py instead.)"""
    draft = None
    if args.drafter:
        draft = Draft("n-gram (no weights)", 0.0, 0.0) if args.drafter == "ngram" else checkpoint_draft(args.drafter)
    scheme = None  # a quantized --target's weights at their size
    if args.target:
        path = Path(args.target)
        scheme = read_scheme(read_json(path) if path.is_file() else read_hf_config(path))
    plans = [memory_plan(cfg, name, DEVICES[d], n, args.batch, args.context, draft, mtp, scheme)
             for cfg, name, d, n, mtp in memory_cases(args)]
    print(format_memory(plans))
    if args.json:
        write_report({"memory": [p.as_dict() for p in plans]}, args.json)
    return 0


def load_pair(target_dir: str, drafter_arg: str):

    target = load(target_dir)
    drafter = NgramDrafter() if drafter_arg == "ngram" else load_drafter(drafter_arg, target)
    return target, drafter


def calibration_prompts(target, n: int) -> list:
    """Held-out prompts from the checkpoint's manifest when it has them, else random ids (what bench uses)."""

    return bench_prompts(target, n)


def plot_shapes(p, choices: Sequence[Choice], table) -> list[Shape]:
    """Shapes worth a curve: off, chains 1/2/4/8, every best shape of the plan, and the DP's 64-node tree."""
    shapes = [shape_of(None, p)] + [shape_of(chain(k), p) for k in (1, 2, 4, 8)]
    shapes += [c.best.shape for c in choices]
    if table is not None and table.max_nodes >= 64:
        shapes.append(shape_of(table.tree(64), p))
    seen, out = set(), []
    for s in shapes:
        if s.label not in seen:
            seen.add(s.label)
            out.append(s)
    return out


def plot_speedups(p, cm: CostModel, choices: Sequence[Choice], table, path: str, title: str = "",
                  call: Call | None = None) -> None:
    """Predicted speedup vs concurrency, one line per shape, on log-2 axes; the planner's pick marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401 (used as matplotlib.ticker)
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    lo, hi = min(c.batch for c in choices), max(c.batch for c in choices)
    grid = sorted({2 ** i for i in range(0, 12) if lo <= 2 ** i <= hi} | {c.batch for c in choices})
    curves = shape_curve(plot_shapes(p, choices, table), grid, cm.verify_s, cm.draft_s, call=call)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, (label, ys) in enumerate(curves.items()):
        ax.plot(grid, ys, marker=".", label=label, color=colors[(2 * i) % 20 + (2 * i) // 20 % 2],
                linestyle="--" if label == "off" else "-")
    ax.scatter([c.batch for c in choices], [c.best.speedup for c in choices], s=80, facecolors="none",
               edgecolors="k", zorder=5, label="planner's pick")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("concurrency (rows verified together)")
    ax.set_ylabel("predicted speedup over plain decoding")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- profile


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target checkpoint (default: embedded tiny)")
    p.add_argument("--drafter", default=None, help="draft-model checkpoint to time propose for")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--nodes", default="1,2,4,8,16,32")
    p.add_argument("--cache-lens", default="256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="runs/profile.json", help="profile JSON (profiles are added under their key)")
    p.add_argument("--tensor-parallel", type=int, default=None,
                   help="load the target split over this many devices and time it there (keyed with the mesh: tp8)")


def profile_main(args: argparse.Namespace) -> int:

    target = load(args.target or str(DEFAULT_TARGET), tensor_parallel=args.tensor_parallel)
    drafter = load_drafter(args.drafter, target) if args.drafter else None
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    cache_lens = [int(x) for x in args.cache_lens.split(",") if x.strip()]
    prof = profile(target, drafter, ints(args.batches, "--batches"), ints(args.nodes, "--nodes"), cache_lens,
                   repeats=args.repeats, log=lambda m: print(m, flush=True))
    path = save_profile(prof, args.out)
    print(f"wrote {path} (key {prof.key})")
    return 0
