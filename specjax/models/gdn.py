"""Gated DeltaNet: Qwen3.5's linear-attention layer, its delta rule in three forms, and its causal conv.

The recurrence (per value head, state S [d_k, d_v] in fp32; transformers' `torch_recurrent_gated_delta_rule`):
    S <- S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S <- S + k_t delta^T;  o_t = S^T q_t
with q, k L2-normed and q scaled by d_k^-1/2. Three forms compute it:

* `recurrent_step`: one token (plain decoding), the recurrence as written.
* `chunked_rule`: a sequence in chunks of 64 (prefill): within a chunk the updates are condensed by the
  WY/UT transform (transformers' `torch_chunk_gated_delta_rule`), so only the chunks run in sequence.
* `masked_block`: one block of tokens whose order is given by a mask (mask[i, j]: token j is token i or an
  earlier token on i's path). With the causal mask it is one chunk; with a draft tree's ancestor mask,
  every node's output is the one the recurrence along its root-to-node path gives, in one pass and
  without a state per node: the UT system only couples a node to its ancestors, and the cumulative decay
  runs along the path. It returns, per node, the corrected value `v_new` and the cumulative decay, from
  which `state_along_path` forms the state after any accepted node (S0 decayed + a rank-n update over the
  path): what the speculative loop commits. See docs/architecture_targets.md for the memory this saves over keeping
  a state per node.

All three take q, k already expanded to the value heads (`expand_heads`: value head h reads key head
h // (Hv / Hk), transformers' repeat_interleave) and run in fp32 at full matmul precision (no TF32).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

CHUNK = 64  # transformers' chunk_size
_HI = lax.Precision.HIGHEST


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum x^2 + eps) over the last axis (transformers' `l2norm`, as the FLA library)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def expand_heads(x_BTGK: jax.Array, num_value_heads: int) -> jax.Array:
    """[B, T, Hk, K] -> [B, T, Hv, K]: each key head serves Hv / Hk consecutive value heads."""
    return jnp.repeat(x_BTGK, num_value_heads // x_BTGK.shape[2], axis=2)


def recurrent_step(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, state_BHKV):
    """One token of the recurrence: (o [B, Hv, V], new state)."""
    state_BHKV = state_BHKV * jnp.exp(g_BH)[..., None, None]
    kv_mem_BHV = jnp.einsum("bhkv,bhk->bhv", state_BHKV, k_BHK, precision=_HI)
    delta_BHV = (v_BHV - kv_mem_BHV) * beta_BH[..., None]
    state_BHKV = state_BHKV + k_BHK[..., :, None] * delta_BHV[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", state_BHKV, q_BHK, precision=_HI), state_BHKV


def unit_lower_inverse(a_BTT: jax.Array) -> jax.Array:
    """(I + A)^-1 for strictly lower-triangular A [..., T, T]: with N = -A nilpotent (N^T = 0), the inverse
    is (I + N)(I + N^2)(I + N^4)... over ceil(log2 T) factors, all powers of one N, so they commute.

    Matmuls only (no triangular-solve custom call), so its gradient is matmuls too: with
    `lax.linalg.triangular_solve` here, a jitted gradient of the model never returned on its second call
    under XLA:CPU's multi-threaded Eigen (it ran with --xla_cpu_multi_thread_eigen=false). The results
    match transformers' triangular solve to 2e-6 (tests/test_gdn.py).
    """
    t = a_BTT.shape[-1]
    eye = jnp.eye(t, dtype=a_BTT.dtype)
    power = -a_BTT
    inverse = eye + power
    for _ in range(max(0, math.ceil(math.log2(max(t, 2))) - 1)):
        power = jnp.einsum("...ij,...jk->...ik", power, power, precision=_HI)
        inverse = jnp.einsum("...ij,...jk->...ik", inverse, eye + power, precision=_HI)
    return inverse


def _ut_parts(q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT, mask_BTT):
    """The state-independent half of a block: (u, w, decayed q, intra-block scores, cumulative decay).

    u = (I + A)^-1 beta v and w = (I + A)^-1 beta k exp(cum), with A[i, j] = beta_i k_i.k_j exp(cum_i - cum_j)
    over j a strict ancestor of i; leading batch axes may be [B, H] or [B, H, chunks].
    """
    t = q_BHTK.shape[-2]
    maskf_BTT = mask_BTT.astype(jnp.float32)
    cum_BHT = jnp.einsum("...ij,...j->...i", maskf_BTT, g_BHT, precision=_HI)
    diff_BHTT = cum_BHT[..., :, None] - cum_BHT[..., None, :]
    decay_BHTT = jnp.where(mask_BTT, jnp.exp(jnp.where(mask_BTT, diff_BHTT, 0.0)), 0.0)
    strict_BTT = mask_BTT & ~jnp.eye(t, dtype=jnp.bool_)
    kk_BHTT = jnp.einsum("...ik,...jk->...ij", k_BHTK, k_BHTK, precision=_HI)
    a_BHTT = jnp.where(strict_BTT, beta_BHT[..., :, None] * kk_BHTT * decay_BHTT, 0.0)
    inverse_BHTT = unit_lower_inverse(a_BHTT)
    u_BHTV = jnp.einsum("...ij,...jv->...iv", inverse_BHTT, v_BHTV * beta_BHT[..., None], precision=_HI)
    w_BHTK = jnp.einsum("...ij,...jk->...ik", inverse_BHTT, k_BHTK * (beta_BHT * jnp.exp(cum_BHT))[..., None],
                        precision=_HI)
    qd_BHTK = q_BHTK * jnp.exp(cum_BHT)[..., None]
    intra_BHTT = jnp.einsum("...ik,...jk->...ij", q_BHTK, k_BHTK, precision=_HI) * decay_BHTT
    return u_BHTV, w_BHTK, qd_BHTK, intra_BHTT, cum_BHT


def _read_block(state_BHKV, u_BHTV, w_BHTK, qd_BHTK, intra_BHTT):
    """The state-dependent half of a block: (o, v_new) given the state before it."""
    v_new_BHTV = u_BHTV - jnp.einsum("bhtk,bhkv->bhtv", w_BHTK, state_BHKV, precision=_HI)
    o_BHTV = jnp.einsum("bhtk,bhkv->bhtv", qd_BHTK, state_BHKV, precision=_HI) + \
        jnp.einsum("bhij,bhjv->bhiv", intra_BHTT, v_new_BHTV, precision=_HI)
    return o_BHTV, v_new_BHTV


def state_along_path(state_BHKV, k_BHTK, v_new_BHTV, cum_BHT, on_path_BT, cum_end_BH):
    """The state after a block's token whose path (itself and its ancestors) is `on_path_BT`, cum_end its
    cumulative decay: S0 exp(cum_end) + sum over the path of k_j exp(cum_end - cum_j) v_new_j^T."""
    gap_BHT = jnp.where(on_path_BT[:, None, :], cum_end_BH[..., None] - cum_BHT, -jnp.inf)
    weight_BHT = jnp.where(on_path_BT[:, None, :], jnp.exp(jnp.where(on_path_BT[:, None, :], gap_BHT, 0.0)), 0.0)
    update_BHKV = jnp.einsum("bhtk,bhtv->bhkv", k_BHTK * weight_BHT[..., None], v_new_BHTV, precision=_HI)
    return state_BHKV * jnp.exp(cum_end_BH)[..., None, None] + update_BHKV


def masked_block(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV, mask_BTT):
    """A block of T tokens ordered by mask_BTT [B, T, T] (self included) from state S0.

    Returns (o [B, T, Hv, V], v_new [B, Hv, T, V], cum [B, Hv, T]); `state_along_path` turns the last two
    into the state after any token.
    """
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q_BTHK, k_BTHK, v_BTHV))
    g, beta = g_BTH.transpose(0, 2, 1), beta_BTH.transpose(0, 2, 1)
    mask_B1TT = mask_BTT[:, None]
    u, w, qd, intra, cum_BHT = _ut_parts(q, k, v, g, beta, mask_B1TT)
    o_BHTV, v_new_BHTV = _read_block(state_BHKV, u, w, qd, intra)
    return o_BHTV.transpose(0, 2, 1, 3), v_new_BHTV, cum_BHT


def chunked_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV, chunk: int = CHUNK):
    """A sequence from state S0, in chunks (prefill): (o [B, T, Hv, V], final state).

    Padding up to a whole chunk has g = 0 and beta = 0 (state untouched), as do callers' padded tokens.
    """
    b, t, h, dk = k_BTHK.shape
    pad = (-t) % chunk
    padded = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in
              (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)]
    n = (t + pad) // chunk
    # [B, T, H, ...] -> [B, H, n, C, ...]
    q, k, v = (x.reshape(b, n, chunk, h, -1).transpose(0, 3, 1, 2, 4) for x in padded[:3])
    g, beta = (x.reshape(b, n, chunk, h).transpose(0, 3, 1, 2) for x in padded[3:])
    causal_TT = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_))
    u, w, qd, intra, cum = _ut_parts(q, k, v, g, beta, causal_TT)
    carry_k = k * jnp.exp(cum[..., -1:] - cum)[..., None]  # k_j exp(cum_last - cum_j): the state update
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, n]

    def body(state, xs):
        u_c, w_c, qd_c, intra_c, carry_k_c, decay_c = xs
        o_c, v_new_c = _read_block(state, u_c, w_c, qd_c, intra_c)
        state = state * decay_c[..., None, None] + jnp.einsum("bhtk,bhtv->bhkv", carry_k_c, v_new_c, precision=_HI)
        return state, o_c

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, qd, intra, carry_k, chunk_decay))
    state_BHKV, o_nBHCV = lax.scan(body, state_BHKV, xs)
    o_BTHV = o_nBHCV.transpose(1, 0, 3, 2, 4).reshape(b, n * chunk, h, -1)[:, :t]
    return o_BTHV, state_BHKV


def conv_sequence(x_BTC: jax.Array, window_BKC: jax.Array, w_KC: jax.Array) -> jax.Array:
    """Depthwise causal conv over a sequence after the K-1 inputs in `window` (oldest first), then SiLU.

    w_KC is the kernel with tap K-1 on the current token (transformers' conv1d weight [C, 1, K], transposed).
    """
    k = w_KC.shape[0]
    t = x_BTC.shape[1]
    ext_BSC = jnp.concatenate([window_BKC.astype(x_BTC.dtype), x_BTC], axis=1)
    out = sum(ext_BSC[:, j:j + t] * w_KC[j] for j in range(k))
    return jax.nn.silu(out)


def conv_window(x_BTC: jax.Array, window_BKC: jax.Array, end_B: jax.Array) -> jax.Array:
    """The K-1 conv inputs ending at token end_B - 1 of the sequence window ++ x (end_B = 0: the window itself)."""
    km1 = window_BKC.shape[1]
    ext_BSC = jnp.concatenate([window_BKC, x_BTC.astype(window_BKC.dtype)], axis=1)
    idx_BK = end_B[:, None] + jnp.arange(km1)[None, :]
    return jnp.take_along_axis(ext_BSC, idx_BK[..., None], axis=1)


def path_ancestors(mask_BTT: jax.Array, lags: int) -> jax.Array:
    """int [B, T, lags]: node i's ancestor `lag` steps up its path (lag 1 = parent), or -(steps past the root)
    where the path runs out (-1: the token before the root, -2 the one before that, ...)."""
    depth_BT = jnp.sum(mask_BTT, axis=-1, dtype=jnp.int32) - 1
    out = []
    for lag in range(1, lags + 1):
        want_BT = depth_BT - lag
        hit_BTT = mask_BTT & (depth_BT[:, None, :] == want_BT[:, :, None])
        out.append(jnp.where(want_BT >= 0, jnp.argmax(hit_BTT, axis=-1), want_BT))
    return jnp.stack(out, axis=-1)


def conv_tree(x_BTC: jax.Array, window_BKC: jax.Array, w_KC: jax.Array, mask_BTT: jax.Array) -> jax.Array:
    """The causal conv along each node's root-to-node path (a tree's ancestor mask; a chain's is causal), then SiLU.

    Lag j of node i is its j-th ancestor, or, past the root, the committed window's input j - depth - 1 back.
    """
    k = w_KC.shape[0]
    anc_BTL = path_ancestors(mask_BTT, k - 1)
    km1 = window_BKC.shape[1]
    ext_BSC = jnp.concatenate([window_BKC.astype(x_BTC.dtype), x_BTC], axis=1)
    idx_BTL = km1 + anc_BTL  # ancestor a at ext index K-1+a; -1 -> window[K-2], the latest committed input
    out = x_BTC * w_KC[k - 1]
    for lag in range(1, k):
        picked_BTC = jnp.take_along_axis(ext_BSC, idx_BTL[:, :, lag - 1, None], axis=1)
        out = out + picked_BTC * w_KC[k - 1 - lag]
    return jax.nn.silu(out)
