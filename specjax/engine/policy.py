"""Which draft shape the next chunk runs, from the number of slots decoding now.

Tokens per second of a shape at occupancy n in bucket nb = n x tau(shape) / cost(nb, shape):
- cost, seconds per round of the compiled chunk at bucket nb: once the shape has run there, round_s, an exponential
  average of the wall time over the rounds of its chunks with no prefill or catch-up before them (the realized rate
  below counts every chunk); before that, its warmup timing (`Engine.warmup`, the least of three, device time
  alone: warm_s) times the median, over the shapes that have run there, of their round_s over their warm_s. A
  running chunk's time holds the host's gap as well, so raw warmup timings made every shape not running look
  cheaper than the one running, and the policy kept leaving a shape for one that, once run, cost more;
- tau, tokens a row emits per round, from the planner's positional acceptance model (planning/planner.py): p[d][r]
  = P(the rank-r draft at depth d + 1 is accepted | its parent was), counted online across every chunk whatever its
  shape (verified drafts per (depth, rank) over their opportunities, planning/calibration.py `opportunities`), so
  a chain's runs price every chain and every tree's spine, and a tree's runs price its side branches. A chain of K
  emits 1 + p_1 + p_1 p_2 + ... ; a tree the sum of its nodes' reach (`expected_tau`); a one-pass dynamic tree the
  reach of the tree the best-first rule grows on p (planning/block_trees.py `expected_template`). Where a (depth,
  rank) has too few opportunities yet: a deeper depth continues the deepest measured one; rank 0 before any data
  is PRIOR_ACCEPTANCE; rank r > 0 takes RANK_PRIOR of the probability the ranks before it leave;
- "off" emits one token per row per step;
- times a realization factor per (bucket, shape): the tokens its chunks emitted over the tokens this model predicted
  for them (sums, older chunks forgotten, FORGET a chunk at that bucket; a clean chunk counts as realized, its time
  being the round cost's own sample), shrunk toward 1 by PRIOR_CHUNKS chunks' worth of belief. It carries the work
  the round cost leaves out, which running requests bring: prefills, prompt pieces and catch-ups between chunks (a
  draft model's prefill and catch-up are its shapes' alone), which under churn precede almost every chunk. A shape
  never run at a bucket keeps factor 1 (the model's word) until it is tried there: when the shape in use realizes
  less than it is predicted to give, or by exploration (`LoadPolicy.explore`: once the shape in use is measured at
  a bucket, a shape predicted within EXPLORE_WITHIN of the best and not measured there runs up to EXPLORE_CHUNKS
  chunks, cut short once it trails the shape in use; as evidence ages, tried again).
Hysteresis, in size and in time: the shape in use is kept while its prediction is within `hysteresis` of the best,
and a better shape replaces it only once it has led by more than that for `dwell` choices in a row, so one request
joining and leaving (a bucket boundary crossed back and forth) or one noisy chunk time does not flip it. A shape in
use that is dropped at this bucket is left at once. The loop is closed: each (bucket, shape) keeps its realized
tokens per live row per second (decayed sums of tokens over row-seconds, so a chunk weighs by its time), and a shape
that measures, over `MIN_SAMPLES` chunks, more than 10% worse than off at a bucket (off's realized rate there, or
while off has run fewer chunks there, off's prediction against its own) is dropped there, for DROP_CHUNKS chunks
at that bucket: then its realization starts afresh and it may be chosen again (a drop measured while something else
loaded the machine must not last).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from specjax.decoding.tree import DynamicTreeSpec, TreeSpec, child_ranks
from specjax.planning.block_trees import expected_template
from specjax.planning.calibration import opportunities
from specjax.planning.planner import expected_tau

OFF = "off"
PRIOR_ACCEPTANCE = 0.7  # rank 0's acceptance before any is measured
RANK_PRIOR = 0.3  # an unmeasured rank r > 0: this share of what the ranks before it leave (sum p <= 1)
MIN_OFFERED = 16  # opportunities of a (depth, rank) before its measured acceptance replaces the prior
MIN_SAMPLES = 16  # chunks per (bucket, shape) before its realized rate can drop it (requests join and leave inside
# a chunk: its time varies by about 25% here, a 16-chunk mean by about 6%)
DROP_MARGIN = 0.9  # dropped only when this far below off: a drop lasts DROP_CHUNKS, and 0.95 dropped shapes that
# were as good as off
DROP_CHUNKS = 300  # chunks at a bucket a drop lasts
EMA = 0.1  # weight of a new chunk in the running round costs
FORGET = 0.999  # per chunk at a bucket: how much of each shape's realization evidence there is kept
PRIOR_CHUNKS = 2.0  # chunks' worth of belief in the model (factor 1) that a measured factor is shrunk toward
EXPLORE_CHUNKS = 6  # chunks a shape runs when tried at a bucket (LoadPolicy.explore), at most
EXPLORE_MIN = 2  # chunks of a trial before it may be cut short
EXPLORE_STOP = 0.9  # a trial realizing less than this share of the incumbent's rate is cut short
EXPLORE_WITHIN = 0.8  # tried only if predicted within this share of the best shape
EXPLORE_AGAIN = 700  # chunks at a bucket before a shape tried there may be tried again (as its evidence ages)
DWELL = 3  # choices in a row a challenger must lead by more than the hysteresis before it replaces the shape in use


@dataclasses.dataclass
class Average:
    value: float = 0.0
    samples: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else (1 - EMA) * self.value + EMA * x
        self.samples += 1


@dataclasses.dataclass
class Realization:
    """Decayed sums over a (bucket, shape)'s chunks: tokens emitted, tokens the model predicted, row-seconds (live
    rows x wall time), chunks counted; and the chunks recorded, undecayed."""
    tokens: float = 0.0
    predicted: float = 0.0
    row_seconds: float = 0.0
    chunks: float = 0.0
    runs: int = 0

    def forget(self) -> None:
        """Another chunk ran at this bucket: every sum keeps FORGET of itself."""
        self.tokens, self.predicted = FORGET * self.tokens, FORGET * self.predicted
        self.row_seconds, self.chunks = FORGET * self.row_seconds, FORGET * self.chunks

    def add(self, tokens: float, predicted: float, row_seconds: float) -> None:
        self.tokens, self.predicted, self.chunks = self.tokens + tokens, self.predicted + predicted, self.chunks + 1
        self.row_seconds, self.runs = self.row_seconds + row_seconds, self.runs + 1

    def factor(self) -> float:
        """Emitted over predicted, shrunk toward 1 by PRIOR_CHUNKS chunks of belief in the model."""
        if self.predicted <= 0:
            return 1.0
        return (self.chunks * self.tokens / self.predicted + PRIOR_CHUNKS) / (self.chunks + PRIOR_CHUNKS)

    def rate(self) -> float:
        """Realized tokens per live row per second: the sums' ratio, so each chunk weighs by its time (a mean of
        per-chunk rates would give a short chunk after a prefill the weight of a long clean one)."""
        return self.tokens / max(self.row_seconds, 1e-12)


def shape_size(specs) -> tuple[int, int]:
    """(depths, ranks) that every shape's acceptance counts fit: the deepest shape, the most children of a node."""
    depth, ranks = 1, 1
    for spec in specs:
        if isinstance(spec, DynamicTreeSpec):
            depth, ranks = max(depth, spec.max_depth), max(ranks, spec.top_k)
        elif spec.num_nodes > 1:
            depth, ranks = max(depth, spec.max_depth), max(ranks, max(child_ranks(spec)) + 1)
    return depth, ranks


