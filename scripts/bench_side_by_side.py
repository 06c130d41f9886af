"""Time two checkouts of specjax side by side (before/after a change): interleaved runs, medians, ratios.

Each side is a repository root with its own virtual environment in `.venv` (e.g. the current tree and
`git worktree add ../old <commit>` with `pip install -e .` there). Every repeat runs each benchmark once
per side, alternating which side goes first, in fresh processes with the compile cache off, so compile
times are real compiles. Benchmarks:
  - `ar`: plain decoding of a random 21.7M model (`specjax bench ar --preset tiny20m --batch 1 8 --no-hf`),
    tokens/s per batch and the plain loop's compile time;
  - `compile`: compile time of the plain loop and of the speculative loop (embedded pair, chain 4);
  - `families`: `scripts/bench_families.py --no-peer` (every drafter family; slow: ~10 min a run here).

    python scripts/bench_side_by_side.py --before ../old --after . --repeats 3 --bench ar compile
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

COMPILE_PROBE = """
import json, specjax
t = specjax.load('checkpoints/tiny/target'); d = specjax.load_drafter('checkpoints/tiny/draft', t); p = ['def f(x):']
plain = specjax.generate(t, p, max_new_tokens=48).stats['compile_s']
spec = specjax.generate(t, p, max_new_tokens=48, drafter=d, num_draft_tokens=4).stats['compile_s']
print(json.dumps({'plain loop compile s': plain, 'speculative loop compile s': spec}))
"""


def run(side: Path, args: list[str]) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_COMPILE_CACHE": "off", "PYTHONPATH": str(side)}
    python = str(side / ".venv" / "bin" / "python")
    done = subprocess.run([python, *args], cwd=side, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{side}: {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def bench_ar(side: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ar.json"
        run(side, ["-m", "specjax.cli", "bench", "ar", "--preset", "tiny20m", "--batch", "1", "8", "--no-hf",
                   "--repeats", "3", "--out", str(out)])
        rows = json.loads(out.read_text())["rows"]
    figures = {}
    for row in rows:
        figures[f"ar batch {row['batch']} tok/s"] = row["specjax_tokens_per_s"]
        figures[f"ar batch {row['batch']} compile s"] = row["specjax_compile_s"]
    return figures


def bench_compile(side: Path) -> dict[str, float]:
    return json.loads(run(side, ["-c", COMPILE_PROBE]).strip().splitlines()[-1])


def bench_families(side: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "families.json"
        run(side, ["scripts/bench_families.py", "--no-peer", "--repeats", "1", "--out", str(out)])
        rows = json.loads(out.read_text())["rows"]
    return {f"families b{r['batch']} {r['method']} tok/s": r["tokens_per_s"] for r in rows}


BENCHES = {"ar": bench_ar, "compile": bench_compile, "families": bench_families}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=Path("."))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bench", nargs="+", choices=sorted(BENCHES), default=["ar", "compile"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for i in range(args.repeats):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        for name in args.bench:
            for side in order:
                for key, value in BENCHES[name](sides[side]).items():
                    runs[side].setdefault(key, []).append(value)
            print(f"repeat {i + 1}/{args.repeats}: {name} done", flush=True)
    print(f"\n{platform.machine()}, {os.cpu_count()} cores; medians of {args.repeats} interleaved runs, compile cache off")
    print("| figure | before | after | after / before | spread before | spread after |")
    print("|---|---|---|---|---|---|")
    for key in runs["before"]:
        b, a = statistics.median(runs["before"][key]), statistics.median(runs["after"][key])
        spread = {side: f"{min(runs[side][key]):.3g}-{max(runs[side][key]):.3g}" for side in runs}
        print(f"| {key} | {b:.3g} | {a:.3g} | {a / b:.3f} | {spread['before']} | {spread['after']} |")
    if args.out:
        args.out.write_text(json.dumps({"sides": {k: str(v) for k, v in sides.items()}, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
