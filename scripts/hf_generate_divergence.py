#!/usr/bin/env python
"""Where transformers' `generate` and specjax's greedy output part ways on the embedded target, and why.

For each held-out prompt: specjax's and transformers' greedy continuations (64 tokens, EOS off, the target
exported with `specjax export`); at the first differing position, the full-sequence logits of transformers'
own forward pass on the shared prefix: its argmax, the two chosen tokens' logits and their gap. docs/benchmarks.md
(the drafter families' table, its peer note) quotes these figures.

    python scripts/hf_generate_divergence.py [--attn eager|sdpa]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

import specjax
from specjax.bench.agreement import compare_tokens
from specjax.convert.export import export_model

TINY = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = specjax.load(TINY / "target")
    hf_dir = export_model(TINY / "target", Path(tempfile.mkdtemp()) / "target")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation=args.attn).eval()
    prompts = [p["text"] for p in json.loads((TINY / "manifest.json").read_text())["held_out_prompts"]]
    for i, text in enumerate(prompts):
        ids = target.encode(text)
        mine = specjax.generate(target, [ids], max_new_tokens=args.max_new_tokens, eos_token_id=[]).tokens[0]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                 min_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
        div = compare_tokens([mine], [theirs]).first_divergence
        if div is None:
            print(f"prompt {i}: identical")
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([ids + mine[: div.position]])).logits[0, -1].numpy()
        print(f"prompt {i}: first difference at output position {div.position}: specjax {div.plain}, "
              f"transformers generate {div.speculative}; transformers' full forward: argmax "
              f"{int(np.argmax(logits))}, logits {logits[div.plain]:.5f} vs {logits[div.speculative]:.5f} "
              f"(gap {logits[div.plain] - logits[div.speculative]:.5f})")


if __name__ == "__main__":
    main()
