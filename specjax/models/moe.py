"""The mixture-of-experts MLP (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next) as a Flax NNX module, and its expert paths.

Routing follows transformers' Qwen3MoeTopKRouter: softmax over every expert's logit (in fp32 here), the top
k, renormalised to sum 1 when the config says so, the weights cast to the model dtype. No capacity factor
and no token dropping: every token reaches all of its k experts, so the output is transformers'.

The experts run under fixed shapes by one of three paths, all exact (they differ in summation order only):
* "gather": every (token, expert) slot its own block of one row. It reads exactly the k experts of each
  token and needs no sort: decode at batch 1, where a sort's bookkeeping costs more than the slots.
* "sorted": the N x k slots sorted by expert into one-expert blocks of `block_rows` rows (a block's unused
  rows are zeros), at most min(S, S/R + E) blocks for S slots: each routed expert is read about once per R
  of its tokens, a padded row costs FLOPs only, and R trades one against the other.
* "ragged": the same sort as one `jax.lax.ragged_dot` per projection. XLA lowers ragged_dot on CPU and
  on NVIDIA GPUs (without --xla_gpu_experimental_use_ragged_dot_fusion) through its RaggedDotRewriter,
  a dense dot over a group-broadcast LHS: E times the FLOPs (xla/hlo/transforms/expanders/
  ragged_dot_rewriter.cc). It is kept for backends that lower it to a grouped GEMM, never chosen by "auto".
Blocks run through `expert_matmuls`. On a GPU that is XLA's gather of the blocks' expert matrices and one
batched matmul: no Pallas kernel here, so the gathered matrices are copied before the matmul (a fused
grouped GEMM reading them in place, as vLLM's Triton fused_moe does, would save the copy); scripts/
gpu_checks.sh moe times the paths there. `expert_path` picks a path from the slot count (static under jit);
scripts/bench_moe.py measures where they cross on this CPU.

Experts read from a quantized checkpoint stay quantized ([E, ...] `QuantizedWeight`s, specjax/quant): the gather
and sorted paths index the blocks' experts first and dequantize only those, inside the trace, so a step reads
the quantized bytes of the experts it uses; "ragged" dequantizes every expert (it reads every expert anyway).
Their W8A8 activation rounding (quant/activations.py), which `x @ w` applies itself, the batched paths apply to
each block's or row's input before multiplying the dequantized experts (`rounded_input`), so every path computes
the same numbers. A dynamic per-tensor scale is taken over the input a matmul sees (a block, or every slot), not
per expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from specjax import kernels
from specjax.config import ModelConfig, MoeConfig
from specjax.models.layers import normal, param, swiglu
from specjax.models.sharding import active_mesh, axis_size, split
from specjax.quant.activations import fake_quantize
from specjax.quant.qarray import is_quantized

# Slots (tokens x k) up to which "auto" runs the gather path: one token at Qwen3-30B-A3B's k = 8 (decode at
# batch 1 skips the sort and the block bookkeeping, a handful of kernels on a GPU). On this CPU both run the same
# loop over one-row blocks there and time alike (1.0-1.3 ms for one token of a 32-expert layer); from 64 slots
# the sorted path's larger blocks are 2.7-12x faster (scripts/bench_moe.py --paths-only).
GATHER_MAX_SLOTS = 8
MAX_BLOCK_ROWS = 128
# Rows of compute that cost as much as reading one expert's matrices once (peak FLOP/s x bytes per weight /
# (2 x bandwidth)): the 2-core CPU in fp32 (200 GFLOP/s, 31 GB/s: planning/profile.py DEVICES) and an H100 in bf16
# (989 TFLOP/s, 3.35 TB/s: its roofline knee).
ROWS_PER_READ = {"cpu": 13, "gpu": 295}


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


def expert(w_EDI, e) -> jax.Array:
    """Expert e's matrix of [E, ...] experts (e traced), quantized experts dequantized after the index."""
    if is_quantized(w_EDI):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, e, keepdims=False), w_EDI)
    return lax.dynamic_index_in_dim(w_EDI, e, keepdims=False)


def dense(w, dtype) -> jax.Array:
    """An expert array as it computes: a quantized one dequantized to `dtype` (inside the trace)."""
    return w.dequantize(dtype) if is_quantized(w) else w


def rounded_input(x: jax.Array, w, expert_rows: jax.Array | None = None) -> jax.Array:
    """x as experts `w` (quantized [E or B, ...]) round their input under W8A8 (quant/activations.py), x itself
    for weights without activation quantization. A static `input_scale` [E or B] applies per leading entry of x
    ([B, R, D] blocks), or per row by `expert_rows` (each row's expert: the ragged path's [S, D] rows)."""
    if not is_quantized(w) or w.activations is None:
        return x
    scale = w.input_scale if w.input_scale is None or expert_rows is None else w.input_scale[expert_rows]
    return fake_quantize(x, w.activations, scale)


