"""Turning logits into a token: greedy, or temperature / top-k / top-p sampling.

`sampling_logprobs` is the one definition of the distribution a sampler draws from;
verification applies the same function to target and draft logits, which is what
keeps speculative sampling exactly equal to plain sampling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from specjax.config import SamplingConfig


def sampling_logprobs(logits_XV: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p (masked entries are -inf).

    The order and rules of Hugging Face's warpers (Temperature, TopK, TopP): top-k keeps every
    token tied with the k-th logit; top-p follows TopPLogitsWarper position by position, so a
    tie group at the cut is split, lower token ids dropped first (torch.sort(stable=True) order).
    """
    logits_XV = logits_XV.astype(jnp.float32) / sampling.temperature
    if 0 < sampling.top_k < logits_XV.shape[-1]:
        kth_X1 = lax.top_k(logits_XV, sampling.top_k)[0][..., -1:]
        logits_XV = jnp.where(logits_XV < kth_X1, -jnp.inf, logits_XV)
    if sampling.top_p < 1.0:
        # Ascending stable sort; drop sorted positions whose cumulative mass is <= 1 - top_p,
        # never the last (most likely) one; scatter the decision back to token order.
        order_XV = jnp.argsort(logits_XV, axis=-1, stable=True)
        sorted_XV = jnp.take_along_axis(logits_XV, order_XV, axis=-1)
        cum_XV = jnp.cumsum(jax.nn.softmax(sorted_XV, axis=-1), axis=-1)
        drop_sorted_XV = (cum_XV <= 1.0 - sampling.top_p).at[..., -1].set(False)
        drop_XV = jnp.put_along_axis(jnp.zeros_like(drop_sorted_XV), order_XV, drop_sorted_XV,
                                     axis=-1, inplace=False)
        logits_XV = jnp.where(drop_XV, -jnp.inf, logits_XV)
    return jax.nn.log_softmax(logits_XV, axis=-1)


def row_keys(seeds_B: jax.Array, fold_B: jax.Array) -> jax.Array:
    """One PRNG key per row (a key array [B]): fold_in(key(seed_b), fold_b); see request.row_seeds."""
    return jax.vmap(lambda s, f: jax.random.fold_in(jax.random.key(s), f))(seeds_B, fold_B)


def split_rows(keys_B: jax.Array, num: int) -> jax.Array:
    """Split each row's key into `num` keys: [num, B]. A row's keys depend on its own key only."""
    return jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, num))(keys_B), 1, 0)


def sample_rows(keys_B: jax.Array, logp_BV: jax.Array) -> jax.Array:
    """One draw per row from log-probabilities [B, V], row b with its own key keys_B[b]."""
    return jax.vmap(jax.random.categorical)(keys_B, logp_BV).astype(jnp.int32)


def uniform_rows(keys_B: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniforms of shape [B, ...], row b drawn with its own key keys_B[b]."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(keys_B)


def choose_token(keys_B: jax.Array, logits_BV: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """One token per row: argmax when greedy, else a draw from `sampling_logprobs` with the row's own key."""
    if sampling.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return sample_rows(keys_B, sampling_logprobs(logits_BV, sampling))
