"""Quantizing a plain weight into a `QuantizedWeight` in the formats checkpoints ship: for random targets in
benchmarks and GPU checks (a random 8B target in FP8 without an 8B file), and for tests. Loading a checkpoint never
re-quantizes: it reads the producer's values as they are (convert/quantized.py).

  "fp8"   block FP8 (float8_e4m3fn, one f32 scale per 128 x 128 block: max |w| / 448), as DeepSeek-V3 / Qwen ship
  "int8"  INT8 per output channel (max |w| / 127), as compressed-tensors W8A8 ships
  "int4"  INT4 per group of 128 inputs (max |w| / 7, symmetric), as compressed-tensors W4A16 ships
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.quant.qarray import QuantizedWeight

FORMATS = ("fp8", "int8", "int4")
FP8_MAX = 448.0
BLOCK = 128
# The dense decoder layer's linear weights ([in, out]): what a quantized checkpoint's target keeps quantized.
LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def quantize_weight(w_IO: jax.Array, fmt: str, compute_dtype: str = "bfloat16") -> QuantizedWeight:
    """`w_IO` [..., I, O] quantized in `fmt` (module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    w = w_IO.astype(jnp.float32)
    *lead, i, o = w.shape
    if fmt == "int8":
        scale = jnp.maximum(jnp.max(jnp.abs(w), axis=-2, keepdims=True), 1e-12) / 127
        q = jnp.clip(jnp.round(w / scale), -128, 127).astype(jnp.int8)
        return QuantizedWeight(q, scale, block=(i, 1), fmt="int8 per channel", compute_dtype=compute_dtype)
    bi, bo = (BLOCK, BLOCK) if fmt == "fp8" else (BLOCK, 1)
    gi, go = math.ceil(i / bi), math.ceil(o / bo)
    padded = jnp.pad(w, [(0, 0)] * len(lead) + [(0, gi * bi - i), (0, go * bo - o)])
    blocks = padded.reshape(*lead, gi, bi, go, bo)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(-3, -1)), 1e-12)  # [..., gi, go]
    scale = amax / (FP8_MAX if fmt == "fp8" else 7)
    scaled = (blocks / scale[..., :, None, :, None]).reshape(padded.shape)[..., :i, :o]
    if fmt == "fp8":
        q = scaled.astype(jnp.float8_e4m3fn)
        return QuantizedWeight(q, scale, block=(bi, bo), fmt=f"fp8 block [{bo}, {bi}]", compute_dtype=compute_dtype)
    q = jnp.clip(jnp.round(scaled), -8, 7).astype(jnp.int4)
    return QuantizedWeight(q, scale, block=(bi, bo), fmt=f"int4 group {bi}", compute_dtype=compute_dtype)


def quantize_params(params: dict, fmt: str) -> dict:
    """A dense target's params with every decoder layer's linear weight quantized in `fmt` (stacked or per-layer
    layout); the embedding, norms and lm_head stay as they are, as quantized checkpoints ship them."""
    def layer(weights: dict) -> dict:
        return {k: quantize_weight(v, fmt, str(v.dtype)) if k in LINEAR_KEYS and v is not None else v
                for k, v in weights.items()}

    layers = params["layers"]
    if isinstance(layers, dict) and 0 in layers:
        return {**params, "layers": {i: layer(w) for i, w in layers.items()}}
    if isinstance(layers, (list, tuple)):
        return {**params, "layers": [layer(w) for w in layers]}
    return {**params, "layers": layer(layers)}
