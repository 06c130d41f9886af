"""Read the multi-token-prediction (MTP) tensors a target checkpoint carries, checked against the target.

Three layouts (torch [out, in] weights; H = the target's hidden size, V its vocabulary):

  DeepSeek-V3: MTP layer j is stored as an extra decoder layer `model.layers.{L + j}` (L =
  num_hidden_layers) with, besides the usual layer tensors (input_layernorm, self_attn.*,
  post_attention_layernorm, mlp.*):
      enorm.weight [H], hnorm.weight [H], eh_proj.weight [H, 2H], shared_head.norm.weight [H],
      shared_head.head.weight [V, H] (optional: else the target's lm_head),
      embed_tokens.weight [V, H] (optional: else the target's embedding).
  config.json: num_nextn_predict_layers (when present it must match the layers found).

  Qwen3-Next / Qwen3.5: `mtp.fc.weight` [H, 2H], `mtp.pre_fc_norm_embedding.weight` [H],
  `mtp.pre_fc_norm_hidden.weight` [H], `mtp.norm.weight` [H] (shared by all MTP layers),
  `mtp.layers.{j}.*` (the usual layer tensors: on a Qwen3.5 target its gated full-attention
  layer, q_proj holding query and gate per head), optionally `mtp.embed_tokens.weight` [V, H]
  (`mtp_use_dedicated_embeddings`; else the target's embedding, as vLLM's qwen3_5_mtp.py loads
  it); the target's lm_head.
  config.json: mtp_num_hidden_layers or num_nextn_predict_layers (checked when present).

  MiMo (XiaomiMiMo/MiMo-7B, a Qwen2 target, architectures MiMoForCausalLM): MTP layer j is
  `model.mtp_layers.{j}` with token_layernorm.weight [H], hidden_layernorm.weight [H],
  input_proj.weight [H, 2H], final_layernorm.weight [H] and the Qwen2 layer tensors directly under
  the same prefix (vllm/model_executor/models/mimo_mtp.py maps them to its mtp_block).
  config.json: num_nextn_predict_layers.

A quantized checkpoint's MTP linears (FP8 releases that keep `mtp.*` quantize them too) stay quantized as the
target's layers' do (convert/quantized.py: the fc and the block's LAYER_LINEARS become QuantizedWeights, whose
matmuls dequantize inside the drafter's trace); any other quantized MTP tensor is dequantized to the target's dtype
here. `specjax.load(..., dequantize=True)` (the exact mode) and `specjax.convert` dequantize them with the target.
specjax's MTP block is a full-attention decoder layer of the target's family, so every block tensor
must have the shape of one of the target's layers; on an MoE target a block with a router
(`mlp.gate.weight`) has the target's experts (convert/moe.py; Qwen3.5-MoE: fused, 19 tensors per
layer). MLA blocks are refused by name.
Stored form (`params["mtp"]` of a converted checkpoint, `Target.mtp`), [in, out] matrices:
  deepseek, mimo: {"layers": {"0": {embed_norm, hidden_norm, fc [2H, H], final_norm, block {...},
                                    optionally embed [V, H], lm_head [H, V]}, "1": ...}}
                  (the layout follows the target: MiMo's family is "mimo")
  qwen3_next: {embed_norm, hidden_norm, fc, final_norm, optionally embed, "layers": {"0": {block {...}}, ...}}
A per-layer embed_tokens or shared_head.head equal to the target's own table is not kept (the
drafter uses the target's array: DeepSeek-V3's checkpoint repeats both in its MTP layer).
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np

from specjax.config import ModelConfig
from specjax.convert.hf_files import LAYER_KEYS, NP_DTYPES, read_hf_config, read_tensors, safetensors_files, take_layer
from specjax.convert.moe import ROUTER, moe_hf_tensors
from specjax.convert.quantized import LAYER_LINEARS, QuantScheme, read_scheme, read_weight, swap_last
from specjax.convert.qwen35 import GATED_Q, join_gated_q, take_attention_layer
from specjax.drafters.mtp import layer_shapes

_SHOWN = 8


def _np_dtype(cfg: ModelConfig):
    return NP_DTYPES[cfg.dtype]


def _layer_keys() -> dict:
    return LAYER_KEYS


def block_shapes(cfg: ModelConfig, sparse: bool = False) -> dict:
    """Shapes of one decoder layer of the target ([in, out]): an MTP layer's block (with the MoE when `sparse`)."""
    return layer_shapes(cfg, sparse)["block"]


