"""Quantizing a plain weight into a `QuantizedWeight` in the formats checkpoints ship: for random targets in
benchmarks and GPU checks (a random 8B target in FP8 without an 8B file), and for tests. Loading a checkpoint
reads the producer's values as they are (convert/quantized.py); only the opt-in `quantized_matmul="per_channel"`
re-quantizes them (requantize_per_channel below).

  "fp8"   block FP8 (float8_e4m3fn, one f32 scale per 128 x 128 block: max |w| / 448), as DeepSeek-V3 / Qwen ship
  "int8"  INT8 per output channel (max |w| / 127), as compressed-tensors W8A8 ships
  "int4"  INT4 per group of 128 inputs (max |w| / 7, symmetric), as compressed-tensors W4A16 ships
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.quant.qarray import MATMULS, QuantizedWeight, is_quantized

FORMATS = ("fp8", "int8", "int4")
QUANTIZED_MATMULS = (*MATMULS, "per_channel")  # how a loaded quantized weight multiplies (specjax.load)
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


def requantize_per_channel(w: QuantizedWeight) -> QuantizedWeight:
    """An FP8 weight with scales that vary along the input (128 x 128 blocks) re-quantized at load to FP8 with one
    scale per output column (max |w[:, o]| / 448 of the dequantized weight), so the scale commutes with the matmul
    (tpu-inference's choice for TPUs). It changes the numbers: opt-in only (`specjax.load(...,
    quantized_matmul="per_channel")`; docs/quantization.md reports its error). Other weights are returned as they
    are: integer formats' groups would lose far more at one scale per column; a g_idx has no blocks to merge."""
    if not w.fmt.startswith("fp8") or w.g_idx is not None or w.scale.shape[-2] == 1:
        return w
    exact = np.asarray(w.dequantize(np.float32))  # on the host: it runs at load, before the weights are placed
    scale = np.maximum(np.max(np.abs(exact), axis=-2, keepdims=True), 1e-12) / FP8_MAX  # [..., 1, O]
    q = (exact / scale).astype(ml_dtypes.float8_e4m3fn)
    return QuantizedWeight(q, scale, block=(w.shape[-2], 1), fmt=f"fp8 per channel (re-quantized from {w.fmt})",
                           compute_dtype=w.compute_dtype, activations=w.activations, input_scale=w.input_scale)


def check_matmul(mode: str) -> None:
    """ValueError unless `mode` is one of QUANTIZED_MATMULS."""
    if mode not in QUANTIZED_MATMULS:
        raise ValueError(f"quantized_matmul must be one of {QUANTIZED_MATMULS}, got {mode!r}")


def with_matmul(params, mode: str):
    """`params` with every QuantizedWeight run by `mode`: "blocks" (as stored, the default), "ktile" (quant/qarray.py
    ktile_matmul) or "per_channel" (requantize_per_channel, then the plain dequantizing matmul).

    Raises:
        ValueError: an unknown mode.
    """
    check_matmul(mode)
    if mode == "blocks":
        return params

    def one(w):
        if not is_quantized(w):
            return w
        return requantize_per_channel(w) if mode == "per_channel" else dataclasses.replace(w, matmul=mode)

    return jax.tree.map(one, params, is_leaf=is_quantized)
