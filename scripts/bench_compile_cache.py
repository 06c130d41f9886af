#!/usr/bin/env python
"""What JAX's persistent compilation cache saves a fresh process: compile time of the demo's speculative call.

Runs the embedded demo pair (checkpoints/tiny/target + draft, chain of 4 drafts, 3 short
prompts, 32 new tokens, greedy) in two fresh processes sharing a new, empty cache directory,
then twice more with the cache off, and reports each process's `stats["compile_s"]`, the
wall time of the generate call and of the whole process, and what the cache holds.

  python scripts/bench_compile_cache.py [--out runs/compile_cache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(args) -> None:
    """One process's measurement, printed as a JSON line (runs with --child)."""
    start = time.perf_counter()
    import specjax
    from specjax.demo import EMBEDDED, PROMPTS

    target = specjax.load(args.target or EMBEDDED / "target")
    drafter = specjax.load_drafter(args.draft or EMBEDDED / "draft", target)
    call = time.perf_counter()
    out = specjax.generate(target, PROMPTS, max_new_tokens=args.max_new_tokens, drafter=drafter,
                           num_draft_tokens=args.num_draft_tokens)
    done = time.perf_counter()
    print(json.dumps({"compile_s": out.stats["compile_s"], "generate_s": done - call, "process_s": done - start,
                      "cache_dir": specjax.compile_cache.status(), "tokens": out.tokens}))


def run_process(args, cache: str) -> dict:
    """A fresh interpreter running `child` with SPECJAX_COMPILE_CACHE=cache; its JSON result."""
    env = {**os.environ, "SPECJAX_COMPILE_CACHE": cache}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, __file__, "--child", "--max-new-tokens", str(args.max_new_tokens),
           "--num-draft-tokens", str(args.num_draft_tokens)]
    cmd += ["--target", args.target] if args.target else []
    cmd += ["--draft", args.draft] if args.draft else []
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"child process failed:\n{done.stderr}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - start}


def cache_size(path: Path) -> tuple[int, int]:
    """(files, bytes) under the cache directory."""
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def measure(args) -> dict:
    """Two processes with a shared fresh cache, two with the cache off."""
    with tempfile.TemporaryDirectory(prefix="specjax-cache-bench-") as tmp:
        cache = Path(tmp) / "jax"
        cached = [run_process(args, str(cache)) for _ in range(2)]
        files, size = cache_size(cache)
    uncached = [run_process(args, "off") for _ in range(2)]
    if not all(r["tokens"] == cached[0]["tokens"] for r in cached + uncached):
        raise RuntimeError("the four processes generated different tokens")
    rows = [{"cache": "on", "process": i + 1, **pick(r)} for i, r in enumerate(cached)]
    rows += [{"cache": "off", "process": i + 1, **pick(r)} for i, r in enumerate(uncached)]
    return {"workload": {"pair": "checkpoints/tiny target + draft", "prompts": 3,
                         "max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens},
            "rows": rows, "cache_files": files, "cache_bytes": size}


def pick(result: dict) -> dict:
    return {k: round(result[k], 3) for k in ("compile_s", "generate_s", "process_s", "wall_s")}


def format_table(result: dict) -> str:
    lines = ["cache  process  compile_s  generate_s  process_s  wall_s"]
    for r in result["rows"]:
        lines.append(f"{r['cache']:<6} {r['process']:>7}  {r['compile_s']:>9.2f}  {r['generate_s']:>10.2f}  "
                     f"{r['process_s']:>9.2f}  {r['wall_s']:>6.2f}")
    lines.append(f"cache after both runs: {result['cache_files']} files, {result['cache_bytes'] / 1e6:.1f} MB")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="default: checkpoints/tiny/target")
    parser.add_argument("--draft", default=None, help="default: checkpoints/tiny/draft")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    result = measure(args)
    print(format_table(result))
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
