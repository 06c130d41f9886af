"""What each EAGLE-3 producer's config.json says, read and written back: one set of rules per checkpoint layout.

A published EAGLE-3 head is one network (drafters/eagle3.py) in five layouts. Each rule below is the one the
producer's own code applies; the file is named beside each.

| layout | recognised by | layer names | taps (-> HF hidden_states) | RoPE |
|---|---|---|---|---|
| safeailab | `draft_vocab_size`, architectures LlamaForCausalLM | `midlayer.*` | `eagle_config` ids + 1, else 2, L//2, L-3 | cnets.py `_init_rope` |
| specforge | architectures LlamaForCausalLMEagle3 (also SGLang's heads), `midlayer.*` tensors | `midlayer.*` | as safeailab | llama3_eagle.py `get_rope_config` |
| speculators | `speculators_config` / `transformer_layer_config` | `layers.{i}.*` | top-level ids as they are | the layer config's |
| modelopt | `eagle_config` with ModelOpt's flags, tensors `layers.{i}.*` | `layers.{i}.*` | `eagle_config` ids + 1 | top-level fields |
| deepspec | architectures Qwen3Eagle3Model | `layers.0.*` | `target_layer_ids` + 1 | the (target's) Qwen3 config |

Taps. SGLang (python/sglang/srt/models/llama.py `set_eagle3_layers_to_capture`: the
`eagle_config.eagle_aux_hidden_state_layer_ids` it is given, + 1; its default 2, L//2, L-3 as is) and ModelOpt
(modelopt/torch/speculative/plugins/hf_eagle.py: a forward hook on `layers[i]` collects its output) count
"output of layer i" = hidden_states[i + 1]. vLLM's target models (model_executor/models/llama.py
`_maybe_add_hidden_state(aux, idx + 1, ...)` after layer idx) count a top-level
`eagle_aux_hidden_state_layer_ids` entry k as the stream after k layers = hidden_states[k]: the numbering of
speculators' configs, whose training data vLLM extracts. DeepSpec (deepspec/modeling/eagle3/common.py
`extract_eagle3_context_feature`) concatenates hidden_states[id + 1] for its `target_layer_ids`. Without ids:
(2, L//2, L-3), the default of SafeAILab, vLLM (`get_eagle3_default_aux_hidden_state_layers`), speculators
(models/utils.py `resolve_target_layer_ids`) and ModelOpt (`default_eagle_aux_layer_ids` {1, L//2-1, L-4} + 1).
Note vLLM 0.33 reads an `eagle_config` id list in its own numbering (v1/worker/gpu_model_runner.py
`_get_eagle3_aux_layers_from_config`, no conversion): one less than what SGLang and ModelOpt mean by the same
list; specjax follows the producers.

RoPE. Absent everything, base 10000: what SafeAILab (cnets.py) and SpecForge (`get_rope_config`'s default)
train and SGLang and vLLM serve. SafeAILab's linear scaling is built on base 10000 whatever rope_theta says
(cnets.py `LlamaLinearScalingRotaryEmbedding(..., base default)`); every other layout reads theta and scaling as
transformers does (`rope_parameters`, else `rope_theta` / `rope_scaling`). Implemented: default, linear, llama3
(the same formula in SpecForge's `LlamaRotaryEmbedding` and transformers) and YaRN (ModelOpt's exporter writes
{"rope_type": "yarn", "factor": 32, "original_max_position_embeddings": 2048} unless told not to; transformers'
`_compute_yarn_parameters` and vLLM's YaRNScalingRotaryEmbedding agree on it).

EAGLE-3.1 (`eagle31_flags`). `fc_norm` (an RMSNorm per tap before fc, tensors `fc_norm.{i}.weight`),
`norm_before_fc` (one RMSNorm over the concatenated taps, `input_norm.weight`) and `norm_output` (the final norm's
output fed back) are read as the code that runs each layout computes them: speculators' heads by
speculators/models/eagle3/core.py (flags at the top level); ModelOpt-layout heads by vLLM's
model_executor/models/llama_eagle3.py (`norm_before_fc` in `eagle_config` or at the top, `fc_norm` and
`norm_output` at the top; `model.fc_norm.*` is vLLM's name after its loader prefixes `model.`); SpecForge /
SafeAILab `midlayer.*` heads: `fc_norm` and `norm_before_fc` as vLLM and SpecForge's llama3_eagle.py
`project_hidden_states` compute them. Their `norm_output` is refused unless the caller says which reading holds:
SpecForge from b7ce50cd (2026-07-19, EAGLE-3.1 support) up to PR #879 (2026-09-15) trained `norm_output: true`
(its default) as plain EAGLE-3 (normed logits, the pre-norm output fed back) and `false` as no final norm at all;
from #879 on `true` means EAGLE-3.1 (the post-norm output fed back, what vLLM and SGLang serve) and `false` EAGLE-3.
The tensors and config are the same either way, so only the trainer's version tells.

Not implemented, refused by name: attention or MLP biases, speculators decoder types other than llama and qwen3,
and ModelOpt's Kimi-K2 (MLA) heads.
"""

