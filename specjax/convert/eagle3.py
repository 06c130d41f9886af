"""Read an EAGLE-3 head checkpoint (SafeAILab / SpecForge layout) and check it fits a target.

A head directory holds config.json and model.safetensors (or pytorch_model.bin, read only
when torch is installed). Tensors, torch [out, in]:
    fc.weight [H, 3*Ht]; midlayer.self_attn.{q,k,v,o}_proj.weight; midlayer.mlp.{gate,up,down}_proj.weight;
    midlayer.{hidden_norm, input_layernorm, post_attention_layernorm}.weight; norm.weight;
    lm_head.weight [Vd, H]; d2t [Vd] (target id = draft id + d2t); t2d bool [V];
    embed_tokens.weight [V, H] only in some exports (otherwise the head uses the target's table).
Every tensor must be accounted for, as in convert/hf.py.

Feature layers. The original taps the residual stream entering target layers 2, L//2 and
L-3 (Hugging Face `hidden_states[2]`, `[L//2]`, `[L-3]`), concatenated in that order.
Configs may instead name them in `eagle_config.eagle_aux_hidden_state_layer_ids`, counted
as "output of layer i" = `hidden_states[i + 1]`. Either way the result is in HF
hidden_states numbering, which is what `Drafter.feature_layers` uses.

RoPE follows the original head: head_dim from the config (SpecForge's Qwen3 heads: 128 with hidden / heads 64
or 80), else hidden / heads; base = config `rope_theta` when
present (or `rope_parameters.rope_theta`, the newer spelling), else 10000. Of the scalings,
the original implements linear (which it builds with base 10000 whatever rope_theta says;
kept) and dynamic NTK (not implemented here: refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specjax.config import _DTYPE_NAMES, ModelConfig, RopeConfig
from specjax.convert.hf_files import NP_DTYPES, read_hf_config, read_safetensors
from specjax.drafters.eagle3 import Eagle3Config, param_shapes

# specjax layer key -> name inside `midlayer.` (all [out, in] matrices transposed)
_LAYER_KEYS = {
    "embed_norm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}
_TOP_KEYS = {"fc": "fc.weight", "final_norm": "norm.weight", "lm_head": "lm_head.weight"}
_HARMLESS = ("midlayer.self_attn.rotary_emb.inv_freq",)


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The original's taps in HF hidden_states numbering: entering layers 2, L//2, L-3."""
    return 2, num_layers // 2, num_layers - 3


