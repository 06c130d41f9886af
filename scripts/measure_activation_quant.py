"""What W8A8 activation quantization changes on a tiny model: specjax's logits with the format's activation rounding
(the default) and without it (`activation_quant=False`), each against the unquantized model, for each W8A8 format
tests/hf_quant.py writes (the formats' own code: compressed-tensors' presets, transformers' block-FP8 quantizer).

The model is tests/hf_tiny.py's random Qwen3 (2 layers, hidden 64, vocab 256; 32 x 32 blocks for block FP8), the
reference its bf16 weights in fp32 compute (what the quantizers started from). Errors are max |logits - reference|
over a 40-token prompt, relative to max |reference|; "greedy equal" is the share of 32 greedy tokens (two prompts)
equal between the two modes.

    PYTHONPATH=.:tests python scripts/measure_activation_quant.py --out docs/records/activation_quant_tiny_cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from hf_quant import write_block_fp8, write_compressed_tensors
from hf_tiny import build_hf_model

import specjax
from specjax.bench.ar import machine_info

PROMPT = list(np.random.default_rng(0).integers(3, 256, size=40))
FORMATS = {  # name -> writer(model, path)
    "compressed-tensors W8A8 (int8 per channel, int8 per token)":
        lambda m, p: write_compressed_tensors(m, p, "W8A8", "int-quantized", activations=True),
    "compressed-tensors FP8_DYNAMIC (fp8 per channel, fp8 per token)":
        lambda m, p: write_compressed_tensors(m, p, "FP8_DYNAMIC", "float-quantized", activations=True),
    "compressed-tensors FP8 (fp8 per tensor, static fp8 per tensor)":
        lambda m, p: write_compressed_tensors(m, p, "FP8", "float-quantized", activations=True,
                                              calibration=PROMPT),
    "block FP8 32 x 32 (fp8 per token per group of 32)": lambda m, p: write_block_fp8(m, p, block=(32, 32)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, write) in enumerate(FORMATS.items()):
            model = build_hf_model("qwen3", seed=0, num_hidden_layers=2)
            path = write(model, Path(tmp) / str(i))  # saving casts the torch model to bf16 in place
            with torch.no_grad():
                ref = model.float()(torch.tensor([PROMPT])).logits[0].numpy()
            scale = np.abs(ref).max()
            targets = {mode: specjax.load(path, dtype="float32", activation_quant=mode == "w8a8")
                       for mode in ("w8a8", "weight_only")}
            logits = {mode: np.asarray(t.model(np.array([PROMPT])))[0] for mode, t in targets.items()}
            greedy = {mode: specjax.generate(t, [PROMPT[:8], PROMPT[:20]], max_new_tokens=16, eos_token_id=[]).tokens
                      for mode, t in targets.items()}
            same = [a == b for x, y in zip(greedy["w8a8"], greedy["weight_only"]) for a, b in zip(x, y)]
            rows.append(dict(format=name, activations=repr(targets["w8a8"]).split("activations ")[1].split(",")[0],
                             w8a8_error=float(np.abs(logits["w8a8"] - ref).max() / scale),
                             weight_only_error=float(np.abs(logits["weight_only"] - ref).max() / scale),
                             w8a8_vs_weight_only=float(np.abs(logits["w8a8"] - logits["weight_only"]).max() / scale),
                             greedy_equal=sum(same) / len(same)))
    print("| format | activations | error, W8A8 | error, weight-only | W8A8 vs weight-only | greedy equal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['activations']} | {r['w8a8_error']:.1e} | {r['weight_only_error']:.1e} | "
              f"{r['w8a8_vs_weight_only']:.1e} | {r['greedy_equal']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps(dict(machine=machine_info(), prompt_tokens=len(PROMPT), rows=rows), indent=2))


if __name__ == "__main__":
    main()
