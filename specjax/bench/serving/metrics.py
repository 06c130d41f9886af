"""vLLM's serving metrics from the timed requests (vllm/benchmarks/serve.py, `calculate_metrics`), and one more.

Over the successful requests, with dur the run's wall time:
- TTFT: the first content chunk's arrival minus the send time.
- TPOT, per request with more than one output token: (E2EL - TTFT) / (output tokens - 1).
- ITL: every gap between consecutive content chunks of a request, all requests pooled (one value a chunk).
- ITL per token (not in vLLM; a speculative chunk carries several tokens, vllm #49730): each chunk that brought k
  new tokens (by the server's per-chunk usage) contributes k values of (its gap since the last such chunk) / k; the
  first such chunk's tokens past the first contribute 0 (they came with it). A request's values then add up to the
  time from its first token to its last, over (output tokens - 1) values: their mean is the token-weighted TPOT.
- E2EL: the last chunk carrying a choice, minus the send time.
- request, output and total (input + output) token throughput: count / dur; goodput: the requests meeting every SLO
  given (ttft, tpot, e2el in ms; a request of one token has TPOT 0 here, as in vLLM) / dur.
- mean, median, std and the chosen percentiles of each, in ms (numpy's linear-interpolated percentile).
- the peak output tokens in any whole second of the run, and the most requests in flight during such a second.
Token counts are the usage chunk's (completion_tokens, prompt_tokens); without one, output tokens are counted by
`count_tokens` on the text (vLLM's fallback), else taken as the number of content chunks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import numpy as np

from specjax.bench.serving.args import METRIC_NAMES

if TYPE_CHECKING:
    from specjax.bench.serving.client import RequestResult

METRICS = dict(zip(METRIC_NAMES, ("Time to First Token", "Time per Output Token (excl. 1st token)",
                                  "Inter-token Latency (per chunk)", "Inter-token Latency (per token)",
                                  "End-to-end Latency")))
SLO_NAMES = ("ttft", "tpot", "e2el")


def output_len(r: RequestResult, count_tokens: Callable[[str], int] | None = None) -> int:
    """A successful request's output tokens: the usage's, else counted on its text, else its content chunks."""
    if r.output_tokens:
        return r.output_tokens
    if count_tokens is not None:
        return count_tokens(r.text)
    return len(r.content_times)


def itl_per_token(r: RequestResult) -> list[float]:
    """The per-token inter-token latencies of one request (module docstring); [] without per-chunk usage."""
    if not r.token_times:
        return []
    values = [0.0] * (r.token_counts[0] - 1)
    for t0, t1, k in zip(r.token_times, r.token_times[1:], r.token_counts[1:]):
        values += [(t1 - t0) / k] * k
    return values


def calculate(results: list[RequestResult], duration_s: float, percentiles=(90.0, 99.0),
              goodput: dict[str, float] | None = None, selected=tuple(METRICS),
              count_tokens: Callable[[str], int] | None = None) -> dict:
    """The run's metrics, keyed as vLLM's --save-result JSON (mean_ttft_ms, p99_itl_ms, ...)."""
    unknown = sorted(set(selected) - set(METRICS))
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {', '.join(METRICS)}")
    ok = [r for r in results if r.success]
    lens = [output_len(r, count_tokens) for r in ok]
    values: dict[str, list[float]] = {name: [] for name in METRICS}
    all_tpots = []
    for r, n in zip(ok, lens):
        tpot = (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            values["tpot"].append(tpot)
        all_tpots.append(tpot)
        values["ttft"].append(r.ttft)
        values["itl"] += r.itl
        values["itl_per_token"] += itl_per_token(r)
        values["e2el"].append(r.latency)
    total_input, total_output = sum(r.prompt_len for r in ok), sum(lens)
    good = _good(values["ttft"], all_tpots, values["e2el"], goodput) if goodput else None
    out = {"duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
           "total_input_tokens": total_input, "total_output_tokens": total_output,
           "request_throughput": len(ok) / duration_s,
           "request_goodput": None if good is None else good / duration_s,
           "output_throughput": total_output / duration_s,
           "total_token_throughput": (total_input + total_output) / duration_s,
           **_peak(ok, lens)}
    for name in selected:
        if name == "itl_per_token" and not values[name]:
            continue  # the server sent no per-chunk usage
        ms = np.asarray(values[name] or [0.0]) * 1000  # vLLM reports 0 for an empty metric
        out |= {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
                f"std_{name}_ms": float(np.std(ms))}
        out |= {f"p{_word(p)}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles}
    return out


def _good(ttfts, tpots, e2els, slo_ms: dict[str, float]) -> int:
    """Requests within every SLO given."""
    columns = {"ttft": ttfts, "tpot": tpots, "e2el": e2els}
    return sum(all(columns[k][i] <= slo_ms[k] / 1000 for k in slo_ms) for i in range(len(ttfts)))


def _peak(ok: list[RequestResult], lens: list[int]) -> dict:
    """vLLM's max_output_tokens_per_s (the most tokens timed in one whole second from the first send) and
    max_concurrent_requests (the most requests active in such a second). A token's time is its chunk's: by the
    per-chunk usage where sent, else one token a content chunk."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start for r in ok)
    seconds = int(math.ceil(max(r.start + r.latency for r in ok) - t0)) + 1
    tokens, active = np.zeros(seconds), np.zeros(seconds)
    for r, n in zip(ok, lens):
        times, counts = ((r.token_times, r.token_counts) if r.token_times
                         else (r.content_times, [1] * len(r.content_times)))
        for t, k in zip(times, counts):
            tokens[int(r.start + t - t0)] += k
        active[int(r.start - t0): int(r.start + r.latency - t0) + 1] += 1
    return {"max_output_tokens_per_s": float(tokens.max()), "max_concurrent_requests": int(active.max())}


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """--goodput ttft:ms tpot:ms ... (vLLM's KEY:VALUE pairs; one comma-separated string works too)."""
    slo: dict[str, float] = {}
    for pair in (p for item in pairs or [] for p in item.split(",") if p):
        name, _, value = pair.partition(":")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: expected KEY:MS pairs like ttft:200 tpot:50, got {pair!r}") from None
        if name not in SLO_NAMES or slo[name] < 0:
            raise ValueError(f"--goodput: {pair!r}: the key must be one of {', '.join(SLO_NAMES)} and the value a "
                             "number of milliseconds >= 0")
    return slo


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)
