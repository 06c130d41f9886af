"""Speculation following the live load: the engine's shape choice against time under a ramp, and, at fixed
concurrencies, "auto" against "off" and every fixed chain.

    python scripts/bench_engine_load.py --preset 300m --drafters replay:0.6,replay:0.9,draft --slots 16 \
        --out runs/engine_load.json --plot runs/engine_load.png

The target is a random model large enough that decode is bandwidth-bound here (`--preset 300m`, 246M parameters,
as scripts/load_curve.py uses). Drafts come from the replay drafter (specjax/drafters/replay.py) keyed by prompt,
so a request finds its own continuation in whatever slot it lands: each draft is the target's true next token with
probability alpha, drafting costs nothing, and acceptance is set exactly ("replay:ALPHA"; "treereplay:ALPHA" drafts
any tree too, the true token the rank-r child w.p. alpha (1 - alpha)^r, for `--trees`); or from the preset's
random draft model ("draft": a real drafter that costs its forward passes and is almost never right, so the
engine should learn to keep speculation off).

1. Fixed concurrency c (`--concurrency`): max(`--requests`, 4c) requests of mixed output lengths (`--spread`) kept c
   in flight (a new one submitted as one ends), through one engine per setting: "auto" (off or a chain of
   `--chains`, chosen per chunk), "off", and each fixed chain, every engine with the same KV cache length.
   Settings run interleaved (a shuffled order per repeat), `--repeats` times; tokens/s medians are reported, and
   auto / off and auto / best fixed per concurrency as the median of the ratios within each repeat.
2. A ramp: target concurrency 1 -> --slots -> 1 in steps of `--step-s` seconds through the "auto" engine; the shape
   it chose (engine.stats()["shapes_over_time"]) against time, beside the live occupancy sampled every 50 ms.
Every engine is warmed up first (compile and cost profile), and nothing compiles during the timed runs (checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time

import numpy as np

import specjax
from specjax.bench.ar import PRESETS, machine_info
from specjax.bench.spec import preset_pair
from specjax.decoding.request import round_cache_length
from specjax.decoding.tree import parse_tree
from specjax.drafters.replay import replay_drafter, tree_replay


def keep_in_flight(engine, prompts, budget, concurrency, duration_s: float | None = None,
                   total: int | None = None, samples: list | None = None) -> tuple[int, float]:
    """Keep concurrency() requests in flight (a callable of elapsed seconds, or an int) until `total` requests have
    finished or `duration_s` has passed; returns (tokens, seconds). budget: every request's max_new_tokens, or a list
    (request i gets budget[i % len]). samples: (t, occupancy) appended every 50 ms."""
    budgets = budget if isinstance(budget, list) else [budget]
    target_c = concurrency if callable(concurrency) else (lambda t: concurrency)
    start, tokens, submitted, finished = time.perf_counter(), 0, 0, 0
    inflight = []
    while True:
        now = time.perf_counter() - start
        if (total is not None and finished >= total) or (duration_s is not None and now >= duration_s):
            break
        for h in [h for h in inflight if h.done()]:
            inflight.remove(h)
            tokens += len(h.result().tokens)
            finished += 1
        while len(inflight) < target_c(now) and (total is None or submitted < total):
            inflight.append(engine.submit(prompts[submitted % len(prompts)],
                                          max_new_tokens=budgets[submitted % len(budgets)],
                                          eos_token_id=[], temperature=0.0))
            submitted += 1
        if samples is not None:
            samples.append((round(now, 3), engine.stats()["occupancy"]))
        time.sleep(0.05 if samples is not None else 0.002)
    for h in inflight:
        tokens += len(h.result().tokens)
    return tokens, time.perf_counter() - start


def workload(preset: str, dtype, prompt_len: int, tokens: int, spread: float, chains: list[int], trees: list[str]):
    """(target, draft model, 64 random prompts, 97 output budgets uniform in tokens x [1 - spread, 1 + spread],
    each prompt's greedy continuation, the max_len that gives every engine one KV cache length)."""
    target, draft_model = preset_pair(preset, dtype, 0, "auto")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, target.cfg.vocab_size, prompt_len).tolist() for _ in range(64)]
    low, high = round(tokens * (1 - spread)), round(tokens * (1 + spread))
    budgets = rng.integers(max(low, 1), high + 1, 97).tolist()  # 97: prime, so (prompt, length) pairs vary by pass
    continuations = specjax.generate(target, prompts, max_new_tokens=high + 1, eos_token_id=[]).tokens
    # One KV cache length for every engine: an engine's cache holds max_len plus its largest shape's draft nodes,
    # rounded up (round_cache_length), so with max_len just above the need a tree's nodes alone could push "auto"
    # and the tree to the next multiple (256 positions against 128 here) and slow every round they run.
    nodes = max([parse_tree(None, k).cache_slots for k in chains] + [parse_tree(t, None).cache_slots for t in trees])
    max_len = round_cache_length(prompt_len + high + 1 + nodes) - nodes
    return target, draft_model, prompts, budgets, continuations, max_len


