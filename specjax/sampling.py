"""Turning logits into a token: greedy, or temperature / top-k / top-p sampling.

`sampling_logprobs` is the one definition of the distribution a sampler draws from;
verification applies the same function to target and draft logits, which is what
keeps speculative sampling exactly equal to plain sampling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .config import SamplingConfig


def sampling_logprobs(logits_XV: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p (masked entries are -inf)."""
    logits_XV = logits_XV.astype(jnp.float32) / sampling.temperature
    if 0 < sampling.top_k < logits_XV.shape[-1]:
        kth_X1 = lax.top_k(logits_XV, sampling.top_k)[0][..., -1:]
        logits_XV = jnp.where(logits_XV < kth_X1, -jnp.inf, logits_XV)
    if sampling.top_p < 1.0:
        sorted_XV = jnp.sort(logits_XV, axis=-1)[..., ::-1]
        probs_XV = jax.nn.softmax(sorted_XV, axis=-1)
        mass_before_XV = jnp.cumsum(probs_XV, axis=-1) - probs_XV
        # Keep the smallest prefix of the sorted tokens whose mass reaches top_p.
        kept_XV = mass_before_XV < sampling.top_p
        threshold_X1 = jnp.min(jnp.where(kept_XV, sorted_XV, jnp.inf), axis=-1, keepdims=True)
        logits_XV = jnp.where(logits_XV < threshold_X1, -jnp.inf, logits_XV)
    return jax.nn.log_softmax(logits_XV, axis=-1)


def row_keys(key: jax.Array, batch: int) -> jax.Array:
    """One key per batch row, derived from the row index: a row's draws do not depend on the batch around it."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))


def sample_rows(key: jax.Array, logp_BV: jax.Array) -> jax.Array:
    """One draw per row from log-probabilities [B, V], with per-row keys."""
    draw = jax.vmap(lambda k, lp: jax.random.categorical(k, lp))
    return draw(row_keys(key, logp_BV.shape[0]), logp_BV).astype(jnp.int32)


def uniform_rows(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniforms of shape [B, ...], with per-row keys."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(row_keys(key, shape[0]))


def choose_token(key: jax.Array, logits_BV: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """One token per row: argmax when greedy, else a draw from `sampling_logprobs`."""
    if sampling.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return sample_rows(key, sampling_logprobs(logits_BV, sampling))
