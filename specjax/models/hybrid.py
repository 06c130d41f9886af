"""Qwen3.5's hybrid decoder: Gated DeltaNet layers interleaved with gated full-attention layers (Flax NNX).

Follows transformers' models/qwen3_5/modeling_qwen3_5.py (the reference the tests run). The full-attention
layers are `DecoderLayer`s with the output gate, partial rotary and zero-centred norms; the linear-attention
layers are `GatedDeltaNetLayer` below, its delta rule in models/gdn.py. The cache is a `HybridCache`.

A forward runs in one of two modes:
* sequential (prefill, plain decoding): the new tokens extend every row; DeltaNet layers advance their conv
  window and state (chunked form for T > 1, the recurrence for T = 1). Right-padded tokens past
  `num_valid_B` leave the state as it is (decay 0, beta 0) and stay out of the conv window.
* provisional (`provisional=True`, verification): the new tokens are a draft tree under `mask_BTT`; each
  node's output follows its root-to-node path, the state stays as it was, and per-node results go to
  `cache.nodes` for `HybridCache.commit`.

Layers run unrolled from an `nnx.List` (one module per layer, two kinds), in every backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ModelConfig
from specjax.models.cache import HybridCache, KVCache, NodeResults, init_cache
from specjax.models.decoder import POST_NORM, Decoder, DecoderLayer, PreNormMLP
from specjax.models.gdn import (
    chunked_rule,
    conv_sequence,
    conv_tree,
    conv_window,
    expand_heads,
    l2_normalize,
    masked_block,
    recurrent_step,
)
from specjax.models.layers import causal_mask, normal, param, rms_norm, rope_inv_freq
from specjax.models.sharding import constrain_cache


class GatedDeltaNetLayer(PreNormMLP, nnx.Module):
    """A pre-norm Gated DeltaNet token mixer, then the SwiGLU MLP (transformers' Qwen3_5GatedDeltaNet + MLP).

    Weights as [in, out]: w_qkv [D, C] (C = 2 Hk dk + Hv dv, the conv's channels), w_z [D, Hv dv] (the
    output gate), w_b / w_a [D, Hv] (beta and the decay's input), conv_w [K, C], dt_bias and A_log [Hv],
    out_norm [dv] (a plain RMSNorm weight, not zero-centred), w_out [Hv dv, D].
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, scale: float = 0.02, sparse: bool = False):
        self.cfg = cfg
        lin = cfg.linear
        d, dtype = cfg.hidden_size, jnp.dtype(cfg.dtype)

        def weight(shape, *axes):
            return param(normal(rngs, shape, dtype, scale), *axes)

        def zeros(n, axis):
            return param(jnp.zeros((n,), dtype), axis)

        self.attn_norm = zeros(d, "embed")
        self.w_qkv = weight((d, lin.conv_dim), "embed", "conv")
        self.w_z = weight((d, lin.value_dim), "embed", "v_heads")
        self.w_b = weight((d, lin.num_value_heads), "embed", "v_heads")
        self.w_a = weight((d, lin.num_value_heads), "embed", "v_heads")
        self.conv_w = weight((lin.conv_kernel, lin.conv_dim), None, "conv")
        self.dt_bias = param(jnp.ones((lin.num_value_heads,), dtype), "v_heads")
        self.A_log = param(jnp.log(jnp.linspace(1.0, 16.0, lin.num_value_heads)).astype(dtype), "v_heads")
        self.out_norm = param(jnp.ones((lin.value_head_dim,), dtype), None)
        self.w_out = weight((lin.value_dim, d), "v_heads", "embed")
        self.init_mlp(cfg, sparse, rngs, scale)

    def inputs(self, mixed_BTC: jax.Array, x_BTD: jax.Array, valid_BT: jax.Array | None):
        """After the conv: fp32 q (normed, scaled), k (normed) on the value heads, v, decay g and beta."""
        lin = self.cfg.linear
        b, t, _ = mixed_BTC.shape
        q, k, v = jnp.split(mixed_BTC, [lin.key_dim, 2 * lin.key_dim], axis=-1)
        q_BTHK = expand_heads(l2_normalize(q.reshape(b, t, lin.num_key_heads, -1).astype(jnp.float32)),
                              lin.num_value_heads) * lin.key_head_dim ** -0.5
        k_BTHK = expand_heads(l2_normalize(k.reshape(b, t, lin.num_key_heads, -1).astype(jnp.float32)),
                              lin.num_value_heads)
        v_BTHV = v.reshape(b, t, lin.num_value_heads, -1).astype(jnp.float32)
        beta_BTH = jax.nn.sigmoid(x_BTD @ self.w_b[...]).astype(jnp.float32)
        a_BTH = (x_BTD @ self.w_a[...]).astype(jnp.float32)
        g_BTH = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a_BTH + self.dt_bias[...])
        if valid_BT is not None:  # padding: no decay, no write
            beta_BTH, g_BTH = jnp.where(valid_BT[..., None], beta_BTH, 0.0), jnp.where(valid_BT[..., None], g_BTH, 0.0)
        return q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH

    def __call__(self, h_BTD, conv_BKC, state_BHKV, *, mask_BTT=None, num_valid_B=None):
        """Sequential (mask None): (h, new conv window, new state, None); provisional (mask_BTT, a tree's
        ancestor mask): (h, conv window, state unchanged, NodeResults)."""
        lin, dtype = self.cfg.linear, h_BTD.dtype
        b, t, _ = h_BTD.shape
        x_BTD = self.norm(h_BTD, self.attn_norm)
        mixed_BTC = x_BTD @ self.w_qkv[...]
        w_KC = self.conv_w[...]
        nodes = None
        if mask_BTT is None:
            valid_BT = None if num_valid_B is None else jnp.arange(t)[None, :] < num_valid_B[:, None]
            conved = conv_sequence(mixed_BTC, conv_BKC, w_KC)
            q, k, v, g, beta = self.inputs(conved, x_BTD, valid_BT)
            if t == 1:
                o_BHV, state_BHKV = recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state_BHKV)
                o_BTHV = o_BHV[:, None]
            else:
                o_BTHV, state_BHKV = chunked_rule(q, k, v, g, beta, state_BHKV)
            end_B = jnp.full((b,), t, jnp.int32) if num_valid_B is None else num_valid_B
            conv_BKC = conv_window(mixed_BTC, conv_BKC, end_B)
        else:
            conved = conv_tree(mixed_BTC, conv_BKC, w_KC, mask_BTT)
            q, k, v, g, beta = self.inputs(conved, x_BTD, None)
            o_BTHV, v_new_BHTV, cum_BHT = masked_block(q, k, v, g, beta, state_BHKV, mask_BTT)
            nodes = NodeResults(mixed_BTC, k.transpose(0, 2, 1, 3), v_new_BHTV, cum_BHT)
        # The gated output norm: plain-weight RMSNorm of o (in the model dtype), times silu(z) in fp32.
        o_BTHV = o_BTHV.astype(dtype)
        z_BTHV = (x_BTD @ self.w_z[...]).reshape(b, t, lin.num_value_heads, -1)
        gated = rms_norm(o_BTHV, self.out_norm[...], self.cfg.rms_norm_eps) * jax.nn.silu(z_BTHV.astype(jnp.float32))
        h_BTD = h_BTD + gated.astype(dtype).reshape(b, t, -1) @ self.w_out[...]
        return self.mlp(h_BTD), conv_BKC, state_BHKV, nodes


