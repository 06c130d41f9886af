"""A sparse MLP's tensors (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next) <-> the `moe` params of models/moe.py.

Inside a layer (`{prefix}` = "model.layers.{i}." or an MTP block's prefix), torch [out, in]:
    mlp.gate.weight [E, D]                                   the router
    experts, in one of the two published forms:
      per expert (Qwen3-30B-A3B, Qwen3-Next; what transformers 5 saves for those):
        mlp.experts.{j}.gate_proj.weight / up_proj.weight [I, D], down_proj.weight [D, I]
      fused (Qwen3.5-MoE; transformers 5's in-memory layout):
        mlp.experts.gate_up_proj [E, 2I, D] (gate rows first, then up), mlp.experts.down_proj [E, D, I]
        (in block FP8: F8_E4M3 values plus `<name>_scale_inv` [E, ceil(out / bo), ceil(in / bi)], as transformers'
        FP8Experts holds them: convert/quantized.read_fused_experts)
    with a shared expert (Qwen3.5-MoE, Qwen3-Next):
        mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1, D]
specjax keeps router [D, E], w_gate / w_up [E, D, I], w_down [E, I, D], shared_* [in, out].
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from specjax.convert.lazy import stack
from specjax.convert.quantized import split_columns, uniform_weights
from specjax.quant.qarray import is_quantized

# (name, expected specjax shape, transpose: the stored [..., out, in] read as [..., in, out]) -> array, or a
# QuantizedWeight [..., in, out] where the tensor is stored quantized
Take = Callable[[str, tuple[int, ...], bool], np.ndarray]

ROUTER = "mlp.gate.weight"
FUSED_GATE_UP, FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
SHARED = {"shared_gate": "mlp.shared_expert.gate_proj.weight", "shared_up": "mlp.shared_expert.up_proj.weight",
          "shared_down": "mlp.shared_expert.down_proj.weight", "shared_expert_gate": "mlp.shared_expert_gate.weight"}


def expert_name(j: int, proj: str) -> str:
    return f"mlp.experts.{j}.{proj}_proj.weight"


def is_fused(tensors: dict, prefix: str) -> bool:
    """Whether the experts under `prefix` are stored fused (one [E, ...] tensor per projection)."""
    return f"{prefix}{FUSED_GATE_UP}" in tensors


def take_moe(take: Take, tensors: dict, prefix: str, shapes: dict) -> dict:
    """The `moe` params of one sparse layer from either expert form; `shapes` is that layer's moe shapes."""
    e, d, i = shapes["w_gate"]
    moe = {"router": take(prefix + ROUTER, shapes["router"], True)}
    if is_fused(tensors, prefix):
        # [E, D, 2I] (each expert's [2I, D] transposed); quantized ones ([E, ...] QuantizedWeights) split with their
        # scale blocks (a block straddling gate and up, I not a multiple of the block: dequantized, logged)
        gate_up = take(prefix + FUSED_GATE_UP, (e, d, 2 * i), True)
        if is_quantized(gate_up):
            moe["w_gate"], moe["w_up"] = split_columns(gate_up, lambda w_OD: (w_OD[:i].T, w_OD[i:].T),
                                                       prefix + FUSED_GATE_UP)
        else:
            moe["w_gate"], moe["w_up"] = gate_up[..., :i], gate_up[..., i:]
        moe["w_down"] = take(prefix + FUSED_DOWN, (e, i, d), True)
    else:
        for key, proj in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down")):
            experts = [take(prefix + expert_name(j, proj), shapes[key][1:], True) for j in range(e)]
            # quantized experts stay quantized: [E, ...] values and scales (models/moe.py dequantizes the ones used)
            experts = uniform_weights(experts, None)  # mixed: dequantized to the model dtype
            moe[key] = jax.tree.map(lambda *xs: stack(xs), *experts)
    for key, name in SHARED.items():
        if key in shapes:
            moe[key] = take(prefix + name, shapes[key], True)
    return moe


def moe_hf_tensors(moe: dict, prefix: str, fused: bool) -> dict[str, np.ndarray]:
    """The inverse of take_moe: one sparse layer's tensors in the per-expert or the fused form."""
    out = {prefix + ROUTER: np.asarray(moe["router"]).T}
    gate, up, down = (np.asarray(moe[k]) for k in ("w_gate", "w_up", "w_down"))
    if fused:
        out[prefix + FUSED_GATE_UP] = np.concatenate([gate, up], axis=-1).transpose(0, 2, 1)
        out[prefix + FUSED_DOWN] = down.transpose(0, 2, 1)
    else:
        for j in range(gate.shape[0]):
            for proj, w in (("gate", gate), ("up", up), ("down", down)):
                out[prefix + expert_name(j, proj)] = w[j].T
    for key, name in SHARED.items():
        if key in moe:
            out[prefix + name] = np.asarray(moe[key]).T
    return out
