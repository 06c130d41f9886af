"""Read a z-lab DFlash drafter checkpoint (`DFlashDraftModel`) and check it fits a target.

A DFlash directory holds config.json (a Qwen3 config with architectures ["DFlashDraftModel"])
and model.safetensors (or an index with shards). Config fields it adds:
  older: top-level `block_size`, `rope_theta`;
  newer: `dflash_config` {block_size (optional), mask_token_id, target_layer_ids} and
         `rope_parameters` {rope_type, rope_theta};
  JetSpec's heads (hao-ai-lab/JetSpec, jetspec/models/draft_head.py): `dflash_config.causal_head`
         true, a causal mask inside the block (BlockConfig.causal); `dflash_config.target_hidden_size`
         other than hidden_size (JetSpec's random-init HiddenDimAdapter) is refused;
  `num_target_layers` (the default taps are spread over 1..num_target_layers - 3 when
  dflash_config has no target_layer_ids, as the original's `build_target_layer_ids`).
Unset Qwen3 fields take Qwen3Config's defaults (head_dim 128, rms_norm_eps 1e-6, rope base
10000, attention_bias false), as the original, which builds its layers from a Qwen3Config.

Tensors (no `model.` prefix; torch [out, in]):
    fc.weight [H, n*H]; hidden_norm.weight [H]; norm.weight [H];
    layers.{i}.self_attn.{q,k,v,o}_proj.weight (attention_bias configs are refused);
    layers.{i}.self_attn.{q,k}_norm.weight [head_dim];
    layers.{i}.mlp.{gate,up,down}_proj.weight; layers.{i}.{input,post_attention}_layernorm.weight.
The drafter has no embedding or lm_head: it uses the target's. Every tensor must be accounted for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specjax.config import _DTYPE_NAMES, ModelConfig, _rope_from_hf
from specjax.convert.hf_files import NP_DTYPES, read_hf_config, read_tensors, safetensors_files
from specjax.drafters.dflash import BlockConfig, param_shapes

ARCHITECTURE = "DFlashDraftModel"

# specjax layer key -> (name inside layers.{i}., transpose?)
LAYER_KEYS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
TOP_KEYS = {"fc": ("fc.weight", True), "hidden_norm": ("hidden_norm.weight", False),
             "final_norm": ("norm.weight", False)}
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)


def is_dflash_config(hf: dict[str, Any]) -> bool:
    """A DFlash drafter config: the DFlashDraftModel architecture or a `dflash_config` section."""
    return ARCHITECTURE in (hf.get("architectures") or []) or "dflash_config" in hf


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The original's default taps (layer ids, 'output of layer id'): one per draft layer, spread evenly
    from 1 to num_target_layers - 3 and rounded; the middle layer for a one-layer drafter."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    return tuple(int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def _need(hf: dict[str, Any], key: str):
    if key not in hf:
        raise ValueError(f"the DFlash drafter's config.json lacks required field '{key}'")
    return hf[key]


def check_layer_fields(family: str, hf: dict[str, Any], target: ModelConfig, need) -> tuple[int, int, int]:
    """(layers, heads, kv heads) of a block drafter's config.json, refusing a hidden size or vocabulary that is
    not the target's, heads that do not group, and sliding-window layers (ValueError naming both sides).

    Shared by the DFlash and DSpark readers; `need` reads a required field with the family's own message.
    """
    hidden = need(hf, "hidden_size")
    if hidden != target.hidden_size:
        raise ValueError(f"the {family} drafter's hidden_size is {hidden} but the target's is {target.hidden_size}: "
                         f"{family} reads the target's hidden states, so they must be equal (use the drafter trained "
                         "for this target)")
    vocab = hf.get("vocab_size")
    if vocab is not None and vocab != target.vocab_size:
        raise ValueError(f"the {family} drafter's config.json vocab_size is {vocab} but the target's vocabulary has "
                         f"{target.vocab_size} tokens; the drafter must be trained for this target's tokenizer")
    layers = need(hf, "num_hidden_layers")
    heads = need(hf, "num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"the {family} drafter's num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    refuse_sliding(hf, layers)
    return layers, heads, kv_heads


def _block_size(hf: dict[str, Any], dflash: dict[str, Any]) -> int:
    """Top-level `block_size` (older configs, what the original reads) or dflash_config.block_size (newer)."""
    top, inner = hf.get("block_size"), dflash.get("block_size")
    if top is not None and inner is not None and int(top) != int(inner):
        raise ValueError(f"the DFlash drafter's config.json has block_size={top} but dflash_config.block_size="
                         f"{inner}; they must agree (or give only one)")
    size = top if top is not None else inner
    if size is None:
        raise ValueError("the DFlash drafter's config.json has no block_size (top-level or in dflash_config)")
    if int(size) < 2:
        raise ValueError(f"the DFlash drafter's block_size is {size}; a block holds the anchor and at least one "
                         "MASK row, so block_size must be >= 2 (typically 16)")
    return int(size)


def refuse_sliding(hf: dict[str, Any], num_layers: int) -> None:
    """The drafter's layers must all be full attention (specjax has no sliding-window drafter layers)."""
    types = hf.get("layer_types")
    if types is None and hf.get("use_sliding_window") and hf.get("sliding_window"):
        window_from = int(hf.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= window_from else "full_attention" for i in range(num_layers)]
    if types and any(t != "full_attention" for t in types):
        raise ValueError(f"the DFlash drafter's layers have attention types {sorted(set(types))}; specjax implements "
                         "DFlash with full attention in every layer only (no sliding-window draft layers)")


