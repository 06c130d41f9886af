"""When each request is sent: offsets in seconds from the start of the run, decided before it starts.

As vLLM's `get_request` (vllm/benchmarks/serve.py): at a finite rate the gaps are Gamma(shape=burstiness,
scale=1 / (rate * burstiness)) draws (burstiness 1: exponential gaps, a Poisson process; below 1 burstier, above 1
more even, inf: evenly spaced), rescaled so the last request goes at n / rate (vLLM does this to steady the
throughput across seeds); at rate inf all are sent at once and --max-concurrency alone paces them. A ramp changes the
rate request by request, from start_rps to end_rps: "linear" and "exponential" as vLLM's --ramp-up-strategy (load
only rises, no rescaling), and "updown", which rises linearly to end_rps at the middle request and falls back to
start_rps at the last: load that comes and goes, for watching a server adapt.
"""

from __future__ import annotations

import numpy as np

RAMPS = ("linear", "exponential", "updown")


def request_rates(n: int, rate: float, ramp: str | None = None, start_rps: float | None = None,
                  end_rps: float | None = None) -> list[float]:
    """The rate (requests/s) in force at each of n requests."""
    if ramp is None:
        return [rate] * n
    if ramp not in RAMPS:
        raise ValueError(f"--ramp-up-strategy must be one of {', '.join(RAMPS)}, got {ramp!r}")
    if start_rps is None or end_rps is None or start_rps <= 0 or end_rps <= 0:
        raise ValueError(f"--ramp-up-strategy {ramp} needs --ramp-up-start-rps and --ramp-up-end-rps, both > 0; got "
                         f"{start_rps} and {end_rps}")
    progress = np.arange(n) / max(n - 1, 1)
    if ramp == "linear":
        rates = start_rps + (end_rps - start_rps) * progress
    elif ramp == "exponential":
        rates = start_rps * (end_rps / start_rps) ** progress
    else:
        rates = start_rps + (end_rps - start_rps) * (1 - np.abs(2 * progress - 1))
    return rates.tolist()


def send_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0, ramp: str | None = None,
                 start_rps: float | None = None, end_rps: float | None = None) -> list[float]:
    """Seconds after the start at which each of n requests is sent (non-decreasing, the first gap included)."""
    if n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0 (1: Poisson arrivals), got {burstiness}")
    if ramp is None and not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {rate}")
    rng = np.random.default_rng(seed)
    gaps = []
    for r in request_rates(n, rate, ramp, start_rps, end_rps):
        if r == float("inf"):
            gaps.append(0.0)
        elif burstiness == float("inf"):
            gaps.append(1.0 / r)
        else:
            gaps.append(float(rng.gamma(shape=burstiness, scale=1.0 / (r * burstiness))))
    offsets = np.cumsum(gaps)
    if ramp is None and offsets[-1] > 0:
        offsets *= (n / rate) / offsets[-1]
    return offsets.tolist()
