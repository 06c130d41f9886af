"""`specjax bench serve`'s flags: vLLM's `vllm bench serve` flags that apply to an OpenAI-compatible endpoint, and a few
of its own (--tokenizer's embedded default, --plot, --metrics-interval, --no-continuous-usage, the updown ramp).
Kept apart from main.py so that building the `specjax` command needs none of the HTTP client's packages."""

from __future__ import annotations

import argparse

from specjax.bench.serving.arrivals import RAMPS
from specjax.bench.serving.datasets import EMBEDDED_OUTPUT_LEN

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
METRIC_NAMES = ("ttft", "tpot", "itl", "itl_per_token", "e2el")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000 (else --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    p.add_argument("--model", default=None, help="the served model's name (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json or a checkpoint directory holding one: random prompts are drawn from it and "
                        "prompt lengths counted by it (default for --dataset-name embedded: the embedded target's)")
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "custom", "embedded"],
                   help="random ids; a ShareGPT .json/.jsonl (sharegpt) or a JSONL of {\"prompt\"} (custom) at "
                        "--dataset-path; the embedded tiny models' held-out prompts")
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    p.add_argument("--output-len", type=int, default=None,
                   help="every request's max_tokens (overrides --random-output-len, --sharegpt-output-len; "
                        f"embedded default {EMBEDDED_OUTPUT_LEN})")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals, or Gamma with --burstiness); inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--ramp-up-strategy", choices=RAMPS, default=None,
                   help="the rate moves from --ramp-up-start-rps to --ramp-up-end-rps over the run (updown: up to "
                        "the end rate at the middle request, back down by the last)")
    p.add_argument("--ramp-up-start-rps", type=float, default=None)
    p.add_argument("--ramp-up-end-rps", type=float, default=None)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM's extension)")
    p.add_argument("--temperature", type=float, default=None, help="default: the server's (greedy in vLLM's bench)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--no-continuous-usage", action="store_true",
                   help="do not ask for usage on every chunk (then no per-token ITL)")
    p.add_argument("--goodput", nargs="+", default=None, help="SLOs as KEY:MS pairs: ttft, tpot, e2el")
    p.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES),
                   help=f"which metrics get percentiles, of {','.join(METRIC_NAMES)}")
    p.add_argument("--metric-percentiles", default="90,99")
    p.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics samples")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--label", default="specjax")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw the run: output tokens/s and requests in flight per second, and the server's draft "
                        "shape beside its occupancy over time")
