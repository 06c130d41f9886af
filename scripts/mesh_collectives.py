"""The collectives XLA's partitioner puts in the plain loop of a tiny target split over a mesh, by kind and shape.

What the sharding rules cost in communication, read from the compiled executable (no timing: on fake CPU
devices it would mean nothing). docs/architecture_devices.md quotes it for the MoE choice between
splitting inside the experts (the default rules) and whole experts per device (EXPERT_PARALLEL), and for the
DeltaNet's packed channels.

    python scripts/mesh_collectives.py --target moe --tensor-parallel 8
    python scripts/mesh_collectives.py --target moe --tensor-parallel 8 --expert-parallel
    python scripts/mesh_collectives.py --target hybrid --tensor-parallel 8
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

DEVICES = 8
if "jax" not in sys.modules and "force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\(")


def build(target: str, where: Path) -> Path:
    """A tiny random HF checkpoint (tests/hf_tiny.py): 8 heads, 4 kv heads, vocab 256."""
    from hf_tiny import build_hf_model, build_moe, build_qwen35, save_hf_model

    if target == "dense":
        model = build_hf_model("qwen3", seed=1, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2)
    elif target == "hybrid":
        model = build_qwen35(seed=3, num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4,
                             linear_num_value_heads=8)
    else:
        model = build_moe("qwen3_moe", seed=4, num_attention_heads=8, num_key_value_heads=4)
    return save_hf_model(model, where / target)


def collectives(executable_text: str) -> collections.Counter:
    """(kind, result shape) -> how many, in an executable's HLO text."""
    return collections.Counter((m.group(2), m.group(1)) for m in COLLECTIVE.finditer(executable_text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("dense", "hybrid", "moe"), default="moe")
    parser.add_argument("--tensor-parallel", type=int, default=8)
    parser.add_argument("--expert-parallel", action="store_true", help="whole experts per device (EXPERT_PARALLEL)")
    args = parser.parse_args()

    import specjax
    from specjax.models.sharding import EXPERT_PARALLEL

    with tempfile.TemporaryDirectory() as tmp:
        path = build(args.target, Path(tmp))
        target = specjax.load(path, tensor_parallel=args.tensor_parallel,
                              rules=EXPERT_PARALLEL if args.expert_parallel else None)
        specjax.generate(target, [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12]], max_new_tokens=8, eos_token_id=[])
        (executable,) = target.compiled.values()
        counts = collectives(executable.as_text())
    rules = "EXPERT_PARALLEL" if args.expert_parallel else "RULES"
    print(f"{args.target} at TP {args.tensor_parallel} ({rules}): the plain loop's collectives")
    for (kind, shape), n in sorted(counts.items()):
        print(f"  {n:3d} x {kind:18s} {shape}")


if __name__ == "__main__":
    main()
