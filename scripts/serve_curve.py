#!/usr/bin/env python
"""The seed's load curve, live: `specjax serve` with speculation off, each fixed chain, and "auto", loaded by
`specjax bench serve` at each concurrency; throughput and TPOT against concurrency.

    python scripts/serve_curve.py --out docs/records/serve_curve_cpu.json --plot docs/serve_curve_cpu.png

Every server setting (--settings: off, chain:K, auto) is started first: `specjax serve CKPT --drafter D
--num-draft-tokens ... --greedy-only` as a subprocess on a free port each, started and warmed up one at a time. Then,
--repeats times, at every --concurrency, the settings are loaded in a shuffled order (interleaved, so a drift of the
machine's speed moves every setting alike): --max-concurrency C with C x --prompts-per-slot requests of the embedded
held-out prompts, all sent at once, greedy. Each server is then stopped with SIGTERM and its exit code recorded (0
expected). With --preset (a random target and draft model, e.g. 8b on a GPU) the engines are built and served in
this process instead, with `bench serve`'s random dataset (--input-len ids drawn from the vocabulary less its special
tokens, sent as text) on the target's stand-in tokenizer (specjax/bench/stand_in_tokenizer.py).
Reported per (setting, concurrency): the run with the median output throughput over the repeats; auto / off and
auto / best fixed as the median of the ratios within each repeat; the best fixed chain at a concurrency is the
fixed setting with the highest median output throughput there. The JSON keeps every run's vLLM metrics and the
server's acceptance over it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from specjax.bench.serving import datasets, metrics
from specjax.bench.serving.main import benchmark
from specjax.bench.serving.plot import plot_curve
from specjax.loading.embedded import EMBEDDED_DIR, embedded

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(setting: str) -> list[str]:
    return ["--num-draft-tokens", setting.split(":")[-1] if setting.startswith("chain:") else setting]


@contextlib.contextmanager
def checkpoint_server(args, setting: str, exit_codes: dict):
    """`specjax serve` in a subprocess (its own interpreter, so the load generator does not share its GIL); stopped
    by SIGTERM, its exit code recorded."""
    port = free_port()
    log = Path(args.logs) / f"serve_{setting.replace(':', '')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "specjax.cli", "serve", str(args.target), "--drafter", str(args.drafter),
           *engine_flags(setting), "--max-slots", str(args.max_slots), "--max-len", str(args.max_len), "--port",
           str(port), "--served-model-name", "tiny", "--max-logprobs", "-1", "--no-penalties", "--greedy-only",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, args.ready_timeout)
        print(f"{setting}: ready ({log})", flush=True)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_codes[setting] = proc.wait(timeout=300)
        print(f"{setting}: stopped by SIGTERM, exit code {exit_codes[setting]}", flush=True)


@contextlib.contextmanager
def preset_server(args, setting: str, pair):
    """An engine on a random preset target and draft model, built in this process, served on a thread."""
    from specjax.engine import Engine
    from specjax.serve.app import Server, build_app
    from specjax.serve.main import serve_in_thread

    target, draft = pair
    shape = setting.split(":")[-1] if setting.startswith("chain:") else setting
    engine = Engine(target, None if shape == "off" else draft, max_slots=args.max_slots, max_len=args.max_len,
                    num_draft_tokens=int(shape) if shape.isdigit() else shape, sampling=False)
    try:
        print(f"{setting}: warm-up {engine.warmup():.1f} s", flush=True)
        with serve_in_thread(build_app(Server(engine, target, "tiny", max_len=args.max_len))) as url:
            yield url
    finally:
        engine.close()


def replay_for(args, target):
    """The replay drafter over every prompt the run sends (samples_for at the largest concurrency: each smaller
    one's prompts are its first ones), drafting the target's greedy continuation right with probability ALPHA."""
    import specjax
    from specjax.drafters.replay import replay_drafter

    kind, _, alpha = args.preset_drafter.partition(":")
    if kind != "replay" or not alpha:
        raise SystemExit(f"--preset-drafter must be 'draft' or 'replay:ALPHA', got {args.preset_drafter!r}")
    samples = samples_for(args, max(args.concurrency) * args.prompts_per_slot, target.tokenizer)
    prompts = [target.encode(s.prompt) for s in samples]  # the ids the server reads the text as
    continuations = specjax.generate(target, prompts, max_new_tokens=args.output_len + 1, eos_token_id=[]).tokens
    return replay_drafter(continuations, target.cfg.vocab_size, 1.0 - float(alpha), prompts=prompts)


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server was not ready in {timeout_s} s")


def samples_for(args, n: int, tokenizer) -> list[datasets.Sample]:
    """The embedded held-out prompts, or (a random preset target) `bench serve`'s random dataset: --input-len ids
    decoded to text by the target's stand-in tokenizer. Seeded, so a smaller n gives the first prompts of a larger."""
    if not args.preset:
        return datasets.embedded_samples(EMBEDDED_DIR / "manifest.json", tokenizer, n, args.output_len)
    return datasets.random_samples(tokenizer, n, args.input_len, args.output_len, range_ratio=0.0, seed=0)


def run_once(args, setting: str, url: str, c: int, tokenizer, repeat: int) -> dict:
    samples = samples_for(args, c * args.prompts_per_slot, tokenizer)
    run = asyncio.run(benchmark(url, "/v1/completions", "tiny", samples, max_concurrency=c,
                                sampling={"temperature": 0.0}, progress=False))
    row = {"setting": setting, "max_concurrency": c, "repeat": repeat, **metrics.calculate(run["results"],
                                                                                           run["duration"]),
           "server": run["server"], "shapes_seen": sorted({g["shape"] for g in run["gauges"] if g.get("shape")})}
    print(f"{setting:>8} c={c:<3} rep {repeat}: {row['output_throughput']:8.1f} tok/s  median TPOT "
          f"{row['median_tpot_ms']:7.1f} ms  TTFT {row['median_ttft_ms']:7.1f} ms  shapes {row['shapes_seen']}"
          f"  failed {row['failed']}", flush=True)
    return row


def run_interleaved(args, servers: dict, tokenizer) -> list[dict]:
    """Every (repeat, concurrency): each setting's server loaded in turn, in a shuffled order."""
    runs = []
    for repeat in range(args.repeats):
        for c in args.concurrency:
            order = list(servers)
            np.random.default_rng(repeat * 1000 + c).shuffle(order)
            runs += [run_once(args, setting, servers[setting], c, tokenizer, repeat) for setting in order]
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(embedded("target")))
    ap.add_argument("--preset", default=None, help="a random target and draft model instead (bench spec's presets: "
                                                   "8b on a GPU; tiny20m, 300m on a CPU), served in this process")
    ap.add_argument("--input-len", type=int, default=128, help="with --preset: random prompts of this many tokens")
    ap.add_argument("--preset-drafter", default="draft",
                    help="with --preset: its random draft model ('draft'), or 'replay:ALPHA', the replay drafter "
                         "keyed by prompt (each draft the target's own next token with probability ALPHA, free to "
                         "draft: specjax/drafters/replay.py)")
    ap.add_argument("--drafter", default=str(embedded("draft")))
    ap.add_argument("--settings", default="off,chain:1,chain:2,chain:4,auto")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--max-slots", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=496,
                    help="every server's; a speculating engine's KV cache holds max_len plus its largest shape's "
                         "draft nodes, rounded up to a multiple of 128, so pick it 16 below a multiple (496: 512 "
                         "positions for every setting; 512 would give the speculating servers 640 and 'off' 512)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-slot", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every (setting, concurrency)")
    ap.add_argument("--ready-timeout", type=float, default=1800)
    ap.add_argument("--logs", default="runs/serve_curve")
    ap.add_argument("--out", default="runs/serve_curve.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--from", dest="source", default=None, help="print the table (and --plot) of a saved record only")
    args = ap.parse_args(argv)
    if args.source:
        record = json.loads(Path(args.source).read_text())
        print(format_table(record["runs"]))
        if args.plot:
            plot_curve(best_fixed(record["runs"]), args.plot, title=record.get("title", ""))
        return 0
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    pair = None
    if args.preset:
        from specjax.bench.spec import preset_pair

        pair = preset_pair(args.preset, None, 0, "auto")
        tokenizer = pair[0].tokenizer  # the random target's stand-in
        if args.preset_drafter != "draft":
            pair = (pair[0], replay_for(args, pair[0]))
    else:
        tokenizer = datasets.load_tokenizer(args.target)
    exit_codes: dict[str, int] = {}
    record = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(), "date": time.strftime("%Y-%m-%d"), "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        servers = {setting: stack.enter_context(preset_server(args, setting, pair) if pair else
                                                checkpoint_server(args, setting, exit_codes))
                   for setting in args.settings.split(",")}
        record["runs"] = run_interleaved(args, servers, tokenizer)
        out.write_text(json.dumps(record, indent=1))
    record["server_exit_codes"] = exit_codes
    curves = best_fixed(record["runs"])
    record["curve"] = {label: [{k: r[k] for k in ("max_concurrency", "output_throughput", "median_tpot_ms",
                                                   "setting")} for r in rows] for label, rows in curves.items()}
    record["ratios"] = ratios(record["runs"])
    drafter = "its random draft model" if args.preset_drafter == "draft" else f"{args.preset_drafter} drafter"
    what = f"random {args.preset} target + {drafter}" if args.preset else "embedded target + draft model"
    record["title"] = f"specjax serve, {what}, {record['machine'].split(',')[0]}"
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    print(format_table(record["runs"]))
    if args.plot:
        plot_curve(curves, args.plot, title=record["title"])
        print(f"wrote {args.plot}")
    return 0