def fuse_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of an MTP layer's own params besides its block: embed_norm, hidden_norm, fc [2H, H], final_norm."""
    return {k: s for k, s in layer_shapes(cfg).items() if k != "block"}


def _layout_names(prefix: str, layout: str) -> dict[str, str]:
    """specjax fuse key -> checkpoint name for one layout."""
    if layout == "deepseek":
        return {"embed_norm": f"{prefix}enorm.weight", "hidden_norm": f"{prefix}hnorm.weight",
                "fc": f"{prefix}eh_proj.weight", "final_norm": f"{prefix}shared_head.norm.weight"}
    if layout == "mimo":
        return {"embed_norm": f"{prefix}token_layernorm.weight", "hidden_norm": f"{prefix}hidden_layernorm.weight",
                "fc": f"{prefix}input_proj.weight", "final_norm": f"{prefix}final_layernorm.weight"}
    return {"embed_norm": "mtp.pre_fc_norm_embedding.weight", "hidden_norm": "mtp.pre_fc_norm_hidden.weight",
            "fc": "mtp.fc.weight", "final_norm": "mtp.norm.weight"}


class _Reader:
    """Takes tensors by name with shape checks whose errors say what the target implies."""

    def __init__(self, tensors: dict[str, np.ndarray], cfg: ModelConfig, scheme: QuantScheme | None = None):
        self.tensors, self.cfg, self.used, self.scheme = tensors, cfg, set(), scheme
        self.dtype = _np_dtype(cfg)

    def take(self, name: str, shape: tuple[int, ...], transpose: bool, why: str, keep: bool = False) -> np.ndarray:
        """The tensor `name` as `shape` (transpose: stored [..., out, in], read [..., in, out]); stored quantized, a
        QuantizedWeight when `keep` (a linear the target keeps quantized too), else dequantized to the dtype."""
        stored_shape = swap_last(shape) if transpose else shape
        if self.scheme is not None:
            qw, names = read_weight(self.tensors, name, self.scheme, self.cfg.dtype)
            if qw is not None:
                if swap_last(qw.shape) != stored_shape:
                    raise ValueError(f"quantized MTP weight '{name}' has shape {list(swap_last(qw.shape))} but {why} "
                                     f"implies {list(stored_shape)}")
                self.used.update(names)
                if keep and transpose:
                    return qw
                w = np.asarray(qw.dequantize(self.dtype))
                return w if transpose else swap_last(w)
        if name not in self.tensors:
            raise ValueError(f"checkpoint lacks MTP tensor '{name}' (shape {stored_shape}, {why})")
        t = self.tensors[name]
        if t.shape != stored_shape:
            raise ValueError(f"MTP tensor '{name}' has shape {tuple(t.shape)} but {why} implies {stored_shape}")
        self.used.add(name)
        return np.asarray(swap_last(t) if transpose else t).astype(self.dtype)

    def fuse(self, names: dict[str, str]) -> dict[str, np.ndarray]:
        h = self.cfg.hidden_size
        why = {"fc": f"the target's hidden_size {h} (an MTP projection maps 2 x {h} -> {h})"}
        return {k: self.take(names[k], s, k == "fc", why.get(k, f"the target's hidden_size {h}"), keep=k == "fc")
                for k, s in fuse_shapes(self.cfg).items()}

    def block(self, prefix: str) -> dict[str, np.ndarray]:
        c = self.cfg
        why = (f"one decoder layer of the target (hidden {c.hidden_size}, {c.num_heads} heads x {c.head_dim}, "
               f"{c.num_kv_heads} kv heads, intermediate {c.intermediate_size}; specjax's MTP block is a dense layer "
               "of the target's family)")
        sparse = f"{prefix}{ROUTER}" in self.tensors
        if sparse and c.moe is None:
            raise ValueError(f"MTP block {prefix} has a router ('{prefix}{ROUTER}') but the target has no experts")
        if sparse:
            why = f"the target's MoE ({c.moe.num_experts} experts of {c.moe.expert_size}, shared {c.moe.shared_size})"
        shapes = block_shapes(c, sparse)

        def take(name, shape, tr):  # the block's linears kept quantized as the target's layers' are
            return self.take(name, shape, tr, why, keep=re.fullmatch(LAYER_LINEARS, name[len(prefix):]) is not None)

        if c.attn_output_gate:  # Qwen3.5: the gated attention layer's q_proj is split into wq and wg
            return take_attention_layer(take, prefix, shapes, c, self.tensors)
        return take_layer(take, self.tensors, prefix, shapes)

    def optional_table(self, name: str, same_as: str | None, transpose: bool) -> np.ndarray | None:
        """An optional [V, H] table; None (use the target's) when absent or equal to `same_as`."""
        if name not in self.tensors:
            return None
        v, h = self.cfg.vocab_size, self.cfg.hidden_size
        t = self.tensors[name]
        if t.ndim != 2 or t.shape[1] != h or t.shape[0] != v:
            raise ValueError(f"MTP tensor '{name}' has shape {tuple(t.shape)} but the target's vocabulary has {v} "
                             f"tokens and its hidden_size is {h}: expected ({v}, {h})")
        self.used.add(name)
        if same_as is not None and same_as in self.tensors and np.array_equal(t, self.tensors[same_as]):
            return None
        return np.asarray(t.T if transpose else t).astype(self.dtype)


