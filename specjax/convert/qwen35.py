"""Qwen3.5's tensor names -> specjax params (transformers' Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration),
and those of its MoE relatives: Qwen3.5-MoE (the same names, a sparse MLP) and Qwen3-Next.

The text model sits under `model.` (CausalLM) or `model.language_model.` (ConditionalGeneration, whose
`model.visual.*` vision tower specjax does not run). Full-attention layers are `DecoderLayer`s whose
q_proj holds each head's query and output gate side by side ([q_h | gate_h] per head, transformers'
`torch.chunk(q_proj(x).view(..., heads, 2 * head_dim), 2)`): split here into wq and wg. Gated DeltaNet
layers map name for name; the conv weight [C, 1, K] is stored [K, C]. Qwen3-Next fuses the DeltaNet's input
projections per key head (`split_qkvz`). A sparse layer's MLP is read by convert/moe.py.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from specjax.config import LinearAttnConfig, ModelConfig
from specjax.convert.hf_files import LAYER_KEYS
from specjax.convert.lazy import deferred_parts
from specjax.convert.moe import moe_hf_tensors, take_moe
from specjax.convert.quantized import split_columns
from specjax.models.model import param_shapes
from specjax.quant.qarray import is_quantized

PREFIXES = ("model.", "model.language_model.")
VISION_PREFIX = "model.visual."

# specjax key -> (name inside the layer, transpose?) for keys taken as stored: the dense layer's names
# (hf_files.LAYER_KEYS) where Qwen3.5 uses them, the DeltaNet's own below.
_SHARED = {k: LAYER_KEYS[k] for k in ("attn_norm", "mlp_norm", "w_gate", "w_up", "w_down")}
_MLP = ("mlp_norm", "w_gate", "w_up", "w_down")  # the MLP half, read by take_mlp
ATTENTION_KEYS = {**_SHARED, **{k: LAYER_KEYS[k] for k in ("wk", "wv", "wo", "q_norm", "k_norm")}}
GATED_Q = "self_attn.q_proj.weight"
DELTANET_KEYS = {
    **_SHARED,
    "w_qkv": ("linear_attn.in_proj_qkv.weight", True),
    "w_z": ("linear_attn.in_proj_z.weight", True),
    "w_b": ("linear_attn.in_proj_b.weight", True),
    "w_a": ("linear_attn.in_proj_a.weight", True),
    "dt_bias": ("linear_attn.dt_bias", False),
    "A_log": ("linear_attn.A_log", False),
    "out_norm": ("linear_attn.norm.weight", False),
    "w_out": ("linear_attn.out_proj.weight", True),
}
CONV = "linear_attn.conv1d.weight"
# Qwen3-Next: in_proj_qkvz [Hk (2 dk + 2 r dv), D] and in_proj_ba [Hk 2 r, D] (r = Hv / Hk), each key head's
# group [q | k | v | z] and [b | a] side by side (transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering).
QKVZ, BA = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"
FUSED_KEYS = ("w_qkv", "w_z", "w_b", "w_a")

Take = Callable[[str, tuple[int, ...], bool], np.ndarray]  # (name, expected shape, transpose) -> array


def text_prefix(tensors: dict[str, np.ndarray]) -> str:
    """'model.language_model.' when the checkpoint is the multimodal layout, else 'model.'."""
    return PREFIXES[1] if f"{PREFIXES[1]}embed_tokens.weight" in tensors else PREFIXES[0]


def split_gated_q(w_OD: np.ndarray, heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """q_proj [heads x 2 head_dim, D] -> (query [D, heads x head_dim], gate [D, heads x head_dim])."""
    per_head = w_OD.reshape(heads, 2, head_dim, -1)
    return (per_head[:, 0].reshape(heads * head_dim, -1).T, per_head[:, 1].reshape(heads * head_dim, -1).T)


def join_gated_q(wq_DQ: np.ndarray, wg_DQ: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """The inverse of split_gated_q: the q_proj weight as transformers stores it."""
    d = wq_DQ.shape[0]
    q, g = wq_DQ.T.reshape(heads, 1, head_dim, d), wg_DQ.T.reshape(heads, 1, head_dim, d)
    return np.concatenate([q, g], axis=1).reshape(heads * 2 * head_dim, d)


def split_qkvz(qkvz_OD: np.ndarray, ba_OD: np.ndarray, lin: LinearAttnConfig) -> dict[str, np.ndarray]:
    """Qwen3-Next's fused projections -> w_qkv [D, 2 Hk dk + Hv dv] ([q | k | v], each head-major), w_z [D, Hv dv],
    w_b / w_a [D, Hv]: the layout Qwen3.5 stores unfused."""
    hk, dk, d = lin.num_key_heads, lin.key_head_dim, qkvz_OD.shape[-1]
    rv = lin.num_value_heads // hk * lin.value_head_dim
    q, k, v, z = np.split(qkvz_OD.reshape(hk, 2 * dk + 2 * rv, d), [dk, 2 * dk, 2 * dk + rv], axis=1)
    b, a = np.split(ba_OD.reshape(hk, -1, d), 2, axis=1)
    flat = [x.reshape(-1, d).T for x in (q, k, v, z, b, a)]
    return {"w_qkv": np.concatenate(flat[:3], axis=1), "w_z": flat[3], "w_b": flat[4], "w_a": flat[5]}


def join_qkvz(layer: dict, lin: LinearAttnConfig) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of split_qkvz: (in_proj_qkvz, in_proj_ba) as Qwen3-Next stores them."""
    hk = lin.num_key_heads
    q, k, v = np.split(np.asarray(layer["w_qkv"]).T, [lin.key_dim, 2 * lin.key_dim])
    d = q.shape[-1]
    group = [x.reshape(hk, -1, d) for x in (q, k, v, np.asarray(layer["w_z"]).T)]
    ba = [np.asarray(layer[key]).T.reshape(hk, -1, d) for key in ("w_b", "w_a")]
    return np.concatenate(group, axis=1).reshape(-1, d), np.concatenate(ba, axis=1).reshape(-1, d)