from __future__ import annotations

import math
from typing import Any

from specjax.config import ModelConfig, RopeConfig, _rope_from_hf

LAYOUTS = ("safeailab", "specforge", "speculators", "modelopt", "deepspec")
MODELOPT_FLAGS = ("use_aux_hidden_state", "use_input_layernorm_in_first_layer", "use_last_layernorm",
                  "next_layer_regular")
SPECULATORS_LAYER_TYPES = ("llama", "qwen3")  # speculators' models/eagle3/model_definitions.py `model_classes`


def is_eagle3_config(hf: dict[str, Any]) -> bool:
    """An EAGLE-3 head's config.json in any layout: an `eagle_config`, a `draft_vocab_size` (SafeAILab, whose
    architecture is plain LlamaForCausalLM with one layer; speculators), an architecture named *Eagle3* (SpecForge,
    DeepSpec) or a speculators config."""
    archs = hf.get("architectures") or []
    return ("eagle_config" in hf or "draft_vocab_size" in hf or "speculators_config" in hf
            or any("eagle3" in a.lower() for a in archs))


def head_layout(hf: dict[str, Any], tensor_names: set[str] | None = None) -> str:
    """The producer layout of an EAGLE-3 head (see the module docstring's table), from its config.json and, when
    given, its tensor names: tensors named `midlayer.*` are a SafeAILab / SpecForge head whatever the config
    carries. SpecForge's own configs (configs/deepseek-v3-671b-eagle3.json, qwen3-235B-A22B-eagle3.json) and
    heads trained from them (AQ-MedAI's Kimi-K2 and Qwen3.5-397B heads) set `eagle_config` with
    `use_aux_hidden_state`, one of ModelOpt's flags, over `midlayer.*` tensors; their ids are SGLang's."""
    archs = hf.get("architectures") or []
    if "speculators_config" in hf or "transformer_layer_config" in hf or "Eagle3Speculator" in archs:
        return "speculators"
    if any(a.endswith("Eagle3Model") for a in archs) and "target_layer_ids" in hf:
        return "deepspec"
    midlayer = tensor_names is not None and any(n.startswith("midlayer.") for n in tensor_names)
    if any(flag in (hf.get("eagle_config") or {}) for flag in MODELOPT_FLAGS) and not midlayer:
        return "modelopt"
    if "LlamaForCausalLMEagle3" in archs:
        return "specforge"
    return "safeailab"


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The original's taps in HF hidden_states numbering: entering layers 2, L//2, L-3."""
    return 2, num_layers // 2, num_layers - 3