_DEEPSEEK_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_QWEN_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")
_MIMO_LAYER = re.compile(r"model\.mtp_layers\.(\d+)\.")
MIMO_PREFIX = "model.mtp_layers."


def read_mtp(tensors: dict[str, np.ndarray], names: list[str], cfg: ModelConfig, hf: dict,
             activation_quant: bool = True) -> dict:
    """The stored MTP params (module docstring) from the checkpoint's MTP tensor `names`.

    ValueError naming the tensor for a missing or mis-shaped one, for MTP tensors specjax does not
    know (an MoE or MLA block, say), and for a layer count that disagrees with config.json.
    """
    reader = _Reader(tensors, cfg, read_scheme(hf, activation_quant))
    qwen = [n for n in names if n.startswith("mtp.")]
    mimo = [n for n in names if n.startswith(MIMO_PREFIX)]
    deepseek = [n for n in names if not n.startswith(("mtp.", MIMO_PREFIX))]
    if mimo and cfg.family != "mimo":
        raise ValueError(f"MiMo-style MTP layers ({_shown(mimo)}) on a '{cfg.family}' target: they belong to a "
                         "MiMoForCausalLM checkpoint (config.json architectures)")
    if cfg.family == "mimo" and (qwen or deepseek):
        raise ValueError(f"a MiMo target's MTP layers are model.mtp_layers.*; this checkpoint has "
                         f"{_shown(qwen + deepseek)}")
    if mimo:
        indices = sorted({int(m.group(1)) for n in mimo if (m := _MIMO_LAYER.match(n))})
        if indices != list(range(len(indices))) or not indices:
            raise ValueError(f"the checkpoint's MiMo MTP layers are model.mtp_layers.{indices}; expected "
                             "model.mtp_layers.0, 1, ...")
        stored = {"layers": {}}
        for j in indices:
            prefix = f"{MIMO_PREFIX}{j}."
            layer = reader.fuse(_layout_names(prefix, "mimo"))
            layer["block"] = reader.block(prefix)
            stored["layers"][str(j)] = layer
        count, count_keys = len(indices), ("num_nextn_predict_layers",)
    elif qwen and deepseek:
        raise ValueError(f"checkpoint mixes the DeepSeek-V3 MTP layout ({_shown(deepseek)}) with the Qwen3-Next one "
                         f"({_shown(qwen)}); a model carries one")
    elif deepseek:
        indices = sorted({int(m.group(1)) for n in deepseek if (m := _DEEPSEEK_LAYER.match(n))})
        count_keys = ("num_nextn_predict_layers",)
        expected = list(range(cfg.num_layers, cfg.num_layers + len(indices)))
        if indices != expected:
            raise ValueError(f"the checkpoint's MTP layers are model.layers.{indices}; DeepSeek-style MTP layers "
                             f"follow the target's {cfg.num_layers} layers as model.layers.{expected}")
        stored = {"layers": {}}
        for j, i in enumerate(indices):
            prefix = f"model.layers.{i}."
            layer = reader.fuse(_layout_names(prefix, "deepseek"))
            layer["block"] = reader.block(prefix)
            head_same = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            head = reader.optional_table(f"{prefix}shared_head.head.weight", head_same, transpose=True)
            if head is not None:
                layer["lm_head"] = head
            embed = reader.optional_table(f"{prefix}embed_tokens.weight", "model.embed_tokens.weight", transpose=False)
            if embed is not None:
                layer["embed"] = embed
            stored["layers"][str(j)] = layer
        count = len(indices)
    else:
        indices = sorted({int(m.group(1)) for n in qwen if (m := _QWEN_LAYER.match(n))})
        count_keys = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
        if indices != list(range(len(indices))) or not indices:
            raise ValueError(f"the checkpoint's Qwen3-Next-style MTP layers are mtp.layers.{indices}; expected "
                             "mtp.layers.0, 1, ... (at least one)")
        stored = reader.fuse(_layout_names("mtp.", "qwen3_next"))
        embed = reader.optional_table("mtp.embed_tokens.weight", _target_embed(tensors), transpose=False)
        if embed is not None:  # mtp_use_dedicated_embeddings
            stored["embed"] = embed
        stored["layers"] = {str(j): {"block": reader.block(f"mtp.layers.{j}.")} for j in indices}
        count = len(indices)
    for key in count_keys:
        if hf.get(key) is not None:
            if hf[key] != count:
                raise ValueError(f"config.json '{key}' is {hf[key]} but the checkpoint has {count} MTP layer(s)")
            break
    leftover = sorted(set(names) - reader.used)
    if leftover:
        raise ValueError(f"checkpoint has {len(leftover)} MTP tensor(s) specjax does not know: {_shown(leftover)}; "
                         "specjax's MTP block is a full-attention decoder layer of the target's family (with the "
                         "target's experts on an MoE target; no MLA), and it refuses to drop weights")
    return stored


