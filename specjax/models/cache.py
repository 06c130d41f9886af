"""Fixed-shape KV cache: one stacked buffer for all layers plus per-row lengths.

Layout `[layers, batch, max_len, kv_heads, head_dim]`, or a tuple of per-layer
`[batch, max_len, kv_heads, head_dim]` buffers: the CPU layout, where XLA copies a layer
out of a stacked buffer before reading it (see models/decoder.py). Row b's visible prefix is
positions `0 .. lengths[b]-1`; anything past it is garbage that is never read.
The model writes new tokens' K/V after the prefix; `commit` moves an accepted
tree path to contiguous positions and advances `lengths`.

`HybridCache` is a hybrid model's (Qwen3.5): a KVCache for its full-attention layers plus, for every
Gated DeltaNet layer, the last K-1 conv inputs and the recurrent state. A provisional pass (verification)
leaves those as they are and keeps per-node results in `nodes`; `commit` forms the accepted node's state
and conv window from them. The loops call the methods both caches share (`lengths`, `with_lengths`,
`commit`, `padded_nodes`), never their fields.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.models.gdn import conv_window, state_along_path


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array | tuple[jax.Array, ...]  # [L, B, S, Hkv, D], or L x [B, S, Hkv, D]
    v: jax.Array | tuple[jax.Array, ...]
    lengths: jax.Array  # int32 [B]

    def with_lengths(self, lengths_B: jax.Array) -> "KVCache":
        return KVCache(self.k, self.v, lengths_B)

    def commit(self, path_BN: jax.Array, num_accepted_B: jax.Array) -> "KVCache":
        return commit(self, path_BN, num_accepted_B)

    def hold_rows(self, before: "KVCache", held_B: jax.Array) -> "KVCache":
        """Rows held_B keep what they had: nothing to do, a write past a row's length is never read."""
        return self

    def padded_nodes(self, n: int) -> "KVCache":
        """The cache after a provisional pass of fewer than n nodes, shaped as one of n (nothing per node here)."""
        return self


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
    if layer is None:  # one scatter per row (vmap: the rows are its batch dimension), written where the row lives
        return jax.vmap(lambda buf_SKD, new_TKD, start: buf_SKD.at[start + jnp.arange(t)].set(
            new_TKD.astype(buf.dtype), mode="drop"))(buf, new_BTKD, start_B)
    # Stacked: rows and positions indexed together. Under a mesh whose "data" axis splits the batch the partitioner
    # gathers every row's new entries for this (small: T tokens per row); the per-row form above, with the rows a
    # middle dimension, was transposed whole by XLA (0.03 s -> 2.7 s for 256 writes on the CPU).
    rows_BT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    pos_BT = start_B[:, None] + jnp.arange(t)[None, :]
    return buf.at[layer, rows_BT, pos_BT].set(new_BTKD.astype(buf.dtype), mode="drop")


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NodeResults:
    """One Gated DeltaNet layer's per-node results of a provisional pass: what commit needs for any node."""

    x: jax.Array  # [B, T, C] conv inputs
    k: jax.Array  # [B, Hv, T, K] normed keys (fp32)
    v_new: jax.Array  # [B, Hv, T, V] corrected values (fp32)
    cum: jax.Array  # [B, Hv, T] cumulative log decay along each node's path


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    kv: KVCache  # the full-attention layers', in their order
    conv: tuple[jax.Array, ...]  # per DeltaNet layer [B, K-1, C]: the last K-1 conv inputs, oldest first
    state: tuple[jax.Array, ...]  # per DeltaNet layer [B, Hv, K, V] fp32
    nodes: tuple[NodeResults, ...] | None = None  # the last provisional pass's, until commit

    @property
    def lengths(self) -> jax.Array:
        return self.kv.lengths

    def with_lengths(self, lengths_B: jax.Array) -> "HybridCache":
        return dataclasses.replace(self, kv=self.kv.with_lengths(lengths_B))

    def hold_rows(self, before: "HybridCache", held_B: jax.Array) -> "HybridCache":
        """Rows held_B keep `before`'s recurrent state and conv window: a sequential pass advances every row's
        state, and a row that is done must not move (the engine prefills a long prompt into a done row between
        chunks, piece by piece)."""
        def keep(new, old):
            return jnp.where(held_B.reshape((-1,) + (1,) * (new.ndim - 1)), old, new)

        return dataclasses.replace(self, conv=tuple(map(keep, self.conv, before.conv)),
                                   state=tuple(map(keep, self.state, before.state)))

    def padded_nodes(self, n: int) -> "HybridCache":
        """Per-node results of a pass over fewer than n nodes padded to n (a scheduler's narrow width)."""
        if self.nodes is None:
            return self

        def pad(x, axis):
            return jnp.pad(x, [(0, 0)] * axis + [(0, n - x.shape[axis])] + [(0, 0)] * (x.ndim - axis - 1))

        nodes = tuple(NodeResults(pad(r.x, 1), pad(r.k, 2), pad(r.v_new, 2), pad(r.cum, 2)) for r in self.nodes)
        return dataclasses.replace(self, nodes=nodes)

    def commit(self, path_BN: jax.Array, num_accepted_B: jax.Array) -> "HybridCache":
        """Keep the accepted path: its K/V (as KVCache.commit), and for each DeltaNet layer the state after the
        path's last node (S0 decayed + a rank-n update along the path) and the K-1 conv inputs ending at it.
        Rows with nothing accepted keep their state."""
        if self.nodes is None:
            raise ValueError("commit needs a provisional pass first (forward(..., provisional=True))")
        b, n = path_BN.shape
        t = self.nodes[0].x.shape[1]
        accepted_BN = jnp.arange(n)[None, :] < num_accepted_B[:, None]
        last_B = jnp.take_along_axis(path_BN, jnp.maximum(num_accepted_B - 1, 0)[:, None], axis=1)[:, 0]
        on_path_BT = jnp.zeros((b, t), jnp.bool_).at[jnp.arange(b)[:, None], jnp.where(accepted_BN, path_BN, t)].set(
            True, mode="drop")
        any_B = num_accepted_B > 0
        conv, state = [], []
        for conv_BKC, state_BHKV, r in zip(self.conv, self.state, self.nodes):
            cum_end_BH = jnp.take_along_axis(r.cum, last_B[:, None, None], axis=2)[..., 0]
            new_state = state_along_path(state_BHKV, r.k, r.v_new, r.cum, on_path_BT, cum_end_BH)
            state.append(jnp.where(any_B[:, None, None, None], new_state, state_BHKV))
            path_x_BNC = jnp.take_along_axis(r.x, path_BN[..., None], axis=1)
            conv.append(conv_window(path_x_BNC, conv_BKC, num_accepted_B))
        return HybridCache(self.kv.commit(path_BN, num_accepted_B), tuple(conv), tuple(state), None)
