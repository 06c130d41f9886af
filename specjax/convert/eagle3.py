"""Read an EAGLE-3 head checkpoint, in any producer's layout, and check it fits a target.

A head directory holds config.json and its weights: model.safetensors, sharded safetensors with
model.safetensors.index.json, or pytorch_model.bin (or shards with pytorch_model.bin.index.json; read only when
torch is installed); fp32, bf16 or fp16.
The config decides the layout (convert/eagle3_layouts.py: SafeAILab, SpecForge, speculators, ModelOpt,
DeepSpec) and with it every rule below. Tensors, torch [out, in]:

    fc.weight [H, n*Ht]                       n taps (three; DeepSpec five)
    fc_norm.{i}.weight [Ht]                   EAGLE-3.1 fc_norm only: one RMSNorm per tap, i < n
    input_norm.weight [n*Ht]                  norm_before_fc only: one RMSNorm over the concatenated taps
    {P0}{input_layernorm, hidden_norm, post_attention_layernorm}.weight; {P0}self_attn.{q,k,v,o}_proj.weight
        [q, k: 2H in]; {P0}mlp.{gate,up,down}_proj.weight; {P0}self_attn.{q,k}_norm.weight when the layout has
        q/k norms; P0 = `midlayer.` (SafeAILab, SpecForge) or `layers.0.`
    layers.{i}.* for i >= 1 (speculators, ModelOpt): a plain decoder layer over H (input_layernorm, self_attn,
        post_attention_layernorm, mlp), as the dense target's layer is named
    norm.weight [H]
    lm_head.weight [Vd, H]                    ModelOpt: optional; absent = the target's lm_head (vLLM's
                                              llm_base_proposer.py `_maybe_share_lm_head`)
    d2t [Vd] (target id = draft id + d2t)     optional when Vd = V: absent = the identity (vLLM's
                                              llama_eagle3.py keeps no map then; ModelOpt writes none)
    t2d bool [V]                              optional, checked against d2t when present
    embed_tokens.weight [V, H]                optional everywhere (absent = the target's table; speculators
                                              and DeepSpec save their copy)

Every tensor must be accounted for, as in convert/hf.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from specjax.config import _DTYPE_NAMES, ModelConfig
from specjax.convert import eagle3_layouts as layouts
from specjax.convert.eagle3_layouts import default_feature_layers  # noqa: F401 (re-exported)
from specjax.convert.hf_files import LAYER_KEYS, NP_DTYPES, read_hf_config, read_json, read_tensors, safetensors_files
from specjax.drafters.eagle3 import Eagle3Config, param_shapes

# specjax first-layer key -> name inside the layer prefix (all [out, in] matrices transposed)
_LAYER_KEYS = {
    "embed_norm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}
_TOP_KEYS = {"fc": "fc.weight", "final_norm": "norm.weight", "lm_head": "lm_head.weight"}
_HARMLESS = ("midlayer.self_attn.rotary_emb.inv_freq",)


def feature_layers_from_config(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """A SafeAILab / SpecForge head's taps in HF hidden_states numbering (`eagle_config` ids + 1, else the
    default 2, L//2, L-3), checked against a target of `num_layers` layers."""
    field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return layouts.default_taps(num_layers, field)
    return layouts.output_of_layer_taps(ids, field, num_layers)


def head_rope(hf: dict[str, Any]):
    """The SafeAILab head's RoPE (kept for callers of the one-layout reader)."""
    return layouts.safeailab_rope(hf)


def lm_head_source(layout: str, names: set[str] | None, target: ModelConfig) -> str:
    """"own" when the checkpoint has lm_head.weight; a ModelOpt head without one uses the target's."""
    if names is None or "lm_head.weight" in names:
        return "own"
    if layout != "modelopt":
        raise ValueError(f"EAGLE-3 checkpoint lacks tensor 'lm_head.weight'; only ModelOpt exports may leave it out "
                         f"(this head is in the {layout} layout)")
    return "target_embed" if target.tie_word_embeddings else "target"


