"""Turning logits into a token: greedy, or temperature / min-p / top-k / top-p sampling, each row its own.

`sampling_probs` is the one definition of the distribution a sampler draws from;
verification applies the same function to target and draft logits, which is what
keeps speculative sampling exactly equal to plain sampling. Its settings are data
(`RowSampling`, one value per row), so new values never compile the loop again and one
batch can mix greedy and sampled rows; a `SamplingConfig` stands for the same values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.config import SamplingConfig, row_column

# Top-k and top-p are decided among this many largest logits (one lax.top_k) when they hold every row's top_p mass
# and k-th largest; otherwise by a radix search over the whole vocabulary. Neither sorts it.
CANDIDATES = 64
# Cumulative sums along a row run over blocks of this many entries, then inside one block (_cumulative_count).
CUMULATIVE_BLOCK = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings as arrays [B] (data: changing them reuses the compiled loop)."""

    temperature: jax.Array  # float32; 0 = this row is greedy
    top_k: jax.Array  # int32; 0 = off
    top_p: jax.Array  # float32; 1 = off
    min_p: jax.Array  # float32; 0 = off

    @classmethod
    def of(cls, sampling: SamplingConfig, n_rows: int, batch: int) -> "RowSampling":
        """Host arrays for a batch of `batch` rows whose first n_rows are prompts (padding rows greedy)."""
        def column(name, dtype, pad):
            return row_column(sampling, name, n_rows, batch, dtype, pad)

        return cls(column("temperature", np.float32, 0.0), column("top_k", np.int32, 0),
                   column("top_p", np.float32, 1.0), column("min_p", np.float32, 0.0))


def as_rows(sampling: SamplingConfig | RowSampling, rows: int) -> RowSampling:
    """`sampling` as RowSampling for `rows` rows (a SamplingConfig's values repeated)."""
    if isinstance(sampling, RowSampling):
        return sampling
    return jax.tree.map(jnp.asarray, RowSampling.of(sampling.validate(), rows, rows))


def sampling_probs(logits_XV: jax.Array, sampling: SamplingConfig | RowSampling) -> jax.Array:
    """Probabilities after temperature, min-p, top-k and top-p (masked entries 0); a greedy row (temperature 0)
    gets all its mass on its argmax (first index among ties).

    Rows are the leading axis of logits_XV ([B, ...] with any axes between; row b uses sampling's entry b).
    Top-k keeps every token tied with the k-th logit (HF's TopKLogitsWarper); top-p follows TopPLogitsWarper
    position by position, so a tie group at the cut is split, lower token ids dropped first
    (torch.sort(stable=True) order); min-p keeps p >= min_p * max p (vLLM's MinPLogitsProcessor).
    Probabilities rather than log-probabilities, because every caller draws from them and keeps them as a
    draft's q; the filters share one exponential of the row (e = exp(z - max)) with the result.
    """
    lead, vocab = logits_XV.shape[:-1], logits_XV.shape[-1]
    rows = as_rows(sampling, lead[0])
    per_row_R = lambda x: jnp.broadcast_to(x.reshape((-1,) + (1,) * (len(lead) - 1)), lead).reshape(-1)  # noqa: E731
    temp_R, k_R, p_R, min_p_R = (per_row_R(x) for x in (rows.temperature, rows.top_k, rows.top_p, rows.min_p))
    raw_RV = logits_XV.reshape(-1, vocab).astype(jnp.float32)
    greedy_R = temp_R == 0.0
    z_RV = raw_RV / jnp.where(greedy_R, 1.0, temp_R)[:, None]
    filtered = jnp.any(~greedy_R & ((k_R > 0) & (k_R < vocab) | (p_R < 1.0) | (min_p_R > 0.0)))

    def filtered_probs():
        e_RV = jnp.exp(z_RV - jnp.max(z_RV, axis=-1, keepdims=True))  # the one exponential; the largest is kept
        kept_RV = jnp.where(_kept(z_RV, e_RV, k_R, p_R, min_p_R), e_RV, 0.0)
        return kept_RV / jnp.sum(kept_RV, axis=-1, keepdims=True)

    p_RV = lax.cond(filtered, filtered_probs, lambda: jax.nn.softmax(z_RV, axis=-1))

    def greedy_rows_one_hot():
        one_hot_RV = (jnp.arange(vocab) == jnp.argmax(raw_RV, axis=-1)[:, None]).astype(jnp.float32)
        return jnp.where(greedy_R[:, None], one_hot_RV, p_RV)

    p_RV = lax.cond(jnp.any(greedy_R), greedy_rows_one_hot, lambda: p_RV)
    return p_RV.reshape(logits_XV.shape)