class LoadPolicy:
    """Chooses among `labels`: "off" and the shapes of `specs` (label -> TreeSpec or DynamicTreeSpec)."""

    def __init__(self, labels: list[str], specs: dict, hysteresis: float = 0.05, dwell: int = DWELL):
        self.labels, self.specs, self.hysteresis, self.dwell = list(labels), dict(specs), hysteresis, dwell
        self.challenger, self.streak = None, 0  # the shape leading the one in use, and for how many choices
        # a trial (explore): (bucket, the shape tried, the shape in use before it, the tried shape's chunks before it)
        self.exploring: tuple[int, str, str, int] | None = None
        self.tried: dict[tuple[int, str], int] = {}  # (bucket, shape) -> the bucket's chunk count when last tried
        self.round_s: dict[tuple[int, str], Average] = defaultdict(Average)  # seconds a round of running chunks
        self.warm_s: dict[tuple[int, str], float] = {}  # seconds a round as warmup timed it (device time)
        self.realized: dict[tuple[int, str], Realization] = defaultdict(Realization)
        self.dropped: dict[tuple[int, str], int] = {}  # (bucket, shape) -> the bucket's chunk count when dropped
        self.chunks_at: dict[int, int] = defaultdict(int)  # chunks recorded per bucket
        depth, ranks = shape_size(self.specs.values())
        self.verified_DR = np.zeros((depth, ranks))  # drafts the target accepted, per (depth, rank)
        self.offered_DR = np.zeros((depth, ranks))  # their opportunities (offered under an accepted parent)
        self._p_DR: np.ndarray | None = None  # acceptance() of these counts, until the next learn()

    def learn(self, label: str, verified_DR: np.ndarray, row_rounds: int) -> None:
        """One chunk's acceptance: its verified drafts per (depth, rank) over `row_rounds` active row-rounds of
        shape `label` (a dynamic tree's opportunities are those of the tree expected from what is known so far)."""
        spec = self.specs.get(label)
        if spec is None or row_rounds <= 0:
            return
        tree = expected_template(spec, self.acceptance()) if isinstance(spec, DynamicTreeSpec) else spec
        d, r = self.verified_DR.shape
        v_DR = np.zeros((d, r))
        got = np.asarray(verified_DR, np.float64)[:d, :r]
        v_DR[:got.shape[0], :got.shape[1]] = got
        self.verified_DR += v_DR
        self.offered_DR += opportunities(tree, v_DR, row_rounds)
        self._p_DR = None

    def acceptance(self) -> np.ndarray:
        """p [D, R]: measured where offered at least MIN_OFFERED times, else the priors (module docstring)."""
        if self._p_DR is not None:
            return self._p_DR
        depth, ranks = self.verified_DR.shape
        known_DR = self.offered_DR >= MIN_OFFERED
        measured_DR = np.where(known_DR, self.verified_DR / np.maximum(self.offered_DR, 1), np.nan)
        p_DR = np.zeros((depth, ranks))
        for d in range(depth):
            for r in range(ranks):
                if known_DR[d, r]:
                    p = measured_DR[d, r]
                elif d > 0:  # deeper than measured: as the depth above
                    p = p_DR[d - 1, r]
                elif r == 0:
                    p = PRIOR_ACCEPTANCE
                else:
                    p = RANK_PRIOR * max(0.0, 1.0 - p_DR[d, :r].sum())
                p_DR[d, r] = p
            total = p_DR[d].sum()
            if total > 1:  # sibling guesses are exclusive; counting noise must not say otherwise
                p_DR[d] /= total
        self._p_DR = p_DR
        return p_DR

    def tau(self, label: str) -> float:
        spec = self.specs.get(label)
        if spec is None:
            return 1.0
        p_DR = self.acceptance()
        tree = expected_template(spec, p_DR) if isinstance(spec, DynamicTreeSpec) else spec
        return expected_tau(tree, p_DR)

    def cost(self, nb: int, label: str) -> float | None:
        """Seconds a round of `label` at bucket nb (module docstring), or None while neither run nor timed there."""
        ran = self.round_s.get((nb, label))
        if ran is not None and ran.samples:
            return ran.value
        warm = self.warm_s.get((nb, label))
        if warm is None:
            return None
        ratios = [a.value / self.warm_s[key] for key, a in self.round_s.items()
                  if key[0] == nb and a.samples and key in self.warm_s]
        return warm * (float(np.median(ratios)) if ratios else 1.0)

    def modelled(self, nb: int, live: int, label: str) -> float | None:
        """The model's tokens per second at `live` rows (tau over the round cost), or None while this bucket's round
        cost is unknown."""
        cost = self.cost(nb, label)
        return None if cost is None else live * self.tau(label) / max(cost, 1e-9)

    def predicted(self, nb: int, live: int, label: str) -> float | None:
        """Tokens per second at `live` rows: the model's, times what this shape realized of it at this bucket."""
        rate = self.modelled(nb, live, label)
        return None if rate is None else rate * self.realized[(nb, label)].factor()

    def choose(self, nb: int, live: int, current: str | None) -> str:
        scores = {label: self.predicted(nb, live, label) for label in self.labels if (nb, label) not in self.dropped}
        unknown = [label for label, score in scores.items() if score is None]
        if unknown:  # never timed at this bucket (no warmup): run it once to learn its cost
            return current if current in unknown else unknown[0]
        best = max(scores, key=scores.get)
        if current not in scores:  # nothing in use yet, or the shape in use was dropped at this bucket
            self.challenger, self.streak, self.exploring = None, 0, None
            return best
        explored = self.explore(nb, current, scores)
        if explored is not None:
            return explored
        if scores[current] >= (1 - self.hysteresis) * scores[best]:
            self.challenger, self.streak = None, 0
            return current
        self.streak = self.streak + 1 if best == self.challenger else 1
        self.challenger = best
        if self.streak < self.dwell:
            return current
        self.challenger, self.streak = None, 0
        return best

    def explore(self, nb: int, current: str, scores: dict) -> str | None:
        """The shape to try at bucket nb (None: choose as usual). Once the shape in use has EXPLORE_CHUNKS / 2
        chunks of evidence here, a shape with less than that, not tried here in the last EXPLORE_AGAIN chunks, whose
        prediction is within EXPLORE_WITHIN of the best runs for up to EXPLORE_CHUNKS chunks, so its realization
        factor is measured rather than assumed: the round cost warmup timed on dummy rows can misjudge a shape at
        this bucket (it priced off 15% dear against its realized rate at 8 rows with a draft model), and a shape the
        model underrates would otherwise never run there. A trial is cut short once, over EXPLORE_MIN chunks, it
        realizes less than EXPLORE_STOP of the incumbent's rate (the shape in use before it), and when it ends the
        incumbent returns unless the trial is now predicted more than the hysteresis ahead of it: a trial that
        disappoints costs a few chunks, not a trial and a dwell."""
        if self.exploring is not None and self.exploring[:2] == (nb, current):
            _, _, incumbent, runs_before = self.exploring
            trial, ran = self.realized[(nb, current)], self.realized[(nb, current)].runs - runs_before
            trails = ran >= EXPLORE_MIN and trial.rate() < EXPLORE_STOP * self.realized[(nb, incumbent)].rate()
            if ran < EXPLORE_CHUNKS and not trails:
                return current
            self.exploring = None
            if incumbent in scores and scores[current] <= (1 + self.hysteresis) * scores[incumbent]:
                return incumbent
            return current
        self.exploring = None
        if self.realized[(nb, current)].chunks < EXPLORE_CHUNKS / 2:
            return None
        top = max(scores.values())
        untried = [label for label, score in scores.items()
                   if self.realized[(nb, label)].chunks < EXPLORE_CHUNKS / 2 and score >= EXPLORE_WITHIN * top
                   and self.chunks_at[nb] - self.tried.get((nb, label), -EXPLORE_AGAIN) >= EXPLORE_AGAIN]
        if not untried:
            return None
        label = max(untried, key=scores.get)
        self.tried[(nb, label)] = self.chunks_at[nb]
        self.exploring, self.challenger, self.streak = (nb, label, current, self.realized[(nb, label)].runs), None, 0
        return label

    def record(self, nb: int, live: int, label: str, rounds: int, tokens: int, seconds: float,
               clean: bool = True) -> None:
        """One chunk's outcome: its rounds, the tokens its live rows emitted, its wall time. A chunk after a prefill
        or a catch-up (not `clean`: that work ran on the device inside its time) updates only the realization: its
        round time would charge one shape with work every shape does."""
        if rounds <= 0 or seconds <= 0 or live <= 0:
            return
        self.chunks_at[nb] += 1
        for key, at in list(self.dropped.items()):  # a drop expires: fresh evidence decides again
            if key[0] == nb and self.chunks_at[nb] - at >= DROP_CHUNKS:
                del self.dropped[key]
                self.realized.pop(key, None)
        modelled = self.modelled(nb, live, label)  # before this chunk's time moves the round cost
        for (b, _), evidence in self.realized.items():
            if b == nb:
                evidence.forget()
        # a clean chunk's time feeds the round cost below: it realizes the model by definition
        predicted = tokens if clean or modelled is None else modelled * seconds
        self.realized[(nb, label)].add(tokens, predicted, live * seconds)
        if clean or self.cost(nb, label) is None:  # (with no warmup: a first cost, however rough)
            self.round_s[(nb, label)].add(seconds / rounds)
        if label != OFF and (nb, label) not in self.dropped and self.worse_than_off(nb, label):
            self.dropped[(nb, label)] = self.chunks_at[nb]

    def worse_than_off(self, nb: int, label: str) -> bool:
        """Whether `label` realizes more than 10% fewer tokens per row per second than off at bucket nb, over at least
        MIN_SAMPLES chunks of it: against off's realized rate there once off has as many, else against off's
        prediction (its timed step cost, one token a step, times what off realized there), with this shape's
        prediction carrying what it realized (its factor), so a shape that keeps off from running at a bucket must
        still measure up to it."""
        this, off = self.realized[(nb, label)], self.realized.get((nb, OFF))
        if this.runs < MIN_SAMPLES:
            return False
        if off is not None and off.runs >= MIN_SAMPLES:
            return this.rate() < DROP_MARGIN * off.rate()
        this_rate, off_rate = self.predicted(nb, 1, label), self.predicted(nb, 1, OFF)
        return this_rate is not None and off_rate is not None and this_rate < DROP_MARGIN * off_rate

    def summary(self) -> dict:
        p_DR = self.acceptance()
        return {"acceptance_at_depth": [float(x) for x in np.cumprod(p_DR[:, 0])],  # a chain's draft d is emitted
                "acceptance_depth_rank": [[float(x) for x in row] for row in p_DR],
                "tau": {label: self.tau(label) for label in self.labels},
                "round_ms": {f"{nb}/{label}": self.cost(nb, label) * 1e3
                             for nb, label in sorted(set(self.round_s) | set(self.warm_s))
                             if self.cost(nb, label) is not None},
                "realized_factor": {f"{nb}/{label}": r.factor() for (nb, label), r in sorted(self.realized.items())
                                    if r.chunks > 0},
                "realized_row_rate": {f"{nb}/{label}": r.rate() for (nb, label), r in sorted(self.realized.items())
                                      if r.chunks > 0},
                "dropped": sorted(f"{nb}/{label}" for nb, label in self.dropped)}
