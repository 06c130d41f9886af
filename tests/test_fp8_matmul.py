"""The fused block-FP8 matmul (specjax/kernels/fp8_matmul.py) in Pallas's interpreter against the exact product and
QuantizedWeight's dequantizing matmul, its tiling plan, its refusals, and where QuantizedWeight uses it: traced for
a GPU (the kernel's pallas_call in the jaxpr, stacked layers included), never on the CPU.

Tolerances are bounds, not fitted numbers. Exact = x in f32 @ the weight dequantized in f32 (the e4m3 -> bf16 / f32
conversion is exact). With u = 2^-24 (f32) and |x| @ |W| as the scale of each output element:
  f32 activations: the kernel and the reference each sum K products in f32 (gamma_K ~ K u each) and round each
    scale product once, so |y - exact| <= (2K + 2) u (|x| @ |W|); the test allows 4K u (twice that);
  bf16 activations: the products are exact in f32 and the output is rounded to bf16 once (2^-9 relative), so
    |y - exact| <= 2^-9 |exact| plus the f32 term; the test allows 2^-8 |exact|;
  against the dequantizing matmul (its weight rounded to bf16 first, 2^-9 relative a product, and its output
    rounded too) the difference is within 2^-8 (|x| @ |W|); the test allows 2^-7.
The compiled kernel on a GPU gets 2^-12 (|x| @ |W|) more: tensor cores' fp32 accumulation is not IEEE
round-to-nearest (its alignment truncates), so the u bound above does not hold for it.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from specjax.config import ModelConfig
from specjax.kernels import block_fp8_matmul, plan_fp8_matmul, targeting_gpu
from specjax.quant.qarray import QuantizedWeight
from specjax.quant.quantize import quantize_weight


def fp8_weight(k: int, n: int, scale_dtype=jnp.float32, seed: int = 0) -> QuantizedWeight:
    """A random [k, n] weight in block FP8 (128 x 128, ragged last blocks), its scales in scale_dtype, with blocks
    of different magnitudes so a scale applied to the wrong block shows."""
    w = 0.02 * jax.random.normal(jax.random.key(seed), (k, n))
    w = w * (1 + 9 * (jnp.arange(k)[:, None] // 128 % 2)) * (1 + 4 * (jnp.arange(n)[None, :] // 128 % 2))
    qw = quantize_weight(w, "fp8")
    return QuantizedWeight(qw.q, qw.scale.astype(scale_dtype), block=qw.block, fmt=qw.fmt)


def check_against_references(y, x, w: QuantizedWeight, extra: float = 0.0):
    x32, w32 = x.astype(jnp.float32), w.dequantize(jnp.float32)
    exact = jnp.matmul(x32, w32, precision="highest")  # IEEE f32 (a GPU's default f32 dot is TF32)
    size = jnp.matmul(jnp.abs(x32), jnp.abs(w32), precision="highest")  # |x| @ |W|
    k = x.shape[-1]
    y32 = y.astype(jnp.float32)
    accumulation = (4 * k * 2.0**-24 + extra) * size
    rounding = 2.0**-8 * jnp.abs(exact) if x.dtype == jnp.bfloat16 else 0.0
    assert y.dtype == x.dtype and y.shape == exact.shape
    assert bool(jnp.all(jnp.abs(y32 - exact) <= rounding + accumulation))
    dequantizing = (x @ w.dequantize(x.dtype)).astype(jnp.float32)  # QuantizedWeight's CPU matmul
    assert bool(jnp.all(jnp.abs(y32 - dequantizing) <= 2.0**-7 * size + accumulation))


# (x shape, K, N, x dtype, scale dtype, num_splits): M = 1, 5, 20 (a 32-row tile), 70 (two 64-row tiles); K and N
# ragged against the 128 blocks and the 64-column tiles, and aligned; leading batch dims; split-K forced and auto
CASES = [((1, 300), 300, 200, jnp.bfloat16, jnp.float32, None),
         ((5, 256), 256, 384, jnp.float32, jnp.bfloat16, 2),
         ((2, 10, 130), 130, 70, jnp.float32, jnp.float16, None),
         ((70, 129), 129, 96, jnp.bfloat16, jnp.bfloat16, 1),
         ((1, 1, 512), 512, 128, jnp.bfloat16, jnp.float32, None)]


@pytest.mark.parametrize("x_shape,k,n,x_dtype,scale_dtype,splits", CASES)
def test_kernel_equals_the_block_fp8_product(x_shape, k, n, x_dtype, scale_dtype, splits):
    w = fp8_weight(k, n, scale_dtype)
    x = jax.random.normal(jax.random.key(1), x_shape).astype(x_dtype)
    y = block_fp8_matmul(x, w.q, w.scale, block=w.block, interpret=True, num_splits=splits)
    check_against_references(y, x, w)


def test_the_plan_for_an_8b_decode_and_prefill():
    """Decode tiles are 16 rows x 64 columns x 128 K rows (one scale a step); split-K only where the N tiles leave
    SMs idle: wq / wo / w_down (64 tiles) in 3, wk / wv (16 tiles) in 8, the 224 tiles of w_gate / w_up in 1."""
    decode = {n: plan_fp8_matmul(m=1, k=k, n=n, block=(128, 128)) for k, n in ((4096, 4096), (4096, 1024),
                                                                                  (4096, 14336))}
    assert {(p.block_m, p.block_n, p.block_k) for p in decode.values()} == {(16, 64, 128)}
    assert [p.num_splits for p in decode.values()] == [3, 8, 1]
    assert plan_fp8_matmul(m=8, k=14336, n=4096, block=(128, 128)).num_splits == 3
    prefill = plan_fp8_matmul(m=1024, k=4096, n=4096, block=(128, 128))
    assert (prefill.block_m, prefill.block_n, prefill.num_splits) == (64, 128, 1)
    assert plan_fp8_matmul(m=1024, k=4096, n=4096, block=(128, 128), itemsize=4).block_n == 64  # fp32: fast compile
    assert plan_fp8_matmul(m=1, k=4096, n=4096, block=(64, 32)).block_k == 64  # tiles within a scale block
    assert plan_fp8_matmul(m=1, k=4096, n=4096, block=(64, 32)).block_n == 32


def test_bad_input_is_refused_with_the_reason():
    w = fp8_weight(256, 128)
    x = jnp.ones((2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="powers of 2 >= 16.*256 x 1"):
        block_fp8_matmul(x, w.q, w.scale, block=(256, 1), interpret=True)
    with pytest.raises(ValueError, match="float8_e4m3fn; got int8"):
        block_fp8_matmul(x, w.q.astype(jnp.int8), w.scale, interpret=True)
    with pytest.raises(ValueError, match="activations must be one of"):
        block_fp8_matmul(x.astype(jnp.int32), w.q, w.scale, interpret=True)
    with pytest.raises(ValueError, match=r"scale_GH must be \[ceil\(K / 128\), ceil\(N / 128\)\] = \(2, 1\)"):
        block_fp8_matmul(x, w.q, w.scale.T, interpret=True)
    with pytest.raises(ValueError, match="must agree on K"):
        block_fp8_matmul(x[:, :100], w.q, w.scale, interpret=True)
    with pytest.raises(ValueError, match=r"num_splits must be in 1..2"):
        block_fp8_matmul(x, w.q, w.scale, interpret=True, num_splits=3)


def pallas_calls(jaxpr) -> list[str]:
    """The names of the pallas_calls in a jaxpr and every jaxpr inside it (jit, scan, cond bodies)."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(str(eqn.params["name"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    names += pallas_calls(getattr(sub, "jaxpr", sub))
    return names