def target_layer_ids(hf: dict[str, Any], target: ModelConfig, num_draft_layers: int) -> tuple[int, ...]:
    """The taps (original numbering: output of layer id), checked against the target (ValueError otherwise).

    Each must lie in 0 .. L-2: the original reads HF hidden_states[id + 1], and hidden_states[L] (the
    last layer's output) is final-normed in HF but not in specjax's capture, and never a DFlash tap.
    """
    dflash = hf.get("dflash_config") or {}
    num_target = hf.get("num_target_layers")
    if num_target is not None and int(num_target) != target.num_layers:
        raise ValueError(f"the DFlash drafter was built for a target of num_target_layers={num_target} layers but "
                         f"the target has {target.num_layers}; use the drafter trained for this target")
    ids = dflash.get("target_layer_ids")
    if ids is None:
        ids = default_target_layer_ids(target.num_layers, num_draft_layers)
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"the DFlash drafter's dflash_config.target_layer_ids is {ids!r}; it must be a non-empty "
                         "list of integer layer ids")
    bad = [i for i in ids if not 0 <= i <= target.num_layers - 2]
    if bad:
        raise ValueError(f"the DFlash drafter's target_layer_ids {list(ids)} have {bad} out of range for the target: "
                         f"with {target.num_layers} layers a tap ('output of layer id', HF hidden_states[id + 1]) "
                         f"must lie in 0..{target.num_layers - 2} (the last layer's output is never a tap)")
    return tuple(int(i) for i in ids)


def dflash_config(hf: dict[str, Any], target: ModelConfig, dtype: str | None = None) -> BlockConfig:
    """BlockConfig from the drafter's config.json, checked against the target (ValueError naming both sides)."""
    if not is_dflash_config(hf):
        raise ValueError(f"config.json architectures is {hf.get('architectures')!r} with no dflash_config; a DFlash "
                         f"drafter's config names {ARCHITECTURE!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"the DFlash drafter's config.json hidden_act is {hf['hidden_act']!r}; only 'silu' is "
                         "implemented")
    if hf.get("mlp_bias"):
        raise ValueError("the DFlash drafter's config.json has mlp_bias true; the Qwen3 MLP it uses has no bias")
    dflash = hf.get("dflash_config") or {}
    layers, heads, kv_heads = check_layer_fields("DFlash", hf, target, _need)
    hidden = target.hidden_size
    if hf.get("attention_bias"):
        raise ValueError("the DFlash drafter's config.json has attention_bias true (Qwen3 then biases q/k/v and "
                         "o_proj); specjax implements the released DFlash layers, which have no attention biases")
    block_size = _block_size(hf, dflash)
    mask = dflash.get("mask_token_id", hf.get("mask_token_id"))
    if mask is None:
        raise ValueError("the DFlash drafter's config.json has no dflash_config.mask_token_id (the token whose "
                         "embedding fills the block's draft rows)")
    if not 0 <= int(mask) < target.vocab_size:
        raise ValueError(f"the DFlash drafter's mask_token_id {mask} is outside the target's vocabulary "
                         f"(0..{target.vocab_size - 1}); it must be a token of the target's tokenizer")
    torch_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    layer_cfg = ModelConfig(
        vocab_size=target.vocab_size, hidden_size=hidden, intermediate_size=_need(hf, "intermediate_size"),
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=int(hf.get("head_dim") or 128),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope=_rope_from_hf(hf),
        qkv_bias=False, qk_norm=True, family="qwen3",
        dtype=dtype or _DTYPE_NAMES.get(str(torch_dtype), "float32"))
    return BlockConfig(layers=layer_cfg, target_layer_ids=target_layer_ids(hf, target, layers),
                       block_size=block_size, mask_token_id=int(mask), causal=causal_head(dflash, hidden))


