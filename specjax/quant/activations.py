"""Activation quantization of W8A8 formats: the input of a quantized linear rounded to INT8 or FP8 as the format
says, before it meets the weight (`QuantizedWeight.__rmatmul__`).

A format's config declares it (convert/quantized.py reads it): compressed-tensors' `input_activations` (INT8 W8A8
and FP8-dynamic per token, FP8 static per tensor with each linear's stored `input_scale`, FP8-block per group of
128 inputs) and block FP8's `activation_scheme: "dynamic"` (per token per group of the weight block's input size).
What runs is fake quantization in fp32, x_fq = clamp(round(x / s)) * s, cast back to x's dtype: the rounded input
times its scale is the value the integer / FP8 GEMM multiplies (its output (x_q @ w_q) * s_x * s_w equals x_fq @ w
up to the sums' rounding), so the dequantizing matmul, and the fused FP8 kernel fed x_fq, compute the format.

The definitions, from the producers' own code:
  compressed-tensors (compressed_tensors/quantization/utils/helpers.py `calculate_qparams`, symmetric): the
      scale is max |x| over the granule / ((q_max - q_min) / 2): 448 for FP8 e4m3 (q_min = -448), 127.5 for INT8
      (q_min = -128, q_max = 127; not 127); a zero scale is replaced by the scale dtype's eps. Dynamic granules
      (`compute_dynamic_scales_and_zp`, same file): "token" = each row of the last axis, "tensor" = the whole
      input, "group" = groups of `group_size` along the last axis. The rounding (lifecycle/forward_helpers.py
      `_quantize_dequantize`, quant_args.py `round_to_quantized_type_args`): x / s clamped to [q_min, q_max],
      then torch.round (half to even) for INT8 or a cast to float8_e4m3fn (round to nearest even) for FP8,
      times s.
  block FP8 (vLLM vllm/model_executor/layers/quantization/utils/fp8_utils.py `per_token_group_quant_fp8`,
      group = weight_block_size[1]): s = max(max |x| over the group, 1e-10) / 448, x / s clamped to +-448, cast
      to FP8. transformers 5.x's FP8Linear runs the hub kernel kernels-community/finegrained-fp8 (not installed
      here), whose `fp8_act_quant` read as public code computes s = max |x| / 448 and x / max(s, 1e-12): the
      same wherever max |x| > 4.5e-10.

Scales are computed in fp32 whatever x's dtype (vLLM's kernels do; the compressed-tensors package computes them
in x's dtype, so on a bf16 torch model its scales are bf16-rounded: an fp32 reference is equal, a bf16 one differs
by that rounding of each scale). "token" and "group" scales depend on a row alone, so a token's output does not depend
on the other rows of its batch (speculative verification and plain decoding see the same function); a dynamic
"tensor" scale is the whole input's and does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

KINDS = {"int8": (-128.0, 127.0), "fp8": (-448.0, 448.0)}  # q_min, q_max
GRANULARITIES = ("token", "tensor", "group")


@dataclasses.dataclass(frozen=True)
class Activations:
    """How a W8A8 format quantizes a linear's input (static: hashable, part of the traced function).

    kind: "int8" or "fp8" (e4m3). granularity: "token" (one scale per row of the last axis), "tensor" (one for
    the input) or "group" (one per `group` consecutive inputs of a row). static: the scale is the checkpoint's
    `input_scale` (granularity "tensor"), else computed from x at run time. divisor: max |x| / divisor is the
    scale (448 FP8; 127.5 compressed-tensors INT8). min_amax: max |x| is first raised to it (vLLM's eps, 1e-10;
    0 for compressed-tensors, whose zero scale becomes fp32's eps instead)."""
    kind: str
    granularity: str
    group: int = 0
    static: bool = False
    divisor: float = 448.0
    min_amax: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"activation kind must be one of {tuple(KINDS)}, got {self.kind!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"activation granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if (self.granularity == "group") != (self.group > 0):
            raise ValueError(f"activation group size {self.group} goes with granularity 'group' only")
        if self.static and self.granularity != "tensor":
            raise ValueError(f"static activation scales are per tensor; got granularity {self.granularity!r}")

    @property
    def name(self) -> str:
        """e.g. "fp8 dynamic per token", "int8 static per tensor", "fp8 dynamic group 128"."""
        how = "static" if self.static else "dynamic"
        grain = f"group {self.group}" if self.granularity == "group" else f"per {self.granularity}"
        return f"{self.kind} {how} {grain}"


def fake_quantize(x: jax.Array, spec: Activations, input_scale: jax.Array | None = None) -> jax.Array:
    """x [..., K] rounded as `spec` says and scaled back, in x's dtype (module docstring). `input_scale` (static
    specs) has the weight's leading shape ([] for a matrix, [B] for B stacked experts multiplying x [B, ..., K])."""
    q_min, q_max = KINDS[spec.kind]
    x32 = x.astype(jnp.float32)
    if spec.static:
        if input_scale is None:
            raise ValueError(f"activations {spec.name} need the checkpoint's input_scale; the weight has none")
        s = jnp.asarray(input_scale, jnp.float32)
        scale = s.reshape(s.shape + (1,) * (x.ndim - s.ndim))
        return rounded(x32, scale, spec.kind, q_min, q_max).astype(x.dtype)
    k = x.shape[-1]
    if spec.granularity == "group":
        pad = -k % spec.group  # a ragged last group: zeros change no max
        x32 = jnp.pad(x32, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, spec.group)
    axes = None if spec.granularity == "tensor" else -1
    amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
    scale = divide(jnp.maximum(amax, spec.min_amax), jnp.float32(spec.divisor))
    scale = jnp.where(scale == 0, np.finfo(np.float32).eps, scale)
    out = rounded(x32, scale, spec.kind, q_min, q_max)
    if spec.granularity == "group":
        out = out.reshape(*x.shape[:-1], -1)[..., :k]
    return out.astype(x.dtype)


def rounded(x32: jax.Array, scale: jax.Array, kind: str, q_min: float, q_max: float) -> jax.Array:
    """clamp(x / scale) rounded to the format's grid (INT8: half to even; FP8 e4m3: nearest even), times scale."""
    v = jnp.clip(divide(x32, scale), q_min, q_max)
    v = jnp.round(v) if kind == "int8" else v.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return v * scale


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b as IEEE division, as the references divide. XLA's algebraic simplifier turns a division by a broadcast
    (x / s per row) or by a constant (amax / 127.5) into a multiplication by the reciprocal, which is not exact:
    x / s of a row's largest |x| then lands beside 127.5 instead of on it and rounds to the other side. The
    divisor broadcast to full shape behind an optimization barrier is an array XLA cannot see through."""
    b = jnp.broadcast_to(b, jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))).astype(a.dtype)
    return a / lax.optimization_barrier(b)