def kernel_calls(fn, *args) -> int:
    """The FP8 kernel's pallas_calls in fn's jaxpr (a scan body counted once). Traced through a new function each
    time: JAX's trace cache keys on the function and the arguments, not on `targeting_gpu`."""
    return pallas_calls(jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr).count("block_fp8_matmul")


on_cpu = pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU's path (a GPU takes the kernel)")
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs the compiled kernel: needs a GPU")


@on_cpu
def test_quantized_weight_takes_the_kernel_only_when_traced_for_a_gpu(caplog):
    w = fp8_weight(256, 192)
    x = jnp.ones((3, 256), jnp.bfloat16)
    matmul = lambda x, w: x @ w  # noqa: E731
    # the CPU: the dequantizing matmul, exactly as before
    assert kernel_calls(matmul, x, w) == 0
    assert str(jax.make_jaxpr(matmul)(x, w)) == str(jax.make_jaxpr(lambda x, w: x @ w.dequantize(x.dtype))(x, w))
    with targeting_gpu():
        assert kernel_calls(matmul, x, w) == 1
        assert kernel_calls(matmul, x.astype(jnp.float32), w) == 1
        stacked = jax.tree.map(lambda a: jnp.stack([a, a]), w)  # [L, K, N]: 2-D inside the layer scan
        assert kernel_calls(lambda x, ws: jax.lax.scan(lambda h, wl: (h, h @ wl), x, ws)[1], x, stacked) == 1
        # not block FP8 with a kernel-sized block, or another matmul chosen: the dequantizing matmul
        assert kernel_calls(matmul, x, quantize_weight(w.dequantize(jnp.float32), "int4")) == 0
        assert kernel_calls(matmul, x, QuantizedWeight(w.q, w.scale, block=w.block, matmul="ktile")) == 0
        with caplog.at_level(logging.WARNING, logger="specjax"):
            per_channel = QuantizedWeight(w.q, jnp.ones((1, 192)), block=(256, 1))
            assert kernel_calls(matmul, x, per_channel) == 0
        assert "block-FP8 matmul: using the XLA reference" in caplog.text and "256 x 1" in caplog.text