def feature_layers_from_config(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The head's taps in HF hidden_states numbering, checked against a target of `num_layers` layers.

    `eagle_config.eagle_aux_hidden_state_layer_ids` counts "output of layer i" (= hidden_states[i + 1]);
    without it, the original's default taps. Three distinct states, each the residual stream
    entering one of the target's layers 1 .. L-1 (ids 0 .. L-2), or ValueError.
    """
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        layers = default_feature_layers(num_layers)
        if len(set(layers)) != 3:
            raise ValueError(f"the default EAGLE-3 feature layers (hidden_states 2, L//2, L-3) = {list(layers)} are "
                             f"not distinct for a target of {num_layers} layers (needs at least 7); set "
                             "eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json")
        return layers
    if not isinstance(ids, (list, tuple)) or len(ids) != 3 or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"config.json eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}; an EAGLE-3 "
                         "head needs three integer layer ids")
    layers = tuple(i + 1 for i in ids)
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise ValueError(f"config.json eagle_config.eagle_aux_hidden_state_layer_ids {list(ids)} has {bad} outside "
                         f"the target's layers: with {num_layers} layers the ids ('output of layer i') must lie "
                         f"in 0..{num_layers - 2}")
    if len(set(layers)) != 3:
        raise ValueError(f"config.json eagle_config.eagle_aux_hidden_state_layer_ids {list(ids)} repeats a layer; "
                         "an EAGLE-3 head reads three distinct layers")
    return layers


def head_rope(hf: dict[str, Any]) -> RopeConfig:
    """The head's RoPE as the original builds it (see the module docstring)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type")) if scaling else None
    if kind is None or kind == "default":
        return RopeConfig(theta=float(hf.get("rope_theta", params.get("rope_theta", 10000.0))))
    if kind == "linear":
        return RopeConfig(theta=10000.0, rope_type="linear", factor=float(scaling["factor"]))
    raise ValueError(f"the EAGLE-3 head's config.json rope_scaling has type {kind!r}; specjax implements the head's "
                     "RoPE without scaling or with 'linear' scaling only")


def eagle3_config(hf: dict[str, Any], target: ModelConfig, dtype: str | None = None) -> Eagle3Config:
    """Eagle3Config from the head's config.json, checked against the target (ValueError naming both sides)."""
    def need(key):
        if key not in hf:
            raise ValueError(f"the EAGLE-3 head's config.json lacks required field '{key}'")
        return hf[key]

    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"the EAGLE-3 head's config.json has num_hidden_layers={hf['num_hidden_layers']}; "
                         "an EAGLE-3 head has exactly one decoder layer")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"the EAGLE-3 head's config.json hidden_act is {hf['hidden_act']!r}; "
                         "only 'silu' is implemented")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    if (hf.get("head_dim") is None and hidden % heads) or heads % kv_heads:
        raise ValueError(f"the EAGLE-3 head's hidden_size={hidden}, num_attention_heads={heads}, "
                         f"num_key_value_heads={kv_heads}: heads must divide by kv heads, and without head_dim "
                         "hidden by heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2):
        raise ValueError(f"the EAGLE-3 head's config.json head_dim is {head_dim!r}; it must be an even integer "
                         "(RoPE rotates pairs), or absent for hidden_size / num_attention_heads")
    target_hidden = hf.get("target_hidden_size") or hidden
    if target_hidden != target.hidden_size:
        field = "target_hidden_size" if hf.get("target_hidden_size") else "hidden_size"
        raise ValueError(f"the EAGLE-3 head reads target features of width {target_hidden} (config.json {field}) "
                         f"but the target's hidden_size is {target.hidden_size}")
    vocab = need("vocab_size")
    if vocab != target.vocab_size:
        raise ValueError(f"the EAGLE-3 head's config.json vocab_size is {vocab} but the target's vocabulary has "
                         f"{target.vocab_size} tokens; the head must be trained for this target")
    torch_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return Eagle3Config(
        hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=need("intermediate_size"),
        vocab_size=vocab, draft_vocab_size=hf.get("draft_vocab_size") or vocab, target_hidden_size=target_hidden,
        feature_layers=feature_layers_from_config(hf, target.num_layers),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope=head_rope(hf),
        dtype=dtype or _DTYPE_NAMES.get(str(torch_dtype), "float32"),
        config_head_dim=head_dim if head_dim != hidden // heads else None)


def read_head_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """The head's tensors: model.safetensors, else pytorch_model.bin through torch (if importable)."""
    model_dir = Path(model_dir)
    st = model_dir / "model.safetensors"
    if st.is_file():
        return read_safetensors(st)
    binary = model_dir / "pytorch_model.bin"
    if binary.is_file():
        try:
            import torch  # noqa: PLC0415 (optional: only this format needs it)
        except ImportError:
            raise ValueError(f"{binary} is a PyTorch pickle and torch is not installed: install torch "
                             "(pip install torch) or convert the head to model.safetensors") from None
        state = torch.load(str(binary), map_location="cpu", weights_only=True)
        return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}
    raise FileNotFoundError(f"no EAGLE-3 head weights in {model_dir}: expected model.safetensors or pytorch_model.bin")


def _check_vocab_maps(d2t: np.ndarray, t2d: np.ndarray | None, cfg: Eagle3Config) -> None:
    """d2t must map every draft id inside the target vocabulary, consistently with t2d when present."""
    if d2t.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"tensor 'd2t' has shape {d2t.shape} but config.json draft_vocab_size is "
                         f"{cfg.draft_vocab_size}")
    target_ids = np.arange(cfg.draft_vocab_size) + d2t.astype(np.int64)
    bad = np.nonzero((target_ids < 0) | (target_ids >= cfg.vocab_size))[0]
    if bad.size:
        raise ValueError(f"d2t maps draft ids {bad[:8].tolist()} to target ids {target_ids[bad[:8]].tolist()}, "
                         f"outside the target's vocabulary of {cfg.vocab_size} tokens")
    if len(np.unique(target_ids)) != cfg.draft_vocab_size:
        raise ValueError("d2t maps two draft ids to the same target id; the draft vocabulary must be a set of "
                         "distinct target tokens")
    if t2d is None:
        return
    if t2d.shape != (cfg.vocab_size,):
        raise ValueError(f"tensor 't2d' has {t2d.shape[0] if t2d.ndim == 1 else t2d.shape} entries but the target's "
                         f"vocabulary has {cfg.vocab_size} tokens")
    expected = np.zeros(cfg.vocab_size, bool)
    expected[target_ids] = True
    if not np.array_equal(t2d.astype(bool), expected):
        raise ValueError("t2d and d2t disagree: t2d must be true exactly at the target ids d2t maps to")


