"""TRANSITIONAL: the dict-based layer functions the drafters used before their networks became NNX modules.

Removed once every drafter runs on modules; nothing new may import it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from specjax.config import ModelConfig
from specjax.models.cache import KVCache
from specjax.models.decoder import has_layer_list, layer_list, stacked_layers
from specjax.models.layers import apply_rope, rms_norm


def qkv(cfg: ModelConfig, p: dict, h_BTD: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array):
    """The attention half of a layer up to attention itself: pre-norm, projections, q/k norms, RoPE."""
    return project_qkv(cfg, p, rms_norm(h_BTD, p["attn_norm"], cfg.rms_norm_eps), positions_BT, inv_freq)


def project_qkv(cfg: ModelConfig, p: dict, x_BTX: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array):
    """q/k/v from an input that is already normed (or fused): projections, biases, q/k norms, RoPE.

    The part of `qkv` after its pre-norm, for layers whose attention input is built some other
    way (an EAGLE-3 head projects concat(norm(embedding), norm(hidden)), width 2H). The input
    width is whatever the weights take.
    """
    b, t, _ = x_BTX.shape
    q, k, v = x_BTX @ p["wq"], x_BTX @ p["wk"], x_BTX @ p["wv"]
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q_BTHD = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k_BTKD = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v_BTKD = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q_BTHD = rms_norm(q_BTHD, p["q_norm"], cfg.rms_norm_eps)
        k_BTKD = rms_norm(k_BTKD, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q_BTHD, positions_BT, inv_freq), apply_rope(k_BTKD, positions_BT, inv_freq), v_BTKD


def attn_out_and_mlp(cfg: ModelConfig, p: dict, h_BTD: jax.Array, o_BTHD: jax.Array) -> jax.Array:
    """The rest of a layer after attention: output projection, residual, pre-norm SwiGLU MLP, residual."""
    b, t, _ = h_BTD.shape
    h_BTD = h_BTD + o_BTHD.reshape(b, t, -1) @ p["wo"]
    x_BTD = rms_norm(h_BTD, p["mlp_norm"], cfg.rms_norm_eps)
    return h_BTD + (jax.nn.silu(x_BTD @ p["w_gate"]) * (x_BTD @ p["w_up"])) @ p["w_down"]


def run_layers(params: dict, cfg: ModelConfig, h_BTD: jax.Array, cache: KVCache, layer_fn, extra=None):
    """Run every layer in the layout params and cache are in; returns (h, (k, v), extra).

    layer_fn(p, i, layer, h, k_cache, v_cache, extra) -> (h, k_cache, v_cache, extra), where i is the
    layer index (a Python int when unrolled, traced under scan) and `layer` what `cached_attention`
    takes: None with per-layer cache buffers (CPU; k/v_cache are that layer's own), else the index
    into the stacked cache. Per-layer weights are unrolled; stacked weights run under `lax.scan`
    with the cache carried, so it is updated in place.
    """
    if isinstance(cache.k, tuple):  # per-layer cache buffers: each layer reads and writes its own
        if not has_layer_list(params):
            raise ValueError("a per-layer KV cache needs per-layer params (models.decoder.unstack_layers)")
        k, v = list(cache.k), list(cache.v)
        for i, p in enumerate(layer_list(params)):
            h_BTD, k[i], v[i], extra = layer_fn(p, i, None, h_BTD, k[i], v[i], extra)
        return h_BTD, (tuple(k), tuple(v)), extra
    k, v = cache.k, cache.v
    if has_layer_list(params):  # per-layer arrays, stacked cache: unrolled
        for i, p in enumerate(layer_list(params)):
            h_BTD, k, v, extra = layer_fn(p, i, jnp.int32(i), h_BTD, k, v, extra)
        return h_BTD, (k, v), extra

    def body(carry, xs):
        p, i = xs
        h, k_cache, v_cache, extra = layer_fn(p, i, i, *carry)
        return (h, k_cache, v_cache, extra), None

    (h_BTD, k, v, extra), _ = lax.scan(body, (h_BTD, k, v, extra),
                                       (stacked_layers(params), jnp.arange(cfg.num_layers, dtype=jnp.int32)))
    return h_BTD, (k, v), extra
