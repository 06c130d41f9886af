#!/usr/bin/env python
"""The seed's load curve, live: `specjax serve` with speculation off, each fixed chain, and "auto", loaded by
`specjax bench serve` at each concurrency; throughput and TPOT against concurrency.

    python scripts/serve_curve.py --out docs/records/serve_curve_cpu.json --plot docs/serve_curve_cpu.png

For each server setting (--settings: off, chain:K, auto) it starts `specjax serve CKPT --drafter D
--num-draft-tokens ... --greedy-only` as a subprocess on a free port, waits for its warm-up, runs the load at every
--concurrency (--max-concurrency C with C x --prompts-per-slot requests of the embedded held-out prompts, all sent
at once, greedy), then stops it with SIGTERM and records its exit code (0 expected). With --preset (a random target
and draft model, e.g. 8b on a GPU) the engine is built and served in this process instead, with random prompt ids.
The best fixed chain at each concurrency is the fixed setting with the highest output throughput there. The JSON
keeps each run's vLLM metrics and the server's acceptance over it.
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


def samples_for(args, n: int, tokenizer, vocab: int | None) -> list[datasets.Sample]:
    """The embedded held-out prompts, or (a random preset target) random ids of --input-len."""
    if vocab is None:
        return datasets.embedded_samples(EMBEDDED_DIR / "manifest.json", tokenizer, n, args.output_len)
    rng = np.random.default_rng(0)
    return [datasets.Sample(rng.integers(3, vocab, args.input_len).tolist(), args.input_len, args.output_len)
            for _ in range(n)]


def run_setting(args, setting: str, server, tokenizer, vocab: int | None) -> list[dict]:
    rows = []
    with server as url:
        for c in args.concurrency:
            samples = samples_for(args, c * args.prompts_per_slot, tokenizer, vocab)
            run = asyncio.run(benchmark(url, "/v1/completions", "tiny", samples, max_concurrency=c,
                                        sampling={"temperature": 0.0}, progress=False))
            result = metrics.calculate(run["results"], run["duration"])
            row = {"setting": setting, "max_concurrency": c, **result, "server": run["server"],
                   "shapes_seen": sorted({g["shape"] for g in run["gauges"] if g.get("shape")})}
            rows.append(row)
            print(f"{setting:>8} c={c:<3} {row['output_throughput']:8.1f} tok/s  median TPOT "
                  f"{row['median_tpot_ms']:7.1f} ms  TTFT {row['median_ttft_ms']:7.1f} ms  shapes {row['shapes_seen']}"
                  f"  failed {row['failed']}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(embedded("target")))
    ap.add_argument("--preset", default=None, help="a random target and draft model instead (bench spec's presets: "
                                                   "8b on a GPU; tiny20m, 300m on a CPU), served in this process")
    ap.add_argument("--input-len", type=int, default=128, help="with --preset: random prompt ids of this length")
    ap.add_argument("--drafter", default=str(embedded("draft")))
    ap.add_argument("--settings", default="off,chain:1,chain:2,chain:4,auto")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--max-slots", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-slot", type=int, default=2)
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
    pair = tokenizer = vocab = None
    if args.preset:
        from specjax.bench.spec import preset_pair

        pair = preset_pair(args.preset, None, 0, "auto")
        vocab = pair[0].cfg.vocab_size
    else:
        tokenizer = datasets.load_tokenizer(args.target)
    exit_codes: dict[str, int] = {}
    record = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}", "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for setting in args.settings.split(","):
        server = preset_server(args, setting, pair) if pair else checkpoint_server(args, setting, exit_codes)
        record["runs"] += run_setting(args, setting, server, tokenizer, vocab)
        record["server_exit_codes"] = exit_codes
        out.write_text(json.dumps(record, indent=1))
    curves = best_fixed(record["runs"])
    record["curve"] = {label: [{k: r[k] for k in ("max_concurrency", "output_throughput", "median_tpot_ms",
                                                   "setting")} for r in rows] for label, rows in curves.items()}
    what = f"random {args.preset} target + draft model" if args.preset else "embedded target + draft model"
    record["title"] = f"specjax serve, {what}, {record['machine'].split(',')[0]}"
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    print(format_table(record["runs"]))
    if args.plot:
        plot_curve(curves, args.plot, title=record["title"])
        print(f"wrote {args.plot}")
    return 0


def format_table(runs: list[dict]) -> str:
    """Markdown: output tok/s and median TPOT per concurrency, a column pair per setting, the best fixed marked."""
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    best = {r["max_concurrency"]: r["setting"] for label, rows in best_fixed(runs).items() if label.startswith("best")
            for r in rows}
    head = "| concurrency | " + " | ".join(f"{s} tok/s (TPOT ms)" for s in settings) + " | auto's shapes |"
    lines = [head, "|" + "---|" * (len(settings) + 2)]
    for c in sorted({r["max_concurrency"] for r in runs}):
        cells, shapes = [], ""
        for s in settings:
            r = next((r for r in runs if r["setting"] == s and r["max_concurrency"] == c), None)
            mark = "**" if best.get(c) == s else ""
            cells.append("" if r is None else f"{mark}{r['output_throughput']:.0f}{mark} ({r['median_tpot_ms']:.1f})")
            if r is not None and s == "auto":
                shapes = ", ".join(r["shapes_seen"])
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {shapes} |")
    return "\n".join(lines)


def best_fixed(runs: list[dict]) -> dict[str, list[dict]]:
    """{"off": [...], "best fixed (chain:...)": [the best chain:K run at each concurrency], "auto": [...]} (those
    present)."""
    curves: dict[str, list[dict]] = {}
    for label in ("off", "auto"):
        rows = [r for r in runs if r["setting"] == label]
        if rows:
            curves[label] = rows
    fixed = [r for r in runs if r["setting"].startswith("chain:")]
    if fixed:
        best = {}
        for r in fixed:
            c = r["max_concurrency"]
            if c not in best or r["output_throughput"] > best[c]["output_throughput"]:
                best[c] = r
        chains = sorted({r["setting"] for r in fixed}, key=lambda s: int(s.split(":")[1]))
        curves[f"best fixed ({', '.join(chains)})"] = [best[c] for c in sorted(best)]
    return curves


if __name__ == "__main__":
    sys.exit(main())
