"""The prefix scheduler: Algorithm 1 against a numpy reference, the width rule against brute force, and the
speculative loop with the scheduler on: greedy equality with plain decoding (ragged batch, EOS, budgets),
sampled losslessness (chi-square), verification cost that follows the drafter's confidences, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model
from test_lossless_sampling import NEW, PROMPT, ROWS, chi_square_passes, exact_distribution, tiny

import specjax
from specjax.config import SamplingConfig
from specjax.decoding.scheduler import cost_table, prefix_schedule, verify_widths, width_for, width_schedule
from specjax.planning.profile import CostModel

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 40
B, K = 6, 5
prefix_jit = jax.jit(prefix_schedule)
width_jit = jax.jit(width_schedule, static_argnums=3)


def algorithm1(conf_BK: np.ndarray, active_B: np.ndarray, seconds_T: np.ndarray) -> tuple[np.ndarray, set]:
    """Algorithm 1 in plain Python: (admitted per row, the admitted (r, j) set), one admission at a time."""
    a_BK = np.cumprod(np.clip(conf_BK, 0, 1), axis=1)
    items = sorted(((a_BK[r, j], r, j) for r in range(a_BK.shape[0]) if active_B[r] for j in range(a_BK.shape[1])),
                   key=lambda x: (-x[0], x[1] * a_BK.shape[1] + x[2]))
    rows = int(active_B.sum())
    tokens, tau = rows, float(rows)
    theta = tau / seconds_T[max(tokens, 1)]
    admitted = set()
    for a, r, j in items:
        new_theta = (tau + a) / seconds_T[tokens + 1]
        if not new_theta > theta:
            break
        tokens, tau, theta = tokens + 1, tau + a, new_theta
        admitted.add((r, j))
    len_B = np.zeros(a_BK.shape[0], int)
    for r, _ in admitted:
        len_B[r] += 1
    return len_B, admitted


def random_case(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Confidences (some exact ties and 1s), activity, and a cost curve with an intercept, a knee and a slope."""
    rng = np.random.default_rng(seed)
    conf = rng.choice([rng.uniform(0.2, 1.0), 1.0, 0.9], size=(B, K), p=[0.6, 0.2, 0.2]) if seed % 3 == 0 \
        else rng.uniform(0.0, 1.0, (B, K)) ** rng.uniform(0.2, 1.0)
    active = rng.random(B) < 0.8
    knee, slope = rng.uniform(2, 20), rng.uniform(0.01, 0.3)
    secs = np.array([1.0 + slope * max(t - knee, 0.0) for t in range(B * (K + 1) + 1)], np.float32)
    return conf.astype(np.float32), active, secs


@pytest.mark.parametrize("seed", range(12))
def test_prefix_schedule_is_algorithm_1_and_admits_prefixes(seed):
    conf, active, secs = random_case(seed)
    got = np.asarray(prefix_jit(jnp.asarray(conf), jnp.asarray(active), jnp.asarray(secs)))
    want, admitted = algorithm1(conf, active, secs)
    np.testing.assert_array_equal(got, want)
    for r in range(B):  # a prefix: drafts 1..len of the row and nothing else
        assert {j for rr, j in admitted if rr == r} == set(range(want[r]))
    assert np.all(got[~active] == 0)


def test_flat_curve_admits_everything_and_steep_curve_only_the_best():
    conf = np.full((B, K), 0.8, np.float32)
    active = np.array([1, 1, 1, 0, 1, 1], bool)
    flat = np.ones(B * (K + 1) + 1, np.float32)
    got = np.asarray(prefix_jit(jnp.asarray(conf), jnp.asarray(active), jnp.asarray(flat)))
    np.testing.assert_array_equal(got, np.where(active, K, 0))
    steep = np.arange(B * (K + 1) + 1, dtype=np.float32) + 1.0  # seconds = tokens + 1: only a > Theta pays
    conf[1, :] = 0.99
    got = np.asarray(prefix_jit(jnp.asarray(conf), jnp.asarray(active), jnp.asarray(steep)))
    assert got[1] >= 1 and got.sum() <= 2 * K and np.all(got[[0, 2, 4, 5]] <= got[1])
    np.testing.assert_array_equal(got, algorithm1(conf, active, steep)[0])
    linear = np.maximum(np.arange(B * (K + 1) + 1, dtype=np.float32), 1.0)  # pure compute: nothing below 1 pays
    assert np.asarray(prefix_jit(jnp.asarray(conf), jnp.asarray(active), jnp.asarray(linear))).sum() == 0
    nobody = np.zeros(B, bool)
    assert np.asarray(prefix_jit(jnp.asarray(conf), jnp.asarray(nobody), jnp.asarray(flat))).sum() == 0


