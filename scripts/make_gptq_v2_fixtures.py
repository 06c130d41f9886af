"""Build the GPTQ v2 (`checkpoint_format: gptq_v2`) parity fixtures with GPTQModel's own packing and CPU matmul.

    python scripts/make_gptq_v2_fixtures.py --gptqmodel-repo /path/to/GPTQModel --out tests/fixtures/gptq

--gptqmodel-repo is a GPTQModel source tree (the committed fixtures come from github.com/ModelCloud/GPTQModel at
the commit written to meta_v2.json). Nothing is downloaded and no GPTQModel code is copied into specjax; CI never
runs this script, the tests read only the npz files it writes.

What is ORIGINAL GPTQModel code, executed unchanged from the given tree: gptqmodel/nn_modules/qlinear/torch.py's
`TorchLinear`: its `pack_block(linear, scales, zeros, g_idx)` (rounds each weight to its group's grid and packs
qweight along the input and qzeros along the output, the zero point itself: GPTQModel's internal v2 format, what it
saves with format "gptq_v2"), and its eager CPU `_forward_eager` in the module's default (training) mode, whose
dequantization is PackableQuantLinear.dequantize_weight (unpack, scales[g_idx] * (w - zeros[g_idx]), x @ W).
What is not run: the package's `__init__` modules (they import every model definition and its optional
dependencies): the packages on the way are registered bare, and the third-party modules GPTQModel imports at module
level that are not installed here (pcre, logbar: its logger, device_smi, tokenicer, defuser, threadpoolctl) are
permissive stubs, so its log calls go nowhere. The native pack extension and the Triton dequantization are switched
off by GPTQModel's own environment flags, so its Python paths run.

What this script chooses (as make_gptq_fixtures.py does for v1): a [out 96, in 128] weight, groups of 32, random
scales and zero points including 0 (a v2 zero point v1 cannot store: v1 keeps zero - 1), a g_idx from a random
permutation for the act-order cases; 4 and 8 bits. Each npz holds qweight, qzeros, scales, g_idx as a gptq_v2
checkpoint stores them, the input x and GPTQModel's output y.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import numpy as np
import torch

CASES = {"v2_4bit": dict(bits=4, desc_act=False), "v2_4bit_act_order": dict(bits=4, desc_act=True),
         "v2_8bit_act_order": dict(bits=8, desc_act=True)}
IN, OUT, GROUP = 128, 96, 32
STUBBED = {"pcre", "logbar", "device_smi", "tokenicer", "defuser", "threadpoolctl"}
BARE = ("gptqmodel", "gptqmodel.models", "gptqmodel.quantization")


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Optional third-party modules GPTQModel imports at module level, as permissive stubs."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__ = [], spec, spec.name
        return module

    def exec_module(self, module):
        pass


def load_torch_linear(repo: Path):
    os.environ.update(GPTQMODEL_DISABLE_PACK_EXT="1", GPTQ_TORCH_TRITON_DEQUANT="0")
    sys.meta_path.insert(0, _Stubs())
    sys.path.insert(0, str(repo))
    for name in BARE:  # packages whose __init__ would import every model: registered without running it
        package = types.ModuleType(name)
        package.__path__ = [str(repo / name.replace(".", "/"))]
        sys.modules[name] = package
    sys.modules["gptqmodel"].DEBUG_ON = False  # what gptqmodel/__init__.py sets without GPTQMODEL_DEBUG
    config = importlib.import_module("gptqmodel.quantization.config")
    sys.modules["gptqmodel.quantization"].FORMAT = config.FORMAT
    sys.modules["gptqmodel.quantization"].METHOD = config.METHOD
    return importlib.import_module("gptqmodel.nn_modules.qlinear.torch").TorchLinear, config.FORMAT


def make_case(TorchLinear, FORMAT, bits: int, desc_act: bool, seed: int) -> dict:
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
    zeros = torch.randint(0, maxq + 1, (OUT, groups))
    zeros[0, 0] = 0  # a zero point of 0: v1 would store -1
    ql = TorchLinear(bits=bits, group_size=GROUP, sym=False, desc_act=desc_act, in_features=IN, out_features=OUT,
                     bias=False, format=FORMAT.GPTQ_V2)
    ql.pack_block(linear, scales, zeros, g_idx)  # left in training mode: eval() imports gptqmodel.utils.model
    x = torch.randn(3, IN)
    with torch.no_grad():
        y = ql._forward_eager(x, x.shape[:-1] + (OUT,))
    return {"qweight": ql.qweight.numpy(), "qzeros": ql.qzeros.numpy(), "scales": ql.scales.numpy(),
            "g_idx": ql.g_idx.numpy().astype(np.int32), "x": x.numpy(), "y": y.numpy(),
            "bits": np.int32(bits), "group_size": np.int32(GROUP), "desc_act": np.bool_(desc_act),
            "zeros": zeros.T.numpy().astype(np.int32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gptqmodel-repo", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default=None, help="the tree's commit, for meta_v2.json (default: git rev-parse)")
    args = ap.parse_args()
    TorchLinear, FORMAT = load_torch_linear(args.gptqmodel_repo.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    for i, (name, case) in enumerate(CASES.items()):
        np.savez(args.out / f"{name}.npz", **make_case(TorchLinear, FORMAT, seed=10 + i, **case))
        print(f"wrote {args.out / name}.npz")
    commit = args.commit or subprocess.run(["git", "-C", str(args.gptqmodel_repo), "rev-parse", "HEAD"],
                                           capture_output=True, text=True).stdout.strip()
    (args.out / "meta_v2.json").write_text(json.dumps(
        {"producer": "github.com/ModelCloud/GPTQModel", "commit": commit, "checkpoint_format": "gptq_v2",
         "code": "gptqmodel/nn_modules/qlinear/torch.py TorchLinear.pack_block + _forward_eager (CPU)",
         "cases": list(CASES)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