def _check_taps(layers: tuple[int, ...], field: str, ids, num_layers: int, convention: str) -> tuple[int, ...]:
    """Taps (HF hidden_states numbering) must be distinct residual streams entering layers 1 .. L-1."""
    bad = [i for i, layer in zip(ids, layers) if not 1 <= layer <= num_layers - 1]
    if bad:
        lo, hi = (1, num_layers - 1) if convention == "hidden_states" else (0, num_layers - 2)
        raise ValueError(f"config.json {field} {list(ids)} has {bad} outside the target's layers: with {num_layers} "
                         f"layers the ids ({convention}) must lie in {lo}..{hi}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"config.json {field} {list(ids)} repeats a layer; an EAGLE-3 head reads distinct layers")
    return layers


def _id_list(ids, field: str, count: int | None = 3) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) for i in ids) or \
            (count is not None and len(ids) != count) or not ids:
        what = f"{'three' if count == 3 else count} integer layer ids" if count else "a list of integer layer ids"
        raise ValueError(f"config.json {field} is {ids!r}; an EAGLE-3 head needs {what}")
    return list(ids)


def output_of_layer_taps(ids, field: str, num_layers: int, count: int | None = 3) -> tuple[int, ...]:
    """ids counted as "output of layer i" (SGLang, ModelOpt, DeepSpec) -> hidden_states i + 1."""
    ids = _id_list(ids, field, count)
    return _check_taps(tuple(i + 1 for i in ids), field, ids, num_layers, "'output of layer i'")


def hidden_state_taps(ids, field: str, num_layers: int) -> tuple[int, ...]:
    """ids counted as vLLM's target models count them (hidden_states k), unchanged."""
    ids = _id_list(ids, field, None)
    return _check_taps(tuple(ids), field, ids, num_layers, "hidden_states")


def default_taps(num_layers: int, where: str) -> tuple[int, ...]:
    layers = default_feature_layers(num_layers)
    if len(set(layers)) != 3:
        raise ValueError(f"the default EAGLE-3 feature layers (hidden_states 2, L//2, L-3) = {list(layers)} are "
                         f"not distinct for a target of {num_layers} layers (needs at least 7); set {where} in the "
                         "head's config.json")
    return layers


def safeailab_rope(hf: dict[str, Any]) -> RopeConfig:
    """SafeAILab cnets.py `_init_rope`: rope_theta when present (or `rope_parameters.rope_theta`), else 10000;
    linear scaling on base 10000; dynamic NTK is not implemented here (refused)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type")) if scaling else None
    if kind is None or kind == "default":
        return RopeConfig(theta=float(hf.get("rope_theta", params.get("rope_theta", 10000.0))))
    if kind == "linear":
        return RopeConfig(theta=10000.0, rope_type="linear", factor=float(scaling["factor"]))
    raise ValueError(f"the EAGLE-3 head's config.json rope_scaling has type {kind!r}; specjax implements the "
                     "SafeAILab head's RoPE without scaling or with 'linear' scaling only")


def transformers_rope(hf: dict[str, Any]) -> RopeConfig:
    """RoPE as transformers reads a Llama / Qwen3 config (rope_parameters, else rope_theta / rope_scaling; base 10000
    when absent): SpecForge's `get_rope_config`, speculators' and DeepSpec's rotary classes, vLLM's `get_rope`.
    YaRN too (what ModelOpt's exporter writes by default, `eagle_export_rope_scaling`)."""
    params = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    if params.get("rope_type", params.get("type")) == "yarn":
        return yarn_rope(hf, params)
    try:
        return _rope_from_hf(hf)
    except ValueError as err:
        raise ValueError(f"the EAGLE-3 head's {err} (and 'yarn')") from None


def yarn_rope(hf: dict[str, Any], params: dict[str, Any]) -> RopeConfig:
    """YaRN's fields as transformers' `_compute_yarn_parameters` reads them (and vLLM's get_rope): factor (else
    max_position_embeddings / original), beta_fast 32, beta_slow 1, attention_factor (else from factor, mscale and
    mscale_all_dim: 0.1 ln(factor) + 1), truncate."""
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ValueError("the EAGLE-3 head's config.json has 'yarn' RoPE scaling without "
                         "original_max_position_embeddings")
    factor = params.get("factor") or hf.get("max_position_embeddings", original) / original

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all else mscale_of(factor)
    return RopeConfig(theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_type="yarn",
                      factor=float(factor), original_max_position_embeddings=int(original),
                      beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                      attention_factor=float(attention), truncate=bool(params.get("truncate", True)))


def refuse_unimplemented(hf: dict[str, Any], where: str = "config.json") -> None:
    """Biases and activations specjax does not implement, refused by name."""
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"the EAGLE-3 head's {where} sets {key}=true; specjax implements bias-free heads only")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"the EAGLE-3 head's {where} hidden_act is {hf['hidden_act']!r}; only 'silu' is implemented")