def split_fused(qkvz_DO, ba_DO, lin: LinearAttnConfig, prefix: str = "") -> tuple:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba ([in, out], either kept quantized) -> (w_qkv, w_z, w_b, w_a) as
    split_qkvz splits them, each source apart so a quantized one keeps its blocks (split_columns)."""
    def of_qkvz(w_OD):  # q, k, v and z come from in_proj_qkvz alone
        parts = split_qkvz(w_OD, np.zeros((ba_DO.shape[-1], w_OD.shape[-1]), w_OD.dtype), lin)
        return parts["w_qkv"], parts["w_z"]

    def of_ba(w_OD):
        parts = split_qkvz(np.zeros((qkvz_DO.shape[-1], w_OD.shape[-1]), w_OD.dtype), w_OD, lin)
        return parts["w_b"], parts["w_a"]

    return split_columns(qkvz_DO, of_qkvz, prefix + QKVZ) + split_columns(ba_DO, of_ba, prefix + BA)


def take_mlp(take: Take, tensors: dict, prefix: str, shapes: dict) -> dict:
    """A layer's MLP half: the dense SwiGLU's tensors, or (a sparse layer) the MoE's."""
    if "moe" in shapes:
        return {"mlp_norm": take(prefix + LAYER_KEYS["mlp_norm"][0], shapes["mlp_norm"], False),
                "moe": take_moe(take, tensors, prefix, shapes["moe"])}
    return {k: take(prefix + LAYER_KEYS[k][0], shapes[k], LAYER_KEYS[k][1]) for k in _MLP}


def take_attention_layer(take: Take, prefix: str, shapes: dict, cfg: ModelConfig, tensors: dict) -> dict:
    """One gated full-attention layer's params from the tensors under `prefix` (a target layer or an MTP block)."""
    layer = {k: take(prefix + name, shapes[k], tr) for k, (name, tr) in ATTENTION_KEYS.items() if k not in _MLP}
    qd = cfg.num_heads * cfg.head_dim
    q_proj = take(prefix + GATED_Q, (cfg.hidden_size, 2 * qd), True)  # [D, 2 qd], or kept quantized

    def split(w_OD):
        return split_gated_q(w_OD, cfg.num_heads, cfg.head_dim)

    if is_quantized(q_proj):
        layer["wq"], layer["wg"] = split_columns(q_proj, split, prefix + GATED_Q)
    else:
        q_proj = q_proj.T
        layer["wq"], layer["wg"] = deferred_parts(lambda: split(np.asarray(q_proj)), [(cfg.hidden_size, qd)] * 2,
                                                  q_proj.dtype, q_proj)
    return {**layer, **take_mlp(take, tensors, prefix, shapes)}