def engine_settings(chains: list[int], trees: list[str]) -> dict:
    """Engine keyword arguments per setting: "auto" (off, the chains and the trees), "off", each chain, each tree."""
    return {"auto": dict(num_draft_tokens="auto", auto_chains=chains, auto_trees=trees),
            "off": dict(num_draft_tokens="off"), **{f"chain:{k}": dict(num_draft_tokens=k) for k in chains},
            **{f"tree:{t}": dict(tree=t) for t in trees}}


def make_drafter(which: str, draft_model, continuations, prompts, vocab: int):
    """The drafter `which` names: "draft" (the preset's draft model), "replay:ALPHA" or "treereplay:ALPHA" (each
    prompt's continuation, `continuations`, drafted right with probability ALPHA)."""
    if which == "draft":
        return draft_model
    if which.startswith("replay:"):
        return replay_drafter(continuations, vocab, 1.0 - float(which.split(":")[1]), prompts=prompts)
    if which.startswith("treereplay:"):
        return tree_replay(continuations, vocab, float(which.split(":")[1]), prompts=prompts)
    raise SystemExit(f"unknown drafter {which!r}: replay:ALPHA, treereplay:ALPHA or draft")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="300m", choices=sorted(PRESETS))
    ap.add_argument("--drafters", default="replay:0.6,replay:0.9,draft")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--chains", default="1,2,4")
    ap.add_argument("--trees", default="", help="trees among auto's shapes and run fixed, ';'-separated "
                    "(e.g. 'kary:3,2,1;kary:4,2,2,1'); they need a drafter that drafts trees (treereplay, draft)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=24,
                    help="requests per fixed-concurrency run (at least 4 x the concurrency; at 8 a cell lasted about "
                         "a second on the CPU, too short to tell 5%% apart)")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request (their mean with --spread)")
    ap.add_argument("--spread", type=float, default=0.5,
                    help="output lengths uniform in tokens x [1 - spread, 1 + spread], seeded, the same sequence for "
                         "every setting (0: all equal; then a steady 'off' engine's rows start and finish together, "
                         "which no mixed load does)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--step-s", type=float, default=4.0, help="seconds per concurrency step of the ramp")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--from", dest="source", nargs="+", default=None,
                    help="records to merge (one per drafter) and print as a table (and --plot, --out), running nothing")
    args = ap.parse_args()
    if args.source:
        record = merge_records(args.source)
        print(format_table(record))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
        if args.plot:
            plot(record, args.plot)
        return

    chains = [int(k) for k in args.chains.split(",")]
    trees = [t for t in args.trees.split(";") if t]
    levels = [int(c) for c in args.concurrency.split(",")]
    target, draft_model, prompts, budgets, continuations, max_len = workload(
        args.preset, args.dtype, args.prompt_len, args.tokens, args.spread, chains, trees)
    vocab = target.cfg.vocab_size
    record = {"script": "scripts/bench_engine_load.py", "args": vars(args), "machine": machine_info(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(), "date": time.strftime("%Y-%m-%d"), "drafters": {}}
    for which in args.drafters.split(","):
        drafter = make_drafter(which, draft_model, continuations, prompts, vocab)
        settings = engine_settings(chains, trees)
        engines = {}
        for name, kw in settings.items():
            engines[name] = specjax.Engine(target, drafter, max_slots=args.slots, max_len=max_len, sampling=False,
                                           **kw)
            warm = engines[name].warmup()
            print(f"{which} {name}: warmup {warm:.1f} s, {engines[name].stats()['compiles']} compiles, "
                  f"cache {engines[name].cache_len}")
        assert len({e.cache_len for e in engines.values()}) == 1, {n: e.cache_len for n, e in engines.items()}
        compiles = {name: e.stats()["compiles"] for name, e in engines.items()}
        runs = {c: {name: [] for name in engines} for c in levels}
        auto_shapes = {c: [] for c in levels}  # the shapes "auto" ran at each level (each change, in order)
        for rep in range(args.repeats):
            for c in levels:
                order = list(engines)
                np.random.default_rng(rep * 100 + c).shuffle(order)
                for name in order:
                    changes_before = len(engines[name].stats()["shapes_over_time"])
                    tokens, seconds = keep_in_flight(engines[name], prompts, budgets, c,
                                                     total=max(args.requests, 4 * c))
                    runs[c][name].append(tokens / seconds)
                    if name == "auto":
                        history = engines[name].stats()["shapes_over_time"]
                        auto_shapes[c].append([s for _, _, s in history[max(0, changes_before - 1):]])
        table = []
        for c in levels:
            med = {name: statistics.median(v) for name, v in runs[c].items()}
            best_fixed = max((n for n in med if n != "auto"), key=med.get)
            # ratios within each repeat (the settings ran back to back), then their median: drift on a shared machine
            # moves both sides of a ratio alike
            ratio = {ref: statistics.median(a / b for a, b in zip(runs[c]["auto"], runs[c][ref]))
                     for ref in ("off", best_fixed)}
            table.append({"concurrency": c, "tok_s": med, "runs_tok_s": runs[c], "auto_vs_off": ratio["off"],
                          "best_fixed": best_fixed, "auto_vs_best": ratio[best_fixed], "auto_shapes": auto_shapes[c]})
            print(f"{which} c={c}: " + ", ".join(f"{n} {v:.1f}" for n, v in med.items()) +
                  f" | auto/off {ratio['off']:.2f}, auto/best({best_fixed}) {ratio[best_fixed]:.2f}")
        auto = engines["auto"]
        history = auto.stats()["shapes_over_time"]
        history_from = max(0, len(history) - 1)  # the shape in use when the ramp starts, then every change
        samples: list = []
        ramp_began = time.perf_counter() - auto._started  # the engine's clock, which shapes_over_time uses
        ramp = [1] + [c for c in (2 ** i for i in range(1, 10)) if c <= args.slots]
        ramp = ramp + ramp[-2::-1]
        ramp_s = args.step_s * len(ramp)
        keep_in_flight(auto, prompts, budgets, lambda t: ramp[min(int(t // args.step_s), len(ramp) - 1)],
                       duration_s=ramp_s, samples=samples)
        stats = auto.stats()
        record["drafters"][which] = {
            "fixed": table, "ramp_levels": ramp, "step_s": args.step_s,
            "ramp_shapes": stats["shapes_over_time"][history_from:], "ramp_occupancy": samples,
            "compiles_after_warmup": {n: e.stats()["compiles"] - compiles[n] for n, e in engines.items()},
            "cache_len": auto.cache_len,
            "policy": {k: stats[k] for k in ("round_ms", "realized_factor", "realized_row_rate", "dropped",
                                             "acceptance_at_depth", "acceptance_depth_rank", "tau")},
            "ramp_began": ramp_began}
        for e in engines.values():
            e.close()
        if args.out:  # after each drafter: a long run keeps what it measured
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    if args.plot:
        plot(record, args.plot)


def merge_records(paths: list[str]) -> dict:
    """One record of several runs' (one process per drafter): the first's header, every run's drafters."""
    records = [json.load(open(p)) for p in paths]
    merged = {**records[0], "drafters": {}}
    for r in records:
        merged["drafters"].update(r["drafters"])
    commits = sorted({r["commit"] for r in records})
    merged["note"] = f"one process per drafter, records merged; commits: {', '.join(commits)}"
    return merged


def format_table(record: dict) -> str:
    """Markdown: per drafter and concurrency, median tokens/s of every setting, auto / off and auto / best fixed
    (medians of within-repeat ratios) and the shapes auto ran."""
    first = next(iter(record["drafters"].values()))["fixed"][0]["tok_s"]
    names = list(first)
    lines = ["| drafter | c | " + " | ".join(names) + " | auto / off | auto / best fixed | auto ran |",
             "|" + "---|" * (len(names) + 5)]
    for which, r in record["drafters"].items():
        for row in r["fixed"]:
            ran = sorted({s for run in row["auto_shapes"] for s in run})
            cells = " | ".join(f"{row['tok_s'][n]:.0f}" for n in names)
            lines.append(f"| {which} | {row['concurrency']} | {cells} | {row['auto_vs_off']:.2f} | "
                         f"{row['auto_vs_best']:.2f} ({row['best_fixed']}) | {', '.join(ran)} |")
    return "\n".join(lines)


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = record["drafters"]
    fig, axes = plt.subplots(2, len(drafters), figsize=(6 * len(drafters), 7), squeeze=False)
    for j, (which, r) in enumerate(drafters.items()):
        ax = axes[0, j]
        cs = [row["concurrency"] for row in r["fixed"]]
        for name in r["fixed"][0]["tok_s"]:
            ax.plot(cs, [row["tok_s"][name] for row in r["fixed"]], marker="o", label=name,
                    linewidth=3 if name == "auto" else 1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{which}: fixed concurrency")
        ax.legend(fontsize=8)
        ax = axes[1, j]
        occ = np.array(r["ramp_occupancy"] or [(0, 0)])
        ax.plot(occ[:, 0], occ[:, 1], color="gray", label="occupancy")
        labels = sorted({s for _, _, s in r["ramp_shapes"]}, key=lambda s: (s != "off", s))
        ax2 = ax.twinx()
        times = [max(0.0, t - r["ramp_began"]) for t, _, _ in r["ramp_shapes"]]
        shapes = [labels.index(s) for _, _, s in r["ramp_shapes"]]
        end = r["step_s"] * len(r["ramp_levels"])  # the last shape holds to the ramp's end
        ax2.step(times + [end], shapes + shapes[-1:], where="post", color="C3", label="shape")
        ax2.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("seconds")
        ax.set_ylabel("live requests")
        ax.set_title("ramp 1 -> max -> 1: shape chosen (red) beside occupancy (gray)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