def need(hf: dict[str, Any], key: str, where: str = "config.json"):
    if key not in hf or hf[key] is None:
        raise ValueError(f"the EAGLE-3 head's {where} lacks required field '{key}'")
    return hf[key]


def shape_fields(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """Width, heads, head_dim, MLP width, eps: the fields every layout names alike (in `hf`, or its layer config)."""
    hidden, heads = need(hf, "hidden_size", where), need(hf, "num_attention_heads", where)
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim")
    if (head_dim is None and hidden % heads) or heads % kv_heads:
        raise ValueError(f"the EAGLE-3 head's hidden_size={hidden}, num_attention_heads={heads}, "
                         f"num_key_value_heads={kv_heads}: heads must divide by kv heads, and without head_dim "
                         "hidden by heads")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2):
        raise ValueError(f"the EAGLE-3 head's {where} head_dim is {head_dim!r}; it must be an even integer "
                         "(RoPE rotates pairs), or absent for hidden_size / num_attention_heads")
    return dict(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                intermediate_size=need(hf, "intermediate_size", where), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                config_head_dim=head_dim if head_dim != hidden // heads else None)


def torch_dtype(hf: dict[str, Any]) -> str:
    return str(hf.get("torch_dtype") or hf.get("dtype") or "float32")


# ---- reading: config.json -> the layout's Eagle3Config fields --------------------------------------------------


def read_fields(hf: dict[str, Any], layout: str, target: ModelConfig, norm_output: bool | None = None
                ) -> dict[str, Any]:
    """Eagle3Config fields (all but dtype and lm_head, which the tensors decide) of a head in `layout`;
    norm_output, when given, is the caller's reading of an EAGLE-3.1 head's `norm_output` (`eagle31_flags`)."""
    return {**_READERS[layout](hf, target), **eagle31_flags(hf, layout, norm_output)}


NORM_OUTPUT_VERSIONS = (
    "SpecForge trained `norm_output: true` as plain EAGLE-3 (normed logits, the pre-norm output fed back) from "
    "b7ce50cd (2026-07-19) up to its PR #879 (2026-09-15), and as EAGLE-3.1 (the post-norm output fed back, as vLLM "
    "and SGLang serve it) since; `false` meant no final norm before #879 and plain EAGLE-3 since")


def eagle31_flags(hf: dict[str, Any], layout: str, norm_output: bool | None = None) -> dict[str, bool]:
    """fc_norm, norm_before_fc and norm_output of a head in `layout`, as the code that runs it reads them (module
    docstring). norm_output given by the caller overrides the config (and is required for a `midlayer.*` head whose
    config sets it, whose meaning depends on the SpecForge version that trained it)."""
    eagle = hf.get("eagle_config") or {}
    fc_norm = bool(hf.get("fc_norm", False))
    before_fc = bool(eagle.get("norm_before_fc", hf.get("norm_before_fc", False)))
    if layout == "deepspec" and (fc_norm or before_fc or hf.get("norm_output")):
        raise ValueError("the DeepSpec head's config.json sets an EAGLE-3.1 flag (fc_norm / norm_before_fc / "
                         "norm_output); DeepSpec's Qwen3Eagle3Model has none of them")
    if fc_norm and before_fc:
        raise ValueError("the EAGLE-3 head's config.json sets both fc_norm and norm_before_fc; they are exclusive (one "
                         "norm per tap, or one over the concatenated taps: speculators' Eagle3SpeculatorConfig "
                         "refuses both)")
    if norm_output is None:
        if layout in ("safeailab", "specforge") and "norm_output" in hf:
            raise ValueError(
                f"the EAGLE-3 head's config.json sets norm_output={hf['norm_output']!r}, whose meaning for a "
                f"SpecForge (`midlayer.*`) head depends on the SpecForge version that trained it: "
                f"{NORM_OUTPUT_VERSIONS}. Pass norm_output=True to load_drafter for the EAGLE-3.1 reading (SpecForge "
                "since #879, vLLM, SGLang), or norm_output=False for plain EAGLE-3 (a head trained before #879 with "
                "true, or since with false; one trained before #879 with false has no final norm, not implemented)")
        norm_output = bool(hf.get("norm_output", False))
    return dict(fc_norm=fc_norm, norm_before_fc=before_fc, norm_output=bool(norm_output))


def _midlayer_fields(hf: dict[str, Any], target: ModelConfig, rope: RopeConfig) -> dict[str, Any]:
    """SafeAILab / SpecForge (and SGLang-served) heads: one `midlayer`, the fields at the top level."""
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"the EAGLE-3 head's config.json has num_hidden_layers={hf['num_hidden_layers']}; a "
                         "SafeAILab / SpecForge head (`midlayer.*` tensors) has exactly one decoder layer (cnets.py, "
                         "llama3_eagle.py); multi-layer heads come in the speculators or ModelOpt layout")
    refuse_unimplemented(hf)
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    taps = default_taps(target.num_layers, field) if ids is None else \
        output_of_layer_taps(ids, field, target.num_layers)
    vocab = need(hf, "vocab_size")
    return dict(shape_fields(hf), vocab_size=vocab, draft_vocab_size=hf.get("draft_vocab_size") or vocab,
                target_hidden_size=hf.get("target_hidden_size") or hf["hidden_size"], feature_layers=taps, rope=rope)


