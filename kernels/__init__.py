"""Pallas kernels with pure-jnp references (importable as specjax.kernels)."""

from __future__ import annotations

import jax

from .reference import tree_attention_reference
from .tree_attention import BlockPlan, plan_blocks, tree_attention

__all__ = ["attention", "tree_attention", "tree_attention_reference", "plan_blocks", "BlockPlan"]

IMPLS = ("auto", "xla", "pallas")


def attention(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, *, impl: str = "auto",
              sm_scale=None, layer=None, finite_cache=False):
    """Tree attention through the chosen implementation; one signature for all of them.

    impl="auto": the Pallas kernel when JAX's default backend is a GPU, else the XLA reference.
    impl="pallas" off GPU runs the kernel in interpret mode (slow; for tests).
    finite_cache: see tree_attention_reference (the kernel never reads past lengths + N anyway).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "xla" or (impl == "auto" and not on_gpu):
        return tree_attention_reference(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN,
                                        sm_scale=sm_scale, layer=layer, finite_cache=finite_cache)
    return tree_attention(q_BNHD, k_BSKD, v_BSKD, lengths_B, mask_BNN, sm_scale=sm_scale,
                          layer=layer, interpret=not on_gpu)
