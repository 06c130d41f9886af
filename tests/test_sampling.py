"""`specjax.decoding.sampling` against an independent numpy definition of temperature / top-k / top-p.

The reference follows Hugging Face's logits warpers (TemperatureLogitsWarper, then
TopKLogitsWarper, then TopPLogitsWarper): top-k keeps every token whose logit is at least
the k-th largest; top-p sorts ascending (stable: tied logits in token-id order), drops the
sorted positions whose cumulative mass is <= 1 - top_p and keeps the rest (always at least the
last, most likely one), so a tie group at the cut is split with the lower token ids dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import SamplingConfig
from specjax.decoding.sampling import choose_token, sampling_probs


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
        order = np.argsort(np.where(keep, z, -np.inf), kind="stable")
        drop_sorted = np.cumsum(p[order]) <= 1.0 - top_p
        drop_sorted[-1] = False  # the most likely token always stays
        keep[order[drop_sorted]] = False
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
def test_sampling_probs_match_numpy_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits_XV = (rng.standard_normal((16, 50)) * 3.0).astype(np.float32)
    assert min(_boundary_gap(row, temperature, top_k, top_p) for row in logits_XV) > 1e-4
    got = np.asarray(sampling_probs(jnp.asarray(logits_XV), SamplingConfig(temperature, top_k, top_p)))
    want = np.stack([reference_probs(row, temperature, top_k, top_p) for row in logits_XV])
    # Same support exactly, same probabilities up to float32 rounding.
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)


def _hf_probs(logits_XV: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Hugging Face's sampling distribution: generate()'s warpers, in generate()'s order."""
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.from_numpy(logits_XV.astype(np.float32))
    warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    for warper in warpers:
        scores = warper(None, scores)
    return torch.softmax(scores, dim=-1).numpy()


def _cut_gap(logits_V: np.ndarray, temperature: float, top_k: int, top_p: float) -> float:
    """Distance of 1 - top_p from the nearest ascending cumulative mass (float64)."""
    z = logits_V.astype(np.float64) / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    p = np.sort(np.exp(z - z.max()))
    return float(np.min(np.abs(np.cumsum(p / p.sum()) - (1.0 - top_p))))


def _inside_tie_top_p(logits_V: np.ndarray) -> float:
    """A top_p whose cut falls strictly inside the largest tie group (a split tie)."""
    z = np.sort(logits_V.astype(np.float64))
    cum = np.cumsum(np.exp(z - z.max()) / np.exp(z - z.max()).sum())
    values, counts = np.unique(z, return_counts=True)
    tied = values[np.argmax(counts * (counts > 1) * np.exp(values - values.max()))]
    first = int(np.searchsorted(z, tied))
    return float(1.0 - 0.5 * (cum[first] + cum[first + 1]))


def _tied_logits(seed: int, rows: int, vocab: int) -> np.ndarray:
    """Integer logits in a small range: many tie groups in every row."""
    return np.random.default_rng(seed).integers(-3, 3, size=(rows, vocab)).astype(np.float32)


HF_TIE_SETTINGS = [(1.0, 0), (0.7, 0), (1.0, 5), (1.5, 3), (0.8, 8)]


@pytest.mark.parametrize("temperature,top_k", HF_TIE_SETTINGS)
def test_top_p_ties_match_hugging_face_warpers(temperature, top_k):
    """Many ties, cuts inside tie groups: exactly the tokens transformers keeps, same probabilities.

    Vocab 12: torch.sort (default, unstable) keeps index order for rows of <= 16 entries on
    CPU, so this compares with the unmodified TopPLogitsWarper; the premise is asserted.
    """
    import torch

    logits_XV = _tied_logits(0, 6, 12)
    sorted_idx = torch.sort(torch.from_numpy(logits_XV / np.float32(temperature)))[1].numpy()
    assert (sorted_idx == np.argsort(logits_XV, axis=-1, kind="stable")).all()
    top_ps = [0.3, 0.5, 0.75, 0.9] + [_inside_tie_top_p(row) for row in logits_XV]
    for top_p in top_ps:
        assert min(_cut_gap(row, temperature, top_k, top_p) for row in logits_XV) > 1e-5
        got = np.asarray(sampling_probs(jnp.asarray(logits_XV), SamplingConfig(temperature, top_k, top_p)))
        want = _hf_probs(logits_XV, temperature, top_k, top_p)
        np.testing.assert_array_equal(got > 0, want > 0, err_msg=f"top_p={top_p}")
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
        ref = np.stack([reference_probs(r, temperature, top_k, top_p) for r in logits_XV])
        np.testing.assert_array_equal(ref > 0, want > 0, err_msg=f"numpy ref, top_p={top_p}")


