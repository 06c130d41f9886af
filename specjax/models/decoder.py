"""The dense decoder shared by Llama 3.x, Qwen2/2.5, Qwen3 and Mistral, as pure functions.

Params are a nested dict; the per-layer weights are stacked on a leading axis and the
layers run under `lax.scan`, so compile time does not grow with depth (on CPU,
`unstack_layers` trades that for speed). The KV cache is carried through the layers and
written in place at each row's offset.

Hidden-state numbering follows Hugging Face: `capture=(i,)` returns the residual
stream entering layer i (= HF `hidden_states[i]`, 0 = embeddings); `i = num_layers`
returns the last layer's output before the final norm (HF's last hidden state is
already normed, ours is not: MTP heads want the pre-norm one).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from specjax.config import ModelConfig, RopeConfig
from specjax.kernels import attention
from specjax.models.cache import KVCache, write_layer


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32, cast back before the scale (as Hugging Face does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> jax.Array:
    """Inverse frequencies [head_dim/2], with `linear` or `llama3` scaling applied."""
    inv = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
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


def apply_rope(x_BTHD: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout, not interleaved pairs)."""
    angles_BTF = positions_BT[..., None].astype(jnp.float32) * inv_freq
    angles_BTD = jnp.concatenate([angles_BTF, angles_BTF], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles_BTD).astype(x_BTHD.dtype), jnp.sin(angles_BTD).astype(x_BTHD.dtype)
    half = x_BTHD.shape[-1] // 2
    rotated = jnp.concatenate([-x_BTHD[..., half:], x_BTHD[..., :half]], axis=-1)
    return x_BTHD * cos + rotated * sin


def causal_mask(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((t, t), jnp.bool_))


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
    o = attention(q_BKHD, k_cache, v_cache, base_B, mask_BKR, layer=layer, impl=attn_impl, finite_cache=True)
    return (lax.dynamic_slice_in_dim(o, slot, k, axis=1) if windowed else o), k_cache, v_cache


def _layer(cfg: ModelConfig, p: dict, layer: jax.Array | None, h_BTD, k_cache, v_cache, lengths_B, positions_BT,
           mask_BTT, inv_freq, attn_impl: str):
    """One layer; k/v_cache are the stacked cache (with `layer`) or this layer's own buffers (layer None)."""
    q_BTHD, k_BTKD, v_BTKD = qkv(cfg, p, h_BTD, positions_BT, inv_freq)
    o_BTHD, k_cache, v_cache = cached_attention(q_BTHD, k_BTKD, v_BTKD, k_cache, v_cache, layer, lengths_B, mask_BTT,
                                                attn_impl)
    return attn_out_and_mlp(cfg, p, h_BTD, o_BTHD), k_cache, v_cache


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens_BT: jax.Array,
    cache: KVCache,
    *,
    positions_BT: jax.Array | None = None,
    mask_BTT: jax.Array | None = None,
    capture: tuple[int, ...] = (),
    attn_impl: str = "auto",
) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache]:
    """Run T new tokens per row after each row's cached prefix.

    Writes their K/V at `cache.lengths[b] + t` but leaves `lengths` unchanged: the
    caller advances it (prefill, decode) or commits an accepted path (verify).
    positions default to `lengths + t`; mask_BTT (query i sees new token j) defaults to
    causal — a tree passes its ancestor mask and per-node positions instead.
    Returns the final-normed hidden states [B, T, D], the captured hidden states
    (one [B, T, D] per entry of `capture`) and the updated cache.
    """
    b, t = tokens_BT.shape
    lengths_B = cache.lengths
    if positions_BT is None:
        positions_BT = lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if mask_BTT is None:
        mask_BTT = jnp.broadcast_to(causal_mask(t), (b, t, t))
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    h_BTD = params["embed"][tokens_BT]
    # One buffer slot per distinct captured layer, written by index as the layers run (in place in
    # the carry); a layer that is not captured maps to slot U, which mode="drop" discards.
    unique = sorted(set(capture))
    captured_UBTD = jnp.zeros((len(unique), b, t, cfg.hidden_size), h_BTD.dtype)
    slot_of_layer = jnp.asarray([unique.index(i) if i in unique else len(unique) for i in range(cfg.num_layers + 1)],
                                jnp.int32)

    def keep(captured, layer, h):
        """Record h as the hidden state entering `layer` (static int or traced) if it was asked for."""
        if not capture:
            return captured
        if isinstance(layer, int):
            return captured.at[unique.index(layer)].set(h) if layer in unique else captured
        return captured.at[slot_of_layer[layer]].set(h, mode="drop")

    def layer_fn(p, i, layer, h, k_cache, v_cache, captured):
        captured = keep(captured, i, h)
        h, k_cache, v_cache = _layer(cfg, p, layer, h, k_cache, v_cache, lengths_B, positions_BT, mask_BTT,
                                     inv_freq, attn_impl)
        return h, k_cache, v_cache, captured

    h_BTD, (k, v), captured_UBTD = run_layers(params, cfg, h_BTD, cache, layer_fn, captured_UBTD)
    captured_UBTD = keep(captured_UBTD, cfg.num_layers, h_BTD)
    out_BTD = rms_norm(h_BTD, params["final_norm"], cfg.rms_norm_eps)
    return out_BTD, tuple(captured_UBTD[unique.index(i)] for i in capture), KVCache(k, v, lengths_B)


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
        for i, p in enumerate(params["layers"]):
            h_BTD, k[i], v[i], extra = layer_fn(p, i, None, h_BTD, k[i], v[i], extra)
        return h_BTD, (tuple(k), tuple(v)), extra
    k, v = cache.k, cache.v
    if has_layer_list(params):  # per-layer arrays, stacked cache: unrolled
        for i, p in enumerate(params["layers"]):
            h_BTD, k, v, extra = layer_fn(p, i, jnp.int32(i), h_BTD, k, v, extra)
        return h_BTD, (k, v), extra

    def body(carry, xs):
        p, i = xs
        h, k_cache, v_cache, extra = layer_fn(p, i, i, *carry)
        return (h, k_cache, v_cache, extra), None

    (h_BTD, k, v, extra), _ = lax.scan(body, (h_BTD, k, v, extra),
                                       (params["layers"], jnp.arange(cfg.num_layers, dtype=jnp.int32)))
    return h_BTD, (k, v), extra


