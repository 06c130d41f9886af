"""`specjax bench serve`: load an OpenAI-compatible server and report vLLM's serving metrics.

The flags are `vllm bench serve`'s (those that apply to an OpenAI-compatible endpoint), so a command written for
vLLM runs here; against a vLLM or SGLang server it measures them the same way. Like vLLM it first sends one test
request (a readiness check, not counted), then the run: requests sent at their arrival times (arrivals.py), at most
--max-concurrency in flight, each streamed and timed (client.py), with a progress bar. The server's /metrics is read
before and after (speculative acceptance over the run) and every --metrics-interval seconds during it (requests
running, the draft shape in use). Prints vLLM's table; --save-result writes vLLM's JSON keys (metrics.py) plus
the per-request lists and the server's figures; --plot draws the run (plot.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from datetime import datetime
from pathlib import Path

import httpx
from tqdm.asyncio import tqdm

from specjax.bench.serving import arrivals, client, datasets, metrics, server_metrics
from specjax.bench.serving.args import CHAT
from specjax.bench.serving.datasets import Sample

REQUEST_TIMEOUT_S = 6 * 60 * 60  # vLLM's aiohttp timeout


def make_samples(args) -> list[Sample]:
    """The run's requests from the dataset flags."""
    tokenizer_path = args.tokenizer
    if args.dataset_name == "embedded" and tokenizer_path is None:
        from specjax.loading.embedded import embedded

        tokenizer_path = embedded("target")
    tokenizer = datasets.load_tokenizer(tokenizer_path)
    if args.dataset_name == "random":
        return datasets.random_samples(tokenizer, args.num_prompts, args.input_len or args.random_input_len,
                                       args.output_len or args.random_output_len, args.random_range_ratio, args.seed)
    if args.dataset_name == "embedded":
        from specjax.loading.embedded import EMBEDDED_DIR

        return datasets.embedded_samples(EMBEDDED_DIR / "manifest.json", tokenizer, args.num_prompts, args.output_len)
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} reads --dataset-path FILE (.json or .jsonl)")
    return datasets.file_samples(args.dataset_path, tokenizer, args.num_prompts,
                                 args.output_len or args.sharegpt_output_len, args.seed)


