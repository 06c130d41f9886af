"""A cache-free forward of the dense decoder for training: whole sequences, causal attention.

The serving `Decoder.forward` writes every token's K/V into a fixed-shape cache and attends
over the whole cache; for training that is wasted work and memory. This forward runs the same
Decoder module's layers (`DecoderLayer.qkv`, `attn_out_and_mlp`) over its params, so a model
trained here runs unchanged in serving (tests/test_train.py checks they agree).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from specjax.config import ModelConfig
from specjax.models.decoder import with_layout
from specjax.models.layers import rms_norm, rope_inv_freq
from specjax.models.model import lm_head, merge, sequence_forward

NEG_INF = -1e30


def causal_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array) -> jax.Array:
    """Causal GQA attention over one sequence per row; softmax in fp32, K/V never repeated."""
    b, t, h, d = q_BTHD.shape
    kv = k_BTKD.shape[2]
    q_BTKGD = q_BTHD.reshape(b, t, kv, h // kv, d)
    logits_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BTKD,
                              preferred_element_type=jnp.float32) / math.sqrt(d)
    causal_TS = jnp.tril(jnp.ones((t, t), jnp.bool_))
    logits_BKGTS = jnp.where(causal_TS, logits_BKGTS, NEG_INF)
    probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BTKD.dtype)
    out_BTKGD = jnp.einsum("bkgts,bskd->btkgd", probs_BKGTS, v_BTKD)
    return out_BTKGD.reshape(b, t, h, d)


def train_forward(params: dict, cfg: ModelConfig, tokens_BT: jax.Array, *, capture: tuple[int, ...] = (),
                  remat: bool = False) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Final-normed hidden states [B, T, D] of whole sequences (positions 0..T-1), plus captures.

    The Decoder holding `params` (stacked layers) runs each layer's own `qkv` / `attn_out_and_mlp`
    around causal attention under `lax.scan`. `capture` follows the decoder's numbering: i <
    num_layers is the residual stream entering layer i, i = num_layers the last layer's output
    before the final norm (what EAGLE-3, MTP and DFlash heads read). `remat` recomputes each layer
    in the backward pass to save memory. A hybrid (Qwen3.5) trains through its serving forward with a
    fresh cache (the chunked delta rule; `remat` does not apply).
    """
    if cfg.is_hybrid:
        h_BTD, captured, _ = sequence_forward(params, cfg, tokens_BT, capture)  # its unused logits: dead code to jit
        return h_BTD, captured
    model = merge(cfg, with_layout(params, per_layer=False))
    graph, stacked = nnx.split(model.layers)
    b, t = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)

    def layer_fn(weights, h_BTD):
        layer = nnx.merge(graph, weights)
        q_BTHD, k_BTKD, v_BTKD = layer.qkv(h_BTD, positions_BT, inv_freq)
        return layer.attn_out_and_mlp(h_BTD, causal_attention(q_BTHD, k_BTKD, v_BTKD))

    layer_fn = jax.checkpoint(layer_fn) if remat else layer_fn

    def body(h_BTD, weights):
        return layer_fn(weights, h_BTD), h_BTD

    h_BTD, inputs_LBTD = lax.scan(body, model.embed[...][tokens_BT], stacked)
    captured = tuple(h_BTD if i == cfg.num_layers else inputs_LBTD[i] for i in capture)
    return rms_norm(h_BTD, model.final_norm[...], cfg.rms_norm_eps), captured


def train_logits(params: dict, cfg: ModelConfig, tokens_BT: jax.Array) -> jax.Array:
    """fp32 next-token logits [B, T, V] of whole sequences."""
    h_BTD, _ = train_forward(params, cfg, tokens_BT)
    return lm_head(params, cfg, h_BTD)