def unstack_layers(params: dict) -> dict:
    """Params with the stacked layers split into a tuple of per-layer dicts (forward then unrolls them).

    On CPU, XLA copies each layer's weights out of a stacked array before its matmuls (a
    scan's slice, or even a static slice), tripling the memory traffic of batch-1 decode;
    separate arrays are read in place. On accelerators keep the stacked layout, the usual
    one there: the scan keeps compile time flat in depth.
    """
    if has_layer_list(params):
        return params
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    layers = tuple(jax.tree.map(lambda x: x[i], stacked) for i in range(num_layers))
    return {**params, "layers": layers}


def has_layer_list(params: dict) -> bool:
    """True when params hold per-layer arrays (the CPU layout); loops then give them a per-layer cache too."""
    return isinstance(params["layers"], (list, tuple))


def stacked_layers(params: dict) -> dict:
    """The layer weights stacked on a leading axis, whichever layout params are in."""
    layers = params["layers"]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers) if has_layer_list(params) else layers


def lm_head(params: dict, cfg: ModelConfig, h_BTD: jax.Array) -> jax.Array:
    """Logits in fp32 from final-normed hidden states (tied embeddings when the config says so)."""
    if cfg.tie_word_embeddings:  # contract with the [V, D] table as stored: a transposed view costs a copy on CPU
        return jnp.einsum("btd,vd->btv", h_BTD, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", h_BTD, params["lm_head"], preferred_element_type=jnp.float32)


def param_shapes(cfg: ModelConfig) -> dict:
    """The expected shape of every parameter: the contract conversion and init check against."""
    l, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = {
        "attn_norm": (l, d), "wq": (l, d, qd), "wk": (l, d, kvd), "wv": (l, d, kvd), "wo": (l, qd, d),
        "mlp_norm": (l, d), "w_gate": (l, d, f), "w_up": (l, d, f), "w_down": (l, f, d),
    }
    if cfg.qkv_bias:
        layers |= {"bq": (l, qd), "bk": (l, kvd), "bv": (l, kvd)}
    if cfg.qk_norm:
        layers |= {"q_norm": (l, cfg.head_dim), "k_norm": (l, cfg.head_dim)}
    shapes = {"embed": (cfg.vocab_size, d), "layers": layers, "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> dict:
    """Random params (normal(0, scale) matrices, unit norms, zero biases): for tests, benchmarks, training."""
    dtype = jnp.dtype(cfg.dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))

    def make(name: str, shape: tuple[int, ...], k: jax.Array) -> jax.Array:
        if "norm" in name:
            return jnp.ones(shape, dtype)
        if name in ("bq", "bk", "bv"):
            return jnp.zeros(shape, dtype)
        return (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [make(path[-1].key, shape, k)
                                                  for (path, shape), k in zip(leaves, keys)])
