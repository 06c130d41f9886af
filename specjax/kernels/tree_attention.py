"""Pallas (Triton backend) tree-verification attention for GPU.

One program per (block of packed query rows, KV split, batch row, kv head). The G query heads
that share a kv head and the N new tokens are packed into the matrix M dimension (row
m = n * G + g), so each K/V block is read once per kv head and feeds an [M, block_k] dot.
Per row the KV loop runs only over blocks below end[b] = min(lengths[b] + N, S) (cost follows
the real prefix, not max_len; never a block past the cache, whatever lengths the caller passes)
and splits into two phases:
  prefix blocks, entirely below lengths[b]: no masking at all;
  tail blocks, the (at most `tail_blocks`) blocks holding lengths[b] .. end[b]-1:
    K/V rows at or past end[b] are not loaded (masked load, zero fill) and scores use a
    precomputed visibility mask (prefix | tree ancestor) laid out on that block-aligned window.
Cache positions >= S do not exist (the model drops writes there): a new token whose slot
lengths[b] + j is >= S is invisible to every query, exactly as in the XLA reference.
With num_splits > 1 each program handles a contiguous share of the row's blocks and writes
unnormalised partials (o, running max, running sum) that XLA merges (flash-decoding split-K),
so a single long row still fills the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .reference import NEG_INF, check_inputs, visibility

MIN_DOT_DIM = 16  # Triton's tl.dot needs every dimension >= 16.
MAX_BLOCK_M = 64  # packed query rows per program; more rows -> more M blocks in the grid.
DEFAULT_NUM_SMS = 132  # H100 / H200 SXM; only used to size the KV split.
# Shared memory one program may use on H100 / H200 (the per-block opt-in, 227 KiB; XLA's target configs
# `shared_memory_per_block_optin`). A100 has 163 KiB: plan with shared_memory_bytes=166912 there.
SHARED_MEMORY_BYTES = 232448
LOG2_E = math.log2(math.e)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def kernel_unsupported_reason(*, head_dim: int, max_len: int) -> str | None:
    """Why the kernel cannot run these shapes (None if it can): Triton dots need dims >= 16.

    The one check shared by plan_blocks (which raises it) and attention(impl="auto") (which
    falls back to the XLA reference on it).
    """
    if not _is_pow2(head_dim) or head_dim < MIN_DOT_DIM:
        return f"head_dim must be a power of 2 >= {MIN_DOT_DIM} (e.g. 64, 128); got {head_dim}"
    if max_len % MIN_DOT_DIM != 0:
        return (f"the cache length S={max_len} must be a multiple of {MIN_DOT_DIM} for the "
                "Pallas kernel; allocate the cache with a rounded-up max_len")
    return None


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Static tiling of one tree_attention call (all dims of every dot are >= 16, powers of 2)."""

    block_m: int  # packed query rows (N * G, padded) per program
    m_pad: int  # N * G rounded up to a multiple of block_m
    block_k: int  # KV positions per loop step; divides max_len
    tail_blocks: int  # most KV blocks that can hold one of the N new tokens
    num_splits: int  # programs sharing one row's KV range (split-K)
    num_warps: int
    num_stages: int

    @property
    def num_m_blocks(self) -> int:
        return self.m_pad // self.block_m

    @property
    def tail_width(self) -> int:
        return self.tail_blocks * self.block_k


def shared_memory_estimate(*, block_m: int, block_k: int, head_dim: int, itemsize: int) -> int:
    """Bytes of shared memory Triton gives one program: a K and a V block, the q block, the scores' layout
    conversion, and 8 KiB of barriers and slack. Checked against the compiler: fp32 at head_dim 256 asked for
    288832 bytes (block_m 16, block_k 128; this gives 294912) and 315520 (block_m 32; this gives 319488)."""
    return 2 * block_k * head_dim * itemsize + block_m * head_dim * itemsize + block_m * block_k * 4 + 8192


