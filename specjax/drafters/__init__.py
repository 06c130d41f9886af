"""Drafter families behind one protocol (see base.py), and `load_drafter`."""

from __future__ import annotations

from pathlib import Path

from .base import Drafter, PrefillContext, Settings
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter
from .replay import ReplayDrafter, replay_drafter

__all__ = ["Drafter", "DraftModelDrafter", "NgramDrafter", "PrefillContext", "ReplayDrafter", "Settings",
           "load_drafter", "replay_drafter"]


def load_drafter(path: str | Path, target, *, attn_impl: str | None = None) -> Drafter:
    """Load a drafter checkpoint for `target`, refusing one that does not fit it.

    A directory holding a dense decoder (specjax checkpoint or Hugging Face dir) becomes a
    draft model; it must have the target's vocabulary and, when both carry one, the same tokenizer.
    """
    from ..target import load

    model = load(path, attn_impl=attn_impl or target.attn_impl)
    if model.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft model {path} has vocab_size {model.cfg.vocab_size} but the target has "
                         f"{target.cfg.vocab_size}; a draft model must share the target's tokenizer")
    if model.tokenizer is not None and target.tokenizer is not None:
        if model.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(f"draft model {path} has a different tokenizer from the target (same size, different"
                             " token ids); a draft model must share the target's tokenizer")
    return DraftModelDrafter(model.cfg, model.params, attn_impl=model.attn_impl)
