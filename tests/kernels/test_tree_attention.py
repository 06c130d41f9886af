"""Tree-verification attention: Pallas kernel (interpret mode) vs XLA reference vs numpy.

Run with JAX_PLATFORMS=cpu (interpret mode), or on a GPU to test the compiled kernel.
Every cache position past lengths[b] + N is poisoned with NaN (and, for the stacked cache,
every other layer is all NaN), so a wrong read shows up as NaN. When lengths[b] + N > S the
new tokens past S do not exist (nothing to poison); interpret mode returns NaN for a read
past the end of the array, so an out-of-bounds read shows up as NaN too.
Interpret mode also fills pallas outputs with NaN before the kernel runs, so an output
element the kernel forgets to write is NaN too; every test asserts the result is finite.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import specjax.kernels as kernels_mod
from specjax.kernels import attention, plan_blocks, tree_attention, tree_attention_reference

# On a GPU machine the same tests run the compiled Triton kernel; elsewhere interpret mode.
INTERPRET = jax.default_backend() != "gpu"

# Tolerances against the XLA reference, per dtype. fp32: both sides accumulate in fp32
# (exp2 vs exp and online vs global max differ in the last bits). bf16: the output is
# rounded to bf16 (eps 2^-8 on values of magnitude <= ~3) and p is cast to bf16 before P@V.
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}


# ----------------------------------------------------------------------------- inputs


def random_tree_mask(rng, batch: int, num_new: int, kind: str) -> np.ndarray:
    """bool [B, N, N] ancestor-or-self masks: 'chain' is causal, 'tree' has random parents."""
    masks = np.zeros((batch, num_new, num_new), bool)
    for b in range(batch):
        parents = [-1] + [int(rng.integers(0, i)) if kind == "tree" else i - 1
                          for i in range(1, num_new)]
        for i in range(num_new):
            node = i
            while node >= 0:
                masks[b, i, node] = True
                node = parents[node]
    return masks


def make_inputs(seed, *, batch, num_new, q_heads, kv_heads, head_dim, max_len, lengths,
                dtype, tree="tree", num_layers=None, layer=None):
    """Random q/k/v/mask with everything outside the readable region set to NaN.

    lengths may be anything in 0..S, lengths + N may exceed S (new tokens past S do not exist).
    """
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    assert lengths.shape == (batch,) and np.all((lengths >= 0) & (lengths <= max_len))
    q = rng.standard_normal((batch, num_new, q_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, max_len, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, max_len, kv_heads, head_dim)).astype(np.float32)
    for b in range(batch):
        k[b, lengths[b] + num_new:] = np.nan
        v[b, lengths[b] + num_new:] = np.nan
    if num_layers is not None:  # stacked cache: only `layer` holds data, the rest is NaN
        k_full = np.full((num_layers, *k.shape), np.nan, np.float32)
        v_full = np.full((num_layers, *v.shape), np.nan, np.float32)
        k_full[layer], v_full[layer] = k, v
        k, v = k_full, v_full
    mask = random_tree_mask(rng, batch, num_new, tree)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(lengths), jnp.asarray(mask))


def numpy_attention(q, k, v, lengths, mask, sm_scale=None, layer=None):
    """Naive dense float64 attention: gather the visible positions explicitly per query.

    Positions >= S do not exist; a query that sees nothing gets zeros.
    """
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    if layer is not None:
        k, v = k[layer], v[layer]
    lengths, mask = np.asarray(lengths), np.asarray(mask)
    batch, num_new, q_heads, head_dim = q.shape
    max_len, group = k.shape[1], q_heads // k.shape[2]
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = np.zeros(q.shape)
    for b in range(batch):
        for i in range(num_new):
            seen = list(range(lengths[b])) + [lengths[b] + j for j in range(num_new)
                                               if mask[b, i, j] and lengths[b] + j < max_len]
            if not seen:
                continue
            for h in range(q_heads):
                keys = k[b, seen, h // group]  # [P, D]
                logits = keys @ q[b, i, h] * scale
                w = np.exp(logits - logits.max())
                out[b, i, h] = (w / w.sum()) @ v[b, seen, h // group]
    return out


def assert_close(out, ref, dtype):
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(jnp.asarray(ref, jnp.float32))
    assert np.isfinite(out).all(), "output has NaN/inf: a poisoned element was read or written"
    np.testing.assert_allclose(out, ref, **TOL[dtype])


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize(
    "batch,num_new,q_heads,kv_heads,head_dim,max_len,lengths,tree,sm_scale,layered", [
        (2, 1, 4, 4, 64, 32, [0, 31], "chain", None, False),
        (3, 5, 8, 2, 64, 48, [0, 43, 20], "tree", None, False),
        (2, 8, 8, 1, 128, 40, [32, 7], "tree", 0.3, False),
        (2, 6, 16, 2, 64, 32, [26, 0], "chain", None, True),
    ])
def test_reference_matches_numpy(batch, num_new, q_heads, kv_heads, head_dim, max_len,
                                 lengths, tree, sm_scale, layered):
    layer_kw = dict(num_layers=3, layer=2) if layered else {}
    q, k, v, lengths, mask = make_inputs(
        0, batch=batch, num_new=num_new, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, max_len=max_len, lengths=lengths, dtype=jnp.float32, tree=tree,
        **layer_kw)
    layer = 2 if layered else None
    out = tree_attention_reference(q, k, v, lengths, mask, sm_scale=sm_scale, layer=layer)
    expect = numpy_attention(q, k, v, lengths, mask, sm_scale=sm_scale, layer=layer)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, expect, jnp.float32)


def test_reference_finite_cache_skips_masking_but_not_correctness():
    """finite_cache=True (specjax's own caches) gives the same result when garbage is finite."""
    q, k, v, lengths, mask = make_inputs(
        4, batch=3, num_new=5, q_heads=8, kv_heads=2, head_dim=64, max_len=48,
        lengths=[0, 43, 20], dtype=jnp.float32, num_layers=2, layer=1)
    garbage = np.random.default_rng(5).standard_normal(k.shape).astype(np.float32) * 100
    k = jnp.where(jnp.isnan(k), garbage, k)
    v = jnp.where(jnp.isnan(v), garbage, v)
    out = tree_attention_reference(q, k, v, lengths, mask, layer=1, finite_cache=True)
    assert_close(out, numpy_attention(q, k, v, lengths, mask, layer=1), jnp.float32)


def test_reference_bf16_matches_numpy():
    q, k, v, lengths, mask = make_inputs(
        1, batch=2, num_new=4, q_heads=8, kv_heads=2, head_dim=64, max_len=32,
        lengths=[0, 28], dtype=jnp.bfloat16)
    out = tree_attention_reference(q, k, v, lengths, mask)
    assert out.dtype == jnp.bfloat16
    assert_close(out, numpy_attention(q, k, v, lengths, mask), jnp.bfloat16)


# ----------------------------------------------------------------------------- kernel

# Each axis value appears at least once: N in {1..64}, G in {1,4,8}, D in {64,128},
# fp32/bf16, chain/tree, zero and full (lengths + N == S) prefixes, stacked cache + layer,
# one or several M blocks, explicit block_k (incl. one shrunk to divide S) and KV splits.
KERNEL_CASES = [
    # B, N, Hq, Hkv, D, S, lengths, dtype, tree, layered, block_k, num_splits
    (2, 1, 2, 2, 64, 64, [0, 63], jnp.float32, "chain", False, None, 1),
    (3, 1, 8, 2, 128, 128, [17, 127, 0], jnp.bfloat16, "chain", False, 32, 2),
    (2, 2, 8, 1, 64, 128, [0, 126], jnp.float32, "chain", False, 32, 2),
    (2, 4, 8, 2, 128, 256, [3, 252], jnp.float32, "tree", True, 64, 3),
    (3, 8, 4, 4, 64, 128, [0, 120, 57], jnp.bfloat16, "tree", False, 16, 1),
    (2, 16, 8, 2, 64, 128, [0, 112], jnp.float32, "tree", False, 32, 1),
    (2, 16, 8, 1, 128, 256, [200, 240], jnp.bfloat16, "tree", True, None, 1),
    (2, 32, 8, 2, 64, 128, [0, 96], jnp.float32, "chain", False, None, 2),
    (2, 32, 2, 2, 128, 256, [224, 5], jnp.bfloat16, "tree", False, 64, 2),
    (2, 64, 2, 2, 64, 128, [0, 64], jnp.float32, "chain", False, 32, 1),
    (2, 64, 8, 2, 64, 256, [192, 17], jnp.bfloat16, "tree", False, None, 2),
    (2, 4, 8, 1, 128, 48, [44, 0], jnp.float32, "tree", False, 64, 1),
    (2, 3, 8, 2, 64, 96, [40, 93], jnp.float32, "tree", True, None, None),
]


@pytest.mark.parametrize(
    "batch,num_new,q_heads,kv_heads,head_dim,max_len,lengths,dtype,tree,layered,block_k,"
    "num_splits", KERNEL_CASES)
def test_kernel_matches_reference(batch, num_new, q_heads, kv_heads, head_dim, max_len,
                                  lengths, dtype, tree, layered, block_k, num_splits):
    layer = 1 if layered else None
    layer_kw = dict(num_layers=3, layer=1) if layered else {}
    q, k, v, lengths, mask = make_inputs(
        num_new, batch=batch, num_new=num_new, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, max_len=max_len, lengths=lengths, dtype=dtype, tree=tree,
        **layer_kw)
    layer_arg = None if layer is None else jnp.int32(layer)
    out = tree_attention(q, k, v, lengths, mask, layer=layer_arg, block_k=block_k,
                         num_splits=num_splits, interpret=INTERPRET)
    ref = tree_attention_reference(q, k, v, lengths, mask, layer=layer_arg)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.isfinite(np.asarray(ref.astype(jnp.float32))).all()
    assert_close(out, ref, dtype)


def test_kernel_custom_scale_and_isolated_row():
    """sm_scale is honoured; a query seeing nothing (no prefix, empty mask row) gives 0, not NaN."""
    q, k, v, lengths, mask = make_inputs(
        7, batch=2, num_new=4, q_heads=4, kv_heads=2, head_dim=64, max_len=32,
        lengths=[0, 10], dtype=jnp.float32)
    mask = mask.at[0, 2, :].set(False)
    out = tree_attention(q, k, v, lengths, mask, sm_scale=0.05, interpret=INTERPRET,
                         block_k=16, num_splits=2)
    ref = tree_attention_reference(q, k, v, lengths, mask, sm_scale=0.05)
    assert_close(out, ref, jnp.float32)
    np.testing.assert_array_equal(np.asarray(out[0, 2]), 0.0)


# lengths + N below, at and beyond S, mixed per row: positions >= S do not exist, so new
# tokens there are invisible and the kernel must not read them (each row also has a prefix
# and/or new tokens inside the cache so the result is not trivially zero).
PAST_END_CASES = [
    # B, N, Hq, Hkv, D, S, lengths, dtype, tree, layered, block_k, num_splits
    (2, 64, 2, 2, 64, 48, [0, 0], jnp.float32, "chain", False, None, 1),  # the NaN repro
    (2, 64, 8, 2, 64, 48, [0, 48], jnp.bfloat16, "chain", False, None, 2),
    (3, 64, 4, 1, 64, 48, [0, 47, 30], jnp.float32, "tree", True, 16, 3),
    (4, 8, 8, 2, 64, 64, [57, 64, 56, 30], jnp.float32, "tree", False, 32, 2),  # S-N+1, S, S-N
    (4, 8, 8, 2, 128, 64, [57, 64, 56, 30], jnp.bfloat16, "tree", False, 32, 1),
    (3, 1, 8, 2, 64, 32, [31, 32, 0], jnp.float32, "chain", False, None, 1),  # S-1 / S, N=1
    (3, 1, 8, 2, 64, 32, [31, 32, 0], jnp.bfloat16, "chain", True, 16, 2),
    (3, 16, 8, 2, 64, 64, [49, 40, 63], jnp.bfloat16, "tree", False, 16, 3),
    (2, 5, 4, 4, 64, 48, [44, 46], jnp.float32, "tree", True, None, None),
]


@pytest.mark.parametrize(
    "batch,num_new,q_heads,kv_heads,head_dim,max_len,lengths,dtype,tree,layered,block_k,"
    "num_splits", PAST_END_CASES)
def test_kernel_new_tokens_past_cache_end(batch, num_new, q_heads, kv_heads, head_dim, max_len,
                                          lengths, dtype, tree, layered, block_k, num_splits):
    """lengths + N > S: the kernel stays inside the cache and equals the reference and numpy."""
    layer = jnp.int32(2) if layered else None
    layer_kw = dict(num_layers=3, layer=2) if layered else {}
    q, k, v, lengths, mask = make_inputs(
        11, batch=batch, num_new=num_new, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, max_len=max_len, lengths=lengths, dtype=dtype, tree=tree,
        **layer_kw)
    out = tree_attention(q, k, v, lengths, mask, layer=layer, block_k=block_k,
                         num_splits=num_splits, interpret=INTERPRET)
    ref = tree_attention_reference(q, k, v, lengths, mask, layer=layer)
    expect = numpy_attention(q, k, v, lengths, mask, layer=None if layer is None else 2)
    assert_close(ref, expect, dtype)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("impl", ["reference", "kernel", "kernel_split"])
def test_query_whose_tokens_are_all_past_cache_end_gets_zeros(impl):
    """lengths=0, N=64, S=48, each token sees only itself: queries 48.. see nothing -> zeros."""
    q, k, v, lengths, mask = make_inputs(
        12, batch=2, num_new=64, q_heads=4, kv_heads=2, head_dim=64, max_len=48,
        lengths=[0, 0], dtype=jnp.float32)
    mask = jnp.broadcast_to(jnp.eye(64, dtype=bool), mask.shape)
    if impl == "reference":
        out = tree_attention_reference(q, k, v, lengths, mask)
    else:
        out = tree_attention(q, k, v, lengths, mask, interpret=INTERPRET, block_k=16,
                             num_splits=1 if impl == "kernel" else 3)
    assert_close(out, numpy_attention(q, k, v, lengths, mask), jnp.float32)
    np.testing.assert_array_equal(np.asarray(out[:, 48:]), 0.0)
    # A query inside the cache seeing only itself returns its own V (per kv head).
    v_expect = jnp.repeat(v[:, :48], 2, axis=2)
    np.testing.assert_allclose(np.asarray(out[:, :48]), np.asarray(v_expect), atol=1e-6)


def test_kernel_never_reads_outside_cache_for_lengths_past_s():
    """lengths > S (a caller bug) still reads only the cache: every position is then prefix."""
    q, k, v, _, mask = make_inputs(
        13, batch=2, num_new=8, q_heads=4, kv_heads=2, head_dim=64, max_len=32,
        lengths=[32, 32], dtype=jnp.float32)
    lengths = jnp.asarray([32 + 5, 32 + 40], jnp.int32)
    for num_splits in (1, 2):
        out = tree_attention(q, k, v, lengths, mask, interpret=INTERPRET, num_splits=num_splits)
        assert_close(out, tree_attention_reference(q, k, v, lengths, mask), jnp.float32)


def test_kernel_layer_traced_inside_scan():
    """The stacked cache carried through lax.scan, layer = the traced loop index."""
    num_layers = 2
    q, k1, v1, lengths, mask = make_inputs(
        3, batch=2, num_new=4, q_heads=4, kv_heads=1, head_dim=64, max_len=64,
        lengths=[5, 60], dtype=jnp.float32)
    k = jnp.stack([k1, 2.0 * k1])
    v = jnp.stack([v1, -v1])

    def run(fn):
        def body(cache, layer):
            k_c, v_c = cache
            return cache, fn(q, k_c, v_c, lengths, mask, layer=layer)
        return lax.scan(body, (k, v), jnp.arange(num_layers, dtype=jnp.int32))[1]

    out = jax.jit(lambda: run(lambda *a, **kw: tree_attention(*a, **kw, interpret=INTERPRET)))()
    ref = jax.jit(lambda: run(tree_attention_reference))()
    assert_close(out, ref, jnp.float32)
    for layer in range(num_layers):
        expect = numpy_attention(q, k, v, lengths, mask, layer=layer)
        assert_close(out[layer], expect, jnp.float32)


def _top_level_primitives(jaxpr):
    """Primitives of a jaxpr, recursing into nested jit calls but not into the pallas kernel."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in ("pjit", "jit", "closed_call"):
            yield from _top_level_primitives(eqn.params["jaxpr"].jaxpr)


def test_kernel_reads_layer_without_slicing_the_cache():
    q, k, v, lengths, mask = make_inputs(
        4, batch=2, num_new=2, q_heads=4, kv_heads=2, head_dim=64, max_len=32,
        lengths=[3, 30], dtype=jnp.float32, num_layers=3, layer=0)
    jaxpr = jax.make_jaxpr(lambda layer: tree_attention(
        q, k, v, lengths, mask, layer=layer, interpret=INTERPRET))(jnp.int32(0)).jaxpr
    for eqn in _top_level_primitives(jaxpr):
        if eqn.primitive.name == "pallas_call":
            continue
        if eqn.primitive.name in ("pjit", "jit"):
            continue
        for var in eqn.invars:
            assert getattr(var.aval, "shape", ()) != k.shape, (
                f"{eqn.primitive.name} touches the stacked cache outside the kernel")


def _triton_dot_precisions(dtype) -> list[int]:
    """inputPrecision of every tt.dot in the Triton IR the kernel emits when lowered for CUDA.

    Lowering for CUDA works without a GPU; the Triton module travels as MLIR bytecode in the
    custom call's backend_config, which is parsed back here with the Triton dialect loaded.
    """
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    b, n, hq, hkv, d, s = 1, 4, 4, 2, 64, 64
    args = (jax.ShapeDtypeStruct((b, n, hq, d), dtype), jax.ShapeDtypeStruct((b, s, hkv, d), dtype),
            jax.ShapeDtypeStruct((b, s, hkv, d), dtype), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, n, n), jnp.bool_))
    fn = lambda *a: tree_attention(*a, interpret=False, num_splits=1)
    hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir()
    blobs = [op.attributes["mhlo.backend_config"]["ir"] for op in _walk_ops(hlo.operation)
             if op.name == "stablehlo.custom_call"]
    assert len(blobs) == 1, "expected exactly one Triton custom call"
    ctx = ir.Context()
    tt_dialect.register_dialect(ctx)
    with ctx:
        triton_module = ir.Module.parse(ir.StringAttr(blobs[0]).value_bytes)
    dots = [op for op in _walk_ops(triton_module.operation) if op.name == "tt.dot"]
    assert dots, "no tt.dot in the Triton module"
    return [ir.IntegerAttr(op.attributes["inputPrecision"]).value for op in dots]


def _walk_ops(op):
    """Every operation nested under `op` (depth first)."""
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child.operation
                yield from _walk_ops(child.operation)


def test_fp32_kernel_dots_are_full_precision_in_cuda_lowering():
    """fp32 dots lower to IEEE (not TF32, Triton's default on Ampere/Hopper); bf16 is untouched."""
    from jax._src.lib.triton import dialect as tt_dialect

    ieee = int(tt_dialect.InputPrecision.IEEE)
    fp32 = _triton_dot_precisions(jnp.float32)
    assert fp32 and all(p == ieee for p in fp32), f"fp32 dots: inputPrecision {fp32}"
    bf16 = _triton_dot_precisions(jnp.bfloat16)
    assert bf16 and all(p != ieee for p in bf16), f"bf16 dots: inputPrecision {bf16}"


# ----------------------------------------------------------------------------- block plan


@pytest.mark.parametrize("batch", [1, 3, 32])
@pytest.mark.parametrize("num_new,group", [(1, 1), (1, 4), (2, 8), (16, 4), (64, 8), (7, 3)])
@pytest.mark.parametrize("max_len,block_k", [(48, None), (256, None), (4096, 16), (16384, 128)])
def test_plan_blocks_shapes(batch, num_new, group, max_len, block_k):
    for head_dim in (64, 128):
        plan = plan_blocks(batch=batch, num_new=num_new, group=group, kv_heads=8,
                           max_len=max_len, head_dim=head_dim, block_k=block_k)
        pow2 = lambda x: x & (x - 1) == 0
        # Every dot is [block_m, D] x [D, block_k] and [block_m, block_k] x [block_k, D].
        assert min(plan.block_m, plan.block_k, head_dim) >= 16
        assert pow2(plan.block_m) and pow2(plan.block_k)
        assert max_len % plan.block_k == 0
        assert plan.m_pad % plan.block_m == 0 and plan.m_pad >= num_new * group
        assert plan.num_m_blocks * plan.block_m == plan.m_pad
        # The tail window covers the N new tokens wherever they start inside a block.
        assert plan.tail_width >= num_new + plan.block_k - 1
        assert 1 <= plan.num_splits <= max(1, max_len // plan.block_k)
        if block_k is not None:
            assert plan.block_k <= block_k


def test_plan_blocks_fits_the_tiles_in_shared_memory():
    """fp32 at head_dim 256 with block_k 128 asked H100's compiler for 288832 bytes of shared memory (of 232448) and
    failed (`specjax compile --device h100`, docs/gpu_compile.md): the plan halves block_k until the tiles fit, and
    refuses, naming the fallback, when even the smallest do not."""
    from specjax.kernels.tree_attention import SHARED_MEMORY_BYTES, shared_memory_estimate

    kw = dict(batch=1, kv_heads=8, max_len=4096, head_dim=256)
    assert shared_memory_estimate(block_m=16, block_k=128, head_dim=256, itemsize=4) >= 288832
    for num_new, group in ((1, 1), (8, 4), (16, 4), (256, 8)):
        bf16 = plan_blocks(num_new=num_new, group=group, **kw)
        fp32 = plan_blocks(num_new=num_new, group=group, itemsize=4, **kw)
        assert fp32.block_k == min(bf16.block_k, 64) and fp32.block_m == bf16.block_m
        assert shared_memory_estimate(block_m=fp32.block_m, block_k=fp32.block_k, head_dim=256,
                                      itemsize=4) <= SHARED_MEMORY_BYTES
    with pytest.raises(ValueError, match="attn_impl='xla'"):
        plan_blocks(num_new=1, group=1, itemsize=4, shared_memory_bytes=40000, **kw)


def test_plan_blocks_rejects_bad_shapes():
    """plan_blocks raises exactly what kernel_unsupported_reason reports."""
    kw = dict(batch=1, num_new=1, group=1, kv_heads=1)
    with pytest.raises(ValueError, match="multiple of 16"):
        plan_blocks(**kw, max_len=100, head_dim=64)
    with pytest.raises(ValueError, match="head_dim"):
        plan_blocks(**kw, max_len=64, head_dim=96)
    with pytest.raises(ValueError, match="block_k"):
        plan_blocks(**kw, max_len=64, head_dim=64, block_k=24)
    assert kernels_mod.kernel_unsupported_reason(head_dim=64, max_len=64) is None
    reason = kernels_mod.kernel_unsupported_reason(head_dim=64, max_len=100)
    with pytest.raises(ValueError) as err:
        plan_blocks(**kw, max_len=100, head_dim=64)
    assert str(err.value) == reason


# ----------------------------------------------------------------------------- API


def test_attention_dispatch_off_gpu(monkeypatch):
    """impl="pallas" runs the kernel (interpret mode), "auto" off a GPU never touches it."""
    q, k, v, lengths, mask = make_inputs(
        5, batch=2, num_new=3, q_heads=4, kv_heads=2, head_dim=64, max_len=32,
        lengths=[0, 29], dtype=jnp.float32)
    ref = tree_attention_reference(q, k, v, lengths, mask)
    assert_close(attention(q, k, v, lengths, mask, impl="pallas"), ref, jnp.float32)
    monkeypatch.setattr(kernels_mod, "on_gpu", lambda: False)
    monkeypatch.setattr(kernels_mod, "tree_attention", lambda *a, **kw: pytest.fail("auto used the kernel"))
    assert_close(attention(q, k, v, lengths, mask, impl="auto"), ref, jnp.float32)
    with pytest.raises(ValueError, match="impl"):
        attention(q, k, v, lengths, mask, impl="cuda")


def test_attention_auto_on_gpu_falls_back_once_per_reason(monkeypatch, caplog):
    """On a GPU, impl="auto" with shapes the kernel cannot take uses the reference and logs
    one warning per distinct reason; impl="pallas" still raises; good shapes use the kernel."""
    kernel_calls = []
    monkeypatch.setattr(kernels_mod, "on_gpu", lambda: True)
    monkeypatch.setattr(kernels_mod, "_warned_reasons", set())
    monkeypatch.setattr(kernels_mod, "tree_attention",
                        lambda *a, **kw: kernel_calls.append(kw) or "kernel")
    bad_d = make_inputs(8, batch=1, num_new=2, q_heads=2, kv_heads=1, head_dim=96, max_len=32,
                        lengths=[3], dtype=jnp.float32)
    bad_s = make_inputs(9, batch=1, num_new=2, q_heads=2, kv_heads=1, head_dim=64, max_len=40,
                        lengths=[3], dtype=jnp.float32)
    good = make_inputs(10, batch=1, num_new=2, q_heads=2, kv_heads=1, head_dim=64, max_len=32,
                       lengths=[3], dtype=jnp.float32)
    with caplog.at_level("WARNING", logger="specjax"):
        for inputs in (bad_d, bad_d, bad_s, bad_s, bad_d):
            assert_close(attention(*inputs, impl="auto"), numpy_attention(*inputs), jnp.float32)
    warnings = [r.getMessage() for r in caplog.records if r.name == "specjax"]
    assert len(warnings) == 2, warnings
    assert "head_dim" in warnings[0] and "S=40" in warnings[1]
    assert kernel_calls == []
    assert attention(*good, impl="auto") == "kernel"
    assert kernel_calls == [dict(sm_scale=None, layer=None, interpret=False)]
    monkeypatch.setattr(kernels_mod, "tree_attention", tree_attention)
    for inputs, message in ((bad_d, "head_dim"), (bad_s, "multiple of 16")):
        with pytest.raises(ValueError, match=message):
            attention(*inputs, impl="pallas")


@pytest.mark.parametrize("fn", [tree_attention_reference, tree_attention])
def test_bad_shapes_raise_value_error(fn):
    q, k, v, lengths, mask = make_inputs(
        6, batch=2, num_new=2, q_heads=4, kv_heads=2, head_dim=64, max_len=32,
        lengths=[0, 4], dtype=jnp.float32)
    bad = {
        "multiple of kv heads": (q[:, :, :3], k, v, lengths, mask, None),
        "head_dim mismatch": (q[..., :32], k, v, lengths, mask, None),
        "mask must be": (q, k, v, lengths, mask[:, :1], None),
        "lengths must be": (q, k, v, lengths[:1], mask, None),
        "same shape": (q, k, v[:, :16], lengths, mask, None),
        "pass layer=": (q, k[None], v[None], lengths, mask, None),
        "drop layer=": (q, k, v, lengths, mask, 0),
        "batch mismatch": (q[:1], k, v, lengths[:1], mask[:1], None),
    }
    for message, (q_, k_, v_, lengths_, mask_, layer) in bad.items():
        with pytest.raises(ValueError, match=message):
            fn(q_, k_, v_, lengths_, mask_, layer=layer)