def expert_matmuls(x_BRD: jax.Array, expert_B: jax.Array, w_gate_EDI, w_up_EDI, w_down_EID,
                   used_blocks: jax.Array | int | None = None) -> jax.Array:
    """Block b's rows through expert expert_B[b]'s SwiGLU: [B, R, D] -> [B, R, D]. Blocks from `used_blocks` on
    hold only zero rows (their output is zero).

    On a GPU (or any accelerator) the blocks' expert matrices are gathered and applied as one batched matmul per
    projection (two kernels whatever the block count). On the CPU a loop over the used blocks reads each one's
    expert in place (a dynamic index) and never touches the rest: XLA:CPU copies gathered weights at a few GB/s,
    and the loop was 3.5-8x faster there (scripts/bench_moe.py --paths-only).
    """
    if jax.default_backend() == "cpu" and not kernels.on_gpu():
        def block(b, out_BRD):
            x_RD, e = lax.dynamic_index_in_dim(x_BRD, b, keepdims=False), expert_B[b]
            gate = x_RD @ expert(w_gate_EDI, e)  # a QuantizedWeight dequantizes in x @ w
            up = x_RD @ expert(w_up_EDI, e)
            y_RD = (jax.nn.silu(gate) * up) @ expert(w_down_EID, e)
            return lax.dynamic_update_index_in_dim(out_BRD, y_RD.astype(out_BRD.dtype), b, 0)

        used = x_BRD.shape[0] if used_blocks is None else used_blocks
        return lax.fori_loop(0, used, block, jnp.zeros_like(x_BRD))
    gate, up, down = (w[expert_B] for w in (w_gate_EDI, w_up_EDI, w_down_EID))
    hidden_BRI = (jax.nn.silu(jnp.einsum("brd,bdi->bri", rounded_input(x_BRD, gate), dense(gate, x_BRD.dtype)))
                  * jnp.einsum("brd,bdi->bri", rounded_input(x_BRD, up), dense(up, x_BRD.dtype)))
    return jnp.einsum("bri,bid->brd", rounded_input(hidden_BRI, down), dense(down, x_BRD.dtype))


def gather_experts(x_ND, weights_NK, experts_NK, w_gate_EDI, w_up_EDI, w_down_EID) -> jax.Array:
    """The routed experts' weighted SwiGLU outputs [N, D]: each (token, expert) slot a block of one row."""
    n, k = experts_NK.shape
    x_SRD = jnp.repeat(x_ND, k, axis=0)[:, None, :]
    out_NKD = expert_matmuls(x_SRD, experts_NK.reshape(-1), w_gate_EDI, w_up_EDI, w_down_EID).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", out_NKD, weights_NK)


def block_rows(slots: int, experts: int, rows_per_read: int | None = None) -> int:
    """Rows per expert block of the sorted path, a power of two in 1..128 near sqrt(slots / experts x rows_per_read).

    S slots in blocks of R rows cost about (S/R + E) expert reads and (S + E R) rows of compute (the last block
    of each expert is padded); with one read worth `rows_per_read` rows the sum is least at that R.
    """
    if rows_per_read is None:
        rows_per_read = ROWS_PER_READ["gpu" if kernels.on_gpu() else "cpu"]
    best = (slots / experts * rows_per_read) ** 0.5
    rows = 1
    while rows * 2 <= best and rows < MAX_BLOCK_ROWS:
        rows *= 2
    return rows


