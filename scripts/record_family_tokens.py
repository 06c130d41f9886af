#!/usr/bin/env python
"""Greedy tokens of every drafter family on the embedded pair: record them, or check the code against a record.

A restructure (files moving between modules, nothing meant to change behaviour) must not change any
family's greedy output. This script uses only the public API (specjax.load, load_drafter, generate,
NgramDrafter) so the same file runs before and after such a change. Cases: plain decoding; the draft
model (chain 4); n-gram (chain 4); EAGLE-3 (chain 4, the static tree kary:3,2,1, and an EAGLE-2 dynamic
tree with the same 16 nodes); MTP (chain 3, the length the head's manifest entry was measured with);
DFlash (chain 7 = block_size - 1); DSpark (chain 7 = block_size, without and with the confidence
scheduler on the roofline cost curve). Each runs greedy, 48 new tokens, checkpoint EOS ids, on a ragged
batch of the first 4 held-out prompts of checkpoints/tiny/manifest.json and on the 5th alone (batch 1).
Every speculative case should also equal plain decoding at the same batch ("equal_plain").

    python scripts/record_family_tokens.py --out runs/family_tokens_before.json     # record
    python scripts/record_family_tokens.py --check runs/family_tokens_before.json   # exit 1 on any change
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import specjax

TINY = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny"
MAX_NEW = 48


def cases(target, root: Path) -> dict[str, tuple]:
    """name -> (drafter or None, generate kwargs)."""
    eagle = specjax.load_drafter(root / "eagle3", target)
    dspark = specjax.load_drafter(root / "dspark", target)
    return {
        "plain": (None, {}),
        "draft model, chain 4": (specjax.load_drafter(root / "draft", target), {"num_draft_tokens": 4}),
        "n-gram, chain 4": (specjax.NgramDrafter(), {"num_draft_tokens": 4}),
        "EAGLE-3, chain 4": (eagle, {"num_draft_tokens": 4}),
        "EAGLE-3, kary:3,2,1": (eagle, {"tree": "kary:3,2,1"}),  # 16 nodes, root included
        "EAGLE-3, dynamic top_k=3,depth=4,total_tokens=16": (
            eagle, {"tree": "dynamic:top_k=3,depth=4,total_tokens=16"}),  # the same 16 nodes, rebuilt per round
        "MTP, chain 3": (specjax.load_drafter(root / "mtp", target), {"num_draft_tokens": 3}),
        "DFlash, chain 7": (specjax.load_drafter(root / "dflash", target), {"num_draft_tokens": 7}),
        "DSpark, chain 7": (dspark, {"num_draft_tokens": 7}),
        "DSpark, chain 7, confidence scheduler": (dspark, {"num_draft_tokens": 7, "scheduler": "confidence",
                                                           "scheduler_profile": "roofline"}),
    }


def record(root: Path) -> dict[str, dict]:
    """{"batch N / case": {"tokens": [[...], ...], "equal_plain": bool, "tau": float}} for both batches."""
    target = specjax.load(root / "target")
    held_out = [p["text"] for p in json.loads((root / "manifest.json").read_text())["held_out_prompts"]]
    batches = {4: held_out[:4], 1: held_out[4:5]}
    found = cases(target, root)
    result = {}
    for batch, prompts in batches.items():
        plain = None
        for name, (drafter, kwargs) in found.items():
            out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, drafter=drafter, **kwargs)
            plain = out.tokens if plain is None else plain  # "plain" runs first
            tau = round(out.stats["acceptance_length"], 4)  # informative: greedy drafts are deterministic too
            result[f"batch {batch} / {name}"] = {"tokens": out.tokens, "equal_plain": out.tokens == plain, "tau": tau}
            print(f"batch {batch} / {name}: equal_plain {out.tokens == plain}, tau {tau}, "
                  f"lengths {[len(t) for t in out.tokens]}", flush=True)
    return result


def differences(recorded: dict, current: dict) -> list[str]:
    """Cases whose tokens changed, went missing or appeared, and speculative cases that left plain decoding."""
    bad = [f"{name}: tokens differ from the record" for name in recorded
           if name in current and current[name]["tokens"] != recorded[name]["tokens"]]
    bad += [f"{name}: missing now" for name in recorded if name not in current]
    bad += [f"{name}: not in the record" for name in current if name not in recorded]
    bad += [f"{name}: no longer equals plain decoding" for name, c in current.items() if not c["equal_plain"]]
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=Path, default=TINY, help="target/, draft/, eagle3/, mtp/, dflash/, dspark/")
    ap.add_argument("--out", type=Path, default=None, help="where to write (default runs/family_tokens.json; "
                                                             "with --check only when given)")
    ap.add_argument("--check", type=Path, default=None, help="a recorded file to compare this code's tokens to")
    args = ap.parse_args(argv)
    recorded = json.loads(args.check.read_text()) if args.check else None
    current = record(args.checkpoints)
    out = args.out or (None if args.check else Path("runs/family_tokens.json"))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(current, indent=1))
        print(f"wrote {out}")
    if recorded is None:
        not_equal = [name for name, c in current.items() if not c["equal_plain"]]
        print("every case equals plain decoding" if not not_equal else f"NOT equal to plain: {not_equal}")
        return 1 if not_equal else 0
    bad = differences(recorded, current)
    for name in recorded.keys() & current.keys():  # a note only: the check is on tokens
        if recorded[name].get("tau") not in (None, current[name]["tau"]):
            print(f"note: {name}: tau {recorded[name]['tau']} -> {current[name]['tau']} (the drafts changed)")
    print("\n".join(bad) if bad else f"all {len(current)} cases match {args.check} token for token")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
