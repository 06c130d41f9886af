"""Tiny quantized Hugging Face checkpoints, written at test time in each format by the format's own code.

A tiny random model from tests/hf_tiny.py is saved, then its decoder layers' linear weights are replaced by their
quantized form: block FP8 by transformers' own `Fp8Quantize` (what `FineGrainedFP8Config` saves),
compressed-tensors by the compressed-tensors package's quantize and compressors. The reference each test compares
against is the same format's dequantization: transformers loading the directory on the CPU (which dequantizes FP8
and decompresses compressed-tensors), so nothing here decides what a format means.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.hf_tiny import save_hf_model

# The linear weights a quantizer converts: attention, MLP (dense, shared expert and per-expert ones) and Qwen3.5's
# linear_attn projections; norms, convs, routers, embeddings and the lm_head stay plain.
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp|mlp\.shared_expert|mlp\.experts\.\d+|linear_attn)\."
                    r"\w*proj\w*\.weight")
# Fused expert tensors [E, out, in] (Qwen3.5-MoE's published form; transformers' FP8Experts holds them quantized)
LINEAR_OR_FUSED = re.compile(rf"{LINEAR.pattern}|model\.layers\.\d+\.mlp\.experts\.(gate_up|down)_proj")


def rewrite(path: Path, quantize, quantization_config: dict, skip=lambda name: False, linear=LINEAR) -> Path:
    """Replace every decoder-layer linear weight (names `linear` matches) of the checkpoint at `path` with
    `quantize(name, w)`'s tensors and record `quantization_config` in config.json."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    out = {}
    for name, w in tensors.items():
        out.update(quantize(name, w) if linear.fullmatch(name) and not skip(name) else {name: w})
    out = {k: v.contiguous() for k, v in out.items()}
    save_file(out, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_block_fp8(model, path: Path, block=(32, 32), scale_dtype=torch.float32, skip=lambda name: False) -> Path:
    """Block FP8 as transformers' FineGrainedFP8 saves it (weight F8_E4M3 + weight_scale_inv), scales in
    `scale_dtype` (f32: DeepSeek-V3; bf16: Qwen3 FP8)."""
    save_hf_model(model, path, torch.bfloat16)
    return fp8_in_place(path, block, scale_dtype, skip)


def write_fused_fp8(model, path: Path, block=(16, 16)) -> Path:
    """An MoE saved with fused expert tensors (tests/hf_tiny.py save_fused_experts: mlp.experts.gate_up_proj
    [E, 2I, D], down_proj [E, D, I]) in block FP8 by transformers' own `Fp8Quantize`, which names a fused tensor's
    scales `<name>_scale_inv` [E, out / bo, in / bi] (its `_quantize_one`), the layout its FP8Experts loads."""
    from hf_tiny import save_fused_experts

    save_fused_experts(save_hf_model(model, path, torch.bfloat16))
    return fp8_in_place(path, block, linear=LINEAR_OR_FUSED)


def fp8_copy(src: Path, dst: Path, block=(32, 32), drop=lambda name: False, linear=LINEAR) -> Path:
    """A saved checkpoint `src` copied to `dst` in block FP8 (transformers' quantizer, as write_block_fp8), the
    tensors `drop` names left out (what an FP8 release that drops the base's `mtp.*` layers looks like), the
    weights `linear` matches quantized."""
    import shutil

    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    save_file({k: v for k, v in load_file(file).items() if not drop(k)}, file, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    if drop("mtp.fc.weight"):  # the MTP layers dropped: config.json no longer counts them
        config.pop("mtp_num_hidden_layers", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_in_place(dst, block, linear=linear)


def fp8_in_place(path: Path, block=(32, 32), scale_dtype=torch.float32, skip=lambda name: False,
                 linear=LINEAR) -> Path:
    """The checkpoint at `path` rewritten in block FP8 by transformers' own `Fp8Quantize`."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=list(block))

    class Quantizer:  # what Fp8Quantize reads of its hf_quantizer
        quantization_config = config

    op = Fp8Quantize(Quantizer())

    def quantize(name, w):
        out = op._quantize_one(name, w.float())
        return {k: v.to(scale_dtype) if k.endswith("_scale_inv") else v for k, v in out.items()}

    ignored = ["lm_head"] + [n[: -len(".weight")] for n in load_file(path / "model.safetensors")
                             if LINEAR.fullmatch(n) and skip(n)]
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
          "modules_to_not_convert": ignored}
    return rewrite(path, quantize, qc, skip, linear)


def reference_model(path: Path):
    """transformers' own loading of a quantized directory on the CPU (FP8 dequantized, compressed-tensors
    decompressed), in fp32."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def write_compressed_tensors(model, path: Path, preset: str, fmt: str, activations: bool = False,
                             calibration: list[int] | None = None, **weight_args) -> Path:
    """compressed-tensors as llm-compressor saves it: the package's preset scheme `preset` (e.g. "FP8_DYNAMIC",
    "W8A8", "W4A16", "W4A16_ASYM"; `weight_args` override its weight arguments, e.g. group_size=32), scales
    and zero points from each weight's min / max by the package's `calculate_qparams`, the weight compressed by
    the package's compressor for `fmt` ("float-quantized", "int-quantized", "pack-quantized").

    activations=False drops the preset's activation quantization (a weight-only checkpoint). True keeps it in the
    config; a static one (the "FP8" preset: per tensor, `dynamic: false`) gets each linear's `input_scale` from
    the min / max of its input over the `calibration` tokens (`calculate_qparams` again, as llm-compressor's
    static min-max observer ends up)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=weight_args)
    if not activations:
        scheme.input_activations = None
    scheme.format = fmt
    input_scales = {}
    act = scheme.input_activations
    if act is not None and not act.dynamic:
        input_scales = {f"{m}.input_scale": calculate_qparams(lo, hi, act)[0].float()
                        for m, (lo, hi) in input_ranges(model, calibration).items()}
    args = scheme.weights
    compressor = BaseCompressor.get_value_from_registry(fmt)

    def quantize(name, w):
        w = w.float()
        o, i = w.shape
        if args.strategy == "group":
            g = w.reshape(o, i // args.group_size, args.group_size)
            lo, hi = g.amin(-1), g.amax(-1)
        elif args.strategy == "block":
            bo, bi = args.block_structure
            g = w.reshape(o // bo, bo, i // bi, bi)
            lo, hi = g.amin((1, 3)), g.amax((1, 3))
        elif args.strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        else:  # channel
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        scale, zero = calculate_qparams(lo, hi, args)
        state = {"weight": w, "weight_scale": scale.float(), "weight_zero_point": zero}
        module = name[: -len(".weight")]
        out = {f"{module}.{k}": v for k, v in compressor.compress(state, scheme).items()}
        return out | ({f"{module}.input_scale": input_scales[f"{module}.input_scale"]} if input_scales else {})

    save_hf_model(model, path, torch.bfloat16)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                            quantization_status="compressed").model_dump(mode="json")
    qc["quant_method"] = "compressed-tensors"
    return rewrite(path, quantize, qc)


def input_ranges(model, tokens: list[int]) -> dict[str, tuple]:
    """(min, max) of each decoder-layer linear's input over one forward of `tokens` (forward pre-hooks)."""
    ranges, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and LINEAR.fullmatch(f"{name}.weight"):
            def hook(module, args, name=name):
                ranges[name] = (args[0].amin().reshape(1), args[0].amax().reshape(1))
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model.float()(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return ranges


def write_awq(model, path: Path, group: int = 32) -> Path:
    """AutoAWQ GEMM: each weight quantized per group of `group` inputs, asymmetric 4-bit (q, zero in 0..15),
    qweight / qzeros packed eight a word along the output in AWQ's order 0, 2, 4, 6, 1, 3, 5, 7, scales f16."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def pack(v):  # [R, C] ints 0..15 -> [R, C / 8] int32, nibble k holding column order[k] of each 8
        v = v.to(torch.int64).reshape(v.shape[0], -1, 8)[:, :, list(order)]
        word = sum(v[:, :, k] << (4 * k) for k in range(8))
        return (word - (word >= 2 ** 31) * 2 ** 32).to(torch.int32)

    def quantize(name, w):
        w_IO = w.float().T
        i, o = w_IO.shape
        g = w_IO.reshape(i // group, group, o)
        lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
        q = (torch.round(g / scale[:, None]) + zero[:, None]).clamp(0, 15).reshape(i, o)
        module = name[: -len(".weight")]
        return {f"{module}.qweight": pack(q), f"{module}.qzeros": pack(zero), f"{module}.scales": scale.half()}

    save_hf_model(model, path, torch.float16)
    qc = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group, "zero_point": True,
          "modules_to_not_convert": None}
    return rewrite(path, quantize, qc)


def decompressed_copy(src: Path, dst: Path, scheme_preset: str = "W4A16_ASYM", **weight_args) -> Path:
    """`src` (compressed-tensors pack-quantized, or AutoAWQ GEMM via the package's AutoAWQConverter) with every
    weight decompressed by the compressed-tensors package into a plain fp32 checkpoint at `dst`: the reference
    where transformers cannot load the format on a CPU."""
    import shutil

    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import preset_name_to_scheme

    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    tensors = load_file(src / "model.safetensors")
    if qc["quant_method"] == "awq":
        tensors = AutoAWQConverter(group_size=qc["group_size"]).process(tensors)
    scheme = preset_name_to_scheme(scheme_preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=weight_args)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            state = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".weight")}
            out[f"{module}.weight"] = compressor.decompress(state, scheme)["weight"].float()
        elif not re.search(r"\.weight_(scale|zero_point|shape|packed)$", name):
            out[name] = t.float()
    shutil.copytree(src, dst, dirs_exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
