"""Read a z-lab DFlash2 drafter checkpoint (`DFlash2DraftModel`) and check it fits a target.

Followed from z-lab/vllm-fork `vllm/model_executor/models/qwen3_dflash2.py` (and `qwen3_dflash.py`'s
`_resolve_layer_attention` for the attention of each layer). config.json is a DFlash config (convert/dflash.py)
whose `dflash_config` adds conv_kernel_size, conv_group_size, selector_rank, selector_top_k and optionally
final_logit_softcapping (<= 0 or absent: none), output_multiplier and input_embedding_scale (1 when absent);
`layer_types` may hold `sliding_attention` (window: dflash_config.swa_window_size, else `sliding_window`), and
causality is `is_causal`, else dflash_config.causal, else "sliding layers are causal" (one value for every layer).

Tensors beyond DFlash's (no `model.` prefix; torch [out, in]):
    layers.{i}.{attention_conv,mlp_conv}.base_kernel [2, taps, H];
    layers.{i}.{attention_conv,mlp_conv}.kernel_projection.weight [2 * taps * H / group, H];
    candidate_selector.{predecessor,successor}_codebook [V, rank];
    candidate_selector.hidden_projection.weight [rank, H].
Every tensor must be accounted for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specjax.config import ModelConfig
from specjax.convert.dflash import block_params, dflash_config
from specjax.convert.hf_files import NP_DTYPES, read_hf_config, read_tensors, safetensors_files
from specjax.drafters.dflash import BlockConfig
from specjax.drafters.dflash2 import DFlash2Head, head_param_shapes

ARCHITECTURE = "DFlash2DraftModel"
HEAD_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CONV_NAMES = {"attn": "attention_conv", "mlp": "mlp_conv"}


def is_dflash2_config(hf: dict[str, Any]) -> bool:
    """A DFlash2 drafter config: the DFlash2DraftModel architecture or a dflash_config with selector fields."""
    dflash = hf.get("dflash_config") or {}
    return ARCHITECTURE in (hf.get("architectures") or []) or any(f in dflash for f in HEAD_FIELDS)


def _positive_int(dflash: dict[str, Any], key: str) -> int:
    value = dflash.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"the DFlash2 drafter's dflash_config.{key} is {value!r}; it must be a positive integer "
                         "(z-lab's DFlash2DraftModel configs set it, e.g. conv_kernel_size 2, conv_group_size 16, "
                         "selector_rank 256, selector_top_k 16)")
    return value


def _windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window or None, as vLLM's `_resolve_layer_attention` resolves them."""
    dflash = hf.get("dflash_config") or {}
    types = hf.get("layer_types")
    use_swa = bool(dflash.get("use_swa", False))
    if types is not None and len(types) != num_layers:
        raise ValueError(f"the DFlash2 drafter's layer_types lists {len(types)} layers but num_hidden_layers is "
                         f"{num_layers}")
    bad = sorted({t for t in types or () if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise ValueError(f"the DFlash2 drafter's layer_types has {bad}; each must be 'full_attention' or "
                         "'sliding_attention'")
    if types is None and hf.get("use_sliding_window"):
        raise ValueError("the DFlash2 drafter sets use_sliding_window with no layer_types: which layers slide is not "
                         "said (transformers derives it from max_window_layers, vLLM's DFlash reads layer_types); "
                         "list layer_types in config.json")
    any_sliding = any(t == "sliding_attention" for t in types or ())
    sliding = [use_swa] * num_layers if types is None or (use_swa and not any_sliding) else \
        [t == "sliding_attention" for t in types]
    window = dflash.get("swa_window_size", hf.get("sliding_window"))
    if any(sliding) and (not isinstance(window, int) or window < 1):
        raise ValueError(f"the DFlash2 drafter has sliding-window layers but its window is {window!r}; set "
                         "dflash_config.swa_window_size or sliding_window to a positive integer")
    return tuple(window if s else None for s in sliding)


def _causal(hf: dict[str, Any], windows: tuple[int | None, ...]) -> bool:
    """is_causal, else dflash_config.causal, else 'sliding layers are causal' (vLLM's `_dflash_layer_causal`)."""
    explicit = hf.get("is_causal")
    if explicit is None:
        explicit = (hf.get("dflash_config") or {}).get("causal")
    if explicit is not None:
        return bool(explicit)
    per_layer = {w is not None for w in windows}
    if len(per_layer) > 1:
        raise ValueError("the DFlash2 drafter mixes sliding (causal by default) and full (non-causal) layers with no "
                         "is_causal; specjax runs one block mask for every layer: set is_causal in config.json")
    return per_layer.pop()


def dflash2_config(hf: dict[str, Any], target: ModelConfig, dtype: str | None = None
                   ) -> tuple[BlockConfig, DFlash2Head]:
    """(BlockConfig, DFlash2Head) from the drafter's config.json, checked against the target (ValueError otherwise)."""
    if not is_dflash2_config(hf):
        raise ValueError(f"config.json architectures is {hf.get('architectures')!r} with no DFlash2 fields; a DFlash2 "
                         f"drafter's config names {ARCHITECTURE!r} and dflash_config.{HEAD_FIELDS}")
    dflash = hf.get("dflash_config") or {}
    fields = {key: _positive_int(dflash, key) for key in HEAD_FIELDS}
    if target.hidden_size % fields["conv_group_size"]:
        raise ValueError(f"the DFlash2 drafter's conv_group_size={fields['conv_group_size']} does not divide "
                         f"hidden_size={target.hidden_size}; pick a divisor")
    if fields["selector_top_k"] > target.vocab_size:
        raise ValueError(f"the DFlash2 drafter's selector_top_k={fields['selector_top_k']} exceeds the vocabulary "
                         f"({target.vocab_size})")
    layers = hf.get("num_hidden_layers")
    windows = _windows(hf, int(layers or 0))
    causal = _causal(hf, windows)
    base = {k: v for k, v in hf.items() if k not in ("layer_types", "use_sliding_window", "architectures")}
    cfg = dflash_config({**base, "architectures": ["DFlashDraftModel"]}, target, dtype)
    if any(w is not None and w < cfg.block_size for w in windows):
        raise ValueError(f"the DFlash2 drafter's sliding window {min(w for w in windows if w)} is shorter than its "
                         f"block ({cfg.block_size} rows); specjax needs a window that spans the block")
    softcap = float(dflash.get("final_logit_softcapping") or 0.0)
    head = DFlash2Head(**fields, sliding_windows=windows, final_logit_softcapping=softcap if softcap > 0 else None,
                       output_multiplier=float(dflash.get("output_multiplier", 1.0)),
                       input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)))
    return BlockConfig(cfg.layers, cfg.target_layer_ids, cfg.block_size, cfg.mask_token_id, causal), head


