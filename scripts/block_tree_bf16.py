"""How often a bf16 target's greedy output differs between plain decoding and a one-pass block tree (near-ties).

    python scripts/block_tree_bf16.py --tree dynamic:top_k=7,depth=6,total_tokens=64

Greedy verification is exact arithmetic only in fp32 (tests check equality there); in bf16 the verify pass
computes a node's logits over a different token layout than a plain step (a batch of tree nodes, another
reduction order), so a near-tie between the top two tokens can flip, as JetSpec reports for its engine. This
counts, for the embedded target in bf16 with the embedded DFlash and DSpark heads, the rows whose output differs
from bf16 plain decoding and where the first difference is, and the same for the chain of the block.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import specjax

ROOT = Path(__file__).resolve().parent.parent


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=str(ROOT / "checkpoints" / "tiny"))
    ap.add_argument("--tree", default="dynamic:top_k=7,depth=6,total_tokens=64")
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    ckpt = Path(args.ckpt)
    prompts = [x["text"] for x in json.loads((ckpt / "manifest.json").read_text())["held_out_prompts"]]
    target = specjax.load(ckpt / "target", dtype="bfloat16")
    plain = specjax.generate(target, prompts, max_new_tokens=args.new, eos_token_id=[]).tokens
    for name in ("dflash", "dspark"):
        drafter = specjax.load_drafter(ckpt / name, target)
        for tree in (args.tree, f"chain:{drafter.max_draft_tokens}"):
            out = specjax.generate(target, prompts, max_new_tokens=args.new, eos_token_id=[], drafter=drafter,
                                   tree=tree).tokens
            diffs = [first_difference(a, b) for a, b in zip(out, plain)]
            print(json.dumps({"drafter": name, "tree": tree, "rows": len(prompts), "tokens_per_row": args.new,
                              "rows_differing": sum(d is not None for d in diffs), "first_difference_at": diffs}))


if __name__ == "__main__":
    main()
