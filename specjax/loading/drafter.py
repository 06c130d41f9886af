"""`load_drafter`: a drafter of any family from its directory, checked against the target it drafts for.

Each family's "from a path" constructor lives here, beside the loading it needs: the drafter
modules know their networks and the loop, never the checkpoint formats (convert/ reads those).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.convert.dflash import is_dflash_config, load_dflash
from specjax.convert.dflash2 import is_dflash2_config, load_dflash2
from specjax.convert.dspark import is_dspark_config, load_dspark
from specjax.convert.dspark_speculators import is_speculators_dspark, load_speculators_dspark
from specjax.convert.eagle3 import load_eagle3
from specjax.convert.eagle3_layouts import is_eagle3_config
from specjax.convert.mtp import check_stored, is_mtp_only, read_mtp_only_dir
from specjax.convert.mtp_standalone import is_standalone_mtp, read_standalone_mtp_dir
from specjax.decoding.drafter import Drafter
from specjax.drafters import dflash as dflash_family
from specjax.drafters import dspark as dspark_family
from specjax.drafters import mtp as mtp_family
from specjax.drafters.dflash import DFlashDrafter
from specjax.drafters.dflash2 import DFlash2Drafter
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.dspark import DSparkDrafter
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.drafters.mtp import MtpDrafter, mtp_config
from specjax.loading.target import load
from specjax.models.decoder import has_layer_list
from specjax.models.target import Target
from specjax.models.sharding import abstract, param_shardings, place, replicated
from specjax.multihost import to_host
from specjax.quant.qarray import is_quantized


def drafter_family(path: str | Path) -> str:
    """'dspark', 'dflash2', 'dflash', 'eagle3', 'mtp' or 'draft_model', from the directory's config.json.

    DeepSpec DSpark drafters (and DeepSpec's DFlash ones, the same class with markov_rank 0) say so by
    the Qwen3DSparkModel architecture (or DSpark's config fields).

    DFlash drafters (z-lab) say so by the DFlashDraftModel architecture or a `dflash_config`; DFlash2 ones (z-lab's
    DFlash2DraftModel) by that architecture or dflash_config's conv / selector fields.

    EAGLE-3 heads in any producer's layout say so (convert/eagle3_layouts.py `is_eagle3_config`): an
    `eagle_config` (SGLang, ModelOpt), an architecture named *Eagle3* (SpecForge, DeepSpec), a `draft_vocab_size`
    (SafeAILab, whose architecture is plain LlamaForCausalLM with one layer) or a speculators config.
    An MTP-only directory (MTP tensors without their target, convert/mtp.py) by `specjax_mtp_only`.
    """
    config = Path(path) / "config.json"
    if not config.is_file():
        refuse_variant_root(Path(path))
        raise FileNotFoundError(f"{config} does not exist: a drafter directory needs its config.json")
    hf = json.loads(config.read_text())
    if is_dspark_config(hf) or is_speculators_dspark(hf):  # DeepSpec's (and DFlash, rank 0) or speculators' DSpark
        return "dspark"
    if is_dflash2_config(hf):
        return "dflash2"
    if is_dflash_config(hf):
        return "dflash"
    if is_eagle3_config(hf):
        return "eagle3"
    if is_mtp_only(hf) or is_standalone_mtp(hf):
        return "mtp"
    return "draft_model"


def refuse_variant_root(path: Path) -> None:
    """A repository that publishes its head in several subdirectories (EAGLE-3 heads with `compressed/`, a reduced
    draft vocabulary with `d2t`, beside `full/`, the whole vocabulary) has no config.json at its root: no variant
    is the obvious one (the reduced vocabulary drafts faster, the full one may accept more), so the root is refused
    with each subdirectory named and described, for the caller to pick."""
    variants = sorted(p for p in path.iterdir() if (p / "config.json").is_file()) if path.is_dir() else []
    if not variants:
        return

    def describe(sub: Path) -> str:
        hf = json.loads((sub / "config.json").read_text())
        layer = hf.get("transformer_layer_config") or {}
        vocab = hf.get("vocab_size") or layer.get("vocab_size")
        draft = hf.get("draft_vocab_size") or vocab
        if draft is None:
            return f"{sub.name}/"
        kind = "the whole vocabulary" if draft == vocab else f"a draft vocabulary of {draft} tokens (d2t)"
        return f"{sub.name}/ ({kind})"

    raise ValueError(f"{path} holds no config.json but {len(variants)} drafter variants in subdirectories: "
                     f"{', '.join(describe(v) for v in variants)}; load one of them, e.g. "
                     f"load_drafter('{variants[0]}', target)")


def load_drafter(path: str | Path, target, *, attn_impl: str | None = None, mtp: bool | None = None,
                 rope_theta: float | None = None, norm_output: bool | None = None) -> Drafter:
    """Load a drafter checkpoint for `target`, detecting its family, refusing one that does not fit it.

    - A DeepSpec DSpark drafter (Qwen3DSparkModel; its `dflash_*_block7` checkpoints too, Markov rank 0)
      becomes a `DSparkDrafter` with its own embedding and lm_head copies; hidden size, vocabulary, block,
      mask token and tap layers are checked against the target.
    - A z-lab DFlash drafter becomes a `DFlashDrafter` reading the target's features and using its
      embedding and lm_head; hidden size, vocabulary, mask token and tap layers are checked. A z-lab DFlash2
      drafter (DFlash2DraftModel: convolutions, candidate selector) becomes a `DFlash2Drafter` the same way.
    - An EAGLE-3 head in any producer's layout (SafeAILab, SpecForge, speculators, ModelOpt, DeepSpec;
      convert/eagle3_layouts.py) becomes an `Eagle3Drafter` reading the target's features; hidden size,
      vocabulary, d2t and tap layers are checked against the target.
    - The target's own directory, when its checkpoint carries MTP layers (or `mtp=True`), gives
      the target's `MtpDrafter`; so does another directory of the same model (same config.json
      shape) whose checkpoint carries them. `mtp=False` loads such a directory as a draft model.
    - An MTP-only directory (only MTP tensors + the target's config.json, `specjax_mtp_only`; what
      scripts/train_mtp.py writes) gives an `MtpDrafter` with those layers on `target`; so does a standalone
      MTP repository (`model_type: qwen3_5_mtp`, mlx-vlm's splitter; convert/mtp_standalone.py).
    - A directory holding a dense decoder (specjax checkpoint or Hugging Face dir) becomes a draft
      model; it must have the target's vocabulary and, when both carry one, the same tokenizer.

    Args:
        path: the drafter's directory (or the target's own, for its MTP layers).
        target: the `Target` it drafts for (from `specjax.load`); the drafter follows its mesh.
        attn_impl: the drafter's attention ("xla", "pallas", "auto"); default the target's.
        mtp: True takes a directory's MTP layers, False loads it as a draft model; None decides from the checkpoint.
        rope_theta: overrides the RoPE base a head's own config gives (EAGLE-3, DFlash, DSpark): for a head trained
            at another base than its config says, e.g. SpecForge's Qwen3 heads trained before its RoPE fix of
            2025-10-30 (trained at 10000, config 1e6; acceptance far below the published figure tells). MTP layers
            and draft models have no head config of their own to override: refused there.
        norm_output: how to read an EAGLE-3.1 head's `norm_output` (True: the final norm's output is fed back, as
            vLLM, SGLang and SpecForge since its PR #879 mean it; False: plain EAGLE-3); required for a SpecForge
            (`midlayer.*`) head whose config sets it, whose meaning changed across SpecForge versions
            (convert/eagle3_layouts.py); EAGLE-3 heads only.

    Returns:
        A drafter for `specjax.generate(..., drafter=...)`, `stream`, `inspect_draft` and the engine.

    Raises:
        TypeError: `target` is not a specjax Target.
        ValueError: a drafter that does not fit the target (hidden size, vocabulary, tokenizer, d2t, tap layers,
            block size, mask token; both sides named), an unknown or refused layout, or rope_theta / norm_output
            where it has no meaning.

    Example:
        ```python
        drafter = specjax.load_drafter(specjax.embedded("eagle3"), target)
        ```
    """
    if not isinstance(target, Target):
        raise TypeError(f"load_drafter's second argument is the target the drafter serves, a specjax Target "
                        f"(target = specjax.load(path)); got {type(target).__name__}")
    family = drafter_family(path)
    if rope_theta is not None and family not in ("eagle3", "dflash", "dflash2", "dspark"):
        what = "MTP layers run with the target's RoPE" if family == "mtp" else \
            "a draft model is a whole model: correct the rope_theta in its own config.json"
        raise ValueError(f"rope_theta= overrides the RoPE base of an EAGLE-3, DFlash or DSpark head's own config; "
                         f"{path} is a {family} drafter ({what})")
    if norm_output is not None and family != "eagle3":
        raise ValueError(f"norm_output= says how an EAGLE-3.1 head's config is read; {path} is a {family} drafter")
    if family == "dspark":
        return dspark_drafter(path, target, attn_impl=attn_impl, rope_theta=rope_theta)
    if family == "dflash":
        return dflash_drafter(path, target, attn_impl=attn_impl, rope_theta=rope_theta)
    if family == "dflash2":
        return dflash2_drafter(path, target, attn_impl=attn_impl, rope_theta=rope_theta)
    if family == "eagle3":
        return eagle3_drafter(path, target, attn_impl=attn_impl, rope_theta=rope_theta, norm_output=norm_output)
    if family == "mtp":
        if mtp is False:
            raise ValueError(f"{path} holds only MTP layers (no model to load as a draft model); drop mtp=False")
        hf = json.loads((Path(path) / "config.json").read_text())
        read = read_standalone_mtp_dir if is_standalone_mtp(hf) else read_mtp_only_dir
        return mtp_drafter(target, attn_impl=attn_impl, stored=read(path, target.cfg))
    own = getattr(target, "mtp", None) is not None
    same_dir = _same_dir(path, getattr(target, "path", None))
    if mtp or (mtp is None and own and same_dir):
        if own or same_dir:
            return mtp_drafter(target, attn_impl=attn_impl)  # ValueError when the target has none
    if same_dir:
        raise ValueError(
            f"{path} is the target's own directory and carries no MTP layers: loading it as a draft model would "
            f"draft with the target itself (every draft accepted, each token paid twice). For MTP pass a directory of "
            f"MTP layers trained for this target (the shipped one: checkpoints/tiny/mtp, or specjax.embedded('mtp')); "
            f"for a draft model, a smaller model with the same tokenizer; or an EAGLE-3/DFlash/DSpark head")
    model = load(path, attn_impl=attn_impl or target.attn_impl, mesh=target_mesh(target),
                 rules=getattr(target, "rules", None))
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
    if _same_model(model, target):
        warnings.warn(f"the draft model {path} has the target's own architecture and size: drafting costs as much as "
                      f"verifying, so speculation runs slower than plain decoding; a draft model should be several "
                      f"times smaller than the target", UserWarning, stacklevel=2)
    return DraftModelDrafter(model.cfg, model.params, attn_impl=model.attn_impl)


def _same_dir(a, b) -> bool:
    return b is not None and Path(a).resolve() == Path(b).resolve()


def _same_model(model, target) -> bool:
    """The same architecture and shapes (the dtype and EOS ids may differ): its MTP layers fit the target."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "family", "qkv_bias", "qk_norm", "tie_word_embeddings", "rope")
    return all(getattr(model.cfg, k) == getattr(target.cfg, k) for k in keep)


