"""Fixed-shape KV cache: one stacked buffer for all layers plus per-row lengths.

Layout `[layers, batch, max_len, kv_heads, head_dim]`, or a tuple of per-layer
`[batch, max_len, kv_heads, head_dim]` buffers: the CPU layout, where XLA copies a layer
out of a stacked buffer before reading it (see models/decoder.py). Row b's visible prefix is
positions `0 .. lengths[b]-1`; anything past it is garbage that is never read.
The model writes new tokens' K/V after the prefix; `commit` moves an accepted
tree path to contiguous positions and advances `lengths`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array | tuple[jax.Array, ...]  # [L, B, S, Hkv, D], or L x [B, S, Hkv, D]
    v: jax.Array | tuple[jax.Array, ...]
    lengths: jax.Array  # int32 [B]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None, per_layer: bool = False) -> KVCache:
    """An empty cache (all lengths 0), stacked or as one buffer per layer."""
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype or jnp.dtype(cfg.dtype)
    if per_layer:
        k = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    else:
        k, v = jnp.zeros((cfg.num_layers, *shape), dtype), jnp.zeros((cfg.num_layers, *shape), dtype)
    return KVCache(k, v, jnp.zeros((batch,), jnp.int32))


def write_layer(buf: jax.Array, layer: jax.Array | None, new_BTKD: jax.Array, start_B: jax.Array) -> jax.Array:
    """Write T new entries at per-row offsets start_B (an in-place scatter).

    buf is a stacked [L, B, S, Hkv, D] cache with `layer` selecting the layer, or one
    layer's own [B, S, Hkv, D] buffer with layer None.
    """
    b, t = new_BTKD.shape[:2]
    rows_BT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    pos_BT = start_B[:, None] + jnp.arange(t)[None, :]
    index = (rows_BT, pos_BT) if layer is None else (layer, rows_BT, pos_BT)
    return buf.at[index].set(new_BTKD.astype(buf.dtype), mode="drop")


def commit(cache: KVCache, path_BN: jax.Array, num_accepted_B: jax.Array) -> KVCache:
    """Keep an accepted path of tree nodes written after each row's prefix.

    The N tree nodes of row b sit at `lengths[b] + i`. `path_BN[b, j]` is the node index
    of the j-th accepted token (node 0 is the root, always kept), valid for
    `j < num_accepted_B[b]`. Entries move to `lengths[b] + j`; lengths advance by
    num_accepted. For a chain the path is 0, 1, 2, ... and nothing moves.
    """
    b, s = cache.lengths.shape[0], jax.tree.leaves(cache.k)[0].shape[-3]
    n = path_BN.shape[1]
    rows_BN = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    src_BN = cache.lengths[:, None] + path_BN
    dst_BN = cache.lengths[:, None] + jnp.arange(n)[None, :]
    # Rows past num_accepted write to an out-of-range slot, which mode="drop" discards.
    dst_BN = jnp.where(jnp.arange(n)[None, :] < num_accepted_B[:, None], dst_BN, s)

    def move(buf):  # [L, B, S, Hkv, D] or [B, S, Hkv, D]
        picked = buf[..., rows_BN, src_BN, :, :]  # [(L,) B, N, Hkv, D]; gathered before any write
        return buf.at[..., rows_BN, dst_BN, :, :].set(picked, mode="drop")

    return KVCache(jax.tree.map(move, cache.k), jax.tree.map(move, cache.v), cache.lengths + num_accepted_B)
