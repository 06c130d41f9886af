"""Pallas (Triton backend) block-FP8 matmul for GPU: x [M, K] @ W, W as float8_e4m3fn values [K, N] with one scale
per (bi x bo) block [ceil(K / bi), ceil(N / bo)], the weight never dequantized in memory.

Why: XLA (jax 0.10.2, H100 target) does not fuse a block-FP8 weight's dequantization into its GEMM; it writes the
whole dequantized bf16 weight to HBM and the GEMM reads it back, so a bandwidth-bound decode step moves ~5 bytes a
weight instead of 1 (docs/quantization.md). Here the FP8 tile is read once and converted in registers.

One program per (M block, K split, N block) output tile. It walks its K blocks of block_k rows (block_k divides bi,
so each step lies in one scale row): loads x [block_m, block_k] and the FP8 tile [block_k, block_n] (block_n
divides bo: one scale column), converts the tile to x's dtype, dots with fp32 accumulation, multiplies the
partial product by the step's one scale and adds it. The scale multiplies a sum rather than each weight element
(equal up to rounding; fp8 -> bf16 is exact, so with bf16 activations the only roundings are fp32 accumulation and
the output's cast). Ragged edges (M below the tile's 16 rows at decode, K or N not multiples of the tiles): masked
loads with zero fill and masked stores, so nothing is padded or copied outside the kernel.

Split-K (num_splits > 1): at decode (M <= 16) the N blocks alone give too few programs for 132 SMs on the narrow
projections (wq / wo / w_down of an 8B: 64 tiles of 64 columns); each split then takes a contiguous share of the K
blocks and writes an fp32 partial [splits, M, N] that XLA sums (one small fusion more). The split count is capped so
the partials' bytes (written and read) stay within an eighth of the weight's bytes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .tree_attention import DEFAULT_NUM_SMS, MIN_DOT_DIM, _dot_precision, _is_pow2, _next_pow2

MAX_BLOCK_M = 64  # rows per program; more rows -> more M blocks (each re-reads its weight tiles, from L2 mostly)
MAX_BLOCK_K = 128  # K rows per step (the usual FP8 scale block: one scale per step)
MIN_STEPS_PER_SPLIT = 4  # K blocks each split walks at least (so a split still pipelines its loads)
ACTIVATION_DTYPES = ("bfloat16", "float16", "float32")


def fp8_matmul_unsupported_reason(*, x_dtype, q_dtype, block: tuple[int, int]) -> str | None:
    """Why the kernel cannot multiply these (None if it can): FP8 e4m3 values, floating activations, and scale
    blocks that are powers of 2 >= 16 (Triton's dots need every dimension >= 16; a K step must lie in one block).
    Shared by `block_fp8_matmul` (which raises it) and QuantizedWeight's matmul (which falls back on it)."""
    if jnp.dtype(q_dtype) != jnp.float8_e4m3fn:
        return f"the weight's values must be float8_e4m3fn; got {jnp.dtype(q_dtype).name}"
    if jnp.dtype(x_dtype).name not in ACTIVATION_DTYPES:
        return f"the activations must be one of {ACTIVATION_DTYPES}; got {jnp.dtype(x_dtype).name}"
    bi, bo = block
    if not (_is_pow2(bi) and _is_pow2(bo) and min(bi, bo) >= MIN_DOT_DIM):
        return f"the scale block must be powers of 2 >= {MIN_DOT_DIM} (e.g. 128 x 128); got {bi} x {bo}"
    return None


@dataclasses.dataclass(frozen=True)
class Fp8MatmulPlan:
    """Static tiling of one block_fp8_matmul call."""

    block_m: int  # rows per program (>= 16; rows past M are masked)
    block_n: int  # output columns per program; divides the scale block's bo
    block_k: int  # K rows per step; divides the scale block's bi
    num_splits: int  # programs sharing one output tile's K range (split-K)
    num_warps: int
    num_stages: int

    def grid(self, m: int, k: int, n: int) -> tuple[int, int, int]:
        """(M blocks, splits, N blocks): M blocks vary fastest, so the programs reading one weight tile run together."""
        return -(-m // self.block_m), self.num_splits, -(-n // self.block_n)


def plan_fp8_matmul(*, m: int, k: int, n: int, block: tuple[int, int], itemsize: int = 2,
                    num_splits: int | None = None, num_sms: int = DEFAULT_NUM_SMS) -> Fp8MatmulPlan:
    """Choose the tiles. Decode (M <= 64): block_m = M rounded up to a power of 2 >= 16, block_n 64 (twice the
    programs of 128 on a bandwidth-bound GEMM). Larger M (prefill, wide verification): block_m 64, block_n 128 for
    16-bit activations (itemsize 2); fp32 keeps 64 (its IEEE dots compiled for H100 in 35-40 s at 64 x 128 x 128,
    2 s at 64 x 64 x 128). block_k = min(bi, 128), block_n <= bo. 3 stages of loads in flight (cp.async): the
    largest tile (64 x 128 x 128) compiled for H100 in fp32 and, in bf16, up to 8 stages, so shared memory needs no
    check at these tiles (unlike tree_attention's, whose K and V blocks scale with head_dim). num_splits=None: split
    K only while the tiles alone give fewer programs than SMs, at most ceil(SMs / programs), each split walking >= 4 K blocks, and the
    fp32 partials (written and read: 8 bytes an element) within an eighth of the FP8 weight's K x N bytes."""
    bi, bo = block
    block_m = max(MIN_DOT_DIM, _next_pow2(m)) if m <= MAX_BLOCK_M else MAX_BLOCK_M
    block_n = min(128 if m > MAX_BLOCK_M and itemsize == 2 else 64, bo)
    block_k = min(bi, MAX_BLOCK_K)
    k_blocks = -(-k // block_k)
    programs = -(-m // block_m) * -(-n // block_n)
    if num_splits is None:
        by_bytes = k // (64 * m)  # splits x M x N x 8 <= K x N / 8
        num_splits = max(1, min(-(-num_sms // programs), k_blocks // MIN_STEPS_PER_SPLIT, by_bytes))
    if not 1 <= num_splits <= k_blocks:
        raise ValueError(f"num_splits must be in 1..{k_blocks} (the K blocks of {block_k} rows); got {num_splits}")
    return Fp8MatmulPlan(block_m=block_m, block_n=block_n, block_k=block_k, num_splits=num_splits, num_warps=4,
                         num_stages=3)


def _fp8_matmul_kernel(x_ref, q_ref, scale_ref, o_ref, *, m: int, k: int, n: int, bi: int, bo: int,
                       block_m: int, block_k: int, block_n: int, num_splits: int, dot_precision):
    """One (M block, split, N block) tile. Refs: x [M, K], q [K, N] FP8, scale [ceil(K / bi), ceil(N / bo)], o [M, N]
    (or this split's fp32 partial [M, N]). Every load and store past M, K or N is masked (zero fill); the masks
    exist only where a dimension is ragged (static), so an 8B's aligned shapes run unmasked."""
    i, split, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0 = pl.multiple_of(i * block_m, block_m)
    n0 = pl.multiple_of(j * block_n, block_n)
    k_blocks = -(-k // block_k)
    per_split = -(-k_blocks // num_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, k_blocks)
    scale_col = (j * block_n) // bo
    rows_ok = (m0 + jnp.arange(block_m, dtype=jnp.int32) < m)[:, None] if m % block_m else None
    cols_ok = (n0 + jnp.arange(block_n, dtype=jnp.int32) < n)[None, :] if n % block_n else None

    def both(a, b):
        return a if b is None else b if a is None else a & b

    def body(kb, acc):
        k0 = pl.multiple_of(kb * block_k, block_k)
        depth_ok = (k0 + jnp.arange(block_k, dtype=jnp.int32) < k) if k % block_k else None
        x_ok = both(rows_ok, None if depth_ok is None else depth_ok[None, :])
        w_ok = both(None if depth_ok is None else depth_ok[:, None], cols_ok)
        x = plgpu.load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, block_k)],  # [block_m, block_k]
                       **({} if x_ok is None else dict(mask=x_ok, other=0.0)))
        w = plgpu.load(q_ref.at[pl.ds(k0, block_k), pl.ds(n0, block_n)],  # [block_k, block_n] FP8
                       **({} if w_ok is None else dict(mask=w_ok, other=0.0)))
        partial = plgpu.dot(x, w.astype(x.dtype), precision=dot_precision)  # [block_m, block_n] fp32
        return acc + partial * scale_ref[(kb * block_k) // bi, scale_col].astype(jnp.float32)

    acc = lax.fori_loop(lo, hi, body, jnp.zeros((block_m, block_n), jnp.float32))
    out_ok = both(rows_ok, cols_ok)
    plgpu.store(o_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], acc.astype(o_ref.dtype),
                **({} if out_ok is None else dict(mask=out_ok)))


@functools.partial(jax.jit, static_argnames=("block", "interpret", "num_splits"))
def block_fp8_matmul(x, q_KN, scale_GH, *, block: tuple[int, int] = (128, 128), interpret: bool = False,
                     num_splits: int | None = None):
    """x @ W for a block-FP8 weight W (values q_KN, scales scale_GH), without writing W dequantized.

    Args:
      x: activations [..., K] in bf16, f16 or f32 (leading dims are flattened into the M rows).
      q_KN: the weight's values [K, N], float8_e4m3fn.
      scale_GH: one scale per (bi x bo) block, [ceil(K / bi), ceil(N / bo)], f32 / bf16 / f16.
      block: (bi, bo), powers of 2 >= 16; the last blocks may be ragged (K, N need not be multiples).
      interpret: run the kernel in Pallas's interpreter (CPU tests).
      num_splits: K splits per output tile (None: `plan_fp8_matmul` decides).
    Returns:
      [..., N] in x's dtype: sum over blocks of (x_block @ q_block in fp32) x scale, as
      `x @ QuantizedWeight(q_KN, scale_GH, block=block).dequantize(x.dtype)` up to rounding.
    Raises:
      ValueError: unsupported dtypes or block (`fp8_matmul_unsupported_reason`), or shapes that do not agree.
    """
    reason = fp8_matmul_unsupported_reason(x_dtype=x.dtype, q_dtype=q_KN.dtype, block=block)
    if reason is not None:
        raise ValueError(reason)
    if q_KN.ndim != 2 or x.shape[-1] != q_KN.shape[0]:
        raise ValueError(f"x [..., K] and q_KN [K, N] must agree on K; got x {x.shape}, q_KN {q_KN.shape}")
    k, n = q_KN.shape
    bi, bo = block
    if scale_GH.shape != (-(-k // bi), -(-n // bo)):
        raise ValueError(f"scale_GH must be [ceil(K / {bi}), ceil(N / {bo})] = {(-(-k // bi), -(-n // bo))} for "
                         f"q_KN {q_KN.shape}; got {scale_GH.shape}")
    lead = x.shape[:-1]
    x_MK = x.reshape(-1, k)
    m = x_MK.shape[0]
    if m == 0:  # no rows: no programs to launch
        return jnp.zeros((*lead, n), x.dtype)
    plan = plan_fp8_matmul(m=m, k=k, n=n, block=block, itemsize=jnp.dtype(x.dtype).itemsize, num_splits=num_splits)
    splits = plan.num_splits
    bm, bn = plan.block_m, plan.block_n
    whole = lambda shape: pl.BlockSpec(shape, lambda i, s, j: (0,) * len(shape))  # noqa: E731 - indexed inside
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
        out_spec = whole((m, n))
    else:
        out_shape = jax.ShapeDtypeStruct((splits, m, n), jnp.float32)
        out_spec = pl.BlockSpec((None, m, n), lambda i, s, j: (s, 0, 0))
    kernel = functools.partial(_fp8_matmul_kernel, m=m, k=k, n=n, bi=bi, bo=bo, block_m=bm, block_k=plan.block_k,
                               block_n=bn, num_splits=splits, dot_precision=_dot_precision(x.dtype))
    out = pl.pallas_call(
        kernel,
        grid=plan.grid(m, k, n),
        in_specs=[whole((m, k)), whole((k, n)), whole(scale_GH.shape)],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
        interpret=interpret,
        name="block_fp8_matmul",
    )(x_MK, q_KN, scale_GH)
    if splits > 1:  # the splits' fp32 partials summed by XLA
        out = out.sum(0).astype(x.dtype)
    return out.reshape(*lead, n)