def _kept(z_RV: jax.Array, e_RV: jax.Array, k_R: jax.Array, p_R: jax.Array, min_p_R: jax.Array) -> jax.Array:
    """bool [R, V]: the tokens min-p, top-k and top-p keep, per row, from the temperature-scaled logits z and
    e = exp(z - max z) (their masses, unnormalised).

    Decided among the CANDIDATES largest logits when they decide every row exactly, else by a radix search over
    the whole vocabulary; each way gives the same decisions (up to the rounding of cumulative sums). lax.top_k's
    cost grows with its k (on this CPU, [40, 4096]: 0.87 ms for 64, 2.6 ms for 256, the radix search's cut 1.0 ms;
    `python scripts/bench_sampling.py`), so the candidates are few: top_k <= 64 and peaked rows take them, flat
    rows under top_p the search. Rows the candidates surely cannot decide (top_k > 64, and top-p rows a cheap
    bound shows too flat) go to the search without the lax.top_k."""
    vocab = z_RV.shape[-1]
    m = min(vocab, CANDIDATES)
    top_k_on_R = (k_R > 0) & (k_R < vocab)
    top_p_alone_R = (p_R < 1.0) & ~top_k_on_R
    by_radix = lambda: _kept_by_radix(z_RV, e_RV, k_R, p_R, min_p_R)  # noqa: E731

    def among_candidates():
        kept_RV, exact_R = _kept_among_candidates(z_RV, e_RV, k_R, p_R, min_p_R, m)
        return lax.cond(jnp.all(exact_R), lambda: kept_RV, by_radix)

    too_flat_R = lax.cond(jnp.any(top_p_alone_R), lambda: top_p_alone_R & _too_flat(z_RV, e_RV, p_R, min_p_R, m),
                          lambda: jnp.zeros(k_R.shape, jnp.bool_))
    return lax.cond(jnp.any(top_k_on_R & (k_R > m) | too_flat_R), by_radix, among_candidates)


# Logit distances below a row's largest at which _too_flat bounds the mass of the m largest.
FLATNESS_GAPS = (1.0, 2.0, 4.0)


def _too_flat(z_RV: jax.Array, e_RV: jax.Array, p_R: jax.Array, min_p_R: jax.Array, m: int) -> jax.Array:
    """bool [R]: rows whose m largest logits surely hold less than top_p of the mass min-p leaves, found without
    lax.top_k (the candidates could not decide them; most rows of a flat model, the embedded target's need ~500
    tokens for 95%). For any t, the m largest hold at most the mass at or above t plus, when fewer than m tokens
    reach t, p(t) for each of the rest; the least of that over t = max - FLATNESS_GAPS. A bound, so a row it does
    not flag may still fall short of the candidates and be searched after them: it decides speed only.
    e_RV = exp(z - max z)."""
    max_R1 = jnp.max(z_RV, axis=-1, keepdims=True)
    e_RV = jnp.where(z_RV < _min_p_cut(z_RV, min_p_R)[:, None], 0.0, e_RV)
    bounds = []
    for gap in FLATNESS_GAPS:
        reached_RV = z_RV >= max_R1 - gap
        missing_R = jnp.maximum(m - jnp.sum(reached_RV, axis=-1), 0)
        bounds.append(jnp.sum(jnp.where(reached_RV, e_RV, 0.0), axis=-1) + missing_R * np.exp(-gap))
    return jnp.min(jnp.stack(bounds), axis=0) < p_R * jnp.sum(e_RV, axis=-1)


def _min_p_cut(z_RV: jax.Array, min_p_R: jax.Array) -> jax.Array:
    """min-p's threshold per row: p >= min_p * max p, i.e. z >= max z + log(min_p) (-inf when off). The max as a
    reduction: any slice of top_k's values other than the whole keeps XLA:CPU from lowering top_k to its TopK call
    (it sorts the vocabulary instead)."""
    return jnp.where(min_p_R > 0, jnp.max(z_RV, axis=-1) + jnp.log(jnp.maximum(min_p_R, 1e-30)), -jnp.inf)