@pytest.mark.parametrize("seed", range(8))
def test_width_schedule_is_the_best_width_at_the_cost_paid(seed):
    conf, active, secs = random_case(seed)
    widths = verify_widths(K + 1)
    choice, len_B = width_jit(jnp.asarray(conf), jnp.asarray(active), jnp.asarray(secs), widths)
    a = np.cumprod(conf, axis=1)
    theta = [(active.sum() + a[active, : w - 1].sum()) / secs[B * w] for w in widths]
    assert int(choice) == int(np.argmax(theta))
    np.testing.assert_array_equal(np.asarray(len_B), np.where(active, min(widths[int(choice)] - 1, K), 0))


def test_widths_and_cost_table():
    assert verify_widths(1) == (1,) and verify_widths(7) == (1, 2, 4, 7) and verify_widths(9) == (1, 2, 4, 8, 9)
    assert int(width_for(jnp.array([0, 2, 1]), (1, 2, 4, 7))) == 2  # 3 nodes need width 4
    table = cost_table(lambda b, n: 1.0 + max(b * n - 4, 0) - 0.1 * (b * n == 6), 2, 4)
    assert table.shape == (9,) and table[0] == table[1] == 1.0 and np.all(np.diff(table) >= 0)


# ---------------------------------------------------------------- the loop with the scheduler on


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = build_hf_model("llama", seed=0, tie_word_embeddings=False)
    return specjax.load(save_hf_model(model, tmp_path_factory.mktemp("target")))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 23, 1)]


@pytest.fixture(scope="module")
def plain(target, prompts):
    return specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])


def knee_cost(knee: float, slope: float) -> CostModel:
    """A synthetic compute-bound curve: flat up to `knee` tokens per pass, then `slope` per token."""
    return CostModel(lambda b, n: 1.0 + slope * max(b * n - knee, 0.0), lambda b, d: 0.0, f"knee {knee}")


@pytest.mark.parametrize("mode", ["confidence", "prefix"])
def test_greedy_with_the_scheduler_equals_plain(target, prompts, plain, mode):
    """Ragged prompts, per-row acceptance, noisy confidences; then EOS inside a run and a smaller budget."""
    drafter = specjax.replay_drafter(plain.tokens, target.cfg.vocab_size, [0.1, 0.5, 0.9], confidence=True,
                                     confidence_noise=0.2)
    kw = dict(drafter=drafter, num_draft_tokens=6, scheduler=mode, scheduler_profile=knee_cost(8, 0.1))
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], **kw)
    assert out.tokens == plain.tokens
    assert out.stats["scheduler"]["mode"] == mode and out.stats["scheduler"]["cost"] == "knee 8"
    widths = out.stats["verified_width_rounds"]
    assert sum(widths.values()) == out.stats["rounds"] and set(widths) <= {1, 2, 4, 7}
    assert out.stats["verified_tokens_per_round"] <= out.stats["padded_tokens_per_round"] < 4 * 7
    eos = plain.tokens[1][12]
    want = specjax.generate(target, prompts, max_new_tokens=MAX_NEW - 11, eos_token_id=eos)
    got = specjax.generate(target, prompts, max_new_tokens=MAX_NEW - 11, eos_token_id=eos, **kw)
    assert got.tokens == want.tokens and any(len(t) < MAX_NEW - 11 for t in got.tokens)


def test_verification_width_follows_confidence(target, prompts, plain):
    """Same drafts, same cost curve: confident drafts get wide passes, doubtful ones narrow passes."""
    stats = {}
    for p in (0.05, 0.7):
        drafter = specjax.replay_drafter(plain.tokens, target.cfg.vocab_size, p, confidence=True)
        out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                               num_draft_tokens=6, scheduler="confidence", scheduler_profile=knee_cost(4, 0.2))
        assert out.tokens == plain.tokens
        stats[p] = out.stats
    assert stats[0.7]["padded_tokens_per_round"] < stats[0.05]["padded_tokens_per_round"]
    assert stats[0.7]["verified_tokens_per_round"] < stats[0.05]["verified_tokens_per_round"]
    assert max(stats[0.05]["verified_width_rounds"]) > max(stats[0.7]["verified_width_rounds"])