def medians(runs: list[dict]) -> dict[tuple[str, int], dict]:
    """{(setting, concurrency): its run with the median output throughput over the repeats}."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["setting"], r["max_concurrency"]), []).append(r)
    return {key: sorted(rows, key=lambda r: r["output_throughput"])[(len(rows) - 1) // 2]
            for key, rows in groups.items()}


def ratios(runs: list[dict]) -> dict[int, dict]:
    """Per concurrency: auto / off and auto / the best fixed chain (by median), each the median of the ratios within
    a repeat (the settings ran back to back there, so a drift of the machine moves both sides alike)."""
    med = medians(runs)
    by = {(r["setting"], r["max_concurrency"], r.get("repeat", 0)): r["output_throughput"] for r in runs}
    out = {}
    for c in sorted({c for _, c in med}):
        fixed = [s for s, cc in med if cc == c and s.startswith("chain:")]
        best = max(fixed, key=lambda s: med[(s, c)]["output_throughput"], default=None)
        row = {"best_fixed": best}
        for name, ref in (("auto_vs_off", "off"), ("auto_vs_best", best)):
            pairs = [by[("auto", c, k)] / by[(ref, c, k)] for (s, cc, k) in by
                     if s == "auto" and cc == c and (ref, c, k) in by and by[(ref, c, k)] > 0]
            row[name] = float(np.median(pairs)) if pairs else None
        out[c] = row
    return out


def format_table(runs: list[dict]) -> str:
    """Markdown: median output tok/s and its run's median TPOT per concurrency, a column pair per setting (the best
    fixed chain bold), auto / off and auto / best fixed, and the shapes auto's server reported."""
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    med, rat = medians(runs), ratios(runs)
    head = ("| concurrency | " + " | ".join(f"{s} tok/s (TPOT ms)" for s in settings) +
            " | auto / off | auto / best fixed | auto's shapes |")
    lines = [head, "|" + "---|" * (len(settings) + 4)]
    for c in sorted({r["max_concurrency"] for r in runs}):
        cells = []
        for s in settings:
            r = med.get((s, c))
            mark = "**" if rat[c]["best_fixed"] == s else ""
            cells.append("" if r is None else f"{mark}{r['output_throughput']:.0f}{mark} ({r['median_tpot_ms']:.1f})")
        shapes = sorted({x for r in runs if r["setting"] == "auto" and r["max_concurrency"] == c
                         for x in r["shapes_seen"]})
        fmt = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {fmt(rat[c]['auto_vs_off'])} | "
                     f"{fmt(rat[c]['auto_vs_best'])} | {', '.join(shapes)} |")
    return "\n".join(lines)


def best_fixed(runs: list[dict]) -> dict[str, list[dict]]:
    """{"off": [...], "best fixed (chain:...)": [the best chain:K at each concurrency], "auto": [...]} (those present),
    each setting's median run per concurrency."""
    med = medians(runs)
    curves: dict[str, list[dict]] = {}
    for label in ("off", "auto"):
        rows = [med[k] for k in sorted(med, key=lambda k: k[1]) if k[0] == label]
        if rows:
            curves[label] = rows
    fixed = sorted({s for s, _ in med if s.startswith("chain:")}, key=lambda s: int(s.split(":")[1]))
    if fixed:
        best = [max((med[(s, c)] for s in fixed if (s, c) in med), key=lambda r: r["output_throughput"])
                for c in sorted({c for s, c in med if s in fixed})]
        curves[f"best fixed ({', '.join(fixed)})"] = best
    return curves


if __name__ == "__main__":
    sys.exit(main())
