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


def choose_token(key: jax.Array, logits_XV: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """One token per row: argmax when greedy, else a draw from `sampling_logprobs`."""
    if sampling.greedy:
        return jnp.argmax(logits_XV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, sampling_logprobs(logits_XV, sampling), axis=-1).astype(jnp.int32)