def _target_embed(tensors: dict[str, np.ndarray]) -> str:
    """The target's embedding name in either Qwen3.5 layout."""
    nested = "model.language_model.embed_tokens.weight"
    return nested if nested in tensors else "model.embed_tokens.weight"


def check_stored(stored: dict, cfg: ModelConfig) -> None:
    """Shapes of stored MTP params (e.g. a converted checkpoint) against the target's config."""
    h, v = cfg.hidden_size, cfg.vocab_size
    fuse_sets = [stored] if "fc" in stored else list(stored["layers"].values())
    for fs in fuse_sets:
        for k, s in fuse_shapes(cfg).items():
            if tuple(fs[k].shape) != s:
                raise ValueError(f"MTP param '{k}' has shape {tuple(fs[k].shape)} but the target's hidden_size {h} "
                                 f"implies {s}")
    for j, layer in stored["layers"].items():
        want = jax.tree.leaves_with_path(block_shapes(cfg, "moe" in layer["block"]),
                                         is_leaf=lambda x: isinstance(x, tuple))
        for path, s in want:
            got = layer["block"]
            for key in path:
                got = got.get(key.key) if isinstance(got, dict) else None
            if got is None or tuple(got.shape) != s:
                name = "/".join(str(key.key) for key in path)
                raise ValueError(f"MTP layer {j} block param '{name}' has shape "
                                 f"{tuple(got.shape) if got is not None else 'nothing'} but a layer of the target "
                                 f"implies {s}")
        for k, s in (("embed", (v, h)), ("lm_head", (h, v))):
            if k in layer and tuple(layer[k].shape) != s:
                raise ValueError(f"MTP layer {j} '{k}' has shape {tuple(layer[k].shape)} but the target's vocabulary "
                                 f"({v}) and hidden_size ({h}) imply {s}")


def _shown(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


# ---- MTP-only directories: a head trained (or kept) apart from its target ----------------------------------
#
# config.json is the target's, plus the layer count and MTP_ONLY_KEY: {"target": a path to the
# target it was trained for (informative; relative to the directory), "layout": ...};
# model.safetensors holds only the MTP tensors under the names they would have inside the
# target's checkpoint (DeepSeek-V3: model.layers.{L + j}.*; Qwen3-Next: mtp.*). Appending them to
# the target's safetensors (and the layer count to its config.json) gives a target carrying MTP
# layers that `specjax.convert` / `specjax.load` read. The embedding and lm_head are the target's.

MTP_ONLY_KEY = "specjax_mtp_only"
_SAME_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
               "head_dim", "family", "qkv_bias", "qk_norm", "tie_word_embeddings", "rope", "rms_norm_eps")


