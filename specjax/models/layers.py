"""Parameter-free pieces of every layer (RMSNorm, RoPE, masks, cached attention) and the Param helper.

The modules in decoder.py and the drafters' networks declare their weights with `param`, which
attaches logical axis names (embed, heads, kv_heads, mlp, vocab, layers, experts) as sharding metadata, so a
mesh can map them without renaming anything. Nothing here holds state.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from specjax.config import RopeConfig
from specjax.kernels import attention
from specjax.models.cache import write_layer
from specjax.models.sharding import active_mesh


def param(value: jax.Array, *axes: str | None) -> nnx.Param:
    """An nnx.Param carrying one logical axis name per dimension (None: never sharded).

    Eager sharding stays off: the names are metadata until a mesh maps them (nothing is placed here).
    """
    if len(axes) != value.ndim:
        raise ValueError(f"a parameter of shape {value.shape} needs {value.ndim} axis names, got {axes}")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float) -> jax.Array:
    """normal(0, scale) drawn in fp32 from the rngs' params stream, then cast (random init for tests and training)."""
    return (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: bool = False) -> jax.Array:
    """RMSNorm in fp32, cast back before the scale (as Hugging Face's Llama does).

    offset: Qwen3.5's zero-centred form, x * (1 + w) with the scale applied in fp32 before the cast
    (transformers' Qwen3_5RMSNorm: "(x * w).to(float16)", not "x.to(float16) * w").
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def swiglu(x_BTD: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """The SwiGLU MLP every layer ends with: down(silu(x gate) * (x up))."""
    return (jax.nn.silu(x_BTD @ w_gate) * (x_BTD @ w_up)) @ w_down


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> jax.Array:
    """Inverse frequencies [head_dim/2], with `linear`, `llama3` or `yarn` scaling applied."""
    inv = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "yarn":
        return yarn_inv_freq(rope, head_dim, inv)
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)
    return inv


def yarn_inv_freq(rope: RopeConfig, head_dim: int, inv: jax.Array) -> jax.Array:
    """YaRN's frequencies: extrapolated (unchanged) for dims rotating more than beta_fast times over the original
    context, interpolated (/ factor) below beta_slow rotations, a linear ramp between (transformers'
    `_compute_yarn_parameters`, vLLM's YaRNScalingRotaryEmbedding)."""
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / \
            (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    extrapolated = 1.0 - ramp
    return inv / rope.factor * (1.0 - extrapolated) + inv * extrapolated


def apply_rope(x_BTHD: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout, not interleaved pairs) on the first 2 x len(inv_freq) dims of
    each head; the rest pass through (partial rotary, Qwen3.5)."""
    rot = 2 * inv_freq.shape[0]
    if rot < x_BTHD.shape[-1]:
        return jnp.concatenate([apply_rope(x_BTHD[..., :rot], positions_BT, inv_freq), x_BTHD[..., rot:]], axis=-1)
    angles_BTF = positions_BT[..., None].astype(jnp.float32) * inv_freq
    angles_BTD = jnp.concatenate([angles_BTF, angles_BTF], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles_BTD).astype(x_BTHD.dtype), jnp.sin(angles_BTD).astype(x_BTHD.dtype)
    half = x_BTHD.shape[-1] // 2
    rotated = jnp.concatenate([-x_BTHD[..., half:], x_BTHD[..., :half]], axis=-1)
    return x_BTHD * cos + rotated * sin


def causal_mask(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((t, t), jnp.bool_))


def cached_attention(q_BKHD, k_BKGD, v_BKGD, k_cache, v_cache, layer, base_B, mask_BKR, attn_impl: str, slot=0):
    """Write K new rows' K/V after each row's prefix and attend over the cache: every layer's core.

    The new rows go to window slots `slot .. slot + K - 1` (cache positions `base + slot + i`) of a
    window of R slots after the prefix; row i sees the prefix (< base) and the slots `mask_BKR[:, i]`
    marks. The plain case (slot 0, R = K) is a forward pass's T new tokens; a tree's frontier uses a
    wider window, so only its ancestors among the nodes already run are visible. k/v_cache are a
    stacked cache (with `layer`) or one layer's buffers (layer None). Returns (o_BKHD, k_cache, v_cache).
    """
    b, k = q_BKHD.shape[:2]
    r = mask_BKR.shape[-1]
    k_cache = write_layer(k_cache, layer, k_BKGD, base_B + slot)
    v_cache = write_layer(v_cache, layer, v_BKGD, base_B + slot)
    windowed = not (isinstance(slot, int) and slot == 0 and r == k)
    if windowed:  # the K queries at their slots of the R-row window; the other rows see nothing
        mask_BKR = lax.dynamic_update_slice(jnp.zeros((b, r, r), jnp.bool_), mask_BKR, (0, slot, 0))
        q_BKHD = lax.dynamic_update_slice(jnp.zeros((b, r, *q_BKHD.shape[2:]), q_BKHD.dtype), q_BKHD,
                                          (0, slot, 0, 0))
    # specjax caches start as zeros and only ever hold computed K/V: never NaN past a row's tokens.
    o = attention(q_BKHD, k_cache, v_cache, base_B, mask_BKR, layer=layer, impl=attn_impl, mesh=active_mesh(),
                  finite_cache=True)
    return (lax.dynamic_slice_in_dim(o, slot, k, axis=1) if windowed else o), k_cache, v_cache