def sorted_experts(x_ND, weights_NK, experts_NK, w_gate_EDI, w_up_EDI, w_down_EID, kept_NK=None) -> jax.Array:
    """The same as gather_experts, the slots sorted by expert into one-expert blocks of `block_rows` rows.

    kept_NK (bool, optional): only these slots run; the others are never placed in a block and add nothing
    (expert parallelism: a device runs the slots routed to its own experts)."""
    n, k = experts_NK.shape
    e, s = w_gate_EDI.shape[0], n * k
    rows = block_rows(s, e)
    num_blocks = min(s, -(-s // rows) + e)
    flat_S = experts_NK.reshape(-1)
    if kept_NK is not None:  # a dropped slot takes expert id e: sorted after every kept one, counted by no expert
        flat_S = jnp.where(kept_NK.reshape(-1), flat_S, e)
    order_S = jnp.argsort(flat_S, stable=True)
    expert_S = flat_S[order_S]
    counts_E = jnp.bincount(flat_S, length=e)
    blocks_E = (counts_E + rows - 1) // rows
    first_block_E, first_slot_E = jnp.cumsum(blocks_E) - blocks_E, jnp.cumsum(counts_E) - counts_E
    rank_S = jnp.arange(s) - first_slot_E[expert_S]  # the slot's place among its expert's slots
    dest_S = (first_block_E[expert_S] + rank_S // rows) * rows + rank_S % rows
    dest_S = jnp.where(expert_S < e, dest_S, num_blocks * rows)  # dropped slots: past the last row
    x_BRD = jnp.zeros((num_blocks * rows, x_ND.shape[1]), x_ND.dtype).at[dest_S].set(x_ND[order_S // k],
                                                                                       mode="drop")
    # each block's expert; blocks past the last used one hold zero rows (any expert: the last; skipped on the CPU)
    used_blocks = jnp.sum(blocks_E)
    expert_B = jnp.minimum(jnp.searchsorted(jnp.cumsum(blocks_E), jnp.arange(num_blocks), side="right"), e - 1)
    out_BRD = expert_matmuls(x_BRD.reshape(num_blocks, rows, -1), expert_B, w_gate_EDI, w_up_EDI, w_down_EID,
                             used_blocks)
    out_SD = jnp.take(out_BRD.reshape(num_blocks * rows, -1), dest_S, axis=0, mode="fill", fill_value=0)
    out_SD = out_SD * weights_NK.reshape(-1)[order_S][:, None]
    return jnp.zeros((n, x_ND.shape[1]), out_SD.dtype).at[order_S // k].add(out_SD)


def expert_parallel_experts(x_ND, weights_NK, experts_NK, w_gate_EDI, w_up_EDI, w_down_EID, mesh) -> jax.Array:
    """sorted_experts with whole experts per device (the expert tensors split on E over the mesh's "model" axis):
    under shard_map each device runs, by the sorted path, the slots routed to its own E / n experts, reading
    only those, and one psum over "model" sums the devices' shares (the all-reduce an inside split also pays).
    The tokens are whole on every device of a replica, as every activation is under tensor parallelism, so no
    token moves; the rows split over "data" as the batch does."""
    rows = split(x_ND.shape[0], "data", mesh)
    tokens = P(rows, None)
    experts = [jax.tree.map(lambda a: P("model", *[None] * (a.ndim - 1)), w)  # a quantized one's parts alike
               for w in (w_gate_EDI, w_up_EDI, w_down_EID)]

    def local(x_ND, weights_NK, experts_NK, w_gate_EDI, w_up_EDI, w_down_EID):
        first = lax.axis_index("model") * w_gate_EDI.shape[0]
        local_NK = experts_NK - first
        kept_NK = (local_NK >= 0) & (local_NK < w_gate_EDI.shape[0])
        y_ND = sorted_experts(x_ND, weights_NK, jnp.where(kept_NK, local_NK, 0), w_gate_EDI, w_up_EDI, w_down_EID,
                              kept_NK)
        return lax.psum(y_ND, "model")

    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, *experts),
                         out_specs=tokens)(x_ND, weights_NK, experts_NK, w_gate_EDI, w_up_EDI, w_down_EID)


def ragged_experts(x_ND, weights_NK, experts_NK, w_gate_EDI, w_up_EDI, w_down_EID) -> jax.Array:
    """The same as sorted_experts with the grouped matmuls as `jax.lax.ragged_dot` (see the module docstring)."""
    n, k = experts_NK.shape
    flat_S = experts_NK.reshape(-1)
    order_S = jnp.argsort(flat_S, stable=True)
    token_S = order_S // k
    sizes_E = jnp.bincount(flat_S, length=w_gate_EDI.shape[0]).astype(jnp.int32)
    x_SD = x_ND[token_S]
    expert_S = flat_S[order_S]
    gate_EDI, up_EDI, down_EID = (dense(w, x_SD.dtype) for w in (w_gate_EDI, w_up_EDI, w_down_EID))
    hidden_SI = (jax.nn.silu(lax.ragged_dot(rounded_input(x_SD, w_gate_EDI, expert_S), gate_EDI, sizes_E))
                 * lax.ragged_dot(rounded_input(x_SD, w_up_EDI, expert_S), up_EDI, sizes_E))
    out_SD = (lax.ragged_dot(rounded_input(hidden_SI, w_down_EID, expert_S), down_EID, sizes_E)
              * weights_NK.reshape(-1)[order_S][:, None])
    return jnp.zeros((n, x_ND.shape[1]), out_SD.dtype).at[token_S].add(out_SD)


EXPERT_PATHS = {"gather": gather_experts, "sorted": sorted_experts, "ragged": ragged_experts}


class MoeMLP(nnx.Module):
    """Router [D, E], experts w_gate / w_up [E, D, I] and w_down [E, I, D], optionally a shared SwiGLU expert
    (shared_gate / shared_up [D, Is], shared_down [Is, D]) scaled by sigmoid(x @ shared_expert_gate [D, 1]).

    lead: leading shape and axis names for stacked layers (a DecoderLayer with stacked=L passes ((L,), ("layers",))).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, scale: float = 0.02, lead=((), ())):
        moe = cfg.moe
        self.moe_cfg = moe  # (the layer holding this module calls it `moe`)
        shape, axes = lead
        d, e, i, dtype = cfg.hidden_size, moe.num_experts, moe.expert_size, jnp.dtype(cfg.dtype)

        def weight(dims, *names):
            return param(normal(rngs, shape + dims, dtype, scale), *axes, *names)

        self.record = False  # routing_counts sets it: each call then sows its expert ids (nnx.Intermediate "routed")
        self.router = weight((d, e), "embed", None)
        self.w_gate = weight((e, d, i), "experts", "embed", "mlp")
        self.w_up = weight((e, d, i), "experts", "embed", "mlp")
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
        weights_NK, experts_NK = route(x_ND, self.router[...], self.moe_cfg.top_k, self.moe_cfg.norm_topk_prob)
        if self.record:
            self.sow(nnx.Intermediate, "routed", experts_NK.reshape(b, t, -1))
        experts = (self.w_gate[...], self.w_up[...], self.w_down[...])
        mesh = active_mesh()
        if self.moe_cfg.expert_parallel and mesh is not None and axis_size(mesh, "model") > 1:
            y_ND = expert_parallel_experts(x_ND, weights_NK, experts_NK, *experts, mesh)
        else:
            y_ND = EXPERT_PATHS[expert_path(self.moe_cfg, b * t)](x_ND, weights_NK, experts_NK, *experts)
        if self.shared_gate is not None:
            shared_ND = swiglu(x_ND, self.shared_gate[...], self.shared_up[...], self.shared_down[...])
            y_ND = y_ND + jax.nn.sigmoid(x_ND @ self.shared_expert_gate[...]) * shared_ND
        return y_ND.astype(x_BTD.dtype).reshape(b, t, d)


def routed_experts(model, tokens_BT) -> list[np.ndarray]:
    """Per sparse layer, the experts each token of `tokens_BT` is routed to ([B, T, k]): one eager forward of
    `model` (a Decoder or HybridDecoder holding an MoE) with its routers recording."""
    moes = [layer.moe for layer in model.layers if getattr(layer, "moe", None) is not None]
    if not moes:
        raise ValueError("routed_experts needs an MoE model (its layers hold no experts); per-layer layout")
    for moe in moes:
        moe.record = True
    try:
        _, sown = nnx.capture(model, nnx.Intermediate)(tokens_BT)  # Flax's way to read what sow() stored
    finally:
        for moe in moes:
            moe.record = False
    routed = [(path, value) for path, value in nnx.to_flat_state(sown) if path[-1] == "routed"]
    routed.sort(key=lambda item: [k if isinstance(k, int) else -1 for k in item[0]])  # layer order
    return [np.asarray(_first(value)) for _, value in routed]


def _first(value):
    """The first value sow() stored (a tuple of calls' values, inside a Variable or not)."""
    value = value.get_value() if hasattr(value, "get_value") else value
    return value[0] if isinstance(value, tuple) else value


def distinct_experts(routed: list[np.ndarray], tokens: int, samples: int = 64, seed: int = 0) -> float:
    """Mean distinct experts a pass of `tokens` tokens reads in one sparse layer, the tokens drawn at random from
    the routed ones (rows and positions mixed, as a batch of requests): the measured counterpart of
    MoeConfig.expected_experts."""
    rng = np.random.default_rng(seed)
    counts = []
    for experts_BTK in routed:
        flat_NK = experts_BTK.reshape(-1, experts_BTK.shape[-1])
        if tokens > flat_NK.shape[0]:
            raise ValueError(f"a pass of {tokens} tokens needs at least that many routed tokens, "
                             f"got {flat_NK.shape[0]}")
        for _ in range(samples):
            pick = rng.choice(flat_NK.shape[0], size=tokens, replace=False)
            counts.append(len(np.unique(flat_NK[pick])))
    return float(np.mean(counts))
