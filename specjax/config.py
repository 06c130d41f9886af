"""Model and decode configuration: frozen dataclasses, hashable, static under jit.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dict, written by older
transformers (`rope_theta`, `rope_scaling`) or newer ones (`rope_parameters`), and
refuses any field this code does not implement instead of silently ignoring it.
Qwen3.5 (a hybrid: Gated DeltaNet and gated full-attention layers) is read from both of
its published layouts: `Qwen3_5ForCausalLM` (flat) and `Qwen3_5ForConditionalGeneration`
(the text model's fields nested in `text_config`). Mixture-of-experts targets (Qwen3-MoE, Qwen3.5-MoE,
Qwen3-Next) carry a `MoeConfig`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping, Tuple, Union

import numpy as np

# architectures entry -> family flags. All are the dense pre-norm decoder with GQA,
# SwiGLU MLP and rotate-half RoPE; they differ only in the flags below.
_ARCHITECTURES = {
    "LlamaForCausalLM": dict(family="llama", qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": dict(family="mistral", qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(family="qwen2", qkv_bias=True, qk_norm=False),
    # XiaomiMiMo/MiMo-7B: a Qwen2 decoder carrying MTP layers under model.mtp_layers (convert/mtp.py).
    "MiMoForCausalLM": dict(family="mimo", qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(family="qwen3", qkv_bias=None, qk_norm=True),
    # Qwen3.5: zero-centred norms, gated attention with partial rotary, Gated DeltaNet layers
    # (transformers/models/qwen3_5/modeling_qwen3_5.py).
    "Qwen3_5ForCausalLM": dict(family="qwen3_5", qkv_bias=False, qk_norm=True),
    "Qwen3_5ForConditionalGeneration": dict(family="qwen3_5", qkv_bias=False, qk_norm=True),
    # Mixture-of-experts: Qwen3's decoder with sparse MLPs (transformers/models/qwen3_moe/modeling_qwen3_moe.py),
    # Qwen3.5's hybrid with a routed + shared-expert MLP in every layer (qwen3_5_moe/modeling_qwen3_5_moe.py), and
    # Qwen3-Next: the same hybrid with fused DeltaNet projections (qwen3_next/modeling_qwen3_next.py).
    "Qwen3MoeForCausalLM": dict(family="qwen3_moe", qkv_bias=None, qk_norm=True),
    "Qwen3_5MoeForCausalLM": dict(family="qwen3_5_moe", qkv_bias=False, qk_norm=True),
    "Qwen3_5MoeForConditionalGeneration": dict(family="qwen3_5_moe", qkv_bias=False, qk_norm=True),
    "Qwen3NextForCausalLM": dict(family="qwen3_next", qkv_bias=False, qk_norm=True),
}
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe", "qwen3_next")
MOE_IMPLS = ("auto", "gather", "sorted", "ragged")  # the expert paths of models/moe.py
LAYER_TYPES = ("full_attention", "linear_attention")
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base and optional scaling (`linear`, Llama 3's `llama3`, or `yarn`).

    YaRN (read for EAGLE-3 heads only: ModelOpt exports carry it) blends interpolated and extrapolated
    frequencies between the dims that rotate beta_fast and beta_slow times over the original context, and
    scales q and k by attention_factor (cos/sin times it, as transformers and vLLM apply it)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class LinearAttnConfig:
    """A Gated DeltaNet layer's shape (Qwen3.5's `linear_*` fields): q/k heads, v heads, head dims, conv kernel."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: [q | k | v]."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP's shape: `num_experts` SwiGLU experts of width `expert_size`, `top_k` routed per token
    (softmax over all experts, then the top k, renormalised to sum 1 when `norm_topk_prob`), optionally a
    shared expert of width `shared_size` scaled by sigmoid(x @ shared_gate) (Qwen3.5-MoE, Qwen3-Next).

    sparse_layers: the layers whose MLP is this MoE (the others are dense SwiGLU of the model's
    `intermediate_size`): transformers' rule, layer i is sparse unless it is in `mlp_only_layers`, when
    (i + 1) % decoder_sparse_step == 0.
    """

    num_experts: int
    top_k: int
    expert_size: int
    norm_topk_prob: bool = True
    shared_size: int = 0  # 0: no shared expert
    sparse_layers: tuple[int, ...] = ()
    impl: str = "auto"  # the expert path (models/moe.py): "auto" by tokens per pass, "gather", "sorted", "ragged"
    # whole experts per device on a mesh (load sets it when its rules split the experts over "model"): each device
    # runs the slots of its own experts under shard_map (models/moe.py expert_parallel_experts)
    expert_parallel: bool = False

    def __post_init__(self):
        if self.impl not in MOE_IMPLS:
            raise ValueError(f"MoeConfig impl must be one of {MOE_IMPLS}, got {self.impl!r}")

    def expert_params(self, hidden_size: int) -> int:
        """Weights of one SwiGLU expert: gate, up [D, I] and down [I, D]."""
        return 3 * hidden_size * self.expert_size

    def expected_experts(self, tokens: int) -> float:
        """Distinct experts a pass of `tokens` tokens reads in one sparse layer under uniform routing:
        E (1 - (1 - k/E)^n) (each expert is missed by a token with probability 1 - k/E)."""
        e, k = self.num_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** tokens)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder: dense (Llama 3.x, Qwen2/2.5, Qwen3, Mistral) or hybrid (Qwen3.5), its
    MLPs dense or (`moe`: Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next) a mixture of experts on the sparse layers.

    A hybrid has `layer_types` (one of LAYER_TYPES per layer) and `linear` (the Gated DeltaNet shape);
    its full-attention layers gate their output (`attn_output_gate`) and rotate only the first
    `rotary_dim` dims of each head, and every RMSNorm but the DeltaNet's output norm is zero-centred
    (`norm_offset`: x * (1 + w)).

    A loaded target carries its own (`target.cfg`); `from_hf` reads one from a Hugging Face config.json. Frozen and
    hashable: it is part of every compiled loop's key.

    Attributes:
        vocab_size: tokens in the vocabulary (rows of the embedding, columns of the lm_head).
        hidden_size: the residual stream's width D.
        intermediate_size: the dense SwiGLU MLP's width (0 for Qwen3.5-MoE, which has no dense MLP).
        num_layers: decoder layers.
        num_heads: query heads of a full-attention layer.
        num_kv_heads: key/value heads (grouped-query attention: `num_heads` is a multiple of it).
        head_dim: width of one attention head.
        rms_norm_eps: the RMSNorms' epsilon.
        rope: the rotary embedding: its base and scaling (`RopeConfig`).
        tie_word_embeddings: the lm_head is the embedding's transpose.
        qkv_bias: q/k/v projections carry biases (Qwen2).
        qk_norm: per-head RMSNorm of queries and keys (Qwen3).
        max_position_embeddings: the longest context the checkpoint declares.
        sliding_window: the attention window the config declares, or None.
        bos_token_id: the beginning-of-sequence token, or None.
        eos_token_ids: the config's end-of-sequence tokens.
        family: the architecture family ("llama", "mistral", "qwen2", "mimo", "qwen3", "qwen3_5", "qwen3_moe",
            "qwen3_5_moe", "qwen3_next").
        dtype: the weights' dtype name ("float32", "bfloat16", "float16").
        layer_types: per layer "full_attention" or "linear_attention" (a hybrid); empty: every layer attends.
        linear: the Gated DeltaNet layers' shape (a hybrid), else None.
        partial_rotary_factor: the fraction of each head's dims RoPE rotates (`rotary_dim`).
        attn_output_gate: full attention gates its output by sigmoid(x @ wg) (Qwen3.5).
        norm_offset: zero-centred RMSNorms, x * (1 + w) (Qwen3.5).
        moe: the mixture-of-experts MLP of the sparse layers, or None (dense).

    Example:
        ```python
        import json
        cfg = specjax.ModelConfig.from_hf(json.load(open("Llama-3.2-1B/config.json")))
        cfg.num_params(), cfg.attention_layers
        ```
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 8192
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"
    dtype: str = "float32"
    layer_types: tuple[str, ...] = ()  # empty: every layer full attention
    linear: LinearAttnConfig | None = None
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    norm_offset: bool = False
    moe: MoeConfig | None = None

    @property
    def is_hybrid(self) -> bool:
        """Gated DeltaNet layers among the attention layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)."""
        return self.linear is not None

    def is_sparse(self, i: int) -> bool:
        """Whether layer i's MLP is the mixture of experts.

        Args:
            i: a layer index, 0 .. num_layers - 1.

        Returns:
            True when the config has an MoE and layer i is one of its sparse layers.
        """
        return self.moe is not None and i in self.moe.sparse_layers

    @property
    def mixed_layers(self) -> bool:
        """Layers of more than one kind (a hybrid; an MoE model with dense layers): no one stacked layer to scan,
        so the layers run per-layer."""
        return self.is_hybrid or (self.moe is not None and len(self.moe.sparse_layers) not in (0, self.num_layers))

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (all of them unless `partial_rotary_factor` < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, i: int) -> str:
        """Layer i's mixer: "full_attention" (a KV cache) or "linear_attention" (a Gated DeltaNet layer).

        Args:
            i: a layer index, 0 .. num_layers - 1.

        Returns:
            One of LAYER_TYPES; "full_attention" for every layer of a model without `layer_types`.
        """
        return self.layer_types[i] if self.layer_types else "full_attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers (the ones with a KV cache)."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers (the ones with a conv and a recurrent state)."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == "linear_attention")

    def num_params(self, active: bool = False, shards: Mapping[str, int] | None = None) -> int | float:
        """The model's parameter count, or what one token reads, or one device's share of either.

        Args:
            active: count only the weights one token reads: its k routed experts, not all E (the same as all
                weights for a dense model).
            shards: one device's share under tensor parallelism: per logical axis name of models/layers.py (heads,
                kv_heads, mlp, vocab, v_heads, conv; experts: the routed experts' weights; shared: the shared
                expert's width), the number of devices it splits over (planning/tensor_parallel.py decides which
                split). Norms, the router and the q/k norms count whole on every device. None: the whole model.

        Returns:
            An int without shards; with shards a float (a device's expected share of the k active experts).
        """
        d, v, part = self.hidden_size, self.vocab_size, _share(shards)
        total = sum(self.layer_params(i, active, shards) for i in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else part(d * v, "vocab")
        total += part(v * d, "vocab") + d + head  # + d: the final norm
        return total if shards else int(total)

    def layer_params(self, i: int, active: bool = False, shards: Mapping[str, int] | None = None) -> int | float:
        """Layer i's weights: its mixer (attention or Gated DeltaNet) with its input norm, and its MLP half.

        Args:
            i: a layer index, 0 .. num_layers - 1.
            active: as in `num_params`.
            shards: as in `num_params`.

        Returns:
            The count (a float with shards).
        """
        d, part = self.hidden_size, _share(shards)
        if self.layer_type(i) == "full_attention":
            qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            mixer = part(d * qd * (2 if self.attn_output_gate else 1) + qd * d, "heads") + part(2 * d * kvd, "kv_heads")
            mixer += (part(qd, "heads") + part(2 * kvd, "kv_heads")) if self.qkv_bias else 0
            mixer += 2 * self.head_dim if self.qk_norm else 0
        else:
            lin = self.linear
            mixer = part(d * lin.conv_dim + lin.conv_dim * lin.conv_kernel, "conv") + lin.value_head_dim
            mixer += part(d * (lin.value_dim + 2 * lin.num_value_heads) + lin.value_dim * d + 2 * lin.num_value_heads,
                          "v_heads")
        return mixer + d + self.mlp_params(i, active, shards)  # + d: the layer's input norm

    def mlp_params(self, i: int, active: bool = False, shards: Mapping[str, int] | None = None) -> int | float:
        """Layer i's MLP half with its norm: dense SwiGLU, or router + experts (+ shared expert and its gate).

        Args:
            i: a layer index, 0 .. num_layers - 1.
            active: as in `num_params`.
            shards: as in `num_params`.

        Returns:
            The count (a float with shards).
        """
        d, part = self.hidden_size, _share(shards)
        if not self.is_sparse(i):
            return part(3 * d * self.intermediate_size, "mlp") + d
        moe = self.moe
        experts = moe.top_k if active else moe.num_experts
        shared = part(3 * d * moe.shared_size, "shared") + d if moe.shared_size else 0
        return d * moe.num_experts + part(experts * moe.expert_params(d), "experts") + shared + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str | None = None) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (a multimodal layout's `text_config` is read).

        Args:
            hf: the parsed config.json.
            dtype: the weights' dtype name to record; None: the config's torch_dtype (float32 when absent).

        Returns:
            The ModelConfig.

        Raises:
            ValueError: an architecture specjax does not implement (the supported ones are listed), a required
                field missing, or a field whose value specjax does not implement (named).
        """
        hf = text_config(hf)
        archs = hf.get("architectures") or []
        if len(archs) != 1 or archs[0] not in _ARCHITECTURES:
            raise ValueError(
                f"config.json 'architectures' is {archs!r}; specjax supports exactly one of "
                f"{sorted(_ARCHITECTURES)}"
            )
        arch = _ARCHITECTURES[archs[0]]
        _refuse_unsupported(hf, arch["family"])
        hidden = _require(hf, "hidden_size")
        heads = _require(hf, "num_attention_heads")
        kv_heads = hf.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = hf.get("head_dim") or hidden // heads
        qkv_bias = arch["qkv_bias"] if arch["qkv_bias"] is not None else bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        torch_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        return cls(
            vocab_size=_require(hf, "vocab_size"),
            hidden_size=hidden,
            # Qwen3.5-MoE has no dense MLP (every layer is sparse): its config has no intermediate_size.
            intermediate_size=hf.get("intermediate_size", 0) if arch["family"] == "qwen3_5_moe"
            else _require(hf, "intermediate_size"),
            num_layers=_require(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=arch["qk_norm"],
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            sliding_window=_sliding_window(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=arch["family"],
            dtype=dtype or _DTYPE_NAMES.get(str(torch_dtype), "float32"),
            **(_hybrid_fields(hf) if arch["family"] in HYBRID_FAMILIES else {}),
            moe=_moe_fields(hf, arch["family"]) if arch["family"] in MOE_FAMILIES else None,
        )


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: `text_config` of a multimodal layout (Qwen3.5's ConditionalGeneration),
    with the top level's architectures and embedding tie; the dict itself otherwise."""
    if "text_config" not in hf:
        return hf
    text = dict(hf["text_config"])
    text["architectures"] = hf.get("architectures") or text.get("architectures")
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def _moe_fields(hf: dict[str, Any], family: str) -> MoeConfig:
    """The sparse MLP of a Qwen MoE config. Qwen3.5-MoE: every layer sparse, always renormalised (its router has
    no norm_topk_prob switch); Qwen3-MoE / Qwen3-Next: `decoder_sparse_step` and `mlp_only_layers` pick the
    sparse layers. `num_local_experts` is transformers 5's saved name for `num_experts`."""
    n = _require(hf, "num_hidden_layers")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ValueError("config.json lacks required field 'num_experts' (or 'num_local_experts')")
    top_k = _require(hf, "num_experts_per_tok")
    if not 0 < top_k <= experts:
        raise ValueError(f"config.json 'num_experts_per_tok' is {top_k}; it must be in 1..num_experts ({experts})")
    if family == "qwen3_5_moe":
        sparse, norm_topk = tuple(range(n)), True
    else:
        step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or ())
        if step < 1:
            raise ValueError(f"config.json 'decoder_sparse_step' is {step}; it must be >= 1")
        sparse = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
        norm_topk = bool(hf.get("norm_topk_prob", family == "qwen3_next"))
    shared = int(hf.get("shared_expert_intermediate_size", 0)) if family != "qwen3_moe" else 0
    if family != "qwen3_moe" and not shared:
        raise ValueError(f"config.json lacks 'shared_expert_intermediate_size': a {family} MoE layer has a shared "
                         "expert")
    if len(sparse) < n and not hf.get("intermediate_size"):
        raise ValueError("config.json lacks 'intermediate_size', which its dense (mlp_only_layers) layers need")
    return MoeConfig(num_experts=int(experts), top_k=int(top_k), expert_size=_require(hf, "moe_intermediate_size"),
                     norm_topk_prob=norm_topk, shared_size=shared, sparse_layers=sparse)


def _hybrid_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's hybrid fields (transformers' Qwen3_5TextConfig: `layer_types`, else a full-attention layer every
    `full_attention_interval`, default 4; `partial_rotary_factor` defaults to 0.25).

    `mrope_section` is not read: for text the temporal, height and width position streams are equal, so
    Qwen3.5's multimodal RoPE is plain rotate-half RoPE on the first `rotary_dim` dims (its
    `recomposition_frequencies` picks each frequency from one of three identical streams)."""
    n = _require(hf, "num_hidden_layers")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        interval = int(hf.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if len(layer_types) != n or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(f"config.json 'layer_types' must list one of {LAYER_TYPES} for each of the {n} layers, "
                         f"got {layer_types!r}")
    state_dtype = hf.get("mamba_ssm_dtype", "float32")
    if str(state_dtype) not in ("float32", "torch.float32"):
        raise ValueError(f"config.json 'mamba_ssm_dtype' is {state_dtype!r}; specjax keeps the Gated DeltaNet state in "
                         "float32 (as the published checkpoints do): set it to 'float32'")
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    linear = LinearAttnConfig(
        num_key_heads=_require(hf, "linear_num_key_heads"), num_value_heads=_require(hf, "linear_num_value_heads"),
        key_head_dim=_require(hf, "linear_key_head_dim"), value_head_dim=_require(hf, "linear_value_head_dim"),
        conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)))
    if linear.num_value_heads % linear.num_key_heads:
        raise ValueError(f"linear_num_value_heads={linear.num_value_heads} is not a multiple of "
                         f"linear_num_key_heads={linear.num_key_heads}")
    return dict(layer_types=tuple(layer_types), linear=linear,
                partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
                attn_output_gate=True, norm_offset=True)


def _share(shards: Mapping[str, int] | None):
    """count, axis -> the share of `count` weights on one device when `axis` splits over shards[axis] devices
    (the count itself, an int, without shards)."""
    if not shards:
        return lambda count, axis: count
    return lambda count, axis: count / shards.get(axis, 1)


_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ValueError(f"config.json lacks required field '{key}'")
    return hf[key]


def _refuse_unsupported(hf: dict[str, Any], family: str) -> None:
    if hf.get("mlp_bias"):
        raise ValueError("config.json 'mlp_bias' is true; specjax's MLP has no bias (set it false or drop it)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json 'hidden_act' is {act!r}; specjax implements only 'silu' (SwiGLU)")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise ValueError("config.json 'pretraining_tp' != 1 is not supported")
    if family in HYBRID_FAMILIES:  # its layer_types are read by _hybrid_fields
        if hf.get("attention_bias"):
            raise ValueError(f"config.json 'attention_bias' is true; {family} in specjax has no attention biases "
                             "(as the published checkpoints): set it false")
        return
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"config.json 'layer_types' has {set(layer_types)}; only 'full_attention' is supported")


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """The window that would limit attention, or None. Qwen gates it by `use_sliding_window`."""
    if "use_sliding_window" in hf and not hf["use_sliding_window"]:
        return None
    window = hf.get("sliding_window")
    return int(window) if window else None


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    new, legacy = dict(hf.get("rope_parameters") or {}), dict(hf.get("rope_scaling") or {})
    for field, spec in (("rope_parameters", new), ("rope_scaling", legacy)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(f"config.json '{field}' has rope type {kind!r}, which is not implemented in specjax; "
                             f"supported: {_SUPPORTED_ROPE_TYPES}")
    params = {**new, **legacy}  # transformers lets an explicit rope_scaling override
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json rope scaling type {rope_type!r} is not implemented; supported: {_SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


PerRow = Union[float, Tuple[float, ...]]


def per_row(value, n_rows: int, name: str) -> tuple:
    """A per-call setting as one value per prompt: a scalar is every prompt's, a sequence must have one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_rows:
            raise ValueError(f"{name} has {len(value)} values for {n_rows} prompts: pass one value per prompt, or "
                             "a single value for all")
        return tuple(value)
    return (value,) * n_rows


def row_column(config, name: str, n_rows: int, batch: int, dtype, pad) -> np.ndarray:
    """One setting of `config` as a host array [batch]: its per-prompt values, then `pad` for the padding rows."""
    return np.asarray(list(per_row(getattr(config, name), n_rows, name)) + [pad] * (batch - n_rows), dtype)


def _is_number(x) -> bool:
    """A finite real number (not a bool): NaN and inf are no setting's value (a NaN temperature ended rows at once)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _is_integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _values(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How each row's token is chosen from logits: temperature 0 means greedy (the filters are then ignored).

    Every field is one value for all prompts or a tuple of one per prompt (validate() turns lists into
    tuples). Order of application, vLLM's (vllm/v1/sample/sampler.py): temperature, min_p, top_k, top_p.
    `generate` builds one from its keywords (or a `SamplingParams`); build one yourself only to call the loops or a
    drafter directly.

    Attributes:
        temperature: >= 0; 0 is greedy (argmax).
        top_k: keep the k most likely tokens (ties with the k-th kept); 0 = off.
        top_p: keep the smallest set of most likely tokens holding this mass, in (0, 1]; 1.0 = off.
        min_p: keep tokens with p >= min_p x the largest p, in [0, 1]; 0.0 = off.

    Example:
        ```python
        specjax.SamplingConfig(temperature=(0.0, 0.8), top_p=0.95).validate().greedy   # False: row 1 samples
        ```
    """

    temperature: PerRow = 0.0
    top_k: Union[int, Tuple[int, ...]] = 0  # 0 = off
    top_p: PerRow = 1.0  # 1.0 = off
    min_p: PerRow = 0.0  # 0.0 = off: keep tokens with p >= min_p * max p

    @property
    def greedy(self) -> bool:
        """Every row greedy: the loop then compiles its argmax path (no sampling work at all)."""
        return all(t == 0.0 for t in _values(self.temperature))

    def validate(self) -> "SamplingConfig":
        """Check every value and turn lists into tuples.

        Returns:
            A new SamplingConfig with the same values, lists made tuples (hashable).

        Raises:
            ValueError: a temperature that is not a finite number >= 0, a top_k that is not an integer >= 0, a top_p
                outside (0, 1] or a min_p outside [0, 1] (each named, with the value given).
        """
        fields = {f.name: tuple(v) if isinstance(v := getattr(self, f.name), list) else v
                  for f in dataclasses.fields(self)}
        for t in _values(fields["temperature"]):
            if not _is_number(t) or t < 0:
                raise ValueError(f"temperature must be a number >= 0 (finite; 0 = greedy), got {t!r}")
        for k in _values(fields["top_k"]):
            if not _is_integer(k) or k < 0:
                raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        for p in _values(fields["top_p"]):
            if not _is_number(p) or not 0.0 < p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        for m in _values(fields["min_p"]):
            if not _is_number(m) or not 0.0 <= m <= 1.0:
                raise ValueError(f"min_p must be in [0, 1] (0 = off), got {m!r}")
        return SamplingConfig(**fields)


@dataclasses.dataclass(frozen=True)
class PenaltyConfig:
    """vLLM's penalties and min_tokens, each one value for all prompts or one per prompt.

    repetition_penalty > 0 (1 = off) scales the logits of tokens seen in the prompt or the output (divided when
    positive, multiplied when not); presence_penalty and frequency_penalty subtract p * [count > 0] and f * count
    over the output (vllm/model_executor/layers/utils.py apply_penalties); min_tokens keeps EOS and the stop
    tokens out until a row has that many tokens.
    """

    repetition_penalty: PerRow = 1.0
    presence_penalty: PerRow = 0.0
    frequency_penalty: PerRow = 0.0
    min_tokens: Union[int, Tuple[int, ...]] = 0

    @property
    def active(self) -> bool:
        """Any row penalised: the loop then carries token counts (compiled in only when needed)."""
        return (any(r != 1.0 for r in _values(self.repetition_penalty))
                or any(p != 0.0 for p in _values(self.presence_penalty))
                or any(f != 0.0 for f in _values(self.frequency_penalty))
                or any(m != 0 for m in _values(self.min_tokens)))

    def validate(self) -> "PenaltyConfig":
        fields = {f.name: tuple(v) if isinstance(v := getattr(self, f.name), list) else v
                  for f in dataclasses.fields(self)}
        for r in _values(fields["repetition_penalty"]):
            if not _is_number(r) or r <= 0:
                raise ValueError(f"repetition_penalty must be a number > 0 (finite; 1 = off), got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            for v in _values(fields[name]):
                if not _is_number(v) or not -2.0 <= v <= 2.0:
                    raise ValueError(f"{name} must be a number in [-2, 2] (0 = off, vLLM's range), got {v!r}")
        for m in _values(fields["min_tokens"]):
            if not _is_integer(m) or m < 0:
                raise ValueError(f"min_tokens must be an integer >= 0, got {m!r}")
        return PenaltyConfig(**fields)