def _kept_among_candidates(z_RV, e_RV, k_R, p_R, min_p_R, m: int) -> tuple[jax.Array, jax.Array]:
    """_kept decided among the m largest logits, and bool [R]: whether that decided the row exactly (its k-th
    largest among them, its top_p mass held by them)."""
    vocab = z_RV.shape[-1]
    vals_RM, idx_RM = lax.top_k(z_RV, m)  # descending; ties in ascending id
    top_k_on_R = (k_R > 0) & (k_R < vocab)
    # The k-th largest read from the candidates with a gather (XLA:CPU turns a slice of lax.top_k's values into
    # a full sort of the vocabulary).
    kth_R = jnp.take_along_axis(vals_RM, jnp.clip(k_R - 1, 0, m - 1)[:, None], axis=-1)[:, 0]
    cut_R1 = jnp.maximum(_min_p_cut(z_RV, min_p_R), jnp.where(top_k_on_R, kth_R, -jnp.inf))[:, None]
    kept_RV = z_RV >= cut_R1
    top_p_on_R = p_R < 1.0
    exact_R = ~(top_k_on_R & (k_R > m))

    def top_p():
        p_RV = _normalised(jnp.where(kept_RV, e_RV, 0.0))
        vals_cut_RM = jnp.where(vals_RM < cut_R1, -jnp.inf, vals_RM)
        keep_RV, decided_R = _top_p_among_candidates(z_RV, vals_cut_RM, idx_RM, p_R, p_RV)
        return kept_RV & (keep_RV | ~top_p_on_R[:, None]), exact_R & (decided_R | ~top_p_on_R)

    return lax.cond(jnp.any(top_p_on_R), top_p, lambda: (kept_RV, exact_R))


def _kept_by_radix(z_RV, e_RV, k_R, p_R, min_p_R) -> jax.Array:
    """_kept for any rows, without candidates: the k-th largest and the top-p cut by radix search."""
    vocab = z_RV.shape[-1]
    top_k_on_R = (k_R > 0) & (k_R < vocab)
    kth_R = lax.cond(jnp.any(top_k_on_R), lambda: _kth_by_radix(z_RV, jnp.maximum(k_R, 1)),
                     lambda: jnp.full(k_R.shape, -jnp.inf))
    cut_R = jnp.maximum(_min_p_cut(z_RV, min_p_R), jnp.where(top_k_on_R, kth_R, -jnp.inf))
    kept_RV = z_RV >= cut_R[:, None]
    top_p_on_R = p_R < 1.0

    def top_p():
        z_cut_RV = jnp.where(kept_RV, z_RV, -jnp.inf)
        p_RV = _normalised(jnp.where(kept_RV, e_RV, 0.0))
        return kept_RV & (_top_p_by_radix(z_cut_RV, p_R, p_RV) | ~top_p_on_R[:, None])

    return lax.cond(jnp.any(top_p_on_R), top_p, lambda: kept_RV)


def _normalised(w_RV: jax.Array) -> jax.Array:
    """Each row's weights scaled to sum to 1."""
    return w_RV / jnp.sum(w_RV, axis=-1, keepdims=True)


def _float_order_key(x_RV: jax.Array) -> jax.Array:
    """uint32 keys in the float32 order of x (an order-preserving bit image, used to bisect over values)."""
    bits_RV = lax.bitcast_convert_type(x_RV.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits_RV >> 31 == 1, ~bits_RV, bits_RV | jnp.uint32(0x80000000))


# The radix search's digits, high bits first: three passes over the 32 bits of the float order.
RADIX_BITS = (11, 11, 10)