def eagle3_drafter(path, target, *, dtype: str | None = None, attn_impl: str | None = None,
                   rope_theta: float | None = None, norm_output: bool | None = None) -> Eagle3Drafter:
    """An Eagle3Drafter from an EAGLE-3 head directory (any producer's layout), checked against `target`.

    Uses the checkpoint's embedding when it has one, else the target's (the same array, not a copy); a head
    without an lm_head of its own (ModelOpt) scores with the target's lm_head (or its tied embedding).
    """

    cfg, host = load_eagle3(path, target.cfg, dtype or target.cfg.dtype, rope_theta=rope_theta,
                            norm_output=norm_output)
    params = head_params(host, target)
    params.setdefault("embed", target.params["embed"])
    if cfg.lm_head == "target":
        params["lm_head"] = target.params["lm_head"]
    return Eagle3Drafter(cfg, params, attn_impl=attn_impl or target.attn_impl)


def _with_theta(layers, rope_theta: float | None):
    """A block drafter's layer config with its RoPE base overridden (load_drafter's rope_theta)."""
    if rope_theta is None:
        return layers
    return dataclasses.replace(layers, rope=dataclasses.replace(layers.rope, theta=float(rope_theta)))


def dflash_drafter(path, target, *, dtype: str | None = None, attn_impl: str | None = None,
                   rope_theta: float | None = None) -> DFlashDrafter:
    """A DFlashDrafter from a z-lab DFlash checkpoint directory, checked against `target`.

    The drafter uses the target's embed and lm_head (the same arrays, not copies) and the
    target's layer layout (per-layer on CPU, stacked elsewhere).
    """

    cfg, host = load_dflash(path, target.cfg, dtype or target.cfg.dtype)
    cfg = dataclasses.replace(cfg, layers=_with_theta(cfg.layers, rope_theta))
    block = head_params(host, target)
    params = dflash_family.drafter_params(block, target.params, target.cfg.tie_word_embeddings, has_layer_list(target.params))
    return DFlashDrafter(cfg, params, attn_impl=attn_impl or target.attn_impl)


