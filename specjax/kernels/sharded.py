"""The tree-attention kernel on a device mesh: each device runs it on its own rows and kv heads, under shard_map.

A pallas_call is one custom call that XLA's SPMD partitioner cannot split: handed sharded operands it would gather
them first (the whole KV cache onto every device). Attention is independent per batch row and per kv head (with the
query heads of its group), so under shard_map each device runs the kernel on the slice it already holds, the batch
over the data axis and the kv heads over the model axis, as the model's caches are split, and no collective runs.
A dimension the axis does not divide stays whole (every device of that axis computes it: correct, not split).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .tree_attention import tree_attention


def split_axis(mesh, axis: str, dim: int) -> str | None:
    """`axis` when the mesh has it, larger than 1, and it divides `dim`; else None (that dimension stays whole)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    size = sizes.get(axis, 1)
    return axis if size > 1 and dim % size == 0 else None


def mesh_specs(q_shape: tuple, kv_shape: tuple, mesh, batch_axis: str, head_axis: str) -> tuple[P, P, P, P]:
    """PartitionSpecs of (q [B, N, Hq, D], k/v [.., B, S, Hkv, D], lengths [B], mask [B, N, N]): rows over
    `batch_axis`, kv heads (and so their query heads) over `head_axis`, where those axes divide them."""
    rows = split_axis(mesh, batch_axis, q_shape[0])
    heads = split_axis(mesh, head_axis, kv_shape[-2])
    lead = (None,) * (len(kv_shape) - 4)  # a stacked cache's layers axis
    return P(rows, None, heads, None), P(*lead, rows, None, heads, None), P(rows), P(rows, None, None)


def sharded_tree_attention(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, *, mesh, layer=None, sm_scale=None,
                           interpret=False, batch_axis: str = "data", head_axis: str = "model"):
    """`tree_attention` (same arguments and result) with one kernel per device of `mesh` (a Mesh or the trace's
    AbstractMesh) over its slice: see the module docstring."""
    q_spec, kv_spec, len_spec, mask_spec = mesh_specs(q_BNHD.shape, k_BSKD.shape, mesh, batch_axis, head_axis)
    kernel = functools.partial(tree_attention, sm_scale=sm_scale, interpret=interpret)
    if layer is None:
        local = kernel
        operands, specs = (q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN), (q_spec, kv_spec, kv_spec, len_spec, mask_spec)
    else:  # the layer index (traced under a scan) goes in as a replicated operand
        def local(q, k, v, lengths, mask, layer_):
            return kernel(q, k, v, lengths, mask, layer=layer_)
        operands = (q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, jnp.asarray(layer, jnp.int32))
        specs = (q_spec, kv_spec, kv_spec, len_spec, mask_spec, P())
    # check_vma off: a pallas_call carries no varying-manual-axes types for the checker to follow.
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*operands)
