#!/usr/bin/env python
"""What streaming costs: the same call through `specjax.generate` (the loop whole, one jit) and `specjax.stream` (the
loop in chunks, detokenised and handed out between them), plain and speculative, batch 1 and 8, on this machine.

    python scripts/bench_stream.py --out docs/records/bench_stream_cpu.json

Embedded target (and its draft model, a chain of 4), --tokens new tokens per row with EOS off, the manifest's
held-out prompts. Every configuration is run once to compile, then timed in --repeats interleaved rounds (round i
runs each configuration once, generate then stream, in turn). Throughput = generated tokens / wall seconds of the
whole call (prefill included, compile excluded: it is done before); the table gives medians and the stream/generate
ratio of the medians, and "chunks" how many pieces one stream call handed out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import specjax
from specjax.bench.ar import machine_info

ROOT = Path(__file__).resolve().parent.parent


def held_out(count: int) -> list[str]:
    texts = [p["text"] for p in json.loads((ROOT / "checkpoints/tiny/manifest.json").read_text())["held_out_prompts"]]
    return (texts * count)[:count]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    target = specjax.load(specjax.embedded("target"))
    draft = specjax.load_drafter(specjax.embedded("draft"), target)
    configs = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for loop, kw in (("plain", {}), ("speculative", {"drafter": draft, "num_draft_tokens": 4})):
            configs[(loop, batch)] = (held_out(batch), dict(max_new_tokens=args.tokens, eos_token_id=[], **kw))

    def run_generate(prompts, kw):
        out = specjax.generate(target, prompts, **kw)
        return sum(len(t) for t in out.tokens), 1

    def run_stream(prompts, kw):
        chunks = list(specjax.stream(target, prompts, **kw))
        return sum(len(c.token_ids) for c in chunks), len(chunks)

    for prompts, kw in configs.values():  # compile both paths
        run_generate(prompts, kw), run_stream(prompts, kw)
    times = {(key, how): [] for key in configs for how in ("generate", "stream")}
    chunks = {}
    for _ in range(args.repeats):
        for key, (prompts, kw) in configs.items():
            for how, fn in (("generate", run_generate), ("stream", run_stream)):
                seconds, (tokens, pieces) = timed(lambda: fn(prompts, kw))
                times[(key, how)].append(tokens / seconds)
                chunks[(key, how)] = pieces

    rows = []
    print(f"{'loop':<12} {'batch':>5} {'generate tok/s':>15} {'stream tok/s':>13} {'stream/generate':>16} {'chunks':>7}")
    for (loop, batch) in configs:
        g = statistics.median(times[((loop, batch), "generate")])
        s = statistics.median(times[((loop, batch), "stream")])
        rows.append({"loop": loop, "batch": batch, "generate_tokens_per_s": g, "stream_tokens_per_s": s,
                     "ratio": s / g, "stream_chunks": chunks[((loop, batch), "stream")],
                     "generate_all": times[((loop, batch), "generate")],
                     "stream_all": times[((loop, batch), "stream")]})
        print(f"{loop:<12} {batch:>5} {g:>15.1f} {s:>13.1f} {s / g:>16.3f} {chunks[((loop, batch), 'stream')]:>7}")
    record = {"machine": machine_info(), "tokens": args.tokens, "repeats": args.repeats, "rows": rows,
              "command": "python " + " ".join(sys.argv)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