def dflash2_drafter(path, target, *, dtype: str | None = None, attn_impl: str | None = None,
                    rope_theta: float | None = None) -> DFlash2Drafter:
    """A DFlash2Drafter from a z-lab DFlash2 checkpoint directory, checked against `target`.

    The drafter uses the target's embed and lm_head (the same arrays); its own layers are per-layer whatever the
    target's layout (its block runs unrolled: a convolution pair and a windowed attention per layer).
    """
    cfg, head, host = load_dflash2(path, target.cfg, dtype or target.cfg.dtype)
    cfg = dataclasses.replace(cfg, layers=_with_theta(cfg.layers, rope_theta))
    params = dflash_family.drafter_params(head_params(host, target), target.params,
                                         target.cfg.tie_word_embeddings, per_layer=True)
    return DFlash2Drafter(cfg, params, attn_impl=attn_impl or target.attn_impl, head=head)


def dspark_drafter(path, target, *, dtype: str | None = None, attn_impl: str | None = None,
                   rope_theta: float | None = None) -> DSparkDrafter:
    """A DSparkDrafter from a DeepSpec or speculators DSpark checkpoint directory, checked against `target`.

    DSpark carries its own embedding and lm_head (frozen copies of the target's). A
    `confidence_calibration.json` beside the weights (drafters/confidence.save_calibration) supplies
    the confidence temperatures. The layer layout follows the target's (per-layer on CPU).
    """

    if is_speculators_dspark(json.loads((Path(path) / "config.json").read_text())):
        cfg, block, heads = load_speculators_dspark(path, target.cfg, dtype or target.cfg.dtype)
    else:
        embed = to_host(target.params["embed"])  # split over the model axis, maybe over other processes' devices
        lm_head = to_host(target.params["lm_head"]) if "lm_head" in target.params else embed.T
        cfg, block, heads = load_dspark(path, target.cfg, dtype or target.cfg.dtype, target_tables=(embed, lm_head))
    cfg = dataclasses.replace(cfg, block=dataclasses.replace(cfg.block, layers=_with_theta(cfg.block.layers,
                                                                                           rope_theta)))
    params = dspark_family.drafter_params(head_params(block, target), head_params(heads, target),
                                          has_layer_list(target.params))
    return DSparkDrafter(cfg, params, attn_impl=attn_impl or target.attn_impl)