@pytest.mark.parametrize("vocab", [50, 1000])
def test_top_p_ties_large_vocab_match_hugging_face(vocab, monkeypatch):
    """Large rows: torch's default CPU sort is not stable past 16 entries, so which tied ids
    transformers keeps is an artefact of its sort. How many of each tied value survive does not
    depend on that order (compared with the unmodified warper); the kept ids equal the warper's
    under torch.sort(stable=True), the order specjax reproduces."""
    import torch

    logits_XV = _tied_logits(1, 4, vocab)
    for top_p in [0.5, 0.9] + [_inside_tie_top_p(row) for row in logits_XV]:
        assert min(_cut_gap(row, 1.0, 0, top_p) for row in logits_XV) > 1e-5
        got = np.asarray(sampling_probs(jnp.asarray(logits_XV), SamplingConfig(1.0, 0, top_p)))
        want = _hf_probs(logits_XV, 1.0, 0, top_p)
        for g, w, row in zip(got, want, logits_XV):
            np.testing.assert_array_equal(np.sort(row[g > 0]), np.sort(row[w > 0]))
            np.testing.assert_allclose(np.sort(g[g > 0]), np.sort(w[w > 0]), atol=1e-6, rtol=1e-5)
        with monkeypatch.context() as m:
            sort = torch.sort
            m.setattr(torch, "sort", lambda *a, **kw: sort(*a, **kw, stable=True))
            want_stable = _hf_probs(logits_XV, 1.0, 0, top_p)
        np.testing.assert_array_equal(got > 0, want_stable > 0, err_msg=f"top_p={top_p}")
        np.testing.assert_allclose(got, want_stable, atol=1e-6, rtol=1e-5)


def test_top_p_splits_a_tie_group_like_hugging_face():
    """Four equal logits, top_p=0.6: HF drops the first tied id (cumulative 0.25 <= 0.4)."""
    logits = jnp.asarray([[1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 2.0, 1.0]])
    probs = np.asarray(sampling_probs(logits, SamplingConfig(1.0, top_p=0.6)))
    np.testing.assert_allclose(probs, [[0.0, 1 / 3, 1 / 3, 1 / 3], [0.0, 0.5, 0.5, 0.0]], rtol=1e-6)


def test_top_k_keeps_ties_like_hugging_face():
    """Tokens tied with the k-th largest logit are all kept (HF compares against the k-th value)."""
    logits = jnp.asarray([[3.0, 1.0, 2.0, 2.0, 0.0]])
    probs = np.asarray(sampling_probs(logits, SamplingConfig(1.0, top_k=2)))[0]
    np.testing.assert_array_equal(probs > 0, [True, False, True, True, False])


def test_top_p_keeps_at_least_the_most_likely_token():
    logits = jnp.asarray([[0.0, 5.0, 1.0, -2.0]])
    probs = np.asarray(sampling_probs(logits, SamplingConfig(1.0, top_p=1e-6)))[0]
    np.testing.assert_allclose(probs, [0.0, 1.0, 0.0, 0.0])


def test_top_k_larger_than_vocab_is_off():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8)), jnp.float32)
    big = sampling_probs(logits, SamplingConfig(1.0, top_k=100))
    off = sampling_probs(logits, SamplingConfig(1.0, top_k=0))
    np.testing.assert_allclose(np.asarray(big), np.asarray(off))