def _largest_key_below(key_RV: jax.Array, weight_RV: jax.Array, limit_R: jax.Array) -> jax.Array:
    """Per row, the largest uint32 v whose entries with key < v weigh at most limit (weights >= 0).

    A radix search: one pass per digit of RADIX_BITS, each a histogram of the weights (one scatter-add over the
    row) among the entries whose higher bits equal the prefix found so far; the digit is the last bucket whose
    weight under it stays within the limit. Three passes of 2048 buckets beat four of 256 by ~20% on this CPU (the
    scatter-adds dominate; the bucket search is two-level, see _cumulative_count) and read the row once less on
    any device; a bisection (32 masked sums) is as fast here but reads the row 32 times. The weight below is
    summed from the smallest up, as the warper's ascending cumulative sum is."""
    rows = key_RV.shape[0]
    row_R1 = jnp.arange(rows)[:, None]
    prefix_R = jnp.zeros((rows,), jnp.uint32)
    below_R = jnp.zeros((rows,), weight_RV.dtype)  # the weight of the entries under the prefix's range
    shift = 32
    for bits in RADIX_BITS:
        shift -= bits
        inside_RV = True if shift + bits == 32 else (key_RV >> (shift + bits)) == prefix_R[:, None]
        digit_RV = ((key_RV >> shift) & ((1 << bits) - 1)).astype(jnp.int32)
        hist_RB = jnp.zeros((rows, 1 << bits), weight_RV.dtype).at[row_R1, digit_RV].add(
            jnp.where(inside_RV, weight_RV, 0))
        # the last bucket b whose weight under it (buckets < b) is within the limit: how many leading buckets,
        # the last one excluded, have a cumulative weight within it
        digit_R, under_R = _cumulative_count(hist_RB[:, :-1], limit_R - below_R)
        below_R = below_R + under_R
        prefix_R = (prefix_R << bits) | digit_R.astype(jnp.uint32)
    return prefix_R