class HybridDecoder(Decoder):
    """Qwen3.5's text model: embedding, DeltaNet and attention layers by `cfg.layer_types`, final norm, lm_head.

    `forward` is Decoder.forward's contract over a HybridCache (see the module docstring for its modes);
    `logits` and `__call__` are Decoder's.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, per_layer: bool = True, scale: float = 0.02):
        if not per_layer:
            raise ValueError("a hybrid model runs per-layer weights (its layers are of two kinds): layout='per_layer'")
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed = param(normal(rngs, (v, d), dtype, scale), "vocab", "embed")
        self.layers = nnx.List([
            (DecoderLayer if cfg.layer_type(i) == "full_attention" else GatedDeltaNetLayer)(
                cfg, rngs=rngs, scale=scale, sparse=cfg.is_sparse(i)) for i in range(cfg.num_layers)])
        self.final_norm = param(jnp.zeros((d,), dtype), "embed")
        self.lm_head = None if cfg.tie_word_embeddings else param(normal(rngs, (d, v), dtype, scale), "embed", "vocab")

    def init_cache(self, batch: int, max_len: int) -> HybridCache:
        """An empty cache: per-layer K/V for the attention layers, zero conv windows and states for the rest (split
        like the weights under the active mesh, models/sharding.py)."""
        return constrain_cache(init_hybrid_cache(self.cfg, batch, max_len))

    def forward(self, tokens_BT, cache: HybridCache, *, positions_BT=None, mask_BTT=None, capture=(),
                attn_impl: str = "auto", slot=0, provisional: bool = False, num_valid_B=None):
        cfg = self.cfg
        if not isinstance(slot, int) or slot != 0:
            raise ValueError("a hybrid target runs no windowed frontier (slot != 0): that is a draft model's pass")
        if mask_BTT is not None and not provisional:
            raise ValueError("a hybrid model's masked pass must be provisional (verification): pass provisional=True")
        b, t = tokens_BT.shape
        lengths_B = cache.lengths
        if positions_BT is None:
            positions_BT = lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if provisional and mask_BTT is None:
            mask_BTT = jnp.broadcast_to(causal_mask(t), (b, t, t))
        attn_mask_BTT = mask_BTT if mask_BTT is not None else jnp.broadcast_to(causal_mask(t), (b, t, t))
        inv_freq = rope_inv_freq(cfg.rope, cfg.rotary_dim)
        h_BTD = self.embed[...][tokens_BT]
        captured = {}
        ks, vs = list(cache.kv.k), list(cache.kv.v)
        convs, states, nodes = list(cache.conv), list(cache.state), []
        a = g = 0  # the next attention / DeltaNet layer's index into its cache
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = h_BTD
            if isinstance(layer, GatedDeltaNetLayer):
                h_BTD, convs[g], states[g], node = layer(h_BTD, convs[g], states[g],
                                                         mask_BTT=mask_BTT if provisional else None,
                                                         num_valid_B=num_valid_B)
                nodes.append(node)
                g += 1
            else:
                h_BTD, ks[a], vs[a] = layer(h_BTD, ks[a], vs[a], None, lengths_B, positions_BT, attn_mask_BTT,
                                            inv_freq, attn_impl)
                a += 1
        captured[cfg.num_layers] = h_BTD
        out_BTD = rms_norm(h_BTD, self.final_norm[...], cfg.rms_norm_eps, cfg.norm_offset)
        captured[POST_NORM] = out_BTD
        new_cache = HybridCache(KVCache(tuple(ks), tuple(vs), lengths_B), tuple(convs), tuple(states),
                                tuple(nodes) if provisional else None)
        return out_BTD, tuple(captured[i] for i in capture), new_cache


def init_hybrid_cache(cfg: ModelConfig, batch: int, max_len: int) -> HybridCache:
    lin = cfg.linear
    kv = init_cache(dataclasses.replace(cfg, num_layers=len(cfg.attention_layers)), batch, max_len, per_layer=True)
    n = len(cfg.linear_layers)
    conv = tuple(jnp.zeros((batch, lin.conv_kernel - 1, lin.conv_dim), jnp.dtype(cfg.dtype)) for _ in range(n))
    state = tuple(jnp.zeros((batch, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim), jnp.float32)
                  for _ in range(n))
    return HybridCache(kv, conv, state)