def head_params(tensors: dict[str, np.ndarray], cfg: BlockConfig, head: DFlash2Head) -> tuple[dict, set[str]]:
    """(the DFlash2-only params, numpy [in, out], conv stacked on L; the tensor names used), shapes checked."""
    dtype = NP_DTYPES[cfg.layers.dtype]
    shapes = head_param_shapes(cfg, head)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        want = shape[::-1] if transpose else shape
        if name not in tensors:
            raise ValueError(f"DFlash2 checkpoint lacks tensor '{name}' (expected by config.json, shape {want})")
        if tensors[name].shape != want:
            raise ValueError(f"DFlash2 checkpoint tensor '{name}' has shape {tensors[name].shape}; config.json "
                             f"(conv_kernel_size, conv_group_size, selector_rank) implies {want}")
        used.add(name)
        return np.asarray(tensors[name].T if transpose else tensors[name]).astype(dtype)

    params = {}
    for side, module in CONV_NAMES.items():
        n = cfg.layers.num_layers
        params[f"{side}_conv_base"] = np.stack([take(f"layers.{i}.{module}.base_kernel",
                                                     shapes[f"{side}_conv_base"][1:], False) for i in range(n)])
        params[f"{side}_conv_proj"] = np.stack([take(f"layers.{i}.{module}.kernel_projection.weight",
                                                     shapes[f"{side}_conv_proj"][1:], True) for i in range(n)])
    for which in ("predecessor", "successor"):
        params[f"selector_{which}"] = take(f"candidate_selector.{which}_codebook", shapes[f"selector_{which}"], False)
    params["selector_proj"] = take("candidate_selector.hidden_projection.weight", shapes["selector_proj"], True)
    return params, used


def load_dflash2(model_dir: str | Path, target: ModelConfig, dtype: str | None = None
                 ) -> tuple[BlockConfig, DFlash2Head, dict[str, Any]]:
    """(config, head, host params: DFlash's block params and the DFlash2 ones) of the drafter in model_dir."""
    model_dir = Path(model_dir)
    cfg, head = dflash2_config(read_hf_config(model_dir), target, dtype)
    tensors = read_tensors(safetensors_files(model_dir))
    extra, used = head_params(tensors, cfg, head)
    return cfg, head, {**block_params({k: v for k, v in tensors.items() if k not in used}, cfg), **extra}