def eagle3_config(hf: dict[str, Any], target: ModelConfig, dtype: str | None = None, *,
                  tensor_names: set[str] | None = None, rope_theta: float | None = None,
                  norm_output: bool | None = None) -> Eagle3Config:
    """Eagle3Config from the head's config.json (its layout's rules), checked against the target (ValueError naming
    both sides). tensor_names decides whether a ModelOpt head has its own lm_head; rope_theta overrides the base;
    norm_output the reading of an EAGLE-3.1 `norm_output` (eagle3_layouts.eagle31_flags)."""
    layout = layouts.head_layout(hf, tensor_names)
    fields = layouts.read_fields(hf, layout, target, norm_output)
    if fields["target_hidden_size"] != target.hidden_size:
        field = "target_hidden_size" if hf.get("target_hidden_size") else "hidden_size"
        raise ValueError(f"the EAGLE-3 head reads target features of width {fields['target_hidden_size']} "
                         f"(config.json {field}) but the target's hidden_size is {target.hidden_size}")
    if fields["vocab_size"] != target.vocab_size:
        raise ValueError(f"the EAGLE-3 head's config.json vocab_size is {fields['vocab_size']} but the target's "
                         f"vocabulary has {target.vocab_size} tokens; the head must be trained for this target")
    if rope_theta is not None:
        fields["rope"] = dataclasses.replace(fields["rope"], theta=float(rope_theta))
    lm_head = lm_head_source(layout, tensor_names, target)
    if lm_head != "own" and fields["draft_vocab_size"] != fields["vocab_size"]:
        raise ValueError(f"the ModelOpt head has a draft vocabulary of {fields['draft_vocab_size']} tokens but no "
                         "lm_head.weight of its own: the target's lm_head scores the whole vocabulary "
                         f"({fields['vocab_size']})")
    return Eagle3Config(**fields, dtype=dtype or _DTYPE_NAMES.get(layouts.torch_dtype(hf), "float32"), lm_head=lm_head,
                        layout=layout)


def read_head_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """The head's tensors: (sharded) safetensors, else pytorch_model.bin through torch (if importable)."""
    model_dir = Path(model_dir)
    if (model_dir / "model.safetensors").is_file() or (model_dir / "model.safetensors.index.json").is_file():
        return read_tensors(safetensors_files(model_dir))
    binaries = _pickle_files(model_dir)
    if binaries:
        try:
            import torch  # noqa: PLC0415 (optional: only this format needs it)
        except ImportError:
            raise ValueError(f"{binaries[0]} is a PyTorch pickle and torch is not installed: install torch "
                             "(pip install torch) or convert the head to model.safetensors") from None
        tensors = {}
        for binary in binaries:
            state = torch.load(str(binary), map_location="cpu", weights_only=True)
            tensors.update({k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()})
        return tensors
    raise FileNotFoundError(f"no EAGLE-3 head weights in {model_dir}: expected model.safetensors, "
                            "model.safetensors.index.json with its shards, or pytorch_model.bin (or its index)")


def _pickle_files(model_dir: Path) -> list[Path]:
    """pytorch_model.bin, or the shards pytorch_model.bin.index.json names (what SafeAILab's DeepSpeed save and
    older transformers write)."""
    index = model_dir / "pytorch_model.bin.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map") or {}
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing or not files:
            raise FileNotFoundError(f"{index} names shards that are missing: {missing or 'none listed'}")
        return files
    single = model_dir / "pytorch_model.bin"
    return [single] if single.is_file() else []


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


