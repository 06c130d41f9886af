"""The server's Prometheus /metrics, named after vLLM's where they map (prefix `specjax:` for `vllm:`).

Measured by the server, per request: specjax:request_success_total{finished_reason}, prompt_tokens_total,
generation_tokens_total, and the histograms time_to_first_token_seconds (from the request's arrival to its first
tokens), inter_token_latency_seconds (per token: a chunk of k tokens after a gap g adds k observations of g / k),
request_time_per_output_token_seconds ((e2e - ttft) / (tokens - 1)) and e2e_request_latency_seconds.

Read from the engine at each scrape (its own cumulative counts): num_requests_running (slots occupied),
num_requests_waiting (its queue), max_num_slots, and speculative decoding as vLLM counts it:
spec_decode_num_drafts_total (rounds that verified a draft, summed over slots), spec_decode_num_draft_tokens_total
(draft positions offered), spec_decode_num_accepted_tokens_total, and spec_decode_num_accepted_tokens_per_pos_total
{position}; so acceptance rate = accepted / draft tokens and mean acceptance length = 1 + accepted / drafts. Beyond
vLLM: spec_decode_shape_info{shape} (1 for the draft shape in use: "off", "chain:3", ...), spec_decode_shape_nodes
(its draft positions per row, 0 for off) and compiles_total (executables compiled since start: flat after warm-up).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "specjax:"
# vLLM's bucket edges (vllm/v1/metrics/loggers.py), seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


def shape_nodes(label: str | None) -> int:
    """Draft positions per row of a shape label: off 0, chain:K K, kary:a,b,c a + a*b + a*b*c, dynamic or
    other labels with a total_tokens=N field N, else -1 (unknown)."""
    if not label or label == "off":
        return 0
    kind, _, rest = label.partition(":")
    if kind == "chain" and rest.isdigit():
        return int(rest)
    if kind == "kary":
        total, width = 0, 1
        for part in rest.split(","):
            if not part.isdigit():
                return -1
            width *= int(part)
            total += width
        return total
    fields = dict(p.partition("=")[::2] for p in rest.split(",") if "=" in p)
    return int(fields["total_tokens"]) if fields.get("total_tokens", "").isdigit() else -1


class EngineCollector:
    """The engine's own counters and gauges, read from engine.stats() at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        yield _gauge("num_requests_running", "Requests in a decode slot", s.get("occupancy", 0))
        yield _gauge("num_requests_waiting", "Requests queued for a slot", s.get("queue_length", 0))
        yield _gauge("max_num_slots", "Decode slots", s.get("max_slots", 0))
        offered, accepted = list(s.get("offered_at_depth") or []), list(s.get("accepted_at_depth") or [])
        drafts = offered[0] if offered else 0
        yield _counter("spec_decode_num_drafts", "Drafts verified (rounds x slots drafting)", drafts)
        yield _counter("spec_decode_num_draft_tokens", "Draft positions offered to verification", sum(offered))
        yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", sum(accepted))
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position", labels=["position"])
        for i, n in enumerate(accepted):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        label = s.get("shape")
        info = GaugeMetricFamily(PREFIX + "spec_decode_shape_info", "The draft shape in use (1)", labels=["shape"])
        if label is not None:
            info.add_metric([str(label)], 1)
        yield info
        yield _gauge("spec_decode_shape_nodes", "Draft positions per row of the shape in use", shape_nodes(label))
        yield _counter("compiles", "Executables the engine compiled", s.get("compiles", 0))
        yield _counter("engine_requests_finished", "Requests the engine finished", s.get("requests_finished", 0))
        yield _counter("engine_tokens_emitted", "Tokens the engine emitted", s.get("tokens_emitted", 0))


def _gauge(name: str, text: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, text, value=float(value))


def _counter(name: str, text: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, text, value=float(value))


class ServerMetrics:
    """A registry of its own (several servers may live in one process, as in tests) with the per-request metrics
    and the engine's."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        r = self.registry
        self.success = Counter(PREFIX + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Inter-token latency, per token",
                             buckets=TPOT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds", "(e2e - ttft) / (tokens - 1)",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=E2E_BUCKETS, registry=r)

    def observe(self, finish_reason: str, prompt_tokens: int, chunk_times: list[float], chunk_tokens: list[int],
                e2e_s: float) -> None:
        """One finished request: its chunks' times (s after arrival) and token counts, its end-to-end time."""
        self.success.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        tokens = sum(chunk_tokens)
        self.generation_tokens.inc(tokens)
        self.e2e.observe(e2e_s)
        if not chunk_times:
            return
        self.ttft.observe(chunk_times[0])
        for t0, t1, k in zip(chunk_times, chunk_times[1:], chunk_tokens[1:]):
            for _ in range(k):
                self.itl.observe((t1 - t0) / k)
        if tokens > 1:
            self.tpot.observe((e2e_s - chunk_times[0]) / (tokens - 1))