def causal_head(dflash: dict[str, Any], hidden: int) -> bool:
    """`dflash_config.causal_head` (JetSpec), a bool; JetSpec's `target_hidden_size` adapter is refused."""
    causal = dflash.get("causal_head", False)
    if not isinstance(causal, bool):
        raise ValueError(f"the DFlash drafter's dflash_config.causal_head is {causal!r}; it must be true or false")
    adapted = dflash.get("target_hidden_size", hidden)
    if adapted != hidden:
        raise ValueError(f"the DFlash drafter's dflash_config.target_hidden_size is {adapted} but its hidden_size "
                         f"is {hidden}: JetSpec's HiddenDimAdapter (a random-init smoke path) is not supported; use "
                         f"a head trained for a target of hidden size {hidden}")
    return causal


def block_params(tensors: dict[str, np.ndarray], cfg: BlockConfig) -> dict[str, Any]:
    """specjax block params (numpy, [in, out], layers stacked on L) from the checkpoint's tensors.

    Every tensor is checked against config.json's shapes and accounted for.
    """
    dtype = NP_DTYPES[cfg.layers.dtype]
    shapes = param_shapes(cfg)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        want = shape[::-1] if transpose else shape
        if name not in tensors:
            raise ValueError(f"DFlash checkpoint lacks tensor '{name}' (expected by config.json, shape {want})")
        if tensors[name].shape != want:
            why = (f" ({cfg.num_taps} taps target_layer_ids={list(cfg.target_layer_ids)} x hidden "
                   f"{cfg.hidden_size}; set dflash_config.target_layer_ids to the taps it was trained on)"
                   if name == "fc.weight" else "")
            raise ValueError(f"DFlash checkpoint tensor '{name}' has shape {tensors[name].shape}; config.json implies "
                             f"{want}{why}")
        used.add(name)
        t = tensors[name].T if transpose else tensors[name]
        return np.asarray(t).astype(dtype)

    params: dict[str, Any] = {k: take(name, shapes[k], tr) for k, (name, tr) in TOP_KEYS.items()}
    layer_shapes = shapes["layers"]
    params["layers"] = {
        k: np.stack([take(f"layers.{i}.{LAYER_KEYS[k][0]}", shape[1:], LAYER_KEYS[k][1])
                     for i in range(cfg.layers.num_layers)])
        for k, shape in layer_shapes.items()}
    leftover = sorted(n for n in tensors if n not in used and not n.endswith(HARMLESS_SUFFIXES))
    if leftover:
        shown = ", ".join(f"'{n}'" for n in leftover[:8])
        hint = ""
        if any(n.startswith("model.") for n in leftover):
            hint = " (names with a 'model.' prefix: a DFlash checkpoint's tensors have none; is this the target?)"
        elif any(n.startswith(("embed_tokens", "lm_head")) for n in leftover):
            hint = " (DFlash uses the target's embedding and lm_head; the checkpoint should not carry its own)"
        raise ValueError(f"DFlash checkpoint has {len(leftover)} tensor(s) a DFlash drafter with this config.json does "
                         f"not have: {shown}{' ...' if len(leftover) > 8 else ''}{hint}; specjax refuses to drop "
                         "weights")
    return params


def load_dflash(model_dir: str | Path, target: ModelConfig, dtype: str | None = None
                ) -> tuple[BlockConfig, dict[str, Any]]:
    """(config, host block params) of the DFlash drafter in model_dir, checked against the target's config."""
    model_dir = Path(model_dir)
    hf = read_hf_config(model_dir)
    dflash2 = sorted(k for k in ("conv_kernel_size", "selector_rank") if k in (hf.get("dflash_config") or {}))
    if dflash2 or "DFlash2DraftModel" in (hf.get("architectures") or []):
        raise ValueError(f"{model_dir} is a DFlash2 drafter (DFlash2DraftModel{', ' if dflash2 else ''}"
                         f"{', '.join(dflash2)}): its convolutions and candidate selector would be dropped as DFlash; "
                         "load it with specjax.load_drafter (convert/dflash2.py)")
    cfg = dflash_config(hf, target, dtype)
    return cfg, block_params(read_tensors(safetensors_files(model_dir)), cfg)
