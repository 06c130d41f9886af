"""Read a Hugging Face model directory (config.json + safetensors) into specjax params.

Torch stores linear weights as [out, in]; specjax keeps [in, out] so activations
multiply on the left (x @ W). Per-layer tensors are stacked on a leading layer axis
on the host (numpy), then moved to the device once.

Every tensor in the checkpoint must be accounted for by the config: one the config does
not explain (q/k/v biases with `attention_bias` false, a layer past `num_hidden_layers`)
is refused by name rather than silently dropped, since dropping it would run a different
model from the one the checkpoint describes. Multi-token-prediction (MTP) layers are kept:
they go to `params["mtp"]` through convert/mtp.py (which checks them just as strictly), and
the target itself runs without them. The only exceptions are:
  * `_HARMLESS` below: non-persistent buffers some exporters saved anyway (RoPE
    `inv_freq`), which specjax recomputes from the config;
  * `lm_head.weight` with `tie_word_embeddings` true when it equals the embedding
    (transformers ties them in that case too). If it differs, transformers 5 unties them
    with a warning while older versions silently tie them, so the config and the
    checkpoint disagree and the conversion is refused.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import jax
import numpy as np

from specjax.config import ModelConfig
from specjax.convert.hf_files import NP_DTYPES, read_hf_config, read_tensors, safetensors_files, take_layer
from specjax.convert.lazy import LazyTensors, stack
from specjax.convert.mtp import read_mtp
from specjax.convert.quantized import LAYER_LINEARS, QuantScheme, read_scheme, read_weight, swap_last, uniform_layers
from specjax.convert.qwen35 import VISION_PREFIX, take_hybrid_params, text_prefix
from specjax.models.model import param_shapes

# Known-harmless tensors that no config field accounts for: RoPE inverse-frequency buffers
# (non-persistent in current transformers, but older exports and some converters saved them).
_HARMLESS = (
    re.compile(r"model\.rotary_emb\.inv_freq"),
    re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),
)
# Multi-token-prediction heads: DeepSeek-V3 style (an extra layer past num_hidden_layers with these
# modules), Qwen3-Next / Qwen3.5 style (an `mtp.` prefix) and MiMo's (`model.mtp_layers.`).
# Recognised here, read by convert/mtp.py.
_MTP_MODULES = re.compile(r"\.(enorm|hnorm|eh_proj|shared_head)\.")
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
# The decoder layers' linears kept quantized when stored so (convert/quantized.py LAYER_LINEARS); which of them are
# quantized is read from the tensors themselves.
_KEPT_QUANTIZED = re.compile(rf"model\.(language_model\.)?layers\.\d+\.{LAYER_LINEARS}")
_SHOWN_NAMES = 8  # an error lists at most this many tensor names
logger = logging.getLogger("specjax")


def hf_to_params(tensors: dict[str, np.ndarray], cfg: ModelConfig, hf_config: dict | None = None,
                 activation_quant: bool = True) -> dict:
    """Map HF tensor names to the specjax param tree, checking every name and shape.

    MTP tensors become `params["mtp"]` (convert/mtp.py; `hf_config` gives their layer count).
    activation_quant=False: a W8A8 checkpoint's activation quantization is not read (convert/quantized.py).
    Raises ValueError naming any other tensor the config does not account for (see the module docstring).
    """
    params, used = take_params(tensors, cfg, read_scheme(hf_config or {}, activation_quant))
    if cfg.is_hybrid:  # a multimodal checkpoint's vision tower: specjax runs the text model only
        vision = [n for n in tensors if n.startswith(VISION_PREFIX)]
        if vision:
            logger.warning("skipping the checkpoint's vision tower (%d tensors under %s): specjax runs text only",
                        len(vision), VISION_PREFIX)
            used |= set(vision)
    leftover = unaccounted_tensors(tensors, used, cfg)
    if leftover:
        groups = split_known_extras(leftover, cfg)
        if groups["unknown"]:
            raise ValueError(describe_unaccounted({"unknown": groups["unknown"]}, cfg))
        params["mtp"] = read_mtp(tensors, groups["mtp"], cfg, hf_config or {}, activation_quant)
    return params


def take_params(tensors: dict[str, np.ndarray], cfg: ModelConfig, scheme: QuantScheme | None = None
                ) -> tuple[dict[str, np.ndarray], set[str]]:
    """(the param tree the config asks for, the tensor names it used); a missing or mis-shaped one is an error.

    With a quantization `scheme` (convert/quantized.py), a decoder layer's attention, dense-MLP, expert, shared-
    expert or linear_attn linear stored quantized stays a QuantizedWeight (its [in, out] values and scales; experts
    stacked [E, ...], or read so from fused [E, ...] tensors; a per-head or gate / up split keeps whole scale
    blocks, convert/qwen35.py, convert/moe.py); any other quantized weight (the lm_head, the embedding, a router)
    is dequantized to the config's dtype here. MTP layers: convert/mtp.py, by the same rule.
    """
    dtype = NP_DTYPES[cfg.dtype]
    shapes = param_shapes(cfg)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        # transpose: the stored [..., out, in] read as [..., in, out] (`shape`), per expert for [E, ...] tensors
        if scheme is not None:
            qw, names = read_weight(tensors, name, scheme, cfg.dtype)
            if qw is not None:
                want = shape if transpose else swap_last(shape)  # [in, out]
                if qw.shape != tuple(want):
                    raise ValueError(f"quantized weight '{name}' has shape {list(swap_last(qw.shape))}; the config "
                                     f"implies {list(swap_last(want))}")
                used.update(names)
                if transpose and _KEPT_QUANTIZED.fullmatch(name):
                    return qw
                w = qw.dequantize(dtype)
                return w if transpose else swap_last(w)
        if name not in tensors:
            raise ValueError(f"checkpoint lacks tensor '{name}' (expected by the config, shape {shape})")
        t = swap_last(tensors[name]) if transpose else tensors[name]
        if t.shape != shape:
            stored = tensors[name].shape
            raise ValueError(f"tensor '{name}' has shape {stored}; the config implies "
                             f"{swap_last(shape) if transpose else shape}")
        used.add(name)
        return t.astype(dtype)

    if cfg.is_hybrid:
        return take_hybrid_params(take, tensors, cfg), used
    if cfg.mixed_layers:  # dense and sparse layers (mlp_only_layers): per-layer shapes
        layers = {i: take_layer(take, tensors, f"model.layers.{i}.", shapes["layers"][i])
                  for i in range(cfg.num_layers)}
    else:
        one = jax.tree.map(lambda s: s[1:], shapes["layers"], is_leaf=lambda x: isinstance(x, tuple))
        per_layer = uniform_layers([take_layer(take, tensors, f"model.layers.{i}.", one)
                                    for i in range(cfg.num_layers)], dtype)
        layers = jax.tree.map(lambda *xs: stack(xs), *per_layer)
    params = {
        "embed": take("model.embed_tokens.weight", shapes["embed"], False),
        "layers": layers,
        "final_norm": take("model.norm.weight", shapes["final_norm"], False),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = take("lm_head.weight", shapes["lm_head"], True)
    return params, used


def unaccounted_tensors(tensors: dict[str, np.ndarray], used: set[str], cfg: ModelConfig) -> list[str]:
    """Names in the checkpoint that the config does not explain, minus the known-harmless ones, sorted."""
    return sorted(name for name in tensors
                  if name not in used and not is_harmless(name) and not _is_tied_copy(name, tensors, cfg))


def is_harmless(name: str) -> bool:
    """A buffer specjax recomputes from the config (see `_HARMLESS`)."""
    return any(pattern.fullmatch(name) for pattern in _HARMLESS)


def _is_tied_copy(name: str, tensors: dict[str, np.ndarray], cfg: ModelConfig) -> bool:
    """A stored lm_head equal to the embedding under tied embeddings: the same weights, saved twice."""
    embed = f"{text_prefix(tensors)}embed_tokens.weight"
    if name != "lm_head.weight" or not cfg.tie_word_embeddings or embed not in tensors:
        return False
    return bool(np.array_equal(tensors[name], tensors[embed]))


def split_known_extras(names: list[str], cfg: ModelConfig) -> dict[str, list[str]]:
    """Group leftover names into known families ("mtp": multi-token-prediction heads) and "unknown".

    Kept apart from the error so that a family specjax learns to use can be routed to its reader.
    """
    mtp_layers = {m.group(1) for n in names if _MTP_MODULES.search(n) and (m := _LAYER_INDEX.match(n))
                  and int(m.group(1)) >= cfg.num_layers}
    groups: dict[str, list[str]] = {"mtp": [], "unknown": []}
    for name in names:
        layer = _LAYER_INDEX.match(name)
        is_mtp = name.startswith(("mtp.", "model.mtp_layers.")) or (layer is not None and layer.group(1) in mtp_layers)
        groups["mtp" if is_mtp else "unknown"].append(name)
    return groups


def describe_unaccounted(groups: dict[str, list[str]], cfg: ModelConfig) -> str:
    """One-line error for leftover tensors the config does not explain: which ones, the likely mismatch, what to do."""
    parts = []
    if groups.get("unknown"):
        names = groups["unknown"]
        parts.append(f"checkpoint has {len(names)} tensor(s) the config does not account for: {_shown(names)}"
                     f"{_config_hints(names, cfg)}; specjax refuses to drop weights: make config.json match the"
                     " checkpoint, or remove the tensors that do not belong to the model")
    return "; ".join(parts)


def _shown(names: list[str]) -> str:
    """At most `_SHOWN_NAMES` names, then how many more."""
    shown = ", ".join(f"'{n}'" for n in names[:_SHOWN_NAMES])
    return shown + (f" and {len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else "")


def _config_hints(names: list[str], cfg: ModelConfig) -> str:
    """The config.json field that most likely disagrees with these tensors, if one stands out."""
    hints = []
    if any(re.search(r"self_attn\.[qkv]_proj\.bias$", n) for n in names) and not cfg.qkv_bias:
        hints.append("q/k/v biases present but the config has none (config.json 'attention_bias' false,"
                     f" or a {cfg.family} model without them)")
    layers = [int(m.group(1)) for n in names if (m := _LAYER_INDEX.match(n))]
    if any(i >= cfg.num_layers for i in layers):
        hints.append(f"layers up to {max(layers)} present but config.json 'num_hidden_layers' is {cfg.num_layers}")
    if "lm_head.weight" in names and cfg.tie_word_embeddings:
        hints.append("'lm_head.weight' differs from 'model.embed_tokens.weight' but config.json"
                     " 'tie_word_embeddings' is true (set it false if the head is separate)")
    return f" ({'; '.join(hints)})" if hints else ""


def load_hf(model_dir: Path, dtype: str | None = None, lazy: bool = False, activation_quant: bool = True
            ) -> tuple[dict, ModelConfig, dict]:
    """(raw config.json dict, ModelConfig, host params) from a Hugging Face model directory.

    The params carry `mtp` when the checkpoint has MTP layers (`specjax.load` keeps them apart).
    lazy: the params are views that read their elements when indexed (convert/lazy.py; each device's slice of a
    weight for a mesh), else numpy arrays read whole. activation_quant: read a W8A8 checkpoint's activation
    quantization (convert/quantized.py), else its weights alone.
    """
    hf_cfg = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf_cfg, dtype=dtype)
    files = safetensors_files(model_dir)
    params = hf_to_params(LazyTensors(files) if lazy else read_tensors(files), cfg, hf_cfg, activation_quant)
    return hf_cfg, cfg, params
