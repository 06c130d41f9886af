"""`specjax.sampling` against an independent numpy definition of temperature / top-k / top-p.

The reference follows Hugging Face's logits warpers (TemperatureLogitsWarper, then
TopKLogitsWarper, then TopPLogitsWarper): top-k keeps every token whose logit is at least
the k-th largest; top-p keeps the smallest set of highest-probability tokens whose
cumulative mass reaches top_p (always at least one token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import SamplingConfig
from specjax.sampling import choose_token, sampling_logprobs


def reference_probs(logits_V: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The sampling distribution for one row, in float64 numpy (HF semantics)."""
    z = logits_V.astype(np.float64) / temperature
    keep = np.ones(z.shape, bool)
    if top_k:
        kth = np.sort(z)[::-1][min(top_k, z.size) - 1]
        keep &= z >= kth
    if top_p < 1.0:
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        mass_before = np.cumsum(p[order]) - p[order]
        keep_sorted = mass_before < top_p  # the first token always has 0 mass before it
        top_p_keep = np.zeros(z.shape, bool)
        top_p_keep[order[keep_sorted]] = True
        keep &= top_p_keep
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return p / p.sum()


def _boundary_gap(logits_V: np.ndarray, temperature: float, top_k: int, top_p: float) -> float:
    """How far top_p sits from a cumulative-mass boundary (a tiny gap makes float32 vs float64 ambiguous)."""
    if top_p >= 1.0:
        return 1.0
    z = logits_V.astype(np.float64) / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    p = np.exp(z - z.max())
    p = np.sort(p / p.sum())[::-1]
    return float(np.min(np.abs(np.cumsum(p) - top_p)))


SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 5, 1.0),
    (1.0, 1, 1.0),
    (1.0, 0, 0.9),
    (0.5, 0, 0.5),
    (1.0, 0, 0.05),  # keeps only the top token
    (0.8, 20, 0.8),
    (2.0, 3, 0.95),
]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_sampling_logprobs_match_numpy_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits_XV = (rng.standard_normal((16, 50)) * 3.0).astype(np.float32)
    assert min(_boundary_gap(row, temperature, top_k, top_p) for row in logits_XV) > 1e-4
    got = np.exp(np.asarray(sampling_logprobs(jnp.asarray(logits_XV), SamplingConfig(temperature, top_k, top_p))))
    want = np.stack([reference_probs(row, temperature, top_k, top_p) for row in logits_XV])
    # Same support exactly, same probabilities up to float32 rounding.
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)


def test_top_k_keeps_ties_like_hugging_face():
    """Tokens tied with the k-th largest logit are all kept (HF compares against the k-th value)."""
    logits = jnp.asarray([[3.0, 1.0, 2.0, 2.0, 0.0]])
    probs = np.exp(np.asarray(sampling_logprobs(logits, SamplingConfig(1.0, top_k=2))))[0]
    np.testing.assert_array_equal(probs > 0, [True, False, True, True, False])


def test_top_p_keeps_at_least_the_most_likely_token():
    logits = jnp.asarray([[0.0, 5.0, 1.0, -2.0]])
    probs = np.exp(np.asarray(sampling_logprobs(logits, SamplingConfig(1.0, top_p=1e-6))))[0]
    np.testing.assert_allclose(probs, [0.0, 1.0, 0.0, 0.0])


def test_top_k_larger_than_vocab_is_off():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8)), jnp.float32)
    big = sampling_logprobs(logits, SamplingConfig(1.0, top_k=100))
    off = sampling_logprobs(logits, SamplingConfig(1.0, top_k=0))
    np.testing.assert_allclose(np.asarray(big), np.asarray(off))


def test_greedy_is_argmax():
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((8, 30)), jnp.float32)
    got = choose_token(jax.random.key(0), logits, SamplingConfig(0.0))
    np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), axis=-1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 1.0), (1.2, 0, 0.7), (1.0, 6, 0.9)])
def test_choose_token_draws_from_sampling_distribution(temperature, top_k, top_p):
    """Many draws with a vmapped batch of keys: empirical frequencies match the reference distribution.

    Deterministic (fixed keys). With n = 200k draws over 8 tokens the expected total
    variation from sampling noise is about 0.003; the bound 0.01 is > 3x that, while a
    wrong temperature, top-k or top-p changes the distribution by far more.
    """
    logits_V = np.asarray([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    want = reference_probs(logits_V, temperature, top_k, top_p)
    n = 200_000
    keys = jax.random.split(jax.random.key(1234), n)
    sampling = SamplingConfig(temperature, top_k, top_p)
    draws = jax.jit(jax.vmap(lambda k: choose_token(k, jnp.asarray(logits_V)[None], sampling)[0]))(keys)
    freq = np.bincount(np.asarray(draws), minlength=logits_V.size) / n
    assert np.all(freq[want == 0] == 0), f"drew masked tokens: freq {freq}, want {want}"
    tv = 0.5 * np.abs(freq - want).sum()
    assert tv < 0.01, f"total variation {tv:.4f}: freq {np.round(freq, 4)} vs want {np.round(want, 4)}"
    # Chi-square goodness of fit on the kept tokens (fixed seed, so this is not flaky).
    from scipy import stats

    kept = want > 0
    if kept.sum() > 1:
        counts = np.bincount(np.asarray(draws), minlength=logits_V.size)[kept]
        p_value = stats.chisquare(counts, want[kept] * n).pvalue
        assert p_value > 1e-3, f"chi-square p = {p_value}"
