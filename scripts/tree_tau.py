"""Acceptance length (tau) of draft trees of equal size with the embedded pair, greedy.

Runs the target alone, then speculatively with the embedded draft model and each tree, checks
every speculative output equals plain greedy decoding, and prints tau, the per-depth acceptance
and the drafter passes per round for each tree.

    python scripts/tree_tau.py                       # 16-node trees: dynamic (EAGLE-2) vs static
    python scripts/tree_tau.py --trees kary:3,2,1 dynamic:top_k=4,depth=3,total_tokens=16
    python scripts/tree_tau.py --drafter eagle3 --trees kary:3,2,1,1 kary:7,2 kary:3,3,1 \
        kary:2,1,1,1,1,1,1,1,1,1 chain:21 dynamic:top_k=3,depth=4,total_tokens=22 \
        dynamic:top_k=2,depth=8,total_tokens=22           # the trained EAGLE-3 head, ~22-node trees
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import specjax

ROOT = Path(__file__).resolve().parent.parent
TREES = [
    "dynamic:top_k=4,depth=3,total_tokens=16",
    "dynamic:top_k=3,depth=4,total_tokens=16",
    "dynamic:top_k=2,depth=6,total_tokens=16",
    "kary:3,2,1", "kary:5,2", "kary:3,4", "kary:5,1,1", "kary:3,1,1,1,1", "chain:15",
    # Medusa-style: a deep rank-0 spine with second choices near the root (16 nodes).
    "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,1],[0,1,0],[1,0,0],[0,0,0,0],[0,0,0,1],[0,0,0,0,0],[0,0,0,0,0,0],"
    "[0,0,0,0,0,0,0]]",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default=str(ROOT / "checkpoints" / "tiny"))
    p.add_argument("--trees", nargs="*", default=TREES)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--drafter", default="draft", help="the drafter's directory under --ckpt (draft, eagle3, ...)")
    args = p.parse_args()
    ckpt = Path(args.ckpt)
    manifest = (ckpt / "manifest.json").read_bytes()
    prompts = [x["text"] for x in json.loads(manifest)["held_out_prompts"]]
    target = specjax.load(ckpt / "target")
    drafter = specjax.load_drafter(ckpt / args.drafter, target)
    print(f"manifest {ckpt / 'manifest.json'} sha256 {hashlib.sha256(manifest).hexdigest()[:16]}; "
          f"{len(prompts)} held-out prompts, greedy, {args.max_new_tokens} new tokens, batch {len(prompts)}")
    plain = specjax.generate(target, prompts, max_new_tokens=args.max_new_tokens, eos_token_id=[])
    print(f"{'tree':42s} {'nodes':>5s} {'tau':>6s} {'drafter/round':>13s}  per-depth acceptance")
    for tree in args.trees:
        spec = json.loads(tree) if tree.startswith("[") else tree
        out = specjax.generate(target, prompts, max_new_tokens=args.max_new_tokens, eos_token_id=[],
                               drafter=drafter, tree=spec)
        assert out.tokens == plain.tokens, f"{tree}: speculative output differs from plain greedy decoding"
        s = out.stats
        name = tree if len(tree) <= 42 else tree[:39] + "..."
        print(f"{name:42s} {s['tree_nodes']:5d} {s['acceptance_length']:6.3f} "
              f"{s['drafter_calls'] / max(s['rounds'], 1):13.1f}  "
              + " ".join(f"{a:.2f}" for a in s["per_position_acceptance"]))


if __name__ == "__main__":
    main()