def _safeailab(hf, target):
    return _midlayer_fields(hf, target, safeailab_rope(hf))


def _specforge(hf, target):
    return _midlayer_fields(hf, target, transformers_rope(hf))


def _speculators(hf: dict[str, Any], target: ModelConfig) -> dict[str, Any]:
    """speculators' Eagle3SpeculatorConfig (models/eagle3/config.py): the decoder layer's config nested in
    `transformer_layer_config`; the first layer Eagle3FirstLayerMixin over the 2H concat, the rest the layer
    type's plain decoder layers (models/eagle3/core.py); `norm_before_residual`, absent meaning true as vLLM
    reads these configs (vllm/transformers_utils/configs/speculators/algos.py `update_eagle3`)."""
    kind = hf.get("speculators_model_type", "eagle3")
    if kind != "eagle3":
        raise ValueError(f"config.json speculators_model_type is {kind!r}; specjax reads speculators' 'eagle3' heads "
                         "as EAGLE-3 (its DFlash / DSpark / MTP speculators are other families)")
    layer = hf.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("the speculators head's config.json lacks its decoder layer's config "
                         "('transformer_layer_config')")
    where = "config.json transformer_layer_config"
    model_type = layer.get("model_type", "qwen3")  # speculators' default layer config is Qwen3Config
    if model_type not in SPECULATORS_LAYER_TYPES:
        raise ValueError(f"the speculators head's {where} has model_type {model_type!r}; specjax implements "
                         f"{list(SPECULATORS_LAYER_TYPES)} decoder layers")
    refuse_unimplemented(hf)
    refuse_unimplemented(layer, where)
    num_layers = int(need(layer, "num_hidden_layers", where))
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    taps = default_taps(target.num_layers, "eagle_aux_hidden_state_layer_ids") if not ids else \
        hidden_state_taps(ids, "eagle_aux_hidden_state_layer_ids", target.num_layers)
    vocab = need(layer, "vocab_size", where)
    return dict(shape_fields(layer, where), vocab_size=vocab, draft_vocab_size=hf.get("draft_vocab_size") or vocab,
                target_hidden_size=hf.get("target_hidden_size") or layer["hidden_size"], feature_layers=taps,
                rope=transformers_rope(layer), num_layers=num_layers, qk_norm=model_type == "qwen3",
                norm_before_residual=bool(hf.get("norm_before_residual", True)))