def head_params(tensors: dict[str, np.ndarray], cfg: Eagle3Config) -> dict[str, np.ndarray]:
    """specjax params (numpy, [in, out]) from the head's tensors; every tensor checked and accounted for.

    Includes `embed` only when the checkpoint carries embed_tokens.weight.
    """
    dtype = NP_DTYPES[cfg.dtype]
    shapes = param_shapes(cfg)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"EAGLE-3 checkpoint lacks tensor '{name}' (expected by config.json, shape "
                             f"{shape[::-1] if transpose else shape})")
        t = tensors[name].T if transpose else tensors[name]
        if t.shape != shape:
            raise ValueError(f"tensor '{name}' has shape {tensors[name].shape}; config.json implies "
                             f"{shape[::-1] if transpose else shape}")
        used.add(name)
        return np.asarray(t).astype(dtype)

    params: dict[str, Any] = {k: take(name, shapes[k], k in ("fc", "lm_head")) for k, name in _TOP_KEYS.items()}
    params["layer"] = {k: take(f"midlayer.{name}", shapes["layer"][k], not k.endswith("norm"))
                       for k, name in _LAYER_KEYS.items()}
    if cfg.draft_vocab_size != cfg.vocab_size or "d2t" in tensors:
        if "d2t" not in tensors:
            raise ValueError(f"EAGLE-3 checkpoint lacks tensor 'd2t' but its draft vocabulary ({cfg.draft_vocab_size}) "
                             f"is smaller than the target's ({cfg.vocab_size})")
        d2t = np.asarray(tensors["d2t"])
        t2d = np.asarray(tensors["t2d"]) if "t2d" in tensors else None
        _check_vocab_maps(d2t, t2d, cfg)
        used |= {"d2t", "t2d"} & set(tensors)
    else:
        d2t = np.zeros(cfg.draft_vocab_size, np.int64)
        used |= {"t2d"} & set(tensors)
    params["d2t"] = d2t.astype(np.int32)
    if "embed_tokens.weight" in tensors:
        params["embed"] = take("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), False)
    leftover = sorted(n for n in tensors if n not in used and n not in _HARMLESS)
    if leftover:
        shown = ", ".join(f"'{n}'" for n in leftover[:8])
        raise ValueError(f"EAGLE-3 checkpoint has {len(leftover)} tensor(s) an EAGLE-3 head does not have: {shown}"
                         f"{' ...' if len(leftover) > 8 else ''}; specjax refuses to drop weights")
    return params


def load_eagle3(model_dir: str | Path, target: ModelConfig, dtype: str | None = None
                ) -> tuple[Eagle3Config, dict[str, np.ndarray]]:
    """(config, host params) of the EAGLE-3 head in model_dir, checked against the target's config.

    The params lack `embed` unless the checkpoint has one; the drafter then uses the target's table.
    When the head's width differs from the target's (config `target_hidden_size`), the target's
    table cannot serve and the checkpoint must carry its own.
    """
    model_dir = Path(model_dir)
    hf = read_hf_config(model_dir)
    cfg = eagle3_config(hf, target, dtype)
    params = head_params(read_head_tensors(model_dir), cfg)
    if "embed" not in params and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"the EAGLE-3 head has hidden_size {cfg.hidden_size} but the target {target.hidden_size}, "
                         "and the checkpoint has no embed_tokens.weight of its own: the target's embedding cannot "
                         "serve it")
    return cfg, params