@pytest.mark.parametrize("m,k,n", [(1, 4096, 4096), (5, 300, 200)])
def test_x_at_w_lowers_to_the_triton_kernel_for_cuda(m, k, n):
    """Pallas's Triton lowering of the kernel, without a GPU or jaxlib's CUDA plugin (tests/test_gpu_compile.py
    compiles it for an H100 where the plugin is installed): an 8B projection's split-K plan and a ragged one."""
    w = QuantizedWeight(jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
                        jax.ShapeDtypeStruct((-(-k // 128), -(-n // 128)), jnp.float32), block=(128, 128))
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    with targeting_gpu():
        text = jax.jit(lambda x, w: x @ w).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "block_fp8_matmul" in text


@on_cpu
def test_a_block_fp8_decoder_runs_every_linear_through_the_kernel_on_a_gpu():
    """The stacked decoder's forward traced for a GPU: each of a layer's 7 linears (the scan body, once) is the
    kernel; the embedding and lm_head stay plain."""
    from specjax.aot.graphs import fp8_linears, shapes
    from specjax.models.cache import init_cache
    from specjax.models.model import forward, param_shapes

    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, dtype="bfloat16")
    params = fp8_linears(shapes(param_shapes(cfg), cfg.dtype), cfg.dtype)
    tokens = jnp.zeros((1, 3), jnp.int32)
    fn = lambda p: forward(p, cfg, tokens, init_cache(cfg, 1, 16), attn_impl="xla")[0]  # noqa: E731
    assert kernel_calls(fn, params) == 0
    with targeting_gpu():
        assert kernel_calls(fn, params) == 7


@on_gpu
@pytest.mark.parametrize("x_shape,k,n,x_dtype,scale_dtype,splits", CASES + [((8, 4096), 4096, 14336, jnp.bfloat16,
                                                                              jnp.float32, None)])
def test_the_compiled_kernel_on_a_gpu(x_shape, k, n, x_dtype, scale_dtype, splits):
    """scripts/gpu_checks.sh quant: the Triton kernel itself (not the interpreter), directly and as `x @ w`."""
    w = fp8_weight(k, n, scale_dtype)
    x = jax.random.normal(jax.random.key(1), x_shape).astype(x_dtype)
    check_against_references(block_fp8_matmul(x, w.q, w.scale, block=w.block, num_splits=splits), x, w, 2.0**-12)
    assert kernel_calls(lambda x, w: x @ w, x, w) == 1
    check_against_references(jax.jit(lambda x, w: x @ w)(x, w), x, w, 2.0**-12)
