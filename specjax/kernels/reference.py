"""Pure-XLA tree-verification attention: the CPU production path and the kernel's oracle.

Semantics (shared with the Pallas kernel in tree_attention.py): row b holds lengths[b] cached
prefix tokens (0 <= lengths[b] <= S); the N new tokens sit at positions lengths[b] .. lengths[b]+N-1
of the cache. Query i sees every prefix position and new token j iff mask[b, i, j]. Nothing at
positions >= lengths[b]+N is ever allowed to reach the result (it may hold NaN).
Cache positions >= S do not exist: when lengths[b] + N > S, new token j with lengths[b] + j >= S
was never written (the model writes with mode="drop") and is invisible to every query. A query
that sees nothing at all (no prefix, no visible new token) gets zeros.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

# Finite "minus infinity": keeps the online/global softmax free of inf - inf = NaN.
NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_inputs(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, layer) -> None:
    """Raise ValueError with what is wrong when the shapes do not fit the contract."""
    if q_BNHD.ndim != 4:
        raise ValueError(f"q must be [B, N, Hq, D]; got shape {q_BNHD.shape}")
    if k_BSKD.shape != v_BSKD.shape:
        raise ValueError(f"k and v must have the same shape; got {k_BSKD.shape} and {v_BSKD.shape}")
    if k_BSKD.ndim == 5:
        if layer is None:
            raise ValueError(
                f"k/v of shape {k_BSKD.shape} look like a stacked [L, B, S, Hkv, D] cache; "
                "pass layer= to select one layer")
        kv_shape = k_BSKD.shape[1:]
    elif k_BSKD.ndim == 4:
        if layer is not None:
            raise ValueError(
                f"layer= given but k/v of shape {k_BSKD.shape} are one layer [B, S, Hkv, D]; "
                "pass the stacked [L, B, S, Hkv, D] cache or drop layer=")
        kv_shape = k_BSKD.shape
    else:
        raise ValueError(f"k/v must be [B, S, Hkv, D] or [L, B, S, Hkv, D]; got {k_BSKD.shape}")
    batch, num_new, q_heads, head_dim = q_BNHD.shape
    kv_batch, _, kv_heads, kv_head_dim = kv_shape
    if kv_batch != batch:
        raise ValueError(f"batch mismatch: q has B={batch}, k/v have B={kv_batch}")
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: q has D={head_dim}, k/v have D={kv_head_dim}")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(
            f"query heads ({q_heads}) must be a multiple of kv heads ({kv_heads}) for GQA")
    if tuple(mask_BNN.shape) != (batch, num_new, num_new):
        raise ValueError(
            f"mask must be [B, N, N] = {(batch, num_new, num_new)}; got {tuple(mask_BNN.shape)}")
    if tuple(lengths_B.shape) != (batch,):
        raise ValueError(f"lengths must be [B] = ({batch},); got {tuple(lengths_B.shape)}")
    if layer is not None and jnp.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar; got shape {jnp.shape(layer)}")


def select_layer(x_LBSKD, layer):
    """One layer of a stacked cache via dynamic indexing (the 4-D case passes through)."""
    if layer is None:
        return x_LBSKD
    return lax.dynamic_index_in_dim(x_LBSKD, jnp.asarray(layer, jnp.int32), 0, keepdims=False)


def visibility(lengths_B, mask_BNN, pos_BP):
    """bool [B, N, P]: may query i of row b read cache position pos[b, p]?

    Prefix positions (< lengths) are visible to every query; new token j (position
    lengths + j) is visible iff mask[b, i, j]; everything else is invisible.
    """
    num_new = mask_BNN.shape[1]
    lengths_B1 = lengths_B.astype(jnp.int32)[:, None]
    new_idx_BP = pos_BP - lengths_B1
    is_new_BP = (new_idx_BP >= 0) & (new_idx_BP < num_new)
    gather_BNP = jnp.broadcast_to(
        jnp.clip(new_idx_BP, 0, num_new - 1)[:, None, :],
        (mask_BNN.shape[0], num_new, pos_BP.shape[1]))
    tree_BNP = jnp.take_along_axis(mask_BNN.astype(bool), gather_BNP, axis=2)
    return (pos_BP < lengths_B1)[:, None, :] | (is_new_BP[:, None, :] & tree_BNP)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "interpret", "finite_cache"))
def tree_attention_reference(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, *, sm_scale=None,
                             layer=None, block_k=None, interpret=False, finite_cache=False):
    """Tree attention with XLA einsums over the whole cache and a validity mask.

    Same signature as `tree_attention` (block_k and interpret are accepted and ignored).
    Only positions 0..S-1 are scored, so new tokens past the end of the cache are invisible,
    and the guarded denominator gives zeros for a query that sees nothing.
    GQA reshapes q to [B, N, Hkv, G, D] so K/V are never repeated; softmax is fp32.
    finite_cache=True promises nothing past lengths + N is NaN/inf (true of specjax's own
    zero-initialized caches) and skips masking V, a full copy of V per call (at S = 16k,
    Hkv = 2, D = 64 on CPU: 10.5 ms -> 3.6 ms).
    """
    del block_k, interpret
    check_inputs(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, layer)
    k_BSKD = select_layer(k_BSKD, layer)
    v_BSKD = select_layer(v_BSKD, layer)
    batch, num_new, q_heads, head_dim = q_BNHD.shape
    max_len, kv_heads = k_BSKD.shape[1], k_BSKD.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale

    pos_BS = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32)[None], (batch, max_len))
    visible_BNS = visibility(lengths_B, mask_BNN, pos_BS)
    # Rows past lengths + N may hold NaN: zero V there so 0-weight * NaN cannot leak.
    if not finite_cache:
        readable_BS = pos_BS < (lengths_B.astype(jnp.int32) + num_new)[:, None]
        v_BSKD = jnp.where(readable_BS[:, :, None, None], v_BSKD, jnp.zeros((), v_BSKD.dtype))

    # fp32 inputs get true fp32 matmuls (GPUs would otherwise use TF32); bf16 is unaffected.
    precision = lax.Precision.HIGHEST if q_BNHD.dtype == jnp.float32 else None
    q_BNKGD = q_BNHD.reshape(batch, num_new, kv_heads, group, head_dim)
    logits_BNKGS = jnp.einsum("bnkgd,bskd->bnkgs", q_BNKGD, k_BSKD, precision=precision,
                              preferred_element_type=jnp.float32) * scale
    visible_BN11S = visible_BNS[:, :, None, None, :]
    logits_BNKGS = jnp.where(visible_BN11S, logits_BNKGS, NEG_INF)
    max_BNKG1 = jnp.max(logits_BNKGS, axis=-1, keepdims=True)
    probs_BNKGS = jnp.where(visible_BN11S, jnp.exp(logits_BNKGS - max_BNKG1), 0.0)
    denom_BNKG1 = jnp.sum(probs_BNKGS, axis=-1, keepdims=True)
    out_BNKGD = jnp.einsum("bnkgs,bskd->bnkgd", probs_BNKGS.astype(v_BSKD.dtype), v_BSKD,
                           precision=precision, preferred_element_type=jnp.float32)
    out_BNKGD = out_BNKGD / jnp.where(denom_BNKG1 > 0, denom_BNKG1, 1.0)
    return out_BNKGD.reshape(batch, num_new, q_heads, head_dim).astype(q_BNHD.dtype)