def _cumulative_count(w_RX: jax.Array, u_R: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row, how many leading entries have an inclusive cumulative sum <= u (0..X), and their sum (w >= 0).

    In two levels, over blocks of CUMULATIVE_BLOCK entries and then inside one block: a cumulative sum along a
    whole row is a windowed reduction that cost 0.24 ms at [8, 4096] on this CPU. Exact up to the rounding of the
    sums (the block's own sum may differ from its entries' in the last bit)."""
    rows, x = w_RX.shape
    blocks = -(-x // CUMULATIVE_BLOCK)
    w_RKL = jnp.pad(w_RX, ((0, 0), (0, blocks * CUMULATIVE_BLOCK - x))).reshape(rows, blocks, CUMULATIVE_BLOCK)
    cum_RK = jnp.cumsum(jnp.sum(w_RKL, axis=-1), axis=-1)
    block_R = jnp.minimum(jnp.sum(cum_RK <= u_R[:, None], axis=-1), blocks - 1)  # the block where the count ends
    before_R = jnp.where(block_R > 0, jnp.take_along_axis(cum_RK, jnp.maximum(block_R - 1, 0)[:, None], -1)[:, 0], 0)
    inside_RL = jnp.cumsum(jnp.take_along_axis(w_RKL, block_R[:, None, None], axis=1)[:, 0], axis=-1)
    count_R = jnp.sum(inside_RL <= (u_R - before_R)[:, None], axis=-1)
    within_R = jnp.where(count_R > 0, jnp.take_along_axis(inside_RL, jnp.maximum(count_R - 1, 0)[:, None], -1)[:, 0], 0)
    return jnp.minimum(block_R * CUMULATIVE_BLOCK + count_R, x).astype(jnp.int32), before_R + within_R


def _kth_by_radix(z_RV: jax.Array, k_R: jax.Array) -> jax.Array:
    """The k-th largest value of each row, without a sort: the largest key with at most V - k entries under it
    (at least k at or above it; a radix search of counts), then the value at that key."""
    key_RV = _float_order_key(z_RV)
    vocab = z_RV.shape[-1]
    cut_R = _largest_key_below(key_RV, jnp.ones(z_RV.shape, jnp.float32), (vocab - k_R).astype(jnp.float32))
    # The value whose key is the cut: the smallest value with key >= it.
    return jnp.min(jnp.where(key_RV >= cut_R[:, None], z_RV, jnp.inf), axis=-1)


def _top_p_by_sort(logits_RV: jax.Array, top_p: float) -> jax.Array:
    """bool [R, V] kept by top-p, TopPLogitsWarper verbatim: an ascending stable sort; drop sorted positions whose
    cumulative mass is <= 1 - top_p, never the last (most likely) one; scatter the decision back to token order.
    The reference the two sort-free paths are tested against (a sort of the vocabulary is slow on every device)."""
    order_RV = jnp.argsort(logits_RV, axis=-1, stable=True)
    sorted_RV = jnp.take_along_axis(logits_RV, order_RV, axis=-1)
    cum_RV = jnp.cumsum(jax.nn.softmax(sorted_RV, axis=-1), axis=-1)
    drop_sorted_RV = (cum_RV <= 1.0 - top_p).at[..., -1].set(False)
    drop_RV = jnp.put_along_axis(jnp.zeros_like(drop_sorted_RV), order_RV, drop_sorted_RV, axis=-1, inplace=False)
    return ~drop_RV


def _top_p_by_radix(logits_RV: jax.Array, top_p_R: jax.Array, p_RV: jax.Array | None = None) -> jax.Array:
    """bool [R, V] kept by top-p for any row, without a sort: a radix search over the logits' float order.

    The cut falls in the tie group of the largest logit v whose tokens at or above it hold >= top_p of the mass
    (in the warper's terms: 1 - that mass <= 1 - top_p); tokens above v are kept, tokens below dropped, and within
    v's group a token is kept while the mass ranked before it (every larger logit, then the tied tokens of
    higher ids) leaves more than 1 - top_p after it. v is found by a radix search over the order-preserving uint32
    image of the float32 logits (`_largest_key_below`). p_RV: the logits' softmax, when the caller has it."""
    p_RV = jax.nn.softmax(logits_RV, axis=-1) if p_RV is None else p_RV
    key_RV = _float_order_key(logits_RV)
    top_p_R1 = jnp.broadcast_to(top_p_R, logits_RV.shape[:1])[:, None]

    # The cut: the largest key whose smaller logits hold at most 1 - top_p (the warper drops those).
    cut_R = _largest_key_below(key_RV, p_RV, 1.0 - top_p_R1[:, 0])
    below_R1 = jnp.sum(jnp.where(key_RV < cut_R[:, None], p_RV, 0.0), axis=-1, keepdims=True)
    tied_RV = key_RV == cut_R[:, None]
    p_tied_R1 = jnp.max(jnp.where(tied_RV, p_RV, 0.0), axis=-1, keepdims=True)
    # within the cut's tie group the warper's ascending stable order runs by token id: a tied token's ascending
    # cumulative mass is the mass below plus p for itself and each tied token of a lower id. A cut on a single token
    # (the usual case) skips that count's cumulative sum, which costs more than the search at [40, 4096].
    through_RV = lax.cond(jnp.any(jnp.sum(tied_RV, axis=-1) > 1), lambda: jnp.cumsum(tied_RV, axis=-1),
                          lambda: tied_RV.astype(jnp.int32))
    return (key_RV > cut_R[:, None]) | (tied_RV & (below_R1 + through_RV * p_tied_R1 > 1.0 - top_p_R1))


def _top_p_among_candidates(logits_RV: jax.Array, vals_RM: jax.Array, idx_RM: jax.Array, top_p_R: jax.Array,
                            p_RV: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """bool [R, V] kept by top-p, decided among the m largest logits (vals_RM, idx_RM: lax.top_k of logits_RV),
    and bool [R]: whether that is exact.

    The warper's ascending stable order, read from the top, is descending with ties in descending token id. A token
    is dropped iff the mass ranked after it there, read ascending (1 - the mass ranked before it from the top), is
    <= 1 - top_p. lax.top_k lists ties in ascending id, so within a tie group (equal logits, equal mass p) a
    token has before it the mass of every larger logit and p for each tied token of a higher id. Every token
    outside the candidates ranks below every candidate whose logit beats the m-th largest, so when those hold
    >= top_p of the mass, all others are dropped and the candidates alone decide (exact); the same when every
    token with mass is a candidate (top-k kept fewer than m). The decisions equal the sort's up to the rounding
    of the cumulative sums, summed here from the top down. p_RV: the logits' softmax, when the caller has it."""
    rows, vocab = logits_RV.shape
    m = vals_RM.shape[-1]
    top_p_R1 = jnp.broadcast_to(top_p_R, (rows,))[:, None]
    pos_M = jnp.arange(m)
    if p_RV is None:
        p_RM = jnp.exp(vals_RM - jax.nn.logsumexp(logits_RV, axis=-1, keepdims=True))
    else:  # a candidate cut away (-inf) has mass 0
        p_RM = jnp.where(vals_RM == -jnp.inf, 0.0, jnp.take_along_axis(p_RV, idx_RM, axis=-1))
    above_RM = jnp.cumsum(p_RM, axis=-1) - p_RM  # mass of the candidates listed before
    # Group boundaries: each value against its predecessor, read with a gather (a shifted slice or concatenation of
    # top_k's values makes XLA:CPU sort the whole vocabulary instead, 25x slower at [8, 4096]).
    prev_RM = jnp.take_along_axis(vals_RM, jnp.broadcast_to(jnp.maximum(pos_M - 1, 0), (rows, m)), axis=-1)
    starts_RM = (vals_RM != prev_RM) | (pos_M == 0)
    ends_RM = jnp.concatenate([starts_RM[:, 1:], jnp.ones((rows, 1), jnp.bool_)], axis=-1)
    first_RM = lax.cummax(jnp.where(starts_RM, pos_M, 0), axis=1)  # where each one's tie group starts
    last_RM = lax.cummin(jnp.where(ends_RM, pos_M, m - 1), axis=1, reverse=True)  # and ends
    group_above_RM = jnp.take_along_axis(above_RM, first_RM, axis=-1)
    before_RM = group_above_RM + (last_RM - pos_M) * p_RM
    keep_RM = 1.0 - before_RM > 1.0 - top_p_R1
    # The m-th largest logit's tie group may go on past the candidates: what ranks above it must hold top_p.
    exact_R = ((m == vocab) | (1.0 - group_above_RM[:, -1] <= 1.0 - top_p_R1[:, 0])
               | (jnp.min(vals_RM, axis=-1) == -jnp.inf))
    keep_RV = jnp.zeros((rows, vocab), jnp.bool_).at[jnp.arange(rows)[:, None], idx_RM].set(keep_RM)
    return keep_RV, exact_R


def row_keys(seeds_B: jax.Array, fold_B: jax.Array) -> jax.Array:
    """One PRNG key per row (a key array [B]): fold_in(key(seed_b), fold_b); see request.row_seeds."""
    return jax.vmap(lambda s, f: jax.random.fold_in(jax.random.key(s), f))(seeds_B, fold_B)


def split_rows(keys_B: jax.Array, num: int) -> jax.Array:
    """Split each row's key into `num` keys: [num, B]. A row's keys depend on its own key only."""
    return jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, num))(keys_B), 1, 0)


