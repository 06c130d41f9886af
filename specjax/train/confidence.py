"""Fitting a block drafter's confidence temperatures on a target's verified rounds (DSpark's STS).

`calibrate(target, drafter, prompts)` runs greedy speculative rounds on held-out prompts
(`collect_rounds`: every row drafts all gamma positions each round; no EOS, so every position of
every round is labelled), fits the temperatures (specjax/drafters/confidence.py) and returns the
calibrated drafter (temperatures in its params, applied in `propose`) and a report with ECE before
and after. `save_calibration` writes them beside the drafter's weights
(`confidence_calibration.json`), where loading picks them up.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.config import SamplingConfig
from specjax.convert.dspark import CALIBRATION_FILE
from specjax.decoding.decode import LoopConfig, prefill
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.request import prepare, run_compiled
from specjax.decoding.speculative import verify_pass
from specjax.decoding.tree import ancestor_mask, chain, depths
from specjax.drafters.confidence import DEFAULT_GRID, NUM_BINS, CalibrationReport, fit_report
from specjax.models.model import merge

# ---- collecting (confidence, accepted) from greedy speculative rounds -----------------------------------------


@partial(jax.jit, static_argnames=("lc", "drafter", "rounds"))
def _rounds(params, draft_params, prompt_BT, prompt_len_B, *, lc: LoopConfig, drafter, rounds: int):
    """Prefill, then `rounds` greedy rounds (propose, verify, commit, update).

    Returns the drafts' confidences [R, B, K] and the drafts accepted [R, B] in each round.
    """
    model = merge(lc.model, params)
    b = prompt_BT.shape[0]
    cache = model.init_cache(b, lc.cache_len)
    logits_BV, prompt_features, cache = prefill(model, lc, cache, prompt_BT, prompt_len_B,
                                                capture=drafter.feature_layers)
    root_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    dstate = drafter.init(draft_params, PrefillContext(prompt_BT, prompt_len_B, root_B, prompt_features))
    keys_B = jax.random.split(jax.random.key(0), b)

    def body(carry, _):
        cache, root_B, dstate = carry
        draft, dstate = drafter.propose(draft_params, dstate, root_B, keys_B)
        mask_BNN = ancestor_mask(draft.parents)
        verdict, features, cache, _ = verify_pass(model, lc, draft, mask_BNN, depths(mask_BNN), cache,
                                               drafter.feature_layers, keys_B)  # lc is greedy, no penalties
        cache = cache.commit(verdict.path, verdict.num_accepted)
        dstate = drafter.update(draft_params, dstate, draft, verdict, features)
        return (cache, verdict.bonus, dstate), (draft.confidence[:, 1:], verdict.num_accepted - 1)

    _, (conf_RBK, accepted_RB) = lax.scan(body, (cache, root_B, dstate), None, length=rounds)
    return conf_RBK, accepted_RB


def collect_rounds(target, drafter, prompts: Sequence, *, rounds: int = 16, num_draft_tokens: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Greedy speculative rounds on `prompts`: (confidence logits [M, K] at temperature 1, accepted [M]).

    Every row runs `rounds` rounds of K = num_draft_tokens (default: the whole block) drafts, EOS
    ignored, so every position is labelled; M = rows x rounds. The logits are recovered from the
    fp32 confidences (clipped to [1e-7, 1 - 1e-7], |z| <= 16: past that they all fall in the top bin).
    """
    k = num_draft_tokens or drafter.max_draft_tokens
    spec = chain(k)
    raw = drafter.with_temperatures(np.ones(drafter.cfg.block_size))
    req = prepare(target, prompts, rounds * (k + 1), SamplingConfig(), [], None, 0, draft_nodes=spec.cache_slots)
    configured = raw.configure(Settings(spec, SamplingConfig(), req.lc.cache_len, req.lc.out_len))
    (conf_RBK, accepted_RB), _, _ = run_compiled(
        target, ("dspark_calibration", req.lc, configured, req.prompt_BT.shape, rounds), _rounds,
        (target.params, configured.params, jnp.asarray(req.prompt_BT), jnp.asarray(req.prompt_len_B)),
        {"lc": req.lc, "drafter": configured, "rounds": rounds})
    n = len(req.ids)
    conf_MK = np.asarray(conf_RBK)[:, :n].reshape(-1, k).astype(np.float64)
    accepted_M = np.asarray(accepted_RB)[:, :n].reshape(-1)
    c = np.clip(conf_MK, 1e-7, 1.0 - 1e-7)
    return np.log(c) - np.log1p(-c), accepted_M


def calibrate(target, drafter, prompts: Sequence, *, rounds: int = 16, num_draft_tokens: int | None = None,
              grid: np.ndarray = DEFAULT_GRID, num_bins: int = NUM_BINS):
    """Fit the drafter's confidence temperatures on held-out prompts: (calibrated drafter, CalibrationReport).

    Runs `collect_rounds` (greedy), then sequential temperature scaling. The returned drafter carries
    the temperatures in its params (`confidence_temperature`); `save_calibration` stores them.
    """
    if not getattr(drafter.cfg, "confidence", False):
        raise ValueError(f"drafter '{drafter.name}' has no confidence head to calibrate (a DSpark checkpoint with "
                         "enable_confidence_head true has one)")
    logits_MK, accepted_M = collect_rounds(target, drafter, prompts, rounds=rounds, num_draft_tokens=num_draft_tokens)
    report = fit_report(logits_MK, accepted_M, drafter.cfg.block_size, grid, num_bins)
    return drafter.with_temperatures(np.asarray(report.temperatures)), report


def save_calibration(report: CalibrationReport, directory: str | Path) -> Path:
    """Write `confidence_calibration.json` (temperatures and the report) into the drafter's directory."""
    path = Path(directory) / CALIBRATION_FILE
    payload = {"method": "sequential_temperature_scaling", **report.to_json()}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