def _modelopt(hf: dict[str, Any], target: ModelConfig) -> dict[str, Any]:
    """ModelOpt's export (modelopt/torch/export/plugins/hf_spec_export.py `EagleExporter`, config from
    hf_spec_configs.py `llama_eagle_template_config`), served by vLLM's llama_eagle3.py: layer 0 over the 2H
    concat, layers 1.. plain Llama layers; norm_before_residual off (vLLM's getattr default)."""
    eagle = hf.get("eagle_config") or {}
    if hf.get("model_type", "llama") != "llama" or "Eagle3DeepseekV2ForCausalLM" in (hf.get("architectures") or []):
        raise ValueError(f"the ModelOpt head's config.json is a {hf.get('model_type')!r} head "
                         "(Eagle3DeepseekV2ForCausalLM: MLA attention); specjax implements ModelOpt's llama heads")
    for flag, want in (("use_aux_hidden_state", True), ("use_input_layernorm_in_first_layer", True),
                       ("use_last_layernorm", True), ("use_mtp_layernorm", False)):
        if flag in eagle and eagle[flag] is not None and bool(eagle[flag]) != want:
            raise ValueError(f"the ModelOpt head's config.json eagle_config.{flag} is {eagle[flag]!r}; an EAGLE-3 "
                             f"head has {flag}={want} (other values are EAGLE-1/2 or MTP-style heads, not "
                             "implemented)")
    if (eagle.get("parallel_draft_step") or 1) > 1:
        raise ValueError("the ModelOpt head's config.json eagle_config.parallel_draft_step > 1 (parallel drafting "
                         "heads) is not implemented")
    refuse_unimplemented(hf)
    field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    taps = default_taps(target.num_layers, field) if not ids else \
        output_of_layer_taps(ids, field, target.num_layers, count=None)
    vocab = need(hf, "vocab_size")
    return dict(shape_fields(hf), vocab_size=vocab, draft_vocab_size=hf.get("draft_vocab_size") or vocab,
                target_hidden_size=hf.get("target_hidden_size") or hf["hidden_size"], feature_layers=taps,
                rope=transformers_rope(hf), num_layers=int(hf.get("num_hidden_layers", 1)),
                norm_before_residual=bool(hf.get("norm_before_residual", False)))


