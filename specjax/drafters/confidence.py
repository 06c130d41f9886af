"""Calibrating a block drafter's confidences: sequential temperature scaling (STS) and ECE.

DSpark's confidence head gives c_k = P(draft k accepted | drafts < k accepted), so the chance
that a whole prefix survives verification is the cumulative product a_k = c_1 ... c_k, which
is what the prefix scheduler (specjax/decoding/scheduler.py) sums into an expected acceptance length.
Raw heads are overconfident, so DSpark calibrates post hoc (paper, section 3.2.1): on a held-out
run, for k = 1 .. gamma in order, a 1-D grid search picks the temperature T_k of

    c_k = sigmoid(z_k / T_k)          z_k: the head's logit at position k

that minimises the expected calibration error of a_k against the observed prefix acceptance
(1 when drafts 1..k were all accepted), with T_1 .. T_{k-1} already fixed. Temperature scaling
is order-preserving, so the head's ranking of drafts is unchanged.

ECE, as DeepSpec's evaluator measures it (eval/dspark/confidence_head.py): per position, the
predictions (clamped into [1e-8, 1 - 1e-8]) fall into `num_bins` = 20 equal-width bins of [0, 1];
ECE = sum over bins of |mean prediction - mean label| x (bin count / total). The summary is the
count-weighted mean over positions.

Fitting them on a target's verified rounds is `specjax.train.confidence.calibrate`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

NUM_BINS = 20  # DeepSpec's CONFIDENCE_NUM_BINS
EPS_PROB = 1e-8
DEFAULT_GRID = np.exp(np.linspace(np.log(0.05), np.log(20.0), 241))  # temperatures searched, log-spaced


# ---- ECE and the fit (numpy: a few thousand scalars) ---------------------------------------------------------


def expected_calibration_error(pred: np.ndarray, label: np.ndarray, num_bins: int = NUM_BINS) -> float:
    """ECE of predictions [M] against 0/1 labels [M]: equal-width bins, |mean pred - mean label| weighted by count."""
    pred = np.clip(np.asarray(pred, np.float64).reshape(-1), EPS_PROB, 1.0 - EPS_PROB)
    label = np.asarray(label, np.float64).reshape(-1)
    if pred.size == 0:
        return float("nan")
    idx = np.clip((pred * num_bins).astype(np.int64), 0, num_bins - 1)
    gap = np.abs(np.bincount(idx, pred, num_bins) - np.bincount(idx, label, num_bins))  # |sum pred - sum label|
    return float(gap.sum() / pred.size)


def prefix_labels(accepted_M: np.ndarray, k: int) -> np.ndarray:
    """[M, k] 0/1: position j (1-based j + 1) survived, i.e. at least j + 1 drafts were accepted."""
    return (np.asarray(accepted_M)[:, None] > np.arange(k)[None, :]).astype(np.float64)


def cumulative(logits_MK: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """a_k = prod_{i <= k} sigmoid(z_i / T_i): prefix survival predictions [M, K]."""
    z = np.asarray(logits_MK, np.float64) / np.asarray(temperatures, np.float64)[None, :]
    return np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=1)


def per_position_ece(logits_MK: np.ndarray, accepted_M: np.ndarray, temperatures: np.ndarray,
                     num_bins: int = NUM_BINS) -> np.ndarray:
    """ECE [K] of the cumulative products at each position against prefix acceptance."""
    a_MK = cumulative(logits_MK, temperatures)
    labels_MK = prefix_labels(accepted_M, a_MK.shape[1])
    return np.asarray([expected_calibration_error(a_MK[:, k], labels_MK[:, k], num_bins)
                       for k in range(a_MK.shape[1])])


def fit_temperatures(logits_MK: np.ndarray, accepted_M: np.ndarray, grid: np.ndarray = DEFAULT_GRID,
                     num_bins: int = NUM_BINS) -> np.ndarray:
    """Sequential temperature scaling: T_1 .. T_K, each by grid search on the ECE of a_k with T_{<k} fixed.

    logits_MK: the confidence head's logits (before any temperature) for M rounds x K positions;
    accepted_M: drafts accepted in each round (0..K). Ties keep the temperature closest to 1.
    """
    logits_MK = np.asarray(logits_MK, np.float64)
    m, k = logits_MK.shape
    labels_MK = prefix_labels(accepted_M, k)
    grid = np.asarray(grid, np.float64)
    order = np.argsort(np.abs(np.log(grid)), kind="stable")  # search from T = 1 outwards: ties keep T near 1
    temps, prefix_M = np.ones(k), np.ones(m)
    for j in range(k):
        z_M = logits_MK[:, j]
        errors = [expected_calibration_error(prefix_M / (1.0 + np.exp(-z_M / t)), labels_MK[:, j], num_bins)
                  for t in grid[order]]
        temps[j] = grid[order][int(np.argmin(errors))]
        prefix_M = prefix_M / (1.0 + np.exp(-z_M / temps[j]))
    return temps


@dataclasses.dataclass(frozen=True)
class CalibrationReport:
    """What a calibration did: temperatures, and ECE / mean prediction vs observed rate per position."""

    temperatures: tuple[float, ...]  # T_1 .. T_gamma (positions not calibrated keep 1)
    ece_before: tuple[float, ...]  # per calibrated position
    ece_after: tuple[float, ...]
    predicted_before: tuple[float, ...]  # mean a_k
    predicted_after: tuple[float, ...]
    observed: tuple[float, ...]  # mean prefix acceptance at k
    rounds: int  # (row, round) samples fitted on

    @property
    def mean_ece_before(self) -> float:
        return float(np.mean(self.ece_before))

    @property
    def mean_ece_after(self) -> float:
        return float(np.mean(self.ece_after))

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "mean_ece_before": self.mean_ece_before,
                "mean_ece_after": self.mean_ece_after}


def fit_report(logits_MK: np.ndarray, accepted_M: np.ndarray, block_size: int, grid: np.ndarray = DEFAULT_GRID,
               num_bins: int = NUM_BINS) -> CalibrationReport:
    """Fit STS on (logits, accepted) and report ECE before / after; temperatures padded with 1 to block_size."""
    logits_MK = np.asarray(logits_MK, np.float64)
    k = logits_MK.shape[1]
    temps = fit_temperatures(logits_MK, accepted_M, grid, num_bins)
    ones = np.ones(k)
    labels = prefix_labels(accepted_M, k)
    return CalibrationReport(
        temperatures=tuple(float(t) for t in np.concatenate([temps, np.ones(block_size - k)])),
        ece_before=tuple(per_position_ece(logits_MK, accepted_M, ones, num_bins).tolist()),
        ece_after=tuple(per_position_ece(logits_MK, accepted_M, temps, num_bins).tolist()),
        predicted_before=tuple(cumulative(logits_MK, ones).mean(0).tolist()),
        predicted_after=tuple(cumulative(logits_MK, temps).mean(0).tolist()),
        observed=tuple(labels.mean(0).tolist()), rounds=int(logits_MK.shape[0]))
