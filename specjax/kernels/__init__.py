"""Pallas kernels with pure-jnp references (importable as specjax.kernels)."""

from __future__ import annotations

import contextlib
import contextvars
import logging

import jax

from .fp8_matmul import block_fp8_matmul, fp8_matmul_unsupported_reason, plan_fp8_matmul
from .reference import tree_attention_reference
from .sharded import sharded_tree_attention
from .tree_attention import BlockPlan, kernel_unsupported_reason, plan_blocks, tree_attention

__all__ = ["attention", "on_gpu", "targeting_gpu", "tree_attention", "sharded_tree_attention", "tree_attention_reference", "plan_blocks",
           "BlockPlan", "kernel_unsupported_reason", "block_fp8_matmul", "fp8_matmul_unsupported_reason",
           "plan_fp8_matmul", "use_fp8_matmul_kernel"]

IMPLS = ("auto", "xla", "pallas")
logger = logging.getLogger("specjax")
_warned_reasons: set[str] = set()  # fallback reasons already logged (once each per process)


_targeting_gpu = contextvars.ContextVar("specjax_targeting_gpu", default=False)


def on_gpu() -> bool:
    """Is the code being traced for a GPU: JAX's default backend is one, or `targeting_gpu` is on (one function,
    so tests can pretend too)."""
    return _targeting_gpu.get() or jax.default_backend() == "gpu"


@contextlib.contextmanager
def targeting_gpu():
    """Trace for a GPU on a machine without one (deviceless compilation, specjax/aot): attention takes the compiled
    Pallas kernel, not interpret mode, and the MoE layers their GPU paths, while the default backend stays the CPU."""
    token = _targeting_gpu.set(True)
    try:
        yield
    finally:
        _targeting_gpu.reset(token)


def _warn_fallback_once(reason: str, what: str = "attention impl='auto'") -> None:
    """Log why `what` fell back to XLA instead of its Pallas kernel, once per distinct reason."""
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        logger.warning("%s: using the XLA reference, not the Pallas kernel: %s", what, reason)


def use_fp8_matmul_kernel(x_dtype, q_dtype, block: tuple[int, int]) -> bool:
    """Does a 2-D block-FP8 weight's matmul take `block_fp8_matmul`: tracing for a GPU, the kernel supports the
    dtypes and block (`fp8_matmul_unsupported_reason`), and no multi-device mesh is active (the kernel has no
    sharded form: a partitioner would gather the weight to every device), or the trace is inside shard_map.
    Off GPU: False, silently (the CPU keeps the dequantizing matmul); on a GPU an unsupported case logs its reason
    once and returns False.

    Args:
      x_dtype: the activations' dtype.
      q_dtype: the weight values' dtype (float8_e4m3fn for block FP8).
      block: the scale block (bi, bo).
    Returns:
      True when the caller should call `block_fp8_matmul`.
    """
    if not on_gpu():
        return False
    mesh = jax.sharding.get_abstract_mesh()
    reason = fp8_matmul_unsupported_reason(x_dtype=x_dtype, q_dtype=q_dtype, block=block)
    if reason is None and not mesh.empty and mesh.size > 1 and not mesh.are_all_axes_manual:
        reason = f"a mesh of {mesh.size} devices is active, and the kernel has no sharded form yet"
    if reason is not None:
        _warn_fallback_once(reason, "block-FP8 matmul")
        return False
    return True


def attention(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, *, impl: str = "auto",
              sm_scale=None, layer=None, finite_cache=False, mesh=None):
    """Tree attention through the chosen implementation; one signature for all of them.

    impl="auto": the Pallas kernel on a GPU when the shapes suit it (head_dim a power of 2
    >= 16, S a multiple of 16), else the XLA reference (on GPU with a one-time warning).
    impl="pallas" raises ValueError on unsuitable shapes; off GPU it runs the kernel in
    interpret mode (slow; for tests).
    finite_cache: see tree_attention_reference (the kernel never reads past
    min(lengths + N, S) anyway).
    mesh: the device mesh the trace runs under (axes "data", "model"), or None: with more than one
    device the kernel runs under shard_map, one per device over its rows and kv heads (sharded.py);
    the reference needs nothing, XLA's partitioner splits it.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    gpu = on_gpu()
    use_kernel = impl == "pallas" or (impl == "auto" and gpu)
    if impl == "auto" and gpu:
        reason = kernel_unsupported_reason(head_dim=q_BNHD.shape[-1], max_len=k_BSKD.shape[-3])
        if reason is not None:
            _warn_fallback_once(reason)
            use_kernel = False
    if not use_kernel:
        return tree_attention_reference(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN,
                                        sm_scale=sm_scale, layer=layer, finite_cache=finite_cache)
    if mesh is not None and mesh.size > 1:
        return sharded_tree_attention(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, mesh=mesh, layer=layer,
                                      sm_scale=sm_scale, interpret=not gpu)
    return tree_attention(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, sm_scale=sm_scale,
                          layer=layer, interpret=not gpu)
