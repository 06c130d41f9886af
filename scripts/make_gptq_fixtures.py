"""Build the GPTQ parity fixtures by running AutoGPTQ's own packing and dequantizing matmul on random weights.

    python scripts/make_gptq_fixtures.py --autogptq-repo /path/to/AutoGPTQ --out tests/fixtures/gptq

--autogptq-repo is an AutoGPTQ source tree (the committed fixtures come from github.com/AutoGPTQ/AutoGPTQ at
9f7d370). Nothing is downloaded and no AutoGPTQ code is copied into specjax; CI never runs this script, the tests
read only the npz files it writes.

What is ORIGINAL AutoGPTQ code, executed unchanged from the given tree (the one file is loaded by path, without the
package's __init__, which pulls in its CUDA extensions): auto_gptq/nn_modules/qlinear/qlinear_cuda.py,
`QuantLinear.pack(linear, scales, zeros, g_idx)` (rounds each weight column to its group's grid and packs qweight
along the input and qzeros, minus one, along the output: the v1 "gptq" checkpoint format) and `QuantLinear.forward`
on the CPU (its torch path: unpack, zeros + 1, scales[g_idx] * (w - zeros[g_idx]), x @ W).

What this script chooses: a [out 96, in 128] weight, groups of 32, random scales and zero points, and for the
act-order cases (desc_act) a g_idx from a random permutation of the inputs (what GPTQ's act-order writes); 4 and 8
bits. Each npz holds the packed tensors as a checkpoint stores them (qweight, qzeros, scales, g_idx), the input x
and AutoGPTQ's output y.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import torch

CASES = {"4bit": dict(bits=4, desc_act=False), "4bit_act_order": dict(bits=4, desc_act=True),
         "8bit_act_order": dict(bits=8, desc_act=True)}
IN, OUT, GROUP = 128, 96, 32


def load_quant_linear(repo: Path):
    path = repo / "auto_gptq" / "nn_modules" / "qlinear" / "qlinear_cuda.py"
    spec = importlib.util.spec_from_file_location("autogptq_qlinear_cuda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.QuantLinear


def make_case(QuantLinear, bits: int, desc_act: bool, seed: int) -> dict:
    torch.manual_seed(seed)
    groups = IN // GROUP
    linear = torch.nn.Linear(IN, OUT, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(OUT, IN) * 0.05)
    g_idx = torch.tensor([i // GROUP for i in range(IN)], dtype=torch.int32)
    if desc_act:
        g_idx = g_idx[torch.randperm(IN)]
    maxq = 2 ** bits - 1
    scales = (torch.rand(OUT, groups) * 0.01 + 0.005).half().float()  # [out, groups], as GPTQ's quantizer passes
    zeros = torch.randint(1, maxq, (OUT, groups)).float()
    ql = QuantLinear(bits, GROUP, IN, OUT, bias=False, weight_dtype=torch.float32)
    ql.pack(linear, scales, zeros, g_idx)
    x = torch.randn(3, IN)
    with torch.no_grad():
        y = ql.forward(x)
    return {"qweight": ql.qweight.numpy(), "qzeros": ql.qzeros.numpy(), "scales": ql.scales.numpy().astype(np.float16),
            "g_idx": ql.g_idx.numpy().astype(np.int32), "x": x.numpy(), "y": y.numpy(), "bits": np.int32(bits),
            "group_size": np.int32(GROUP), "desc_act": np.bool_(desc_act)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--autogptq-repo", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    QuantLinear = load_quant_linear(args.autogptq_repo)
    args.out.mkdir(parents=True, exist_ok=True)
    for i, (name, case) in enumerate(CASES.items()):
        np.savez(args.out / f"{name}.npz", **make_case(QuantLinear, seed=i, **case))
        print(f"wrote {args.out / name}.npz")


if __name__ == "__main__":
    main()
