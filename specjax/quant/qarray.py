"""`QuantizedWeight`: a linear weight [..., in, out] stored quantized, dequantized inside the jitted matmul.

One representation covers every format specjax reads: integer or FP8 values `q` [..., I, O] (the weight's own
dtype: float8_e4m3fn, int8, int4), one `scale` per (input block, output block) [..., ceil(I / bi), ceil(O / bo)],
an optional `zero` point of the same shape (asymmetric integer formats: w = (q - zero) * scale), and an optional
`g_idx` [..., I] giving each input row's group (GPTQ's act-order; without it row i is in block i // bi).
  block FP8 (DeepSeek-V3, Qwen FP8):  block (128, 128), ragged last blocks (the ceil)
  per-channel (FP8-dynamic, INT8):    block (I, 1)
  per-tensor:                         block (I, O)
  grouped INT4 / INT8 (AWQ, GPTQ, compressed-tensors pack-quantized): block (group, 1)

It is a pytree (leaves q, scale, zero, g_idx, input_scale; block, compute dtype, activations static), so it sits
where a weight array sits: the value of an `nnx.Param`, a params dict's leaf, a stacked [L, ...] weight sliced by
`lax.scan`, a leaf placed with its own sharding. Model code multiplies `x @ w` unchanged: `__rmatmul__`
dequantizes in the activation's dtype inside the trace (the whole weight's meaning: each block times its own scale,
so 128 x 128 block scales along the contraction stay blocks, not a per-channel approximation), and the matmul
consumes it;
traced for a GPU, a 2-D block-FP8 weight runs the fused Pallas kernel instead (kernels/fp8_matmul.py: XLA does
not fuse the dequantization into its GEMM there).
Why not google/qwix: its QArray needs scale tiles that divide the weight (no ragged 128-blocks), has no
per-row group index (GPTQ act-order), and enters a model by intercepting nnx.Linear / einsum calls, which
our functional modules (plain `x @ w` on param dicts under scan) do not make; the dequantizing matmul is ~40 lines.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels
from specjax.quant.activations import Activations, fake_quantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    q: jax.Array                      # [..., I, O] quantized values (float8_e4m3fn, int8, int4)
    scale: jax.Array                  # [..., ceil(I / bi) or groups, ceil(O / bo)]
    zero: jax.Array | None = None     # like scale, in q's units (asymmetric integer formats)
    g_idx: jax.Array | None = None    # [..., I] int32: each input row's scale row (GPTQ act-order)
    block: tuple[int, int] = dataclasses.field(default=(1, 1), metadata=dict(static=True))
    fmt: str = dataclasses.field(default="", metadata=dict(static=True))         # e.g. "fp8 block 128x128"
    compute_dtype: str = dataclasses.field(default="bfloat16", metadata=dict(static=True))
    # "blocks": dequantize the weight (each block times its scale), then one dot; "ktile": one dot per input block,
    # each [..., O] partial product scaled by its blocks' scales, then summed (MATMULS; opt-in, specjax.load)
    matmul: str = dataclasses.field(default="blocks", metadata=dict(static=True))
    # W8A8: how the input is quantized before the matmul (quant/activations.py); None: it is not (weight-only)
    activations: Activations | None = dataclasses.field(default=None, metadata=dict(static=True))
    input_scale: jax.Array | None = None  # [...] (the weight's leading shape): a static activation scale

    # ---- array-like facts, so code that asks a weight its shape or dtype keeps working ----
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self):
        """The dtype the weight computes in (what a dense weight's dtype says)."""
        return jnp.dtype(self.compute_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held: the quantized values (int4 counted at half a byte) plus scales, zero points and g_idx."""
        return sum(leaf_bytes(x) for x in jax.tree.leaves(self))

    def __getitem__(self, index):
        """`param[...]` (how modules read a weight) returns the weight itself; an int takes one stacked entry."""
        if index is Ellipsis:
            return self
        return jax.tree.map(lambda x: x[index], self)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x @ W: the weight dequantized to x's dtype, then the dot; with matmul="ktile" (and scales that vary along
        the input, no g_idx) the K-tile form instead. Traced for a GPU, a 2-D block-FP8 weight (no zero point or
        g_idx; a stacked weight is 2-D inside the layer scan) with the default matmul="blocks" runs the fused Pallas
        kernel `kernels.block_fp8_matmul` instead: XLA writes the dequantized weight to memory before its GEMM
        (docs/quantization.md), the kernel converts the FP8 tiles in registers. The CPU path is unchanged.
        With `activations` set (W8A8), x is first quantized as the format says and scaled back (fake quantization,
        quant/activations.py), then either path multiplies it: the kernel takes that x as it takes any."""
        if self.activations is not None:
            x = fake_quantize(x, self.activations, self.input_scale)
        if self.matmul == "ktile" and self.q.ndim == 2 and self.g_idx is None and self.scale.shape[0] > 1:
            return self.ktile_matmul(x)
        if (self.matmul == "blocks" and self.q.ndim == 2 and self.zero is None and self.g_idx is None
                and self.q.dtype == jnp.float8_e4m3fn
                and kernels.use_fp8_matmul_kernel(x.dtype, self.q.dtype, self.block)):
            return kernels.block_fp8_matmul(x, self.q, self.scale, block=self.block)
        return x @ self.dequantize(x.dtype)

    def ktile_matmul(self, x: jax.Array) -> jax.Array:
        """x @ W without the scaled weight: the values cast to x's dtype, one dot per input block of bi rows (its
        partial product [..., Kt, O]), each times its blocks' scales in fp32, summed over the blocks.
        A zero point subtracts sum(x over the block) x zero. Equal to the dequantized matmul up to rounding (the
        scale multiplies a sum instead of each element). The input is zero-padded to whole blocks."""
        bi = self.block[0]
        k, n = self.q.shape
        kt = -(-k // bi)
        pad = kt * bi - k
        x_tiles = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], kt, bi)
        q_tiles = jnp.pad(self.q.astype(x.dtype), ((0, pad), (0, 0))).reshape(kt, bi, n)
        # each partial product in x's dtype, as the plain matmul gives it (XLA's CPU has no batched bf16 x bf16 -> f32
        # dot), then scaled and summed in fp32
        partial = jnp.einsum("...tb,tbn->...tn", x_tiles, q_tiles).astype(jnp.float32)
        if self.zero is not None:
            zero_TN = self.expand_columns(self.zero, n, jnp).astype(jnp.float32)
            partial = partial - x_tiles.astype(jnp.float32).sum(-1)[..., None] * zero_TN
        scale_TN = self.expand_columns(self.scale, n, jnp).astype(jnp.float32)
        return (partial * scale_TN).sum(-2).astype(x.dtype)

    def expand_columns(self, per_block, o: int, xp):
        """A per-block array [Gi, Go] repeated along the output to [Gi, O] (last block ragged)."""
        bo = self.block[1]
        return per_block if bo == 1 or per_block.shape[-1] == o else xp.repeat(per_block, bo, axis=-1)[..., :o]

    def dequantize(self, dtype=None) -> jax.Array:
        """The weight [..., I, O] as the format defines it: (q - zero) * scale of its block, in fp32, then cast."""
        dtype = jnp.dtype(dtype or self.compute_dtype)
        xp = np if isinstance(self.q, np.ndarray) else jnp
        i, o = self.q.shape[-2:]
        w = self.q.astype(np.float32)
        if self.zero is not None:
            w = w - self.expand(self.zero, i, o, xp).astype(np.float32)
        return (w * self.expand(self.scale, i, o, xp).astype(np.float32)).astype(dtype)

    def expand(self, per_block, i: int, o: int, xp):
        """A per-block array [..., Gi, Go] repeated to [..., I, O] (rows by g_idx when given; last blocks ragged)."""
        bi, bo = self.block
        if self.g_idx is not None:
            rows = xp.take_along_axis(per_block, self.g_idx[..., :, None].astype(np.int32), axis=-2) \
                if per_block.ndim > 2 else per_block[self.g_idx]
        elif bi == 1 or per_block.shape[-2] == i:
            rows = per_block
        else:
            rows = xp.repeat(per_block, bi, axis=-2)[..., :i, :]
        return self.expand_columns(rows, o, xp)


MATMULS = ("blocks", "ktile")


def leaf_bytes(x) -> int:
    """Bytes of one array, sub-byte dtypes (int4) counted at their bit width."""
    bits = jnp.dtype(x.dtype).itemsize * 8 if jnp.dtype(x.dtype).name not in ("int4", "uint4") else 4
    return math.ceil(int(np.prod(x.shape)) * bits / 8)


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def dequantize_tree(tree, dtype=None):
    """Every QuantizedWeight in a params tree replaced by its dequantized array (the exact mode)."""
    return jax.tree.map(lambda x: x.dequantize(dtype) if is_quantized(x) else x, tree, is_leaf=is_quantized)


def quantized_formats(tree) -> list[str]:
    """The distinct formats of a params tree's quantized weights, in order of first appearance (with their
    activation quantization, e.g. "int8 per channel, activations int8 dynamic per token")."""
    seen: list[str] = []
    for x in filter(is_quantized, jax.tree.leaves(tree, is_leaf=is_quantized)):
        name = x.fmt + (f", activations {x.activations.name}" if x.activations else "")
        if name not in seen:
            seen.append(name)
    return seen


def take_columns(w: QuantizedWeight, cols: np.ndarray) -> QuantizedWeight | None:
    """The output columns `cols` of `w` (a load-time split or reorder: Qwen3.5's per-head [q | gate]), values and
    scales taken together; None where a new scale block would mix columns of different source blocks (the split
    cuts a block: the caller dequantizes). The output's ragged last block is allowed."""
    bo = w.block[1]
    cols = np.asarray(cols)
    src_block = cols // bo
    starts = src_block[::bo]
    if not np.array_equal(src_block, np.repeat(starts, bo)[: len(cols)]):
        return None

    def per_block(x):
        return None if x is None else x[..., starts]

    return dataclasses.replace(w, q=w.q[..., cols], scale=per_block(w.scale), zero=per_block(w.zero))
