"""The mixture-of-experts MLP (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next) as a Flax NNX module, and its two expert paths.

Routing follows transformers' Qwen3MoeTopKRouter: softmax over every expert's logit (in fp32 here), the top
k, renormalised to sum 1 when the config says so, the weights cast to the model dtype. No capacity factor
and no token dropping: every token reaches all of its k experts, so the output is transformers'.

The experts run under fixed shapes by one of two paths, both exact:
* "sorted": the N x k (token, expert) slots sorted by expert, one grouped matmul per projection
  (`jax.lax.ragged_dot` over the E expert matrices with the group sizes), weighted and scattered back.
  Its work is the slots' rows, its weight reads the experts a grouped GEMM visits. On GPU this is XLA's
  ragged-dot lowering (not a hand-written Pallas kernel: JAX's Mosaic GPU ragged_dot has no interpret
  mode to test here; scripts/gpu_checks.sh measures the XLA path).
* "gather": each slot's expert matrices gathered ([N, k, D, I]) and applied by a batched contraction. It
  reads exactly the k experts of each token, so for a few tokens per pass (decode, verification at small
  batch) it never touches the experts no token chose, whatever the grouped GEMM would visit.
`expert_path` picks one from the slot count (static under jit): `scripts/bench_moe.py` measures where they
cross.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from specjax.config import ModelConfig, MoeConfig
from specjax.models.layers import normal, param, swiglu

PATHS = ("auto", "gather", "sorted")
# Slots (tokens x k) up to which "auto" gathers the routed experts' weights. Measured on the 2-core CPU of
# scripts/bench_moe.py (Qwen3-30B-A3B's k = 8 of E = 128, scaled down): gather is faster through 8 slots (one
# token), the sorted grouped matmul from 16 on.
GATHER_MAX_SLOTS = 8


def expert_path(moe: MoeConfig, tokens: int) -> str:
    """The expert path a pass of `tokens` tokens runs: the config's choice, or by slot count for "auto"."""
    if moe.impl != "auto":
        return moe.impl
    return "gather" if tokens * moe.top_k <= GATHER_MAX_SLOTS else "sorted"


def route(x_ND: jax.Array, router_DE: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] in x's dtype, expert ids [N, k]): fp32 softmax over all experts, then the top k."""
    logits_NE = jnp.einsum("nd,de->ne", x_ND, router_DE, preferred_element_type=jnp.float32)
    top_NK, experts_NK = lax.top_k(jax.nn.softmax(logits_NE, axis=-1), top_k)
    if normalize:
        top_NK = top_NK / jnp.sum(top_NK, axis=-1, keepdims=True)
    return top_NK.astype(x_ND.dtype), experts_NK.astype(jnp.int32)


def gather_experts(x_ND, weights_NK, experts_NK, w_gate_EDI, w_up_EDI, w_down_EID) -> jax.Array:
    """The routed experts' weighted SwiGLU outputs [N, D], each slot's expert matrices gathered."""
    gate_NKI = jnp.einsum("nd,nkdi->nki", x_ND, w_gate_EDI[experts_NK])
    up_NKI = jnp.einsum("nd,nkdi->nki", x_ND, w_up_EDI[experts_NK])
    out_NKD = jnp.einsum("nki,nkid->nkd", jax.nn.silu(gate_NKI) * up_NKI, w_down_EID[experts_NK])
    return jnp.einsum("nkd,nk->nd", out_NKD, weights_NK)


def sorted_experts(x_ND, weights_NK, experts_NK, w_gate_EDI, w_up_EDI, w_down_EID) -> jax.Array:
    """The same as gather_experts, the slots sorted by expert and run as grouped matmuls (ragged_dot)."""
    n, k = experts_NK.shape
    flat_S = experts_NK.reshape(-1)
    order_S = jnp.argsort(flat_S, stable=True)
    token_S = order_S // k
    sizes_E = jnp.bincount(flat_S, length=w_gate_EDI.shape[0]).astype(jnp.int32)
    x_SD = x_ND[token_S]
    hidden_SI = jax.nn.silu(lax.ragged_dot(x_SD, w_gate_EDI, sizes_E)) * lax.ragged_dot(x_SD, w_up_EDI, sizes_E)
    out_SD = lax.ragged_dot(hidden_SI, w_down_EID, sizes_E) * weights_NK.reshape(-1)[order_S][:, None]
    return jnp.zeros((n, x_ND.shape[1]), out_SD.dtype).at[token_S].add(out_SD)


EXPERT_PATHS = {"gather": gather_experts, "sorted": sorted_experts}


class MoeMLP(nnx.Module):
    """Router [D, E], experts w_gate / w_up [E, D, I] and w_down [E, I, D], optionally a shared SwiGLU expert
    (shared_gate / shared_up [D, Is], shared_down [Is, D]) scaled by sigmoid(x @ shared_expert_gate [D, 1]).

    lead: leading shape and axis names for stacked layers (a DecoderLayer with stacked=L passes ((L,), ("layers",))).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, scale: float = 0.02, lead=((), ())):
        moe = cfg.moe
        self.moe = moe
        shape, axes = lead
        d, e, i, dtype = cfg.hidden_size, moe.num_experts, moe.expert_size, jnp.dtype(cfg.dtype)

        def weight(dims, *names):
            return param(normal(rngs, shape + dims, dtype, scale), *axes, *names)

        self.router = weight((d, e), "embed", None)
        self.w_gate, self.w_up = weight((e, d, i), "experts", "embed", "mlp"), weight((e, d, i), "experts", "embed", "mlp")
        self.w_down = weight((e, i, d), "experts", "mlp", "embed")
        if moe.shared_size:
            s = moe.shared_size
            self.shared_gate, self.shared_up = weight((d, s), "embed", "mlp"), weight((d, s), "embed", "mlp")
            self.shared_down = weight((s, d), "mlp", "embed")
            self.shared_expert_gate = weight((d, 1), "embed", None)
        else:
            self.shared_gate = self.shared_up = self.shared_down = self.shared_expert_gate = None

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        """The MoE of a normed input [B, T, D] (no residual): routed experts plus the gated shared expert."""
        b, t, d = x_BTD.shape
        x_ND = x_BTD.reshape(b * t, d)
        weights_NK, experts_NK = route(x_ND, self.router[...], self.moe.top_k, self.moe.norm_topk_prob)
        run = EXPERT_PATHS[expert_path(self.moe, b * t)]
        y_ND = run(x_ND, weights_NK, experts_NK, self.w_gate[...], self.w_up[...], self.w_down[...])
        if self.shared_gate is not None:
            shared_ND = swiglu(x_ND, self.shared_gate[...], self.shared_up[...], self.shared_down[...])
            y_ND = y_ND + jax.nn.sigmoid(x_ND @ self.shared_expert_gate[...]) * shared_ND
        return y_ND.astype(x_BTD.dtype).reshape(b, t, d)

    def routing(self, x_BTD: jax.Array) -> jax.Array:
        """The expert ids [B, T, k] each token of a normed input is routed to (for routing statistics)."""
        b, t, d = x_BTD.shape
        _, experts_NK = route(x_BTD.reshape(b * t, d), self.router[...], self.moe.top_k, self.moe.norm_topk_prob)
        return experts_NK.reshape(b, t, -1)