def mtp_drafter(target, *, attn_impl: str | None = None, stored: dict | None = None) -> MtpDrafter:
    """The MtpDrafter of a target loaded with MTP tensors (`Target.mtp`); ValueError when it has none.

    `stored`: MTP layers read from another copy of the same model (cast to the target's dtype).
    """
    stored = stored if stored is not None else getattr(target, "mtp", None)
    if stored is None:
        where = f" ({target.path})" if getattr(target, "path", None) is not None else ""
        raise ValueError(f"the target{where} has no MTP layers: its checkpoint carries no multi-token-prediction "
                         "tensors (model.layers.{num_hidden_layers}.eh_proj... or mtp.fc...), so there is no MTP "
                         "drafter; use a draft model, an EAGLE-3 head or NgramDrafter instead")

    check_stored(stored, target.cfg)
    mesh = target_mesh(target)
    cast = np.asarray if mesh is not None else jnp.asarray  # on a mesh, placed below slice by slice
    # plain weights in the target's dtype; a quantized one (an FP8 checkpoint's MTP linears) keeps its parts' dtypes
    stored = jax.tree.map(lambda x: jax.tree.map(cast, x) if is_quantized(x) else cast(x, jnp.dtype(target.cfg.dtype)),
                          stored, is_leaf=is_quantized)
    cfg = mtp_config(target.cfg, stored)
    params = mtp_family.drafter_params(stored, target.params, target.cfg)
    if mesh is not None:  # the MTP blocks are target layers: split by the same rules as the target's
        params = place(params, param_shardings(mtp_family.head_of(cfg, abstract(params)), target.cfg, mesh,
                                               getattr(target, "rules", None)))
    return MtpDrafter(cfg, params, attn_impl=attn_impl or target.attn_impl)


def target_mesh(target):
    """The mesh the target is split over (None: one device); its drafters follow it."""
    return getattr(target, "mesh", None)


def head_params(host: dict, target) -> dict:
    """A small head's weights (EAGLE-3, DFlash, DSpark) on the device; on the target's mesh, replicated on every
    device: a head is a few layers whose matmuls are too small to split (models/sharding.py)."""
    mesh = target_mesh(target)
    if mesh is None:
        return jax.tree.map(jnp.asarray, host)
    return place(host, replicated(host, mesh))