def _deepspec(hf: dict[str, Any], target: ModelConfig) -> dict[str, Any]:
    """DeepSpec's Qwen3Eagle3Model (deepspec/modeling/eagle3/qwen3/modeling.py): a copy of the target's Qwen3 config
    (config.py `build_draft_config`), fc over the five `target_layer_ids` taps (common.py
    `validate_eagle3_target_layer_ids`: five, strictly increasing, below the last layer per base_evaluator.py
    `assert_no_final_target_layer`), q/k RMSNorm in its layer, a full-vocabulary lm_head, its own embed_tokens.
    Its evaluator (deepspec/eval/eagle3/evaluator.py) runs one-layer heads only."""
    layers = int(hf.get("draft_num_hidden_layers", hf.get("num_hidden_layers", 1)))
    if layers != 1 or hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"the DeepSpec head's config.json has {layers} draft layers; DeepSpec's Qwen3Eagle3Evaluator "
                         "runs draft_num_hidden_layers == 1 only (its cache update assumes one layer)")
    refuse_unimplemented(hf)
    built_for = hf.get("num_target_layers")
    if built_for is not None and built_for != target.num_layers:
        raise ValueError(f"the DeepSpec head was built for a target of {built_for} layers (config.json "
                         f"num_target_layers) but the target has {target.num_layers}")
    ids = _id_list(need(hf, "target_layer_ids"), "target_layer_ids", None)
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"config.json target_layer_ids {ids} must be strictly increasing (DeepSpec's "
                         "validate_eagle3_target_layer_ids)")
    if target.num_layers - 1 in ids:
        raise ValueError(f"config.json target_layer_ids {ids} include the target's last layer {target.num_layers - 1},"
                         " whose hidden state transformers returns normed (DeepSpec refuses it too)")
    taps = output_of_layer_taps(ids, "target_layer_ids", target.num_layers, count=None)
    vocab = need(hf, "vocab_size")
    return dict(shape_fields(hf), vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=hf["hidden_size"],
                feature_layers=taps, rope=transformers_rope(hf), qk_norm=True)


_READERS = {"safeailab": _safeailab, "specforge": _specforge, "speculators": _speculators, "modelopt": _modelopt,
            "deepspec": _deepspec}


def layer_prefix(layout: str, i: int) -> str:
    """Where layer i's tensors live in the layout's checkpoint."""
    if layout in ("safeailab", "specforge"):
        return "midlayer."
    return f"layers.{i}."


# ---- writing: an Eagle3Config -> the layout's config.json -------------------------------------------------------


