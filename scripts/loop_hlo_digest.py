"""Digests of the compiled plain and speculative loops on the embedded pair, source locations stripped.

Two checkouts that print the same digests compile the same executables, instruction for instruction, so
a refactor that only moves code (or wraps it in modules) cannot have changed speed or numerics. The
file names, source lines and stack frames XLA keeps for debugging are removed first (they name the source,
not the program).
Runs on either side of the Flax/layout refactor (it finds the modules under both layouts).

    python scripts/loop_hlo_digest.py
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import specjax
from specjax.config import SamplingConfig

try:  # the layout since the concept folders
    from specjax.decoding import decode, request, speculative
    from specjax.decoding.drafter import Settings
    from specjax.decoding.tree import parse_tree
except ImportError:  # the flat layout before it
    from specjax import decode, request, speculative
    from specjax.drafters.base import Settings
    from specjax.tree import parse_tree

TINY = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny"
PROMPTS = ["def f(x):", "import os"]


def digest(lowered) -> str:
    """sha256 of the optimized HLO without its debug information (op metadata; the tables of file names,
    function names, source locations and stack frames at its top)."""
    text = re.sub(r"metadata=\{[^}]*\}", "", lowered.compile().as_text())
    body = "\n".join(line for line in text.splitlines() if not re.match(r'\s*\d+ ["{]', line))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def main() -> None:
    target = specjax.load(TINY / "target")
    req = request.prepare(target, PROMPTS, 48, SamplingConfig(), None, None, 0)
    print(f"plain: {digest(decode.ar_generate.lower(target.params, *req.arrays(), lc=req.lc))}")
    cases = [("draft", "chain:4"), ("eagle3", "chain:4"), ("eagle3", "dynamic:top_k=3,depth=4,total_tokens=16"),
             ("mtp", "chain:3"), ("dflash", "chain:7"), ("dspark", "chain:7")]
    for name, tree in cases:
        drafter = specjax.load_drafter(TINY / name, target)
        spec = parse_tree(tree, None)
        req = request.prepare(target, PROMPTS, 48, SamplingConfig(), None, None, 0, draft_nodes=spec.cache_slots)
        configured = drafter.configure(Settings(spec, SamplingConfig(), req.lc.cache_len, req.lc.out_len))
        lowered = speculative.spec_generate.lower(target.params, configured.params, *req.arrays(), lc=req.lc,
                                                  drafter=configured)
        print(f"{name} {tree}: {digest(lowered)}")


if __name__ == "__main__":
    main()