def _vocab_map(tensors: dict[str, np.ndarray], cfg: Eagle3Config, used: set[str]) -> np.ndarray:
    """d2t (int32): the checkpoint's, checked, or the identity when the draft vocabulary is the target's."""
    if "d2t" not in tensors:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"EAGLE-3 checkpoint lacks tensor 'd2t' but its draft vocabulary ({cfg.draft_vocab_size}) "
                             f"is smaller than the target's ({cfg.vocab_size})")
        t2d = tensors.get("t2d")
        if t2d is not None and not np.asarray(t2d).astype(bool).all():
            raise ValueError("tensor 't2d' leaves target tokens out of a draft vocabulary the size of the target's")
        used |= {"t2d"} & set(tensors)
        return np.zeros(cfg.draft_vocab_size, np.int32)
    d2t = np.asarray(tensors["d2t"])
    t2d = np.asarray(tensors["t2d"]) if "t2d" in tensors else None
    _check_vocab_maps(d2t, t2d, cfg)
    used |= {"d2t", "t2d"} & set(tensors)
    return d2t.astype(np.int32)


def head_params(tensors: dict[str, np.ndarray], cfg: Eagle3Config) -> dict[str, Any]:
    """specjax params (numpy, [in, out]) from the head's tensors; every tensor checked and accounted for.

    Includes `embed` only when the checkpoint carries embed_tokens.weight, `lm_head` only when it has its own.
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

    params: dict[str, Any] = {k: take(name, shapes[k], k in ("fc", "lm_head"))
                              for k, name in _TOP_KEYS.items() if k in shapes}
    if cfg.fc_norm:
        params["fc_norm"] = np.stack([take(f"fc_norm.{i}.weight", shapes["fc_norm"][1:], False)
                                      for i in range(cfg.num_taps)])
    if cfg.norm_before_fc:
        params["input_norm"] = take("input_norm.weight", shapes["input_norm"], False)
    first = layouts.layer_prefix(cfg.layout, 0)
    params["layer"] = {k: take(first + name, shapes["layer"][k], not k.endswith("norm"))
                       for k, name in _LAYER_KEYS.items() if k in shapes["layer"]}
    for i in range(1, cfg.num_layers):  # layers over H: named as the dense target's layers are
        prefix, layer_shapes = layouts.layer_prefix(cfg.layout, i), shapes["extra_layers"][i - 1]
        params.setdefault("extra_layers", {})[i - 1] = {
            k: take(prefix + name, layer_shapes[k], transpose) for k, (name, transpose) in LAYER_KEYS.items()
            if k in layer_shapes}
    params["d2t"] = _vocab_map(tensors, cfg, used)
    if "embed_tokens.weight" in tensors:
        params["embed"] = take("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), False)
    leftover = sorted(n for n in tensors if n not in used and n not in _HARMLESS)
    if leftover:
        shown = ", ".join(f"'{n}'" for n in leftover[:8])
        raise ValueError(f"EAGLE-3 checkpoint has {len(leftover)} tensor(s) an EAGLE-3 head in the {cfg.layout} "
                         f"layout does not have: {shown}{' ...' if len(leftover) > 8 else ''}; specjax refuses to "
                         "drop weights")
    return params


def load_eagle3(model_dir: str | Path, target: ModelConfig, dtype: str | None = None, *,
                rope_theta: float | None = None, norm_output: bool | None = None
                ) -> tuple[Eagle3Config, dict[str, Any]]:
    """(config, host params) of the EAGLE-3 head in model_dir, checked against the target's config.

    The params lack `embed` unless the checkpoint has one; the drafter then uses the target's table (and,
    for a ModelOpt head without lm_head, the target's lm_head). When the head's width differs from the
    target's (config `target_hidden_size`), the target's table cannot serve and the checkpoint must carry its own.
    """
    model_dir = Path(model_dir)
    hf = read_hf_config(model_dir)
    tensors = read_head_tensors(model_dir)
    cfg = eagle3_config(hf, target, dtype, tensor_names=set(tensors), rope_theta=rope_theta, norm_output=norm_output)
    params = head_params(tensors, cfg)
    if "embed" not in params and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"the EAGLE-3 head has hidden_size {cfg.hidden_size} but the target {target.hidden_size}, "
                         "and the checkpoint has no embed_tokens.weight of its own: the target's embedding cannot "
                         "serve it")
    return cfg, params
