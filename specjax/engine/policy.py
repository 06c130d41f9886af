"""Which draft shape the next chunk runs, from the number of slots decoding now.

Tokens per second of a shape at occupancy n in bucket nb = n x tau(shape) / round_s(nb, shape):
- round_s, seconds per round of the compiled chunk at bucket nb, timed by `Engine.warmup` and then updated from
  every chunk the engine runs (an exponential average of its wall time over its rounds);
- tau, tokens a row emits per round, from the per-depth acceptance the engine counts online (a chain of K emits
  1 + a_1 + ... + a_K, a_d the chance its depth-d draft is emitted; depths not yet run continue the last measured
  ratio a_d / a_(d-1); before any data a prior of 0.7 per depth);
- "off" emits one token per row per step.
Hysteresis, in size and in time: the shape in use is kept while its prediction is within `hysteresis` of the best,
and a better shape replaces it only once it has led by more than that for `dwell` choices in a row, so one request
joining and leaving (a bucket boundary crossed back and forth) or one noisy chunk time does not flip it. A shape in
use that is dropped at this bucket is left at once. The loop is closed: each chunk's realized tokens per live row
per second is recorded per (bucket, shape), and a shape that measures more than 5% worse than off at a bucket
(both over `MIN_SAMPLES` chunks) is dropped there.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

OFF = "off"
PRIOR_ACCEPTANCE = 0.7
MIN_OFFERED = 16  # nodes offered at a depth before its measured acceptance replaces the prior
MIN_SAMPLES = 16  # chunks per (bucket, shape) before a realized rate can drop a shape (a chunk's rate is noisy:
DROP_MARGIN = 0.95  # requests join and leave inside it); dropped only when this far below off
EMA = 0.2  # weight of a new chunk in the running averages
DWELL = 3  # choices in a row a challenger must lead by more than the hysteresis before it replaces the shape in use


@dataclasses.dataclass
class Average:
    value: float = 0.0
    samples: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else (1 - EMA) * self.value + EMA * x
        self.samples += 1


class LoadPolicy:
    """Chooses among `labels` ("off", "chain:K"); `depths[label]` is a chain's K (0 for off)."""

    def __init__(self, labels: list[str], depths: dict[str, int], hysteresis: float = 0.05, dwell: int = DWELL):
        self.labels, self.depths, self.hysteresis, self.dwell = list(labels), dict(depths), hysteresis, dwell
        self.challenger, self.streak = None, 0  # the shape leading the one in use, and for how many choices
        self.round_s: dict[tuple[int, str], Average] = defaultdict(Average)
        self.row_rate: dict[tuple[int, str], Average] = defaultdict(Average)
        self.dropped: set[tuple[int, str]] = set()
        self.acceptance = np.zeros(0)  # a_d, d = 1..

    def learn(self, offered_D: np.ndarray, accepted_D: np.ndarray) -> None:
        """Per-depth acceptance from the engine's cumulative counts (depths offered too rarely stay unknown)."""
        known = np.asarray(offered_D) >= MIN_OFFERED
        a = np.where(known, np.asarray(accepted_D) / np.maximum(offered_D, 1), np.nan)
        self.acceptance = a[: int(np.argmin(known)) if not known.all() else len(a)]

    def tau(self, label: str) -> float:
        k = self.depths[label]
        a = list(self.acceptance[:k])
        while len(a) < k:
            if not a:
                a.append(PRIOR_ACCEPTANCE)
            else:
                ratio = a[-1] / a[-2] if len(a) >= 2 and a[-2] > 0 else a[-1]
                a.append(a[-1] * min(ratio, 1.0))
        return 1.0 + float(np.sum(a))

    def predicted(self, nb: int, live: int, label: str) -> float | None:
        """Tokens per second at `live` rows, or None while this bucket's round time is unknown."""
        cost = self.round_s.get((nb, label))
        if cost is None or cost.samples == 0:
            return None
        return live * self.tau(label) / max(cost.value, 1e-9)

    def choose(self, nb: int, live: int, current: str | None) -> str:
        options = [label for label in self.labels if (nb, label) not in self.dropped]
        unknown = [label for label in options if self.predicted(nb, live, label) is None]
        if unknown:  # never timed at this bucket (no warmup): run it once to learn its cost
            return current if current in unknown else unknown[0]
        scores = {label: self.predicted(nb, live, label) for label in options}
        best = max(scores, key=scores.get)
        if current not in scores:  # nothing in use yet, or the shape in use was dropped at this bucket
            self.challenger, self.streak = None, 0
            return best
        if scores[current] >= (1 - self.hysteresis) * scores[best]:
            self.challenger, self.streak = None, 0
            return current
        self.streak = self.streak + 1 if best == self.challenger else 1
        self.challenger = best
        if self.streak < self.dwell:
            return current
        self.challenger, self.streak = None, 0
        return best

    def record(self, nb: int, live: int, label: str, rounds: int, tokens: int, seconds: float) -> None:
        """One chunk's outcome: its rounds, the tokens its live rows emitted, its wall time."""
        if rounds <= 0 or seconds <= 0 or live <= 0:
            return
        self.round_s[(nb, label)].add(seconds / rounds)
        self.row_rate[(nb, label)].add(tokens / live / seconds)
        off, this = self.row_rate.get((nb, OFF)), self.row_rate[(nb, label)]
        if label != OFF and off is not None and min(off.samples, this.samples) >= MIN_SAMPLES \
                and this.value < DROP_MARGIN * off.value:
            self.dropped.add((nb, label))

    def summary(self) -> dict:
        return {"acceptance_at_depth": [float(x) for x in self.acceptance],
                "round_ms": {f"{nb}/{label}": a.value * 1e3 for (nb, label), a in sorted(self.round_s.items())},
                "dropped": sorted(f"{nb}/{label}" for nb, label in self.dropped)}