def mtp_hf_tensors(stored: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The checkpoint tensors (torch [out, in]) of stored MTP params: the inverse of `read_mtp`."""
    keys, out = _layer_keys(), {}

    def put_block(prefix: str, block: dict) -> None:
        for k, v in block.items():
            if k == "moe":  # Qwen3.5-MoE publishes fused experts, Qwen3-Next one tensor per expert
                out.update(moe_hf_tensors(v, prefix, fused=cfg.family == "qwen3_5_moe"))
                continue
            if k == "wg":
                continue
            if k == "wq" and "wg" in block:  # Qwen3.5: query and gate back into one q_proj, per head
                out[prefix + GATED_Q] = join_gated_q(np.asarray(v), np.asarray(block["wg"]), cfg.num_heads,
                                                     cfg.head_dim)
                continue
            name, transpose = keys[k]
            out[prefix + name] = np.asarray(v).T if transpose else np.asarray(v)

    def put_fuse(names: dict[str, str], fs: dict) -> None:
        for k in fuse_shapes(cfg):
            out[names[k]] = np.asarray(fs[k]).T if k == "fc" else np.asarray(fs[k])

    if "fc" in stored:  # qwen3_next: shared fuse modules
        put_fuse(_layout_names("mtp.", "qwen3_next"), stored)
        if "embed" in stored:
            out["mtp.embed_tokens.weight"] = np.asarray(stored["embed"])
        for j, layer in stored["layers"].items():
            put_block(f"mtp.layers.{j}.", layer["block"])
        return out
    mimo = cfg.family == "mimo"
    for j, layer in stored["layers"].items():
        prefix = f"{MIMO_PREFIX}{j}." if mimo else f"model.layers.{cfg.num_layers + int(j)}."
        put_fuse(_layout_names(prefix, "mimo" if mimo else "deepseek"), layer)
        put_block(prefix, layer["block"])
        if "lm_head" in layer:
            out[prefix + "shared_head.head.weight"] = np.asarray(layer["lm_head"]).T
        if "embed" in layer:
            out[prefix + "embed_tokens.weight"] = np.asarray(layer["embed"])
    return out


def mtp_only_config(target_hf: dict, stored: dict, target_ref: str, dtype: str) -> dict:
    """config.json of an MTP-only directory (see above) for a target whose config.json is target_hf."""
    qwen = "fc" in stored
    config = {k: v for k, v in target_hf.items() if k != "dtype"}
    config["mtp_num_hidden_layers" if qwen else "num_nextn_predict_layers"] = len(stored["layers"])
    config["torch_dtype"] = dtype
    layout = "qwen3_next" if qwen else ("mimo" if target_hf.get("model_type") == "mimo" else "deepseek")
    config[MTP_ONLY_KEY] = {"target": target_ref, "layout": layout,
                            "note": "MTP tensors only (the names they have inside the target's checkpoint); the "
                                    "embedding and lm_head are the target's: specjax.load_drafter(this dir, target)"}
    return config


def is_mtp_only(hf: dict) -> bool:
    return isinstance(hf.get(MTP_ONLY_KEY), dict)


def read_mtp_only_dir(path, cfg: ModelConfig) -> dict:
    """The stored MTP params of an MTP-only directory, checked against the target's config `cfg`.

    ValueError naming both sides when the directory was made for a target of another shape.
    """
    path = Path(path)
    hf = read_hf_config(path)
    mine = ModelConfig.from_hf(hf)
    differ = [f"{k} {getattr(mine, k)!r} vs the target's {getattr(cfg, k)!r}" for k in _SAME_SHAPE
              if getattr(mine, k) != getattr(cfg, k)]
    if differ:
        ref = hf[MTP_ONLY_KEY].get("target")
        raise ValueError(f"the MTP head in {path} was made for another target (trained for {ref!r}): "
                         + "; ".join(differ))
    tensors = read_tensors(safetensors_files(path))
    return read_mtp(tensors, sorted(tensors), cfg, hf)
