"""The decoder shared by Llama 3.x, Qwen2/2.5, Qwen3, Mistral and Qwen3-MoE, as Flax NNX modules.

A layer's MLP half is a dense SwiGLU or, on a sparse layer of an MoE config, the mixture of experts of
models/moe.py (`PreNormMLP`).

The same `DecoderLayer` is Qwen3.5's gated full-attention layer (config flags: output gate, partial
rotary, zero-centred norms); the hybrid model that interleaves it with Gated DeltaNet layers is
models/hybrid.py.

`Decoder` declares its weights (`nnx.Param`, with logical axis names) and runs them; the loops use it
functionally: `nnx.split` once outside (a Target keeps the graphdef and the params as a plain dict of
arrays, whose tree matches the checkpoint's), `nnx.merge` inside the traced function, caches passed in
and returned. Two layer layouts: `layers` stacked on a leading axis (one `DecoderLayer` whose weights
are [L, ...], run under `lax.scan` with the cache carried, so compile time does not grow with depth: the
accelerator graph), or an `nnx.List` of per-layer modules (unrolled: on CPU, XLA copies a layer out of a
stacked array before its matmuls, tripling the memory traffic of batch-1 decode).

Hidden-state numbering follows Hugging Face: `capture=(i,)` returns the residual
stream entering layer i (= HF `hidden_states[i]`, 0 = embeddings); `i = num_layers`
returns the last layer's output before the final norm (HF's last hidden state is
already normed, ours is not); `POST_NORM` (-1) returns the final-normed state, the one the
lm_head scores (what vLLM and SGLang feed most MTP layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from specjax.config import ModelConfig
from specjax.models.cache import KVCache, init_cache
from specjax.models.layers import (
    apply_rope,
    cached_attention,
    causal_mask,
    normal,
    param,
    rms_norm,
    rope_inv_freq,
    swiglu,
)
from specjax.models.moe import MoeMLP
from specjax.models.sharding import constrain_cache

POST_NORM = -1  # a `capture` entry: the final-normed hidden state (the lm_head's input)


class PreNormMLP:
    """What every layer kind shares: this config's RMSNorm and the pre-norm MLP half: weights mlp_norm and
    either a dense SwiGLU (w_gate, w_up, w_down) or a mixture of experts (`moe`, models/moe.py)."""

    def norm(self, x: jax.Array, weight: nnx.Param) -> jax.Array:
        """RMSNorm by this config's convention (zero-centred for Qwen3.5)."""
        return rms_norm(x, weight[...], self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def init_mlp(self, cfg: ModelConfig, sparse: bool, rngs: nnx.Rngs, scale: float, lead=((), ())) -> None:
        """Declare the MLP half's weights: a dense SwiGLU, or the MoE when `sparse`."""
        shape, axes = lead
        d, f, dtype = cfg.hidden_size, cfg.intermediate_size, jnp.dtype(cfg.dtype)
        fill = jnp.zeros if cfg.norm_offset else jnp.ones  # a norm's identity: 1, or 0 when zero-centred
        self.mlp_norm = param(fill(shape + (d,), dtype), *axes, "embed")
        if sparse:
            self.moe = MoeMLP(cfg, rngs=rngs, scale=scale, lead=lead)
            self.w_gate = self.w_up = self.w_down = None
            return
        self.moe = None

        def weight(dims, *names):
            return param(normal(rngs, shape + dims, dtype, scale), *axes, *names)

        self.w_gate, self.w_up, self.w_down = weight((d, f), "embed", "mlp"), weight((d, f), "embed", "mlp"), \
            weight((f, d), "mlp", "embed")

    def mlp(self, h_BTD: jax.Array) -> jax.Array:
        """The MLP half: residual + SwiGLU (or the MoE) of the pre-normed stream."""
        x_BTD = self.norm(h_BTD, self.mlp_norm)
        if self.moe is not None:
            return h_BTD + self.moe(x_BTD)
        return h_BTD + swiglu(x_BTD, self.w_gate[...], self.w_up[...], self.w_down[...])


class DecoderLayer(PreNormMLP, nnx.Module):
    """One pre-norm layer: RoPE attention (optional q/k RMSNorm, q/k/v biases, output gate), then a SwiGLU MLP.

    in_features: the attention input's width (hidden size; an EAGLE-3 head's 2H concat). Without
    input_norm the layer has no attn_norm: its caller builds the normed input (EAGLE-3, DFlash).
    stacked=L: every weight gets a leading "layers" axis; L layers in one module, run by `run_layers`.
    sparse: the MLP half is the config's mixture of experts.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, in_features: int | None = None, input_norm: bool = True,
                 stacked: int | None = None, scale: float = 0.02, sparse: bool = False):
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        x = in_features or d
        qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd
        lead = () if stacked is None else (stacked,)
        lead_axis = () if stacked is None else ("layers",)
        dtype = jnp.dtype(cfg.dtype)

        def weight(shape, *axes):
            return param(normal(rngs, lead + shape, dtype, scale), *lead_axis, *axes)

        def ones(n, axis):  # a norm's identity: 1, or 0 for a zero-centred norm (x * (1 + w))
            fill = jnp.zeros if cfg.norm_offset else jnp.ones
            return param(fill(lead + (n,), dtype), *lead_axis, axis)

        def zeros(n, axis):
            return param(jnp.zeros(lead + (n,), dtype), *lead_axis, axis)

        self.attn_norm = ones(x, "embed") if input_norm else None
        self.wq, self.wk, self.wv = weight((x, qd), "embed", "heads"), weight((x, kvd), "embed", "kv_heads"), \
            weight((x, kvd), "embed", "kv_heads")
        self.wo = weight((qd, d), "heads", "embed")
        # Qwen3.5's gated attention: q_proj's per-head [query | gate] halves, the gate kept as its own matrix.
        self.wg = weight((x, qd), "embed", "heads") if cfg.attn_output_gate else None
        self.bq, self.bk, self.bv = (zeros(qd, "heads"), zeros(kvd, "kv_heads"), zeros(kvd, "kv_heads")) \
            if cfg.qkv_bias else (None, None, None)
        self.q_norm, self.k_norm = (ones(hd, None), ones(hd, None)) if cfg.qk_norm else (None, None)
        self.init_mlp(cfg, sparse, rngs, scale, (lead, lead_axis))

    def gate_output(self, o_BTHD: jax.Array, x_BTX: jax.Array) -> jax.Array:
        """Attention output times sigmoid(x @ wg) (Qwen3.5's output gate, from the same normed input as q);
        unchanged without a gate."""
        if self.wg is None:
            return o_BTHD
        return o_BTHD * jax.nn.sigmoid(x_BTX @ self.wg[...]).reshape(o_BTHD.shape)

    def qkv(self, h_BTD: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array):
        """The attention half of the layer up to attention itself: pre-norm, projections, q/k norms, RoPE."""
        return self.project_qkv(self.norm(h_BTD, self.attn_norm), positions_BT, inv_freq)

    def project_qkv(self, x_BTX: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array):
        """q/k/v from an input that is already normed (or fused): projections, biases, q/k norms, RoPE."""
        cfg = self.cfg
        b, t, _ = x_BTX.shape
        q, k, v = x_BTX @ self.wq[...], x_BTX @ self.wk[...], x_BTX @ self.wv[...]
        if cfg.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        q_BTHD = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k_BTKD = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v_BTKD = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q_BTHD, k_BTKD = self.norm(q_BTHD, self.q_norm), self.norm(k_BTKD, self.k_norm)
        q_BTHD, k_BTKD = apply_rope(q_BTHD, positions_BT, inv_freq), apply_rope(k_BTKD, positions_BT, inv_freq)
        if cfg.rope.attention_factor != 1.0:  # YaRN's magnitude scaling of the rotated q and k
            q_BTHD, k_BTKD = q_BTHD * cfg.rope.attention_factor, k_BTKD * cfg.rope.attention_factor
        return q_BTHD, k_BTKD, v_BTKD

    def attn_out_and_mlp(self, h_BTD: jax.Array, o_BTHD: jax.Array) -> jax.Array:
        """The rest of the layer after attention: output projection, residual, pre-norm SwiGLU MLP, residual."""
        b, t, _ = h_BTD.shape
        h_BTD = h_BTD + o_BTHD.reshape(b, t, -1) @ self.wo[...]
        return self.mlp(h_BTD)

    def __call__(self, h_BTD, k_cache, v_cache, layer, lengths_B, positions_BT, mask_BTR, inv_freq, attn_impl: str,
                 slot=0):
        """The layer over T new tokens written at window slot `slot` (see `cached_attention`); k/v_cache are the
        stacked cache (with `layer`) or this layer's own buffers (layer None)."""
        x_BTD = self.norm(h_BTD, self.attn_norm)
        q_BTHD, k_BTKD, v_BTKD = self.project_qkv(x_BTD, positions_BT, inv_freq)
        o_BTHD, k_cache, v_cache = cached_attention(q_BTHD, k_BTKD, v_BTKD, k_cache, v_cache, layer, lengths_B,
                                                    mask_BTR, attn_impl, slot)
        return self.attn_out_and_mlp(h_BTD, self.gate_output(o_BTHD, x_BTD)), k_cache, v_cache


def run_layers(layers, h_BTD: jax.Array, cache: KVCache, layer_fn, extra=None):
    """Run every layer in the layout `layers` and `cache` are in; returns (h, (k, v), extra).

    layers: an nnx.List of layer modules (unrolled) or one module with stacked weights (`lax.scan`, the
    cache carried so it is updated in place). layer_fn(layer, i, idx, h, k_cache, v_cache, extra) ->
    (h, k_cache, v_cache, extra): i is the layer index (a Python int when unrolled, traced under scan),
    idx what `cached_attention` takes: None with per-layer cache buffers (each layer's own), else the
    index into the stacked cache.
    """
    if isinstance(cache.k, tuple):  # per-layer cache buffers: each layer reads and writes its own
        if not isinstance(layers, nnx.List):
            raise ValueError("a per-layer KV cache needs per-layer weights (Decoder.with_layout(per_layer=True))")
        k, v = list(cache.k), list(cache.v)
        for i, layer in enumerate(layers):
            h_BTD, k[i], v[i], extra = layer_fn(layer, i, None, h_BTD, k[i], v[i], extra)
        return h_BTD, (tuple(k), tuple(v)), extra
    k, v = cache.k, cache.v
    if isinstance(layers, nnx.List):  # per-layer weights, stacked cache: unrolled
        for i, layer in enumerate(layers):
            h_BTD, k, v, extra = layer_fn(layer, i, jnp.int32(i), h_BTD, k, v, extra)
        return h_BTD, (k, v), extra
    graphdef, stacked = nnx.split(layers)

    def body(carry, xs):
        weights, i = xs
        h, k_cache, v_cache, extra = layer_fn(nnx.merge(graphdef, weights), i, i, *carry)
        return (h, k_cache, v_cache, extra), None

    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    (h_BTD, k, v, extra), _ = lax.scan(body, (h_BTD, k, v, extra), (stacked, jnp.arange(num_layers, dtype=jnp.int32)))
    return h_BTD, (k, v), extra


class Decoder(nnx.Module):
    """A dense decoder-only LM: embedding, layers, final RMSNorm, lm_head (tied to the embedding if the config says).

    `forward` runs new tokens after a cached prefix (what the loops call); `__call__` is the plain
    notebook forward: logits for every position of token ids, with a fresh cache.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, per_layer: bool = False, scale: float = 0.02):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed = param(normal(rngs, (v, d), dtype, scale), "vocab", "embed")
        if per_layer:
            self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, scale=scale, sparse=cfg.is_sparse(i))
                                    for i in range(cfg.num_layers)])
        elif cfg.mixed_layers:
            raise ValueError(f"a {cfg.family} model whose layers differ (dense and sparse MLPs) runs per-layer "
                             "weights: layout='per_layer'")
        else:
            self.layers = DecoderLayer(cfg, rngs=rngs, stacked=cfg.num_layers, scale=scale, sparse=cfg.is_sparse(0))
        self.final_norm = param(jnp.ones((d,), dtype), "embed")
        self.lm_head = None if cfg.tie_word_embeddings else param(normal(rngs, (d, v), dtype, scale), "embed", "vocab")

    @property
    def per_layer(self) -> bool:
        return isinstance(self.layers, nnx.List)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache in this model's layer layout (per-layer buffers for per-layer weights), split like its
        weights under the active mesh (models/sharding.py)."""
        return constrain_cache(init_cache(self.cfg, batch, max_len, per_layer=self.per_layer))

    def forward(self, tokens_BT: jax.Array, cache: KVCache, *, positions_BT: jax.Array | None = None,
                mask_BTT: jax.Array | None = None, capture: tuple[int, ...] = (), attn_impl: str = "auto",
                slot=0, provisional: bool = False, num_valid_B: jax.Array | None = None
                ) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache]:
        """Run T new tokens per row after each row's cached prefix.

        Writes their K/V at `cache.lengths[b] + t` but leaves `lengths` unchanged: the
        caller advances it (prefill, decode) or commits an accepted path (verify).
        positions default to `lengths + t`; mask_BTT (query i sees new token j) defaults to
        causal — a tree passes its ancestor mask and per-node positions instead.
        A dynamic tree's frontier runs T nodes at window slots `slot .. slot + T - 1` of a window of
        R expanded slots after the prefix, mask_BTT [B, T, R] marking what each may see (its
        ancestors and itself); attention then runs over the whole window, the one attention function
        (the Pallas kernel on GPU) unchanged.
        provisional (the new tokens are a draft to verify) and num_valid_B (right-padded tokens past it are
        padding) matter only to recurrent layers (models/hybrid.py); attention needs just the mask.
        Returns the final-normed hidden states [B, T, D], the captured hidden states
        (one [B, T, D] per entry of `capture`) and the updated cache.
        """
        cfg = self.cfg
        b, t = tokens_BT.shape
        lengths_B = cache.lengths
        if positions_BT is None:
            positions_BT = lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if mask_BTT is None:
            mask_BTT = jnp.broadcast_to(causal_mask(t), (b, t, t))
        inv_freq = rope_inv_freq(cfg.rope, cfg.rotary_dim)
        h_BTD = self.embed[...][tokens_BT]
        # One buffer slot per distinct captured layer, written by index as the layers run (in place in
        # the carry); a layer that is not captured maps to slot U, which mode="drop" discards.
        unique = sorted(set(i for i in capture if i != POST_NORM))
        captured_UBTD = jnp.zeros((len(unique), b, t, cfg.hidden_size), h_BTD.dtype)
        slot_of_layer = jnp.asarray([unique.index(i) if i in unique else len(unique)
                                     for i in range(cfg.num_layers + 1)], jnp.int32)

        def keep(captured, layer, h):
            """Record h as the hidden state entering `layer` (static int or traced) if it was asked for."""
            if not unique:  # nothing captured between layers (none asked for, or the post-norm state alone)
                return captured
            if isinstance(layer, int):
                return captured.at[unique.index(layer)].set(h) if layer in unique else captured
            return captured.at[slot_of_layer[layer]].set(h, mode="drop")

        def layer_fn(layer, i, idx, h, k_cache, v_cache, captured):
            captured = keep(captured, i, h)
            h, k_cache, v_cache = layer(h, k_cache, v_cache, idx, lengths_B, positions_BT, mask_BTT, inv_freq,
                                        attn_impl, slot)
            return h, k_cache, v_cache, captured

        h_BTD, (k, v), captured_UBTD = run_layers(self.layers, h_BTD, cache, layer_fn, captured_UBTD)
        captured_UBTD = keep(captured_UBTD, cfg.num_layers, h_BTD)
        out_BTD = rms_norm(h_BTD, self.final_norm[...], cfg.rms_norm_eps, cfg.norm_offset)
        picked = tuple(out_BTD if i == POST_NORM else captured_UBTD[unique.index(i)] for i in capture)
        return out_BTD, picked, KVCache(k, v, lengths_B)

    def logits(self, h_BTD: jax.Array) -> jax.Array:
        """Logits in fp32 from final-normed hidden states (tied embeddings when the config says so)."""
        if self.lm_head is None:  # contract with the [V, D] table as stored: a transposed view costs a copy on CPU
            return jnp.einsum("btd,vd->btv", h_BTD, self.embed[...], preferred_element_type=jnp.float32)
        return jnp.einsum("btd,dv->btv", h_BTD, self.lm_head[...], preferred_element_type=jnp.float32)

    def __call__(self, tokens_BT, attn_impl: str = "auto") -> jax.Array:
        """fp32 logits [B, T, V] for every position of `tokens_BT` (int ids), from an empty cache."""
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        cache = self.init_cache(tokens_BT.shape[0], tokens_BT.shape[1])
        h_BTD, _, _ = self.forward(tokens_BT, cache, attn_impl=attn_impl)
        return self.logits(h_BTD)


# ---- the module's state as plain dicts: what conversion, checkpoints, export and the loops pass around ----


def has_layer_list(params: dict) -> bool:
    """True when params hold per-layer weights (the CPU layout); loops then give them a per-layer cache too."""
    layers = params["layers"]
    return isinstance(layers, (list, tuple)) or (isinstance(layers, dict) and 0 in layers)


def layer_list(params: dict) -> list[dict]:
    """The per-layer weight dicts of per-layer params, in layer order."""
    layers = params["layers"]
    return list(layers) if isinstance(layers, (list, tuple)) else [layers[i] for i in range(len(layers))]


def unstack_layers(params: dict) -> dict:
    """Params with per-layer weights ({0: {...}, 1: {...}}, the nnx.List layout), whichever layout they are in."""
    if has_layer_list(params):
        return {**params, "layers": dict(enumerate(layer_list(params)))}
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    return {**params, "layers": {i: jax.tree.map(lambda x: x[i], stacked) for i in range(num_layers)}}


def stacked_layers(params: dict) -> dict:
    """The layer weights stacked on a leading axis, whichever layout params are in."""
    if not has_layer_list(params):
        return params["layers"]
    layers = layer_list(params)
    stack = np.stack if isinstance(jax.tree.leaves(layers)[0], np.ndarray) else jnp.stack
    return jax.tree.map(lambda *xs: stack(xs), *layers)


def with_layout(params: dict, per_layer: bool) -> dict:
    """Params in the per-layer or the stacked layout."""
    return unstack_layers(params) if per_layer else {**params, "layers": stacked_layers(params)}
