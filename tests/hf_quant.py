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

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


def rewrite(path: Path, quantize, quantization_config: dict, skip=lambda name: False) -> Path:
    """Replace every decoder-layer linear weight of the checkpoint at `path` with `quantize(name, w)`'s tensors
    and record `quantization_config` in config.json."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    out = {}
    for name, w in tensors.items():
        out.update(quantize(name, w) if LINEAR.fullmatch(name) and not skip(name) else {name: w})
    save_file(out, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_block_fp8(model, path: Path, block=(32, 32), scale_dtype=torch.float32, skip=lambda name: False) -> Path:
    """Block FP8 as transformers' FineGrainedFP8 saves it (weight F8_E4M3 + weight_scale_inv), scales in
    `scale_dtype` (f32: DeepSeek-V3; bf16: Qwen3 FP8)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=list(block))

    class Quantizer:  # what Fp8Quantize reads of its hf_quantizer
        quantization_config = config

    op = Fp8Quantize(Quantizer())

    def quantize(name, w):
        out = op._quantize_one(name, w.float())
        return {k: v.to(scale_dtype) if k.endswith("_scale_inv") else v for k, v in out.items()}

    save_hf_model(model, path, torch.bfloat16)
    ignored = ["lm_head"] + [n[: -len(".weight")] for n in model.state_dict() if LINEAR.fullmatch(n) and skip(n)]
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
          "modules_to_not_convert": ignored}
    return rewrite(path, quantize, qc, skip)


def reference_model(path: Path):
    """transformers' own loading of a quantized directory on the CPU (FP8 dequantized, compressed-tensors
    decompressed), in fp32."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