def test_greedy_is_argmax():
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((8, 30)), jnp.float32)
    got = choose_token(jax.random.split(jax.random.key(0), logits.shape[0]), logits, SamplingConfig(0.0))
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
    draws = jax.jit(jax.vmap(lambda k: choose_token(k[None], jnp.asarray(logits_V)[None], sampling)[0]))(keys)
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


@pytest.mark.parametrize("top_k", [0, 50, 100, 300])
def test_top_p_without_a_sort_equals_the_sort(top_k):
    """The candidate path (the 64 largest logits; also tried with 256) keeps exactly what the full stable sort keeps,
    and rows it cannot decide (flat rows, top_p near 1, top_k > 64) go to the radix search; through
    sampling_probs every row equals the sort."""
    from specjax.decoding import sampling

    rng = np.random.default_rng(3)
    scale = np.array([0.3, 1.0, 3.0, 6.0])[:, None].repeat(8, axis=0)  # flat to peaked rows
    logits_RV = jnp.asarray(rng.standard_normal((32, 4096)) * scale, jnp.float32)
    if top_k:
        kth = jax.lax.top_k(logits_RV, top_k)[0][:, -1:]
        logits_RV = jnp.where(logits_RV < kth, -jnp.inf, logits_RV)
    fast_seen = slow_seen = False
    for top_p in (0.3, 0.8, 0.95, 0.995):
        want = sampling._top_p_by_sort(logits_RV, top_p)
        for m in (sampling.CANDIDATES, 256):
            vals_RM, idx_RM = jax.lax.top_k(logits_RV, m)
            keep, exact = sampling._top_p_among_candidates(logits_RV, vals_RM, idx_RM, jnp.float32(top_p))
            exact = np.asarray(exact)
            np.testing.assert_array_equal(np.asarray(keep)[exact], np.asarray(want)[exact],
                                          err_msg=f"top_p={top_p}, {m} candidates")
            fast_seen |= exact.any()
            slow_seen |= (~exact).any()
        got = np.asarray(sampling_probs(logits_RV, SamplingConfig(1.0, top_k, top_p))) > 0
        np.testing.assert_array_equal(got, np.asarray(want), err_msg=f"top_p={top_p} through sampling_probs")
    # with top_k <= 64 every row fits among the fewest candidates
    assert fast_seen and (slow_seen or 0 < top_k <= sampling.CANDIDATES)