async def benchmark(base_url: str, endpoint: str, model: str | None, samples: list[Sample], *,
                    request_rate: float = float("inf"), burstiness: float = 1.0, max_concurrency: int | None = None,
                    seed: int = 0, ramp: tuple = (None, None, None), sampling: dict | None = None,
                    continuous_usage: bool = True, ignore_eos: bool = False, metrics_interval_s: float = 0.5,
                    progress: bool = True) -> dict:
    """Run the load: {"model", "results" (RequestResult per sample, in order, .start in s after t0), "duration",
    "t0" (the run's start, a perf_counter reading), "server" (acceptance over the run, or None), "gauges" (the
    /metrics samples over time)}."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    offsets = arrivals.send_offsets(len(samples), request_rate, burstiness, seed, *ramp)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as http:
        model = model or await first_model(http, base_url)
        url = base_url + endpoint
        bodies = [client.payload(endpoint, model, s, sampling or {}, continuous_usage, ignore_eos) for s in samples]
        test = await client.send(http, url, bodies[0], samples[0])
        if not test.success:
            raise RuntimeError(f"the test request to {url} failed: {test.error}")
        before = await server_metrics.scrape(http, base_url)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        bar = tqdm(total=len(samples), disable=not progress, desc="requests")
        stop = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.create_task(server_metrics.sample_gauges(http, base_url, metrics_interval_s, stop, t0))

        async def one(i: int):
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            async with gate:
                result = await client.send(http, url, bodies[i], samples[i])
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(samples))))
        duration = time.perf_counter() - t0
        stop.set()
        gauges = await sampler
        bar.close()
        after = await server_metrics.scrape(http, base_url)
    for r in results:
        r.start -= t0
    return {"model": model, "results": list(results), "duration": duration, "t0": t0,
            "server": server_metrics.acceptance(before, after), "gauges": gauges}


async def first_model(http: httpx.AsyncClient, base_url: str) -> str:
    """The first model /v1/models lists (vLLM's default for --model)."""
    try:
        response = await http.get(f"{base_url}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
        raise ValueError(f"could not read the model name from {base_url}/v1/models ({err}); is the server up? Or pass "
                         f"--model NAME") from None


def report(run: dict, args) -> dict:
    """vLLM's result dict for this run: its metrics, its settings, the per-request lists, the server's figures."""
    tokenizer = datasets.load_tokenizer(args.tokenizer) if args.tokenizer else None
    count = (lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)) if tokenizer else None
    results = run["results"]
    out = metrics.calculate(results, run["duration"], _percentiles(args.metric_percentiles), metrics.parse_goodput(
        args.goodput) or None, [m for m in args.percentile_metrics.split(",") if m], count)
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if args.endpoint == CHAT
            else "openai", "label": args.label, "model_id": run["model"], "endpoint": args.endpoint,
            "dataset_name": args.dataset_name, "num_prompts": len(results), "request_rate": args.request_rate,
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, **out,
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [metrics.output_len(r, count) if r.success else 0 for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "errors": [r.error for r in results], "server": run["server"], "server_gauges": run["gauges"],
            "chunks": [{"start": r.start, "content_times": r.content_times, "token_times": r.token_times,
                        "token_counts": r.token_counts} for r in results]}


def print_table(result: dict, selected: list[str]) -> None:
    """vLLM's printed summary, and the server's acceptance when it reports one."""
    line = "{:<40} {:<10}".format
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    rows = [("Successful requests:", result["completed"]), ("Failed requests:", result["failed"]),
            ("Maximum request concurrency:", result["max_concurrency"]),
            ("Benchmark duration (s):", f"{result['duration']:.2f}"),
            ("Total input tokens:", result["total_input_tokens"]),
            ("Total generated tokens:", result["total_output_tokens"]),
            ("Request throughput (req/s):", f"{result['request_throughput']:.2f}")]
    if result["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
             ("Peak output token throughput (tok/s):", f"{result['max_output_tokens_per_s']:.2f}"),
             ("Peak concurrent requests:", result["max_concurrent_requests"]),
             ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(line(label, str(value)))
    for name in selected:
        keys = [k for k in result if k.endswith(f"_{name}_ms") and not k.startswith("std_")]
        if not keys:
            continue
        print("{s:{c}^{n}}".format(s=metrics.METRICS[name], n=50, c="-"))
        short = name.upper().replace("_PER_TOKEN", " per token")
        for k in keys:
            stat = k.split("_")[0]
            print(line(f"{stat.capitalize() if not stat.startswith('p') else stat.upper()} {short} (ms):",
                       f"{result[k]:.2f}"))
    server = result.get("server")
    if server and server["spec_decode_num_drafts"]:
        print("{s:{c}^{n}}".format(s="Speculative decoding (server)", n=50, c="-"))
        print(line("Acceptance rate:", f"{server['spec_decode_acceptance_rate']:.3f}"))
        print(line("Mean acceptance length:", f"{server['spec_decode_mean_acceptance_length']:.2f}"))
        print(line("Drafts:", int(server["spec_decode_num_drafts"])))
    print("=" * 50)


def main(args) -> int:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    samples = make_samples(args)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    run = asyncio.run(benchmark(
        base_url, args.endpoint, args.model, samples, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed,
        ramp=(args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps), sampling=sampling,
        continuous_usage=not args.no_continuous_usage, ignore_eos=args.ignore_eos,
        metrics_interval_s=args.metrics_interval, progress=not args.disable_tqdm))
    result = report(run, args)
    print_table(result, [m for m in args.percentile_metrics.split(",") if m])
    if args.save_result:
        name = args.result_filename or (f"{args.label}-{args.request_rate}qps-concurrency{args.max_concurrency}-"
                                        f"{Path(run['model']).name}-{result['date']}.json")
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    if args.plot:
        from specjax.bench.serving.plot import plot_run

        plot_run(result, args.plot)
        print(f"wrote {args.plot}")
    return 0 if result["completed"] else 1


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p]
    except ValueError:
        values = []
    if not values or not all(0 < p < 100 for p in values):
        raise ValueError(f"--metric-percentiles: expected comma-separated numbers in (0, 100) like 90,99, got {text!r}")
    return values
