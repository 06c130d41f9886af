"""Prompts for measuring a target: its checkpoint's held-out prompts when it ships them, else random ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specjax.models.target import Target


def bench_prompts(target: Target, n: int, seed: int = 0) -> list:
    """Held-out prompts from the embedded checkpoint's manifest when present, else random ids."""
    manifest = Path(target.path or "").parent / "manifest.json"
    if manifest.is_file() and target.tokenizer is not None:
        texts = [p["text"] for p in json.loads(manifest.read_text()).get("held_out_prompts") or []]
        if texts:
            return [texts[i % len(texts)] for i in range(n)]
    rng = np.random.default_rng(seed)
    return [rng.integers(3, target.cfg.vocab_size, size=32).tolist() for _ in range(n)]