def test_sample_rows_never_draws_a_token_without_mass():
    """Inversion sampling skips zero-probability tokens, even at u -> 1 and with mass only at the ends."""
    from specjax.decoding.sampling import sample_rows

    p = jnp.asarray([[0.0, 0.5, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    keys = jax.random.split(jax.random.key(0), 3)
    for i in range(200):
        drawn = np.asarray(sample_rows(jax.vmap(lambda k: jax.random.fold_in(k, i))(keys), p))
        assert drawn[0] in (1, 3) and drawn[1] == 0 and drawn[2] == 4


@pytest.mark.parametrize("tied", [False, True])
def test_top_p_by_radix_equals_the_sort(tied):
    """The fallback for rows the candidates cannot decide: the same kept set as the warper's sort, for flat and
    peaked rows, with and without ties at the cut."""
    from specjax.decoding import sampling

    rng = np.random.default_rng(4)
    if tied:
        logits = np.concatenate([_tied_logits(5, 16, 300), np.full((16, 3), -np.inf, np.float32)], axis=-1)
    else:
        logits = (rng.standard_normal((16, 3000)) * np.array([0.2, 1.0, 3.0, 8.0]).repeat(4)[:, None]).astype(np.float32)
    for top_p in (0.1, 0.5, 0.9, 0.95, 0.999) + tuple(_inside_tie_top_p(r[np.isfinite(r)]) for r in logits[:3]):
        got = np.asarray(sampling._top_p_by_radix(jnp.asarray(logits), top_p))
        want = np.asarray(sampling._top_p_by_sort(jnp.asarray(logits), top_p))
        np.testing.assert_array_equal(got, want, err_msg=f"top_p={top_p}")


def test_kth_by_radix_equals_the_sorted_kth():
    """The radix search's k-th largest equals a sort's, with ties, -inf entries and k from 1 to the vocabulary."""
    from specjax.decoding import sampling

    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((6, 500)) * np.array([0.1, 1, 3, 10, 1, 1])[:, None]).astype(np.float32)
    logits[4] = np.round(logits[4], 1)  # many ties
    logits[5, ::3] = -np.inf
    for k in (1, 2, 65, 257, 333, 500):
        want = np.sort(logits, axis=-1)[:, ::-1][:, k - 1]
        got = np.asarray(sampling._kth_by_radix(jnp.asarray(logits), jnp.full((6,), k, jnp.int32)))
        np.testing.assert_array_equal(got, want, err_msg=f"k={k}")


def test_sample_rows_draws_each_token_at_its_probability_across_blocks():
    """The two-level inversion (blocks of CUMULATIVE_BLOCK tokens, then inside one): a 300-token row (five blocks, the last
    padded) with empty blocks and empty tokens inside used blocks, 200k draws: no token without mass is drawn and
    the counts fit the probabilities (chi-square, fixed keys)."""
    from scipy import stats

    from specjax.decoding.sampling import CUMULATIVE_BLOCK, sample_rows

    vocab = 300
    assert vocab % CUMULATIVE_BLOCK and vocab > 4 * CUMULATIVE_BLOCK
    p = np.random.default_rng(6).random(vocab) ** 3
    p[CUMULATIVE_BLOCK:2 * CUMULATIVE_BLOCK] = 0.0  # an empty block
    p[::7] = 0.0
    p[-1] = 0.05  # mass in the padded block's last real token
    p /= p.sum()
    n = 200_000
    draws = np.asarray(jax.jit(jax.vmap(lambda k: sample_rows(k[None], jnp.asarray(p, jnp.float32)[None])[0]))(
        jax.random.split(jax.random.key(7), n)))
    counts = np.bincount(draws, minlength=vocab)
    assert counts[p == 0].sum() == 0
    assert stats.chisquare(counts[p > 0], p[p > 0] * n).pvalue > 1e-3


def test_too_flat_only_flags_rows_the_candidates_cannot_decide():
    """The bound that sends flat top-p rows straight to the search: every row it flags is one the 64 candidates
    leave undecided (it is an upper bound on their mass), and on flat rows it flags most of them."""
    from specjax.decoding import sampling

    rng = np.random.default_rng(8)
    scale = np.array([0.3, 0.7, 1.0, 1.5, 2.0, 3.0, 6.0])[:, None].repeat(16, axis=0)
    logits = jnp.asarray(rng.standard_normal((len(scale), 4096)) * scale, jnp.float32)
    rows, m = logits.shape[0], sampling.CANDIDATES
    for top_p, min_p in ((0.5, 0.0), (0.9, 0.0), (0.95, 0.0), (0.95, 0.05)):
        p_R, min_p_R = jnp.full((rows,), top_p), jnp.full((rows,), min_p)
        z = jnp.where(logits < sampling._min_p_cut(logits, min_p_R)[:, None], -jnp.inf, logits)
        vals, idx = jax.lax.top_k(z, m)
        _, exact = sampling._top_p_among_candidates(z, vals, idx, p_R)
        e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        flat = np.asarray(sampling._too_flat(logits, e, p_R, min_p_R, m))
        exact = np.asarray(exact)
        assert not (flat & exact).any(), f"top_p={top_p}, min_p={min_p}: flagged a row the candidates decide"
        if top_p == 0.95 and min_p == 0.0:
            assert (~exact).sum() > rows // 4 and flat[~exact].mean() > 0.5
