"""Pictures of load runs: one run over time (`plot_run`), and runs across concurrency (`plot_curve`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def per_second(result: dict) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens timed in each whole second of the run, and requests in flight during it (from the per-request
    chunk times that `report` keeps)."""
    chunks = [c for c, e in zip(result["chunks"], result["errors"]) if not e and c["content_times"]]
    if not chunks:
        return np.zeros(1), np.zeros(1)
    end = max(c["start"] + c["content_times"][-1] for c in chunks)
    tokens, active = np.zeros(int(end) + 1), np.zeros(int(end) + 1)
    for c in chunks:
        times, counts = ((c["token_times"], c["token_counts"]) if c["token_times"]
                         else (c["content_times"], [1] * len(c["content_times"])))
        for t, k in zip(times, counts):
            tokens[int(c["start"] + t)] += k
        active[int(c["start"]): int(c["start"] + c["content_times"][-1]) + 1] += 1
    return tokens, active


def plot_run(result: dict, path: str | Path) -> None:
    """Top: output tokens/s and requests in flight, per second. Bottom: the server's draft shape in use against time
    beside its running requests, from the /metrics samples (absent when the server reports no shape)."""
    plt = _pyplot()
    gauges = result.get("server_gauges") or []
    shaped = [g for g in gauges if g.get("shape") is not None]
    fig, axes = plt.subplots(2 if shaped else 1, 1, figsize=(9, 6 if shaped else 3.5), squeeze=False, sharex=True)
    tokens, active = per_second(result)
    ax = axes[0][0]
    ax.bar(np.arange(len(tokens)) + 0.5, tokens, width=0.9, color="tab:blue", alpha=0.6)
    ax.set_ylabel("output tokens / s", color="tab:blue")
    twin = ax.twinx()
    twin.step(np.arange(len(active)) + 0.5, active, where="mid", color="tab:red")
    twin.set_ylabel("requests in flight", color="tab:red")
    ax.set_title(f"{result['model_id']}: {result['completed']} requests, max concurrency {result['max_concurrency']}")
    if shaped:
        ax = axes[1][0]
        labels = sorted({g["shape"] for g in shaped}, key=_shape_order)
        t = [g["t"] for g in shaped]
        ax.step(t, [labels.index(g["shape"]) for g in shaped], where="post", color="tab:green")
        ax.set_yticks(range(len(labels)), labels)
        ax.set_ylabel("draft shape in use", color="tab:green")
        twin = ax.twinx()
        twin.step(t, [g["running"] for g in shaped], where="post", color="tab:red")
        twin.set_ylabel("requests running (server)", color="tab:red")
    axes[-1][0].set_xlabel("seconds into the run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curve(curves: dict[str, list[dict]], path: str | Path, title: str = "") -> None:
    """Output throughput and median TPOT against concurrency, one line per server setting ({label: [result, ...]},
    each result a `report` dict with max_concurrency)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, results in curves.items():
        rows = sorted(results, key=lambda r: r["max_concurrency"])
        x = [r["max_concurrency"] for r in rows]
        left.plot(x, [r["output_throughput"] for r in rows], marker="o", label=label)
        right.plot(x, [r["median_tpot_ms"] for r in rows], marker="o", label=label)
    for ax, name in ((left, "output tokens / s"), (right, "median TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    left.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _shape_order(label: str) -> tuple:
    """off first, then chains by length, then anything else by name."""
    if label == "off":
        return (0, 0, label)
    kind, _, rest = label.partition(":")
    return (1, int(rest), label) if kind == "chain" and rest.isdigit() else (2, 0, label)