def write_config(cfg, dtype: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of `cfg` in its layout, from the producer's own config when given (its other keys kept) and
    every field specjax reads set from cfg, so `read_fields` gives cfg back."""
    return _WRITERS[cfg.layout](cfg, dtype, dict(source or {}))


def _rope_keys(rope: RopeConfig, layout: str) -> dict[str, Any]:
    """rope_theta / rope_scaling as transformers 4 configs spell them (what the producers publish)."""
    if rope.rope_type == "default":
        return {"rope_theta": rope.theta, "rope_scaling": None}
    if rope.rope_type == "linear":
        return {"rope_theta": rope.theta, "rope_scaling": {"type": "linear", "rope_type": "linear",
                                                           "factor": rope.factor}}
    if rope.rope_type == "llama3" and layout != "safeailab":
        return {"rope_theta": rope.theta, "rope_scaling": {
            "rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings}}
    if rope.rope_type == "yarn" and layout != "safeailab":
        return {"rope_theta": rope.theta, "rope_scaling": {
            "rope_type": "yarn", "factor": rope.factor, "original_max_position_embeddings":
                rope.original_max_position_embeddings, "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow,
            "attention_factor": rope.attention_factor, "truncate": rope.truncate}}
    raise ValueError(f"an EAGLE-3 head in the {layout} layout cannot carry {rope.rope_type!r} RoPE scaling")


def _shape_keys(cfg) -> dict[str, Any]:
    return {"hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu"}


def _drop_rope_spellings(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_theta", "rope_scaling", "dtype")}


def _eagle31_keys(cfg, config: dict[str, Any], top_norm_output: bool = True) -> dict[str, Any]:
    """fc_norm / norm_before_fc / norm_output as `eagle31_flags` reads them back: set when on, dropped when off
    (norm_output kept at the top only where it means one thing)."""
    config = {k: v for k, v in config.items() if k not in ("fc_norm", "norm_before_fc", "norm_output")}
    if isinstance(config.get("eagle_config"), dict):
        config["eagle_config"] = {k: v for k, v in config["eagle_config"].items() if k != "norm_before_fc"}
    config.update({k: True for k in ("fc_norm", "norm_before_fc") if getattr(cfg, k)})
    if cfg.norm_output and top_norm_output:
        config["norm_output"] = True
    return config


def _write_midlayer(cfg, dtype: str, config: dict[str, Any]) -> dict[str, Any]:
    arch = "LlamaForCausalLMEagle3" if cfg.layout == "specforge" else "LlamaForCausalLM"
    config = {"architectures": [arch], "model_type": "llama", "max_position_embeddings": 2048,
              "tie_word_embeddings": False, **_drop_rope_spellings(config)}
    config.update(_shape_keys(cfg), num_hidden_layers=1, vocab_size=cfg.vocab_size,
                  draft_vocab_size=cfg.draft_vocab_size, torch_dtype=dtype, **_rope_keys(cfg.rope, cfg.layout))
    config["eagle_config"] = {**(config.get("eagle_config") or {}),
                              "eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.feature_layers]}
    if cfg.target_hidden_size != cfg.hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    else:
        config.pop("target_hidden_size", None)
    return _eagle31_keys(cfg, config, top_norm_output=False)


def _write_speculators(cfg, dtype: str, config: dict[str, Any]) -> dict[str, Any]:
    layer = _drop_rope_spellings(config.get("transformer_layer_config") or {})
    layer.update(model_type="qwen3" if cfg.qk_norm else "llama", **_shape_keys(cfg), num_hidden_layers=cfg.num_layers,
                 vocab_size=cfg.vocab_size, tie_word_embeddings=False, torch_dtype=dtype,
                 **_rope_keys(cfg.rope, cfg.layout))
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "embed_requires_grad": False,
              "speculators_config": {"algorithm": "eagle3",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "default_proposal_method": "greedy",
                                     "verifier": {"name_or_path": None, "architectures": []}},
              **{k: v for k, v in config.items() if k != "dtype"}}
    config.update(transformer_layer_config=layer, draft_vocab_size=cfg.draft_vocab_size,
                  norm_before_residual=cfg.norm_before_residual,
                  target_hidden_size=cfg.target_hidden_size if cfg.target_hidden_size != cfg.hidden_size else None,
                  eagle_aux_hidden_state_layer_ids=list(cfg.feature_layers), torch_dtype=dtype,
                  norm_before_fc=cfg.norm_before_fc, fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)
    return config


def _write_modelopt(cfg, dtype: str, config: dict[str, Any]) -> dict[str, Any]:
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
              "use_cache": True, **_drop_rope_spellings(config)}
    eagle = {"use_input_layernorm_in_first_layer": True, "use_mtp_layernorm": False, "next_layer_regular": True,
             "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1, **(config.get("eagle_config") or {})}
    eagle.update(eagle_aux_hidden_state_layer_ids=[i - 1 for i in cfg.feature_layers], use_aux_hidden_state=True,
                 use_last_layernorm=True)
    config.update(_shape_keys(cfg), num_hidden_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
                  draft_vocab_size=cfg.draft_vocab_size, torch_dtype=dtype, eagle_config=eagle,
                  norm_before_residual=cfg.norm_before_residual, **_rope_keys(cfg.rope, cfg.layout))
    if not cfg.norm_before_residual:
        config.pop("norm_before_residual")
    return _eagle31_keys(cfg, config)


def _write_deepspec(cfg, dtype: str, config: dict[str, Any]) -> dict[str, Any]:
    config = {"architectures": ["Qwen3Eagle3Model"], "model_type": "qwen3", "attention_bias": False,
              "ttt_length": 7, "step_loss_decay": 0.8, **_drop_rope_spellings(config)}
    config.update(_shape_keys(cfg), num_hidden_layers=1, draft_num_hidden_layers=1, layer_types=["full_attention"],
                  vocab_size=cfg.vocab_size, tie_word_embeddings=False, torch_dtype=dtype,
                  target_layer_ids=[i - 1 for i in cfg.feature_layers], **_rope_keys(cfg.rope, cfg.layout))
    return config


_WRITERS = {"safeailab": _write_midlayer, "specforge": _write_midlayer, "speculators": _write_speculators,
            "modelopt": _write_modelopt, "deepspec": _write_deepspec}
