"""Quantized Hugging Face checkpoints: which format config.json declares, and each linear weight read as it is stored.

The format comes from config.json's `quantization_config` (or the older `compression_config`); whether a given
weight is quantized, and how, is decided per tensor by its dtype and the tensors stored beside it, never by a list
of names: tools disagree on which layers they quantize. A module the config's `ignore` / `modules_to_not_convert`
names (`re:` patterns included) must be stored plain.

  block FP8 (quant_method "fp8", DeepSeek-V3, Qwen FP8): `weight` F8_E4M3 [O, I] + `weight_scale_inv`
      [ceil(O / bo), ceil(I / bi)] for `weight_block_size` [bo, bi] (last blocks ragged); scale f32 / bf16 / f16.
  compressed-tensors (quant_method "compressed-tensors"): `weight` F8_E4M3 or I8 + `weight_scale` per channel
      [O, 1], per tensor, per group [O, I / g] or per block, optional `weight_zero_point`; "pack-quantized":
      `weight_packed` int32 [O, I * bits / 32] (a little-endian bit stream along the input, values offset by
      2^(bits-1)), `weight_shape`, `weight_scale`, optional packed `weight_zero_point` and `weight_g_idx`.
  fused MoE experts (block FP8 only; transformers' FP8Experts, transformers/integrations/finegrained_fp8.py): per
      layer `mlp.experts.gate_up_proj` F8_E4M3 [E, 2I, D] (gate rows, then up) and `mlp.experts.down_proj`
      [E, D, I], each [E, out, in], with `<name>_scale_inv` [E, ceil(out / bo), ceil(in / bi)] beside it (its
      Fp8Quantize names a non-`.weight` tensor's scale `<name>_scale_inv`; FP8Experts allocates the scales so, and
      its _apply_gate takes the first I outputs as the gate). vLLM's Qwen3.5 MTP loader (vllm-project/vllm
      vllm/model_executor/models/qwen3_5_mtp.py load_weights) read the same names: gate_up_proj split in two along
      its rows (gate, then up), the `_scale_inv` beside it mapped onto their w13_weight_scale_inv.
  AWQ (GEMM): `qweight` / `qzeros` int32 packed along the output in the nibble order 0, 2, 4, 6, 1, 3, 5, 7 and
      `scales` [I / g, O]: w = (q - z) * s.
  GPTQ: `qweight` int32 [I / 8, O] packed along the input, `qzeros` packed along the output (v1 stores zero - 1,
      `checkpoint_format` "gptq_v2" the zero itself), `scales` [groups, O], `g_idx` [I] (act-order).

Activation quantization (W8A8) is read too, per linear, into the weight's `activations` spec (quant/activations.py
defines it and cites each producer): compressed-tensors' `input_activations` of the module's config group (8-bit
int or float, symmetric; dynamic per token, per tensor or per group, or static per tensor with the module's
`input_scale` beside it), and block FP8's `activation_scheme: "dynamic"` (FP8 per token per group of the weight
block's input size, vLLM's per_token_group_quant_fp8; transformers' FineGrainedFP8Config defaults the key to
"dynamic"). Anything else declared for activations is refused by name unless the load turns activation
quantization off (`QuantScheme.activation_quant`; specjax.load's `activation_quant=False`: the weights alone).
Everything is read into `QuantizedWeight` (quant/qarray.py) in specjax's [in, out] layout.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Callable

import ml_dtypes
import numpy as np

from specjax.quant.activations import Activations
from specjax.quant.qarray import QuantizedWeight, is_quantized, take_columns

SUPPORTED = ("fp8", "compressed-tensors", "awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds output column AWQ_ORDER[k] of its 8
# The tensors a quantized linear module may store beside (or instead of) its `weight`.
SUFFIXES = ("weight", "weight_scale_inv", "weight_scale", "weight_zero_point", "weight_packed", "weight_shape",
            "weight_g_idx", "input_scale", "qweight", "qzeros", "scales", "g_idx")
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
# A decoder layer's linears that stay quantized when stored so (models/decoder.py and models/moe.py multiply them
# with `x @ w`), named inside the layer: attention (Qwen3.5's gated q_proj is split per head, convert/qwen35.py),
# dense MLP, an MoE's experts (one module each, or fused [E, ...] tensors) and shared expert, a hybrid's linear_attn
# projections (Qwen3.5's in_proj_qkv / _z / _b / _a and out_proj, Qwen3-Next's fused in_proj_qkvz / _ba). Any other
# quantized weight (the lm_head, the embedding, a router) is dequantized at load.
LAYER_LINEARS = (r"(?:(?:self_attn\.[qkvo]_proj|linear_attn\.(?:in_proj_\w+|out_proj)|"
                 r"mlp\.(?:experts\.\d+\.|shared_expert\.)?(?:gate|up|down)_proj)\.weight|"
                 r"mlp\.experts\.(?:gate_up|down)_proj)")
logger = logging.getLogger("specjax")


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """What config.json declares: the method, the modules left unquantized, and the method's own fields;
    activation_quant=False reads the weights alone, whatever the config says of activations."""
    method: str
    ignore: tuple[str, ...]
    config: dict = dataclasses.field(hash=False, compare=False)
    activation_quant: bool = True

    def ignored(self, module: str) -> bool:
        """True when the config says `module` (e.g. 'model.layers.0.mlp.down_proj') is left unquantized."""
        for p in self.ignore:
            if p.startswith("re:"):
                if re.match(p[3:], module):
                    return True
            elif module == p or module.endswith("." + p) or module.startswith(p + ".") or f".{p}." in module:
                return True
        return False

    def group_weights(self, module: str) -> dict:
        """compressed-tensors: the `weights` arguments of the config group whose targets cover this linear."""
        return self.group(module).get("weights") or {}

    def group(self, module: str) -> dict:
        """compressed-tensors: the config group whose targets cover this linear."""
        for name, group in self.config.get("config_groups", {}).items():
            targets = group.get("targets", [])
            if any(t == "Linear" or (t.startswith("re:") and re.match(t[3:], module)) or module.endswith(t)
                   for t in targets):
                return group
        raise ValueError(f"no compressed-tensors config group targets '{module}' (config_groups "
                         f"{list(self.config.get('config_groups', {}))}), yet it is stored quantized")


def bytes_per_weight(scheme: QuantScheme) -> float:
    """Device bytes per element of a quantized linear weight as specjax holds it: the values at their width
    (int4 at half a byte: packed on an accelerator; the CPU stores a byte each) plus the scales (and int8 zero
    points) spread over the elements they cover. Assumed where config.json does not say: FP8 block scales in f32,
    compressed-tensors scales in bf16; per-channel scales count as nothing (one per output row of thousands)."""
    qc = scheme.config
    if scheme.method == "fp8":
        block = qc.get("weight_block_size")
        return 1 + (4 / (block[0] * block[1]) if block else 0)
    if scheme.method in ("awq", "gptq"):
        bits, g = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
        return bits / 8 + (2 + 1) / g if g > 0 else bits / 8
    w = next(iter(qc.get("config_groups", {}).values()), {}).get("weights") or {}
    per_scale = {"group": w.get("group_size") or 0, "block": math.prod(w.get("block_structure") or (0,))}.get(
        w.get("strategy"), 0)
    return int(w.get("num_bits", 8)) / 8 + ((2 + (0 if w.get("symmetric", True) else 1)) / per_scale
                                            if per_scale else 0)


def read_scheme(hf_cfg: dict, activation_quant: bool = True) -> QuantScheme | None:
    """The quantization config.json declares (None: a plain checkpoint); an unsupported method is refused by name.
    activation_quant=False: W8A8 activations are not read (the weights alone)."""
    qc = hf_cfg.get("quantization_config") or hf_cfg.get("compression_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in SUPPORTED:
        raise ValueError(f"config.json quantization_config has quant_method {method!r}, which specjax does not read "
                         f"(it reads {', '.join(SUPPORTED)}); dequantize the checkpoint to bf16 first")
    if method == "compressed-tensors":
        formats = {qc.get("format")} | {g.get("format") for g in qc.get("config_groups", {}).values()}
        known = {None, "float-quantized", "int-quantized", "naive-quantized", "pack-quantized"}
        if formats - known:
            raise ValueError(f"config.json compressed-tensors format {sorted(formats - known, key=str)} is not "
                             f"read by specjax (it reads {sorted(known - {None})}, not NVFP4 / MXFP4 / sparse ones)")
        for name, group in qc.get("config_groups", {}).items():
            w = group.get("weights") or {}
            if (w.get("type"), w.get("num_bits")) not in (("float", 8), ("int", 8), ("int", 4)):
                raise ValueError(f"compressed-tensors config group '{name}' quantizes weights to "
                                 f"{w.get('type')}{w.get('num_bits')}; specjax reads float8, int8 and int4")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {qc.get('version')!r} is not read by specjax (it reads the GEMM packing)")
    if method in ("awq", "gptq") and qc.get("bits", 4) not in ((4,) if method == "awq" else (4, 8)):
        raise ValueError(f"{method} with bits={qc.get('bits')} is not read by specjax (AWQ: 4; GPTQ: 4 or 8)")
    ignore = qc.get("ignore") or qc.get("modules_to_not_convert") or ()
    return QuantScheme(method, tuple(ignore), qc, activation_quant)


def swap_last(x):
    """torch's [..., out, in] <-> specjax's [..., in, out]: the last two axes swapped (a shape tuple's too); a
    matrix's transpose, an [E, ...] expert tensor's per expert."""
    if isinstance(x, tuple):
        return x[:-2] + x[-2:][::-1]
    return x if x.ndim < 2 else x.transpose(*range(x.ndim - 2), x.ndim - 1, x.ndim - 2)


def read_weight(tensors, name: str, scheme: QuantScheme, compute_dtype: str) -> tuple[QuantizedWeight | None, list]:
    """The stored weight `name` read quantized ([..., in, out]) with the tensor names it used, or (None, []) when it is
    stored plain: a linear's `<module>.weight` (read_linear) or a fused expert tensor (read_fused_experts)."""
    if name.endswith(".weight"):
        return read_linear(tensors, name[: -len(".weight")], scheme, compute_dtype)
    return read_fused_experts(tensors, name, scheme, compute_dtype)


def read_fused_experts(tensors, name: str, scheme: QuantScheme, compute_dtype: str
                       ) -> tuple[QuantizedWeight | None, list]:
    """A fused expert tensor `name` [E, out, in] in block FP8 (module docstring) as a QuantizedWeight [E, in, out],
    scales [E, ceil(in / bi), ceil(out / bo)]; (None, []) when it is stored plain without a scale. Decided by the
    tensor's dtype and the `<name>_scale_inv` beside it."""
    scale_name = f"{name}_scale_inv"
    if name not in tensors:
        return None, []
    values = tensors[name]
    quantized = np.dtype(values.dtype) in (FP8, np.dtype(np.int8))
    if not quantized and scale_name not in tensors:
        return None, []
    if not quantized:
        raise ValueError(f"tensor '{name}' is stored as {np.dtype(values.dtype).name} yet has '{scale_name}' beside "
                         "it: specjax expects F8_E4M3 values with a block scale")
    if scale_name not in tensors:
        raise ValueError(f"tensor '{name}' is stored as {np.dtype(values.dtype).name} but has no '{scale_name}' "
                         "beside it: the checkpoint is incomplete (fused experts are read in block FP8: values "
                         "plus <name>_scale_inv)")
    if scheme.method != "fp8" or np.dtype(values.dtype) != FP8:
        raise ValueError(f"tensor '{name}' is a fused expert tensor quantized as {np.dtype(values.dtype).name} under "
                         f"quant_method {scheme.method!r}; specjax reads fused experts in block FP8 (quant_method "
                         "'fp8', F8_E4M3 values) only, and other formats one module per expert")
    if values.ndim != 3:
        raise ValueError(f"tensor '{name}' is quantized with shape {list(values.shape)}; fused experts are [experts, "
                         "out, in]")
    e, o, i = values.shape
    bo, bi = scheme.config.get("weight_block_size") or (o, i)
    scale = np.asarray(tensors[scale_name])
    check_shape(scale_name, scale, (e, math.ceil(o / bo), math.ceil(i / bi)),
                f"{e} fused experts of [{o}, {i}] (out, in) in blocks of [{bo}, {bi}]")
    module = name.rsplit(".", 1)[0]
    if scheme.ignored(module):
        raise ValueError(f"'{module}' is stored quantized but config.json's ignore / modules_to_not_convert lists "
                         "it: the config and the checkpoint disagree")
    qw = QuantizedWeight(swap_last(np.asarray(values)), swap_last(scale), block=(bi, bo), fmt=f"fp8 block [{bo}, {bi}]",
                         compute_dtype=compute_dtype)
    return with_activations(qw, {}, module, scheme), [name, scale_name]


def split_columns(w: QuantizedWeight | np.ndarray, split: Callable[[np.ndarray], tuple], name: str) -> tuple:
    """`split` (a split of an [O, D] weight into [D, n] parts by output rows, e.g. convert/qwen35.split_gated_q's per
    head) applied to `w` [..., D, O] kept quantized: each part's columns taken with their scales
    (quant/qarray.take_columns), found by splitting the column indices themselves. A part whose columns cut a scale
    block is dequantized to the weight's compute dtype (logged, naming the tensor); a plain `w` is split as it is."""
    if not is_quantized(w):
        return tuple(split(np.asarray(w).T))
    parts = []
    for part in split(np.arange(w.shape[-1])[:, None]):
        kept = take_columns(w, part[0])
        if kept is None:
            logger.warning("'%s' (%s): splitting it cuts a scale block of %d output columns (a part of %d columns "
                           "starts or ends inside one), so that part is dequantized at load", name, w.fmt,
                           w.block[1], len(part[0]))
            kept = np.asarray(w.dequantize())[..., part[0]]
        parts.append(kept)
    return tuple(parts)


def read_linear(tensors, module: str, scheme: QuantScheme, compute_dtype: str) -> tuple[QuantizedWeight | None, list]:
    """(the linear `module` as a QuantizedWeight [I, O], the tensor names it used), or (None, []) when its weight
    is stored plain. Shapes are checked against each other; the caller checks [I, O] against the config."""
    got = {s: tensors[f"{module}.{s}"] for s in SUFFIXES if f"{module}.{s}" in tensors}
    weight = got.get("weight")
    if weight is not None and weight.ndim != 2 and len(got) > 1:
        raise ValueError(f"tensor '{module}.weight' is quantized with {weight.ndim} dimensions {list(weight.shape)}: "
                         "specjax reads quantized linear weights [out, in], and fused experts as "
                         "mlp.experts.gate_up_proj / down_proj with <name>_scale_inv (block FP8)")
    if "qweight" in got:
        if scheme.method not in ("awq", "gptq"):
            raise ValueError(f"tensor '{module}.qweight' is AWQ/GPTQ-packed but config.json declares "
                             f"{scheme.method!r}")
        qw = (read_awq if scheme.method == "awq" else read_gptq)(got, module, scheme, compute_dtype)
    elif "weight_packed" in got:
        qw = read_packed(got, module, scheme, compute_dtype)
    elif weight is not None and (np.dtype(weight.dtype) == FP8 or np.dtype(weight.dtype) == np.int8):
        if "weight_scale_inv" in got:
            qw = read_block_fp8(got, module, scheme, compute_dtype)
        elif "weight_scale" in got:
            qw = read_scaled(got, module, scheme, compute_dtype)
        else:
            raise ValueError(f"tensor '{module}.weight' is stored as {np.dtype(weight.dtype).name} but has no "
                             f"'{module}.weight_scale_inv' or '{module}.weight_scale' beside it: the checkpoint "
                             "is incomplete")
    elif any(s in got for s in ("weight_scale_inv", "weight_scale")):
        raise ValueError(f"tensor '{module}.weight' is stored as {np.dtype(weight.dtype).name} yet has a scale "
                         "beside it: specjax expects a quantized weight (F8_E4M3 or I8) with a scale")
    else:
        return None, []
    if scheme.ignored(module):
        raise ValueError(f"'{module}' is stored quantized but config.json's ignore / modules_to_not_convert lists "
                         "it: the config and the checkpoint disagree")
    return with_activations(qw, got, module, scheme), [f"{module}.{s}" for s in got]


def with_activations(qw: QuantizedWeight, got: dict, module: str, scheme: QuantScheme) -> QuantizedWeight:
    """`qw` with the activation quantization the config declares for `module` (module docstring), and a static
    spec's `input_scale` from `got`; `qw` itself when none is declared or scheme.activation_quant is False."""
    spec = activation_spec(scheme, module) if scheme.activation_quant else None
    if spec is None:
        return qw
    input_scale = None
    if spec.static:
        if "input_scale" not in got:
            raise ValueError(f"'{module}' has static activation quantization ({spec.name}) but no "
                             f"'{module}.input_scale' beside its weight: the checkpoint is incomplete")
        input_scale = np.asarray(got["input_scale"], np.float32)
        check_shape(f"{module}.input_scale", input_scale.reshape(-1), (1,), "a per-tensor activation scale")
        input_scale = input_scale.reshape(())
    return dataclasses.replace(qw, activations=spec, input_scale=input_scale)


def activation_spec(scheme: QuantScheme, module: str) -> Activations | None:
    """The activation quantization config.json declares for the quantized linear `module`, None for none; what
    specjax does not compute is refused, naming the field and the way out (activation_quant=False)."""
    off = "; load with activation_quant=False to run the weights alone (weight-only numbers)"
    if scheme.method == "fp8":
        how = scheme.config.get("activation_scheme", "dynamic")  # transformers' FineGrainedFP8Config default
        block = scheme.config.get("weight_block_size")
        if how != "dynamic" or not block:
            raise ValueError(f"block FP8 with activation_scheme {how!r} and weight_block_size {block} is not "
                             f"computed by specjax (it quantizes activations for 'dynamic' with a block size){off}")
        return Activations("fp8", "group", group=int(block[1]), divisor=448.0, min_amax=1e-10)
    if scheme.method != "compressed-tensors":
        return None
    group = scheme.group(module)
    act = group.get("input_activations")
    if group.get("output_activations"):
        raise ValueError(f"compressed-tensors output_activations (config group targeting '{module}') are not "
                         f"computed by specjax{off}")
    if not act:
        return None
    kind = {("int", 8): "int8", ("float", 8): "fp8"}.get((act.get("type"), act.get("num_bits")))
    strategy, dynamic = act.get("strategy"), act.get("dynamic")
    if (kind is None or not act.get("symmetric", True) or act.get("scale_dtype") is not None
            or strategy not in ("token", "tensor", "group") or dynamic not in (True, False)
            or (not dynamic and strategy != "tensor")):
        raise ValueError(f"compressed-tensors input_activations {act} (config group targeting '{module}') are not "
                         "computed by specjax (it computes symmetric int8 / float8, dynamic per token, tensor or "
                         f"group, or static per tensor){off}")
    return Activations(kind, strategy, group=int(act.get("group_size") or 0) if strategy == "group" else 0,
                       static=not dynamic, divisor=127.5 if kind == "int8" else 448.0)


def check_shape(name: str, array, want: tuple[int, ...], why: str) -> None:
    if tuple(array.shape) != tuple(want):
        raise ValueError(f"tensor '{name}' has shape {list(array.shape)}; {why} needs {list(want)}")


def read_block_fp8(got: dict, module: str, scheme: QuantScheme, compute_dtype: str) -> QuantizedWeight:
    """Block FP8: w[o, i] = q[o, i] * weight_scale_inv[o // bo, i // bi]."""
    q = np.asarray(got["weight"])
    o, i = q.shape
    bo, bi = scheme.config.get("weight_block_size") or (o, i)
    scale = np.asarray(got["weight_scale_inv"])
    check_shape(f"{module}.weight_scale_inv", scale, (math.ceil(o / bo), math.ceil(i / bi)),
                f"a weight of shape [{o}, {i}] in blocks of [{bo}, {bi}]")
    return QuantizedWeight(q.T, scale.T, block=(bi, bo), fmt=f"fp8 block [{bo}, {bi}]", compute_dtype=compute_dtype)


def scale_grid(weights: dict, o: int, i: int, module: str) -> tuple[tuple[int, int], str]:
    """compressed-tensors: the (bo, bi) block a `weights` strategy gives one scale, and its name."""
    strategy = weights.get("strategy", "channel")
    if strategy == "channel":
        return (1, i), "per channel"
    if strategy == "tensor":
        return (o, i), "per tensor"
    if strategy == "group":
        g = weights.get("group_size")
        if not isinstance(g, int) or g < 1 or i % g:
            raise ValueError(f"'{module}': group_size {g} does not divide its {i} input features")
        return (1, g), f"group {g}"
    if strategy == "block":
        bo, bi = weights.get("block_structure") or (0, 0)
        if bo < 1 or bi < 1:
            raise ValueError(f"'{module}': block strategy without a block_structure [rows, cols]")
        return (bo, bi), f"block [{bo}, {bi}]"
    raise ValueError(f"'{module}': compressed-tensors strategy {strategy!r} is not read by specjax")


def read_scaled(got: dict, module: str, scheme: QuantScheme, compute_dtype: str) -> QuantizedWeight:
    """compressed-tensors FP8 / INT8 (float- / int- / naive-quantized): w = (q - zero) * weight_scale by grid."""
    q = np.asarray(got["weight"])
    o, i = q.shape
    weights = scheme.group_weights(module) if scheme.method == "compressed-tensors" else {}
    (bo, bi), grid = scale_grid(weights, o, i, module)
    shape = (math.ceil(o / bo), math.ceil(i / bi))
    scale = np.asarray(got["weight_scale"])
    if grid == "per tensor" and scale.size == 1:
        scale = scale.reshape(1, 1)
    check_shape(f"{module}.weight_scale", scale, shape, f"a weight of shape [{o}, {i}] scaled {grid}")
    zero = zero_point(got, module, shape, q.shape, None)
    kind = "fp8" if q.dtype == FP8 else "int8"
    return QuantizedWeight(q.T, scale.T, None if zero is None else zero.T, block=(bi, bo), fmt=f"{kind} {grid}",
                           compute_dtype=compute_dtype)


def zero_point(got: dict, module: str, shape, weight_shape, bits: int | None) -> np.ndarray | None:
    """The stored zero point [O / bo, I / bi] as int8 (unpacked along the output for pack-quantized), None when
    absent or all zero (symmetric)."""
    if "weight_zero_point" not in got:
        return None
    z = np.asarray(got["weight_zero_point"])
    if bits is not None and z.dtype == np.int32:
        z = unpack_int32(z, bits, shape[0], axis=0, signed=True)
    check_shape(f"{module}.weight_zero_point", z, shape, f"a weight of shape {list(weight_shape)} with scales "
                f"{list(shape)}")
    return None if not np.any(z) else z.astype(np.int8)


def unpack_int32(packed: np.ndarray, bits: int, n: int, axis: int, signed: bool = False,
                 order: tuple[int, ...] | None = None) -> np.ndarray:
    """`n` values of `bits` bits each along `axis` from int32 words (value j at bits [bits*j, bits*(j+1)) of the
    little-endian stream; `order`: word k's value j is element order[j] of its group instead). signed: stored
    offset by 2^(bits-1) (compressed-tensors), returned as signed ints."""
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit packed weights are not read by specjax (4 and 8 are)")
    per = 32 // bits
    words = np.moveaxis(np.asarray(packed).astype(np.int64) & 0xFFFFFFFF, axis, -1)
    vals = (words[..., None] >> (bits * np.arange(per))) & ((1 << bits) - 1)  # [..., W, per]
    if order is not None:
        vals = vals[..., np.argsort(order)]
    vals = vals.reshape(*vals.shape[:-2], -1)
    if vals.shape[-1] < n:
        raise ValueError(f"{packed.shape[axis]} packed words hold {vals.shape[-1]} values, fewer than {n}")
    vals = vals[..., :n].astype(np.int16) - ((1 << (bits - 1)) if signed else 0)
    return np.moveaxis(vals, -1, axis).astype(np.int8 if signed or bits < 8 else np.uint8)


def as_int4(q: np.ndarray, bits: int) -> np.ndarray:
    """Values held at their width on device: int4 for 4-bit (signed range), else int8."""
    return q.astype(ml_dtypes.int4) if bits == 4 and q.min() >= -8 and q.max() <= 7 else q


def read_packed(got: dict, module: str, scheme: QuantScheme, compute_dtype: str) -> QuantizedWeight:
    """compressed-tensors pack-quantized INT4 / INT8: w = (q - zero) * scale[row's group], q unpacked from int32."""
    weights = scheme.group_weights(module)
    bits = int(weights.get("num_bits", 4))
    if "weight_shape" not in got:
        raise ValueError(f"'{module}.weight_packed' has no '{module}.weight_shape' beside it")
    o, i = (int(x) for x in np.asarray(got["weight_shape"]).reshape(-1))
    packed = np.asarray(got["weight_packed"])
    check_shape(f"{module}.weight_packed", packed, (o, math.ceil(i * bits / 32)),
                f"an [{o}, {i}] weight packed {32 // bits} values per int32")
    q = unpack_int32(packed, bits, i, axis=1, signed=True)
    (bo, bi), grid = scale_grid(weights, o, i, module)
    shape = (math.ceil(o / bo), math.ceil(i / bi))
    scale = np.asarray(got["weight_scale"])
    check_shape(f"{module}.weight_scale", scale, shape, f"a weight of shape [{o}, {i}] scaled {grid}")
    zero = zero_point(got, module, shape, (o, i), bits)
    g_idx = None
    if "weight_g_idx" in got:
        g_idx = np.asarray(got["weight_g_idx"]).astype(np.int32)
        check_shape(f"{module}.weight_g_idx", g_idx, (i,), f"a weight with {i} input features")
        if np.array_equal(g_idx, np.arange(i) // bi):
            g_idx = None
    return QuantizedWeight(as_int4(q, bits).T, scale.T, None if zero is None else zero.T, g_idx, block=(bi, bo),
                           fmt=f"int{bits} {grid}", compute_dtype=compute_dtype)


def read_awq(got: dict, module: str, scheme: QuantScheme, compute_dtype: str) -> QuantizedWeight:
    """AWQ GEMM: qweight [I, O / 8], qzeros [I / g, O / 8] (nibbles in AWQ_ORDER), scales [I / g, O]."""
    g = int(scheme.config.get("group_size", 128))
    qweight, scales = np.asarray(got["qweight"]), np.asarray(got.get("scales"))
    i, o = qweight.shape[0], scales.shape[-1] if scales.ndim == 2 else qweight.shape[1] * 8
    if i % g:
        raise ValueError(f"'{module}': AWQ group_size {g} does not divide its {i} input features")
    check_shape(f"{module}.qweight", qweight, (i, o // 8), f"an AWQ [{i}, {o}] weight")
    check_shape(f"{module}.scales", scales, (i // g, o), f"an AWQ [{i}, {o}] weight in groups of {g}")
    qzeros = np.asarray(got["qzeros"])
    check_shape(f"{module}.qzeros", qzeros, (i // g, o // 8), f"an AWQ [{i}, {o}] weight in groups of {g}")
    q = unpack_int32(qweight, 4, o, axis=1, order=AWQ_ORDER)
    zero = unpack_int32(qzeros, 4, o, axis=1, order=AWQ_ORDER)
    return QuantizedWeight(q.astype(ml_dtypes.uint4), scales, zero, block=(g, 1), fmt=f"awq int4 group {g}",
                           compute_dtype=compute_dtype)


def read_gptq(got: dict, module: str, scheme: QuantScheme, compute_dtype: str) -> QuantizedWeight:
    """GPTQ: qweight [I * bits / 32, O] packed along the input, qzeros [G, O * bits / 32] along the output,
    scales [G, O], g_idx [I]; v1 ("gptq") stores each zero point minus one."""
    bits = int(scheme.config.get("bits", 4))
    qweight, scales = np.asarray(got["qweight"]), np.asarray(got["scales"])
    o = qweight.shape[1]
    i = qweight.shape[0] * 32 // bits
    g = int(scheme.config.get("group_size", 128))
    g = i if g == -1 else g
    if i % g:
        raise ValueError(f"'{module}': GPTQ group_size {g} does not divide its {i} input features")
    check_shape(f"{module}.scales", scales, (i // g, o), f"a GPTQ [{i}, {o}] weight in groups of {g}")
    q = unpack_int32(qweight, bits, i, axis=0)
    zero = unpack_int32(np.asarray(got["qzeros"]), bits, o, axis=1).astype(np.int16)
    check_shape(f"{module}.qzeros", zero, (i // g, o), f"a GPTQ [{i}, {o}] weight in groups of {g} (unpacked)")
    if scheme.config.get("checkpoint_format", "gptq") != "gptq_v2":
        zero = zero + 1
    zero = zero.astype(np.int8 if bits == 4 else np.int16)  # 8-bit v1 zero points reach 256
    g_idx = None
    if "g_idx" in got:
        g_idx = np.asarray(got["g_idx"]).astype(np.int32)
        check_shape(f"{module}.g_idx", g_idx, (i,), f"a GPTQ weight with {i} input features")
        if np.array_equal(g_idx, np.arange(i) // g):
            g_idx = None
    q = q.astype(ml_dtypes.uint4) if bits == 4 else q.astype(np.uint8)
    return QuantizedWeight(q, scales, zero, g_idx, block=(g, 1), fmt=f"gptq int{bits} group {g}",
                           compute_dtype=compute_dtype)


def uniform_layers(per_layer: list[dict], dtype) -> list[dict]:
    """Per-layer weight dicts (nested: an MoE's `moe` dict) made stackable: each weight by `uniform_weights`."""
    out = [dict(layer) for layer in per_layer]
    for k in per_layer[0]:
        values = [layer[k] for layer in per_layer]
        fixed = uniform_layers(values, dtype) if isinstance(values[0], dict) else uniform_weights(values, dtype)
        for layer, v in zip(out, fixed):
            layer[k] = v
    return out


def uniform_weights(values: list, dtype) -> list:
    """Weights to stack (one per layer, or one per expert) made stackable: a weight quantized in some entries only
    (a tool that left a layer or an expert plain), or in different formats, is dequantized to `dtype` in every one."""
    quantized = [isinstance(v, QuantizedWeight) for v in values]
    if any(quantized) and (not all(quantized) or len({(v.block, v.fmt, v.q.dtype, v.zero is None, v.g_idx is None,
                                                       v.activations, v.input_scale is None) for v in values}) > 1):
        return [v.dequantize(dtype) if isinstance(v, QuantizedWeight) else v for v in values]
    return list(values)
