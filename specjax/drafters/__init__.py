"""Drafter families behind one protocol (see base.py), and `load_drafter`."""

from __future__ import annotations

import json
from pathlib import Path

from ..convert.dflash import is_dflash_config
from ..convert.dspark import is_dspark_config
from ..convert.mtp import is_mtp_only, read_mtp_only_dir
from .base import Drafter, PrefillContext, Settings
from .dflash import DFlashDrafter, dflash_drafter
from .draft_model import DraftModelDrafter
from .dspark import DSparkDrafter, dspark_drafter
from .eagle3 import Eagle3Drafter, eagle3_drafter
from .mtp import MtpDrafter, mtp_drafter
from .ngram import NgramDrafter
from .replay import ReplayDrafter, replay_drafter

__all__ = ["DFlashDrafter", "DSparkDrafter", "Drafter", "DraftModelDrafter", "Eagle3Drafter", "MtpDrafter",
           "NgramDrafter", "PrefillContext", "ReplayDrafter", "Settings", "dflash_drafter", "drafter_family",
           "dspark_drafter", "load_drafter", "mtp_drafter", "replay_drafter"]


def drafter_family(path: str | Path) -> str:
    """'dspark', 'dflash', 'eagle3', 'mtp' or 'draft_model', from the directory's config.json.

    DeepSpec DSpark drafters (and DeepSpec's DFlash ones, the same class with markov_rank 0) say so by
    the Qwen3DSparkModel architecture (or DSpark's config fields).

    DFlash drafters (z-lab) say so by the DFlashDraftModel architecture or a `dflash_config`.

    EAGLE-3 heads say so by an `eagle_config`, an architecture named *Eagle3 (SpecForge) or a
    `draft_vocab_size` (SafeAILab, whose architecture is plain LlamaForCausalLM with one layer).
    An MTP-only directory (MTP tensors without their target, convert/mtp.py) by `specjax_mtp_only`.
    """
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist: a drafter directory needs its config.json")
    hf = json.loads(config.read_text())
    archs = hf.get("architectures") or []
    if is_dspark_config(hf):  # DeepSpec's DSpark and DFlash (markov_rank 0) drafters: Qwen3DSparkModel
        return "dspark"
    if is_dflash_config(hf):
        return "dflash"
    if "eagle_config" in hf or "draft_vocab_size" in hf or any("eagle3" in a.lower() for a in archs):
        return "eagle3"
    if is_mtp_only(hf):
        return "mtp"
    return "draft_model"


def load_drafter(path: str | Path, target, *, attn_impl: str | None = None, mtp: bool | None = None) -> Drafter:
    """Load a drafter checkpoint for `target`, detecting its family, refusing one that does not fit it.

    - A DeepSpec DSpark drafter (Qwen3DSparkModel; its `dflash_*_block7` checkpoints too, Markov rank 0)
      becomes a `DSparkDrafter` with its own embedding and lm_head copies; hidden size, vocabulary, block,
      mask token and tap layers are checked against the target.
    - A z-lab DFlash drafter becomes a `DFlashDrafter` reading the target's features and using its
      embedding and lm_head; hidden size, vocabulary, mask token and tap layers are checked.
    - An EAGLE-3 head (SafeAILab or SpecForge format) becomes an `Eagle3Drafter` reading the
      target's features; hidden size, vocabulary, d2t and tap layers are checked against the target.
    - The target's own directory, when its checkpoint carries MTP layers (or `mtp=True`), gives
      the target's `MtpDrafter`; so does another directory of the same model (same config.json
      shape) whose checkpoint carries them. `mtp=False` loads such a directory as a draft model.
    - An MTP-only directory (only MTP tensors + the target's config.json, `specjax_mtp_only`; what
      scripts/train_mtp.py writes) gives an `MtpDrafter` with those layers on `target`.
    - A directory holding a dense decoder (specjax checkpoint or Hugging Face dir) becomes a draft
      model; it must have the target's vocabulary and, when both carry one, the same tokenizer.
    """
    from ..target import load

    family = drafter_family(path)
    if family == "dspark":
        return dspark_drafter(path, target, attn_impl=attn_impl)
    if family == "dflash":
        return dflash_drafter(path, target, attn_impl=attn_impl)
    if family == "eagle3":
        return eagle3_drafter(path, target, attn_impl=attn_impl)
    if family == "mtp":
        if mtp is False:
            raise ValueError(f"{path} holds only MTP layers (no model to load as a draft model); drop mtp=False")
        return mtp_drafter(target, attn_impl=attn_impl, stored=read_mtp_only_dir(path, target.cfg))
    own = getattr(target, "mtp", None) is not None
    if mtp or (mtp is None and own and _same_dir(path, getattr(target, "path", None))):
        if own or _same_dir(path, getattr(target, "path", None)):
            return mtp_drafter(target, attn_impl=attn_impl)  # ValueError when the target has none
    model = load(path, attn_impl=attn_impl or target.attn_impl)
    if mtp is not False and model.mtp is not None and _same_model(model, target):
        return mtp_drafter(target, attn_impl=attn_impl, stored=model.mtp)
    if mtp:
        what = "has no MTP layers" if model.mtp is None else "is a different model from the target"
        raise ValueError(f"mtp=True but neither the target nor {path} has MTP layers for it ({path} {what}); an MTP "
                         "drafter runs the target's own multi-token-prediction layers")
    if model.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft model {path} has vocab_size {model.cfg.vocab_size} but the target has "
                         f"{target.cfg.vocab_size}; a draft model must share the target's tokenizer")
    if model.tokenizer is not None and target.tokenizer is not None:
        if model.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(f"draft model {path} has a different tokenizer from the target (same size, different"
                             " token ids); a draft model must share the target's tokenizer")
    return DraftModelDrafter(model.cfg, model.params, attn_impl=model.attn_impl)


def _same_dir(a, b) -> bool:
    return b is not None and Path(a).resolve() == Path(b).resolve()


def _same_model(model, target) -> bool:
    """The same architecture and shapes (the dtype and EOS ids may differ): its MTP layers fit the target."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "family", "qkv_bias", "qk_norm", "tie_word_embeddings", "rope")
    return all(getattr(model.cfg, k) == getattr(target.cfg, k) for k in keep)
