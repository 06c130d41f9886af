"""What the server itself reports on its Prometheus /metrics: speculative acceptance, occupancy, the draft shape.

Names are matched by suffix, so vLLM's `vllm:spec_decode_num_accepted_tokens_total` and specjax's
`specjax:spec_decode_num_accepted_tokens_total` read the same. Acceptance over a run is the difference of the
counters after and before it, as vLLM defines it: acceptance rate = accepted / draft tokens, mean acceptance
length = 1 + accepted / drafts (the bonus token counted), and per position i, accepted at i / drafts. During the
run the gauges are sampled on a timer: requests running and waiting, and (specjax) the draft shape in use.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

DRAFTS, DRAFT_TOKENS, ACCEPTED = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                                  "spec_decode_num_accepted_tokens_total")
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"
RUNNING, WAITING, SHAPE = "num_requests_running", "num_requests_waiting", "spec_decode_shape_info"


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a /metrics page: (name, labels, value)."""
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


async def scrape(client: httpx.AsyncClient, base_url: str) -> list[tuple[str, dict[str, str], float]] | None:
    """The server's /metrics samples, or None when it has none (a 404, a connection error, not Prometheus text)."""
    try:
        response = await client.get(f"{base_url}/metrics")
        return parse(response.text) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _total(samples, suffix: str) -> float | None:
    values = [v for name, _, v in samples if name.endswith(suffix)]
    return sum(values) if values else None


def acceptance(before, after) -> dict | None:
    """The server's speculative acceptance between two scrapes; None when it reports none."""
    if not before or not after:
        return None
    delta = {}
    for key, suffix in (("drafts", DRAFTS), ("draft_tokens", DRAFT_TOKENS), ("accepted_tokens", ACCEPTED)):
        a, b = _total(after, suffix), _total(before, suffix)
        if a is None or b is None:
            return None
        delta[key] = a - b
    per_pos_before = {int(lab["position"]): v for name, lab, v in before if name.endswith(PER_POSITION)}
    per_pos = {int(lab["position"]): v - per_pos_before.get(int(lab["position"]), 0.0)
               for name, lab, v in after if name.endswith(PER_POSITION)}
    drafts = delta["drafts"]
    return {**{f"spec_decode_num_{k}": v for k, v in delta.items()},
            "spec_decode_acceptance_rate": delta["accepted_tokens"] / delta["draft_tokens"] if delta["draft_tokens"]
            else None,
            "spec_decode_mean_acceptance_length": 1 + delta["accepted_tokens"] / drafts if drafts else None,
            "spec_decode_acceptance_per_position": [per_pos[i] / drafts for i in sorted(per_pos)] if drafts else None}


def gauges(samples) -> dict:
    """Requests running and waiting, and the draft shape in use (the label of the info gauge set to 1)."""
    shape = next((lab.get("shape") for name, lab, v in samples if name.endswith(SHAPE) and v == 1), None)
    return {"running": _total(samples, RUNNING), "waiting": _total(samples, WAITING), "shape": shape}


async def sample_gauges(client: httpx.AsyncClient, base_url: str, interval_s: float, stop: asyncio.Event,
                        t0: float) -> list[dict]:
    """gauges() every interval_s until stop is set, each with "t" (seconds after t0, a perf_counter reading)."""
    rows = []
    while not stop.is_set():
        samples = await scrape(client, base_url)
        if samples is None:
            return rows
        rows.append({"t": time.perf_counter() - t0, **gauges(samples)})
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
    return rows