def take_deltanet_layer(take: Take, prefix: str, shapes: dict, cfg: ModelConfig, tensors: dict) -> dict:
    fused_projections = cfg.family == "qwen3_next"
    keys = {k: v for k, v in DELTANET_KEYS.items() if k not in _MLP and not (fused_projections and k in FUSED_KEYS)}
    layer = {k: take(prefix + name, shapes[k], tr) for k, (name, tr) in keys.items()}
    if fused_projections:
        lin = cfg.linear
        r = lin.num_value_heads // lin.num_key_heads
        qkvz = take(prefix + QKVZ, (cfg.hidden_size, lin.conv_dim + lin.value_dim), True)  # [D, O]
        ba = take(prefix + BA, (cfg.hidden_size, lin.num_key_heads * 2 * r), True)
        if is_quantized(qkvz) or is_quantized(ba):
            layer.update(zip(FUSED_KEYS, split_fused(qkvz, ba, lin, prefix)))
        else:
            qkvz, ba = qkvz.T, ba.T
            parts = deferred_parts(lambda: tuple(split_qkvz(np.asarray(qkvz), np.asarray(ba), lin).values()),
                                   [shapes[k] for k in FUSED_KEYS], qkvz.dtype, qkvz, ba)
            layer.update(zip(FUSED_KEYS, parts))
    k, c = shapes["conv_w"]
    layer["conv_w"] = take(prefix + CONV, (c, 1, k), False)[:, 0, :].T
    return {**layer, **take_mlp(take, tensors, prefix, shapes)}


def take_hybrid_params(take: Take, tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """The hybrid target's param tree (per-layer) from a checkpoint in either published layout."""
    prefix = text_prefix(tensors)
    shapes = param_shapes(cfg)
    layers = {}
    for i in range(cfg.num_layers):
        where = f"{prefix}layers.{i}."
        if cfg.layer_type(i) == "full_attention":
            layers[i] = take_attention_layer(take, where, shapes["layers"][i], cfg, tensors)
        else:
            layers[i] = take_deltanet_layer(take, where, shapes["layers"][i], cfg, tensors)
    params = {"embed": take(f"{prefix}embed_tokens.weight", shapes["embed"], False), "layers": layers,
              "final_norm": take(f"{prefix}norm.weight", shapes["final_norm"], False)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = take("lm_head.weight", shapes["lm_head"], True)
    return params


def hybrid_hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of take_hybrid_params: transformers' Qwen3_5(Moe)ForCausalLM / Qwen3NextForCausalLM tensors
    ([out, in]), names under `model.` (the text-only layout; a multimodal source is exported as its text model).
    Experts are written as their family publishes them (fused for Qwen3.5-MoE, per expert for Qwen3-Next)."""
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]),
           "model.norm.weight": np.asarray(params["final_norm"])}
    fused_projections = cfg.family == "qwen3_next"
    for i in range(cfg.num_layers):
        layer, where = params["layers"][i], f"model.layers.{i}."
        attention = cfg.layer_type(i) == "full_attention"
        keys = ATTENTION_KEYS if attention else DELTANET_KEYS
        for k, (name, tr) in keys.items():
            if k in layer and not (fused_projections and k in FUSED_KEYS):
                out[where + name] = np.asarray(layer[k]).T if tr else np.asarray(layer[k])
        if "moe" in layer:
            out.update(moe_hf_tensors(layer["moe"], where, fused=cfg.family == "qwen3_5_moe"))
        if attention:
            out[where + GATED_Q] = join_gated_q(np.asarray(layer["wq"]), np.asarray(layer["wg"]), cfg.num_heads,
                                                cfg.head_dim)
        else:
            out[where + CONV] = np.asarray(layer["conv_w"]).T[:, None, :]
            if fused_projections:
                out[where + QKVZ], out[where + BA] = join_qkvz(layer, cfg.linear)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.asarray(params["lm_head"]).T
    return out


def text_model_config(hf: dict) -> dict:
    """config.json of the text model alone (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) from either published layout."""
    if "text_config" not in hf:
        return hf
    text = {k: v for k, v in hf["text_config"].items() if k != "architectures"}
    moe = "Moe" in (hf.get("architectures") or [""])[0]
    text.update(architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
                model_type="qwen3_5_moe_text" if moe else "qwen3_5_text")
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text