def sample_rows(keys_B: jax.Array, p_BV: jax.Array) -> jax.Array:
    """One draw per row from probabilities [B, V] (any non-negative weights), row b with its own key keys_B[b].

    By inversion: one uniform per row against the cumulative distribution (two-level, _cumulative_count), instead
    of a Gumbel noise per token (jax.random.categorical), which costs V random numbers a row and dominated sampled
    decoding on the CPU. A token of probability 0 is never drawn: the count stops at a token with mass, and where
    rounding carries it past one (u at the total, or at a block's end) the draw is the last token with mass
    before."""
    p_BV = p_BV.astype(jnp.float32)
    u_B = uniform_rows(keys_B, p_BV.shape[:1]) * jnp.sum(p_BV, axis=-1)
    count_B, _ = _cumulative_count(p_BV, u_B)
    ids_V = jnp.arange(p_BV.shape[-1])
    return jnp.max(jnp.where((p_BV > 0) & (ids_V <= count_B[:, None]), ids_V, 0), axis=-1).astype(jnp.int32)


def uniform_rows(keys_B: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniforms of shape [B, ...], row b drawn with its own key keys_B[b]."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(keys_B)


def choose_token(keys_B: jax.Array, logits_BV: jax.Array, sampling: SamplingConfig | RowSampling) -> jax.Array:
    """One token per row: argmax when `sampling` is a greedy SamplingConfig (the compiled greedy path), else a draw
    from `sampling_probs` with the row's own key (a greedy row among sampled ones draws its argmax)."""
    if isinstance(sampling, SamplingConfig) and sampling.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return sample_rows(keys_B, sampling_probs(logits_BV, sampling))