def plan_blocks(*, batch: int, num_new: int, group: int, kv_heads: int, max_len: int,
                head_dim: int, block_k: int | None = None, num_splits: int | None = None,
                num_sms: int = DEFAULT_NUM_SMS, itemsize: int = 2,
                shared_memory_bytes: int = SHARED_MEMORY_BYTES) -> BlockPlan:
    """Choose block sizes for the GPU kernel (the interpret path uses the same plan).

    block_k: requested KV block (power of 2, >= 16); it is lowered to the largest power of 2
    that divides max_len, so max_len must be a multiple of 16, and further while the program's
    shared memory (`shared_memory_estimate` for q/k/v of `itemsize` bytes) would pass
    shared_memory_bytes: fp32 at head_dim 256 takes block_k 64, where 128 failed to compile for
    H100 ("Shared memory size limit exceeded"). num_splits=None picks a split that gives about
    two programs per SM while keeping >= 2 blocks per split at full length.
    """
    reason = kernel_unsupported_reason(head_dim=head_dim, max_len=max_len)
    if reason is not None:
        raise ValueError(reason)
    rows = num_new * group
    if rows <= MAX_BLOCK_M:
        block_m = max(MIN_DOT_DIM, _next_pow2(rows))
        m_pad = block_m
    else:
        block_m = MAX_BLOCK_M
        m_pad = -(-rows // block_m) * block_m
    if block_k is None:
        block_k = 128 if block_m <= 32 else 64
    if not _is_pow2(block_k) or block_k < MIN_DOT_DIM:
        raise ValueError(f"block_k must be a power of 2 >= {MIN_DOT_DIM}; got {block_k}")
    while max_len % block_k != 0:
        block_k //= 2
    fits = lambda bk: shared_memory_estimate(block_m=block_m, block_k=bk, head_dim=head_dim,  # noqa: E731
                                             itemsize=itemsize) <= shared_memory_bytes
    while block_k > MIN_DOT_DIM and not fits(block_k):
        block_k //= 2
    if not fits(block_k):
        raise ValueError(f"the kernel's smallest tiles (block_m {block_m}, block_k {block_k}, head_dim {head_dim}, "
                         f"{itemsize}-byte elements) need more than {shared_memory_bytes} bytes of shared memory; "
                         "use attn_impl='xla' for these shapes")
    tail_blocks = -(-(num_new + block_k - 1) // block_k)
    max_blocks = max_len // block_k
    if num_splits is None:
        programs = batch * kv_heads * (m_pad // block_m)
        want = -(-2 * num_sms // programs)
        num_splits = max(1, min(want, max_blocks // 2, 64))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits}")
    return BlockPlan(block_m=block_m, m_pad=m_pad, block_k=block_k, tail_blocks=tail_blocks,
                     num_splits=num_splits, num_warps=4, num_stages=2)


def _kv_extent(length, *, num_new: int, max_len: int, block_k: int):
    """(end, num_blocks): readable positions are < end = min(length + N, S), in num_blocks blocks.

    num_blocks is clamped to [0, S // block_k] so no caller-supplied length can make the
    kernel read a block outside the cache (positions >= S do not exist).
    """
    end = jnp.minimum(length + num_new, max_len)
    num_blocks = lax.div(jnp.maximum(end, 0) + block_k - 1, block_k)
    return end, jnp.minimum(num_blocks, max_len // block_k)


def _tree_attention_kernel(lengths_ref, layer_ref, q_ref, k_ref, v_ref, vis_ref, *out_refs,
                           scale_log2: float, num_new: int, block_k: int, num_splits: int,
                           dot_precision):
    """One (M block, split, row b, kv head): online softmax over this split's KV blocks.

    Refs: lengths [B], layer [1], q [block_m, D], k/v [L, S, D] (row b, kv head already
    selected by the BlockSpec; the layer is indexed here), vis int8 [block_m, tail_width].
    """
    split = pl.program_id(1)
    b = pl.program_id(2)
    length = lengths_ref[b]
    layer = layer_ref[0]
    block_m, head_dim = q_ref.shape
    max_len = k_ref.shape[1]

    end, num_blocks = _kv_extent(length, num_new=num_new, max_len=max_len, block_k=block_k)
    first_tail = lax.div(length, block_k)  # first block that is not entirely prefix
    per_split = lax.div(num_blocks + num_splits - 1, num_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, num_blocks)

    q = q_ref[...]  # [block_m, D]

    def update(carry, k, v, visible):
        o, m, l = carry
        # [block_m, block_k] fp32, log2 domain
        s = plgpu.dot(q, k, trans_b=True, precision=dot_precision) * scale_log2
        if visible is not None:
            s = jnp.where(visible, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        l_new = alpha * l + jnp.sum(p, axis=1)
        o_new = alpha[:, None] * o + plgpu.dot(p.astype(v.dtype), v, precision=dot_precision)
        return o_new, m_new, l_new

    def prefix_body(kb, carry):
        kv_slice = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        k = k_ref[layer, kv_slice, :]
        v = v_ref[layer, kv_slice, :]
        return update(carry, k, v, None)

    def tail_body(kb, carry):
        start = pl.multiple_of(kb * block_k, block_k)
        kv_slice = pl.ds(start, block_k)
        pos = start + jnp.arange(block_k, dtype=jnp.int32)
        readable = jnp.broadcast_to((pos < end)[:, None], (block_k, head_dim))
        k = plgpu.load(k_ref.at[layer, kv_slice, :], mask=readable, other=0.0)
        v = plgpu.load(v_ref.at[layer, kv_slice, :], mask=readable, other=0.0)
        vis_start = pl.multiple_of((kb - first_tail) * block_k, block_k)
        visible = vis_ref[:, pl.ds(vis_start, block_k)] != 0
        return update(carry, k, v, visible)

    carry = (jnp.zeros((block_m, head_dim), jnp.float32),
             jnp.full((block_m,), NEG_INF, jnp.float32),
             jnp.zeros((block_m,), jnp.float32))
    prefix_hi = jnp.maximum(lo, jnp.minimum(hi, first_tail))
    carry = lax.fori_loop(lo, prefix_hi, prefix_body, carry)
    tail_lo = jnp.maximum(lo, first_tail)
    carry = lax.fori_loop(tail_lo, jnp.maximum(tail_lo, hi), tail_body, carry)
    o, m, l = carry

    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l


def _dot_precision(dtype):
    """HIGHEST (IEEE fp32 dots) for fp32 inputs; Triton's default lowers to TF32 on Hopper/Ampere.

    bf16 keeps the default (None): its dots are exact-input bf16 MMAs either way.
    """
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _window_visibility(lengths_B, mask_BNN, plan: BlockPlan, group: int, max_len: int):
    """int8 [B, m_pad, tail_width]: visibility on the block-aligned window of each row's tail.

    The window starts at block floor(lengths/block_k), exactly where the kernel's tail phase
    starts; rows are the packed (n, g) query rows, padded rows see nothing. Near the end of
    the cache the window runs past S: those columns are never read (the kernel stops at
    block S // block_k) and are set invisible anyway, since positions >= S do not exist.
    """
    batch, num_new, _ = mask_BNN.shape
    lengths_B = lengths_B.astype(jnp.int32)
    window_start_B = (lengths_B // plan.block_k) * plan.block_k
    pos_BW = window_start_B[:, None] + jnp.arange(plan.tail_width, dtype=jnp.int32)[None]
    vis_BNW = visibility(lengths_B, mask_BNN, pos_BW) & (pos_BW < max_len)[:, None, :]
    vis_BMW = jnp.broadcast_to(vis_BNW[:, :, None, :],
                               (batch, num_new, group, plan.tail_width))
    vis_BMW = vis_BMW.reshape(batch, num_new * group, plan.tail_width)
    vis_BMW = jnp.pad(vis_BMW, ((0, 0), (0, plan.m_pad - num_new * group), (0, 0)))
    return vis_BMW.astype(jnp.int8)


@functools.partial(jax.jit,
                   static_argnames=("sm_scale", "block_k", "interpret", "num_splits"))
def tree_attention(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, *, sm_scale=None, layer=None,
                   block_k=None, interpret=False, num_splits=None):
    """Tree-verification attention with the Pallas Triton kernel; same result as the reference.

    q [B, N, Hq, D]; k/v [B, S, Hkv, D] or the stacked [L, B, S, Hkv, D] with `layer` (int32
    scalar, may be traced): the kernel indexes the layer itself, no slice of the cache is made.
    lengths int32 [B], each in 0..S; mask bool [B, N, N]. Returns [B, N, Hq, D] in q's dtype.
    lengths + N may exceed S: new tokens whose slot is >= S do not exist in the cache and are
    invisible (as in the reference); a query that sees nothing at all gets zeros. The kernel
    never reads outside the cache, whatever lengths holds.
    fp32 inputs use full-fp32 dots (no TF32); bf16 dots keep Triton's default.
    S must be a multiple of 16; block_k (default 128 or 64) shrinks to a power of 2 dividing S.
    num_splits: programs per row's KV range (None: sized to fill the GPU; see plan_blocks).
    """
    check_inputs(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, layer)
    if k_BSKD.ndim == 4:  # one layer: view it as a stack of one (a bitcast, no copy)
        k_LBSKD, v_LBSKD, layer = k_BSKD[None], v_BSKD[None], 0
    else:
        k_LBSKD, v_LBSKD = k_BSKD, v_BSKD
    num_layers, batch, max_len, kv_heads, head_dim = k_LBSKD.shape
    _, num_new, q_heads, _ = q_BNHD.shape
    group = q_heads // kv_heads
    plan = plan_blocks(batch=batch, num_new=num_new, group=group, kv_heads=kv_heads,
                       max_len=max_len, head_dim=head_dim, block_k=block_k,
                       num_splits=num_splits, itemsize=jnp.dtype(q_BNHD.dtype).itemsize)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    rows = num_new * group

    # Pack queries: [B, N, Hkv, G, D] -> [B, Hkv, N*G, D], rows padded with zeros to m_pad.
    q_BKMD = q_BNHD.reshape(batch, num_new, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_BKMD = q_BKMD.reshape(batch, kv_heads, rows, head_dim)
    q_BKMD = jnp.pad(q_BKMD, ((0, 0), (0, 0), (0, plan.m_pad - rows), (0, 0)))
    vis_BMW = _window_visibility(lengths_B, mask_BNN, plan, group, max_len)
    lengths_B = lengths_B.astype(jnp.int32)
    layer_1 = jnp.asarray(layer, jnp.int32).reshape(1)

    bm, splits = plan.block_m, plan.num_splits
    # M blocks and splits vary fastest in launch order, so the programs that share one
    # (row, kv head) run together and re-read its K/V blocks from L2 rather than HBM.
    grid = (plan.num_m_blocks, splits, batch, kv_heads)
    in_specs = [
        pl.BlockSpec((batch,), lambda i, s, b, h: (0,)),  # lengths
        pl.BlockSpec((1,), lambda i, s, b, h: (0,)),  # layer
        pl.BlockSpec((None, None, bm, head_dim), lambda i, s, b, h: (b, h, i, 0)),  # q
        pl.BlockSpec((num_layers, None, max_len, None, head_dim),
                     lambda i, s, b, h: (0, b, 0, h, 0)),  # k
        pl.BlockSpec((num_layers, None, max_len, None, head_dim),
                     lambda i, s, b, h: (0, b, 0, h, 0)),  # v
        pl.BlockSpec((None, bm, plan.tail_width), lambda i, s, b, h: (b, i, 0)),  # visibility
    ]
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((batch, kv_heads, plan.m_pad, head_dim), q_BNHD.dtype)]
        out_specs = [pl.BlockSpec((None, None, bm, head_dim), lambda i, s, b, h: (b, h, i, 0))]
    else:
        part = (splits, batch, kv_heads, plan.m_pad)
        out_shape = [jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32)]
        out_specs = [
            pl.BlockSpec((None, None, None, bm, head_dim), lambda i, s, b, h: (s, b, h, i, 0)),
            pl.BlockSpec((None, None, None, bm), lambda i, s, b, h: (s, b, h, i)),
            pl.BlockSpec((None, None, None, bm), lambda i, s, b, h: (s, b, h, i)),
        ]
    kernel = functools.partial(_tree_attention_kernel, scale_log2=scale * LOG2_E,
                               num_new=num_new, block_k=plan.block_k, num_splits=splits,
                               dot_precision=_dot_precision(q_BNHD.dtype))
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=interpret,
        name="tree_attention",
    )(lengths_B, layer_1, q_BKMD, k_LBSKD, v_LBSKD, vis_BMW)

    if splits == 1:
        out_BKMD = outs[0]
    else:  # merge the split partials (flash-decoding): rescale to the common max, then sum
        o_PBKMD, m_PBKM, l_PBKM = outs
        m_BKM = jnp.max(m_PBKM, axis=0)
        w_PBKM = jnp.exp2(m_PBKM - m_BKM[None])
        l_BKM = jnp.sum(w_PBKM * l_PBKM, axis=0)
        o_BKMD = jnp.sum(w_PBKM[..., None] * o_PBKMD, axis=0)
        out_BKMD = (o_BKMD / jnp.where(l_BKM > 0, l_BKM, 1.0)[..., None]).astype(q_BNHD.dtype)

    out_BKMD = out_BKMD[:, :, :rows].reshape(batch, kv_heads, num_new, group, head_dim)
    return out_BKMD.transpose(0, 2, 1, 3, 4).reshape(batch, num_new, q_heads, head_dim)