def test_default_cost_says_where_it_came_from(target, prompts, plain, monkeypatch):
    monkeypatch.delenv("SPECJAX_PROFILE", raising=False)
    drafter = specjax.replay_drafter(plain.tokens, target.cfg.vocab_size, 0.3, confidence=True)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                           num_draft_tokens=6, scheduler="confidence")
    assert out.tokens == plain.tokens
    assert out.stats["scheduler"]["cost"].startswith("estimate: roofline") and "unset" in out.stats["scheduler"]["cost"]


def test_measured_cost_times_each_width_once(target):
    """scheduler_profile="measure": verify rounds of this target timed at this batch and every width, cached."""
    from specjax.planning.scheduler_cost import scheduler_cost

    cost = scheduler_cost(target, "measure", 2, (1, 2, 4), 64)
    assert cost.source.startswith("measured now at batch 2, widths [1, 2, 4]")
    assert all(cost.verify_s(2, w) > 0 for w in (1, 2, 4))
    assert scheduler_cost(target, "measure", 2, (1, 2, 4), 64).verify_s(2, 4) == cost.verify_s(2, 4)  # cached


def test_scheduler_errors(target, prompts, plain):
    replay = specjax.replay_drafter(plain.tokens, target.cfg.vocab_size, 0.3)
    with pytest.raises(ValueError, match="confidences"):
        specjax.generate(target, prompts, max_new_tokens=8, drafter=replay, num_draft_tokens=3, scheduler="prefix")
    confident = specjax.replay_drafter(plain.tokens, target.cfg.vocab_size, 0.3, confidence=True)
    with pytest.raises(ValueError, match="chain"):
        specjax.generate(target, prompts, max_new_tokens=8, drafter=confident, tree="kary:2,1", scheduler="prefix")
    with pytest.raises(ValueError, match="scheduler must be one of"):
        specjax.generate(target, prompts, max_new_tokens=8, drafter=confident, num_draft_tokens=3, scheduler="dspark")
    with pytest.raises(ValueError, match="no drafter"):
        specjax.generate(target, prompts, max_new_tokens=8, scheduler="confidence")
    with pytest.raises(ValueError, match="scheduler_profile"):
        specjax.generate(target, prompts, max_new_tokens=8, drafter=confident, num_draft_tokens=3,
                         scheduler_profile="roofline")
    with pytest.raises(ValueError, match="one per continuation"):
        specjax.replay_drafter(plain.tokens, target.cfg.vocab_size, [0.1, 0.2])


@pytest.mark.parametrize("mode", ["prefix", "confidence"])
def test_sampled_output_with_the_scheduler_has_the_target_distribution(mode):
    """Rows admit different prefixes (per-row rates, noisy confidences, a knee mid-batch): still exact sampling."""
    model = tiny(0, layers=2)
    sampling = SamplingConfig(1.0)
    rng = np.random.default_rng(5)
    reference = [rng.integers(0, 6, NEW).tolist() for _ in range(ROWS)]
    rates = rng.uniform(0.0, 0.9, ROWS).tolist()
    drafter = specjax.replay_drafter(reference, 6, rates, confidence=True, confidence_noise=0.3)
    cost = knee_cost(ROWS * 1.5, 1.0 / ROWS) if mode == "prefix" else knee_cost(ROWS * 1.5, 0.5 / ROWS)
    out = specjax.generate(model, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=1.0, seed=17, drafter=drafter,
                           num_draft_tokens=3, scheduler=mode, scheduler_profile=cost, eos_token_id=[])
    ok, stat, threshold = chi_square_passes(np.array(out.tokens), exact_distribution(model, sampling))
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}: sampled output is not the target's distribution"
    offered = out.stats["offered_at_depth"]
    assert out.stats["acceptance_length"] > 1.0 and offered[0] > 0
    if mode == "prefix":  # rows really were cut differently in the same rounds (the budget allows one draft)
        assert 0 < offered[0] < sum(out.stats["row_rounds"])


def test_bench_script_quick(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_scheduler.py"), "--quick", "--out",
                             str(tmp_path / "b.json")], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "b.json").read_text())
    assert {r["config"] for r in data["rows"]} >= {"chain:1", "chain:3", "sched-confidence/measured"}
    assert data["packed"] and all(p["packed_ms"] > 0 for p in data["packed"])
