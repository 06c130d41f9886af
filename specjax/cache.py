"""Fixed-shape KV cache: one stacked buffer for all layers plus per-row lengths.

Layout `[layers, batch, max_len, kv_heads, head_dim]`. Row b's visible prefix is
positions `0 .. lengths[b]-1`; anything past it is garbage that is never read.
The model writes new tokens' K/V after the prefix; `commit` moves an accepted
tree path to contiguous positions and advances `lengths`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, B, S, Hkv, D]
    v: jax.Array  # [L, B, S, Hkv, D]
    lengths: jax.Array  # int32 [B]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache (all lengths 0)."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype or jnp.dtype(cfg.dtype)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def write_layer(buf_LBSKD: jax.Array, layer: jax.Array, new_BTKD: jax.Array, start_B: jax.Array) -> jax.Array:
    """Write T new entries of one layer at per-row offsets start_B (an in-place scatter)."""
    b, t = new_BTKD.shape[:2]
    rows_BT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    pos_BT = start_B[:, None] + jnp.arange(t)[None, :]
    return buf_LBSKD.at[layer, rows_BT, pos_BT].set(new_BTKD.astype(buf_LBSKD.dtype), mode="drop")


def commit(cache: KVCache, path_BN: jax.Array, num_accepted_B: jax.Array) -> KVCache:
    """Keep an accepted path of tree nodes written after each row's prefix.

    The N tree nodes of row b sit at `lengths[b] + i`. `path_BN[b, j]` is the node index
    of the j-th accepted token (node 0 is the root, always kept), valid for
    `j < num_accepted_B[b]`. Entries move to `lengths[b] + j`; lengths advance by
    num_accepted. For a chain the path is 0, 1, 2, ... and nothing moves.
    """
    l, b, s = cache.k.shape[:3]
    n = path_BN.shape[1]
    rows_BN = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    src_BN = cache.lengths[:, None] + path_BN
    dst_BN = cache.lengths[:, None] + jnp.arange(n)[None, :]
    # Rows past num_accepted write to an out-of-range slot, which mode="drop" discards.
    dst_BN = jnp.where(jnp.arange(n)[None, :] < num_accepted_B[:, None], dst_BN, s)

    def move(buf):
        picked = buf[:, rows_BN, src_BN]  # [L, B, N, Hkv, D]; gathered before any write
        return buf.at[:, rows_BN, dst_BN].set(picked, mode="drop")

    return KVCache(move(cache.k), move(cache.v), cache.lengths + num_accepted_B)
