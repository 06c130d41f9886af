"""Write specjax models back to the formats the ecosystem loads (`specjax export SRC DST`).

Targets and draft models (a converted specjax checkpoint: orbax params + config.json) become a
Hugging Face directory: config.json (the original, with `torch_dtype` set to what was written),
model.safetensors with torch's [out, in] layout and transformers' tensor names, and the
tokenizer files copied. transformers' `AutoModelForCausalLM.from_pretrained` loads it
(tests/test_export.py checks the logits). This is the inverse of `convert/hf.py`.

MTP layers (convert/mtp.py) go back in the layout they came from: DeepSeek-V3's extra
`model.layers.{L + j}.*` (config `num_nextn_predict_layers`) or Qwen3-Next's `mtp.*` (config
`mtp_num_hidden_layers`), so `specjax.load` of the export gives the same `Target.mtp`.
DeepSeek-V3 layers are written with their own `embed_tokens` and `shared_head.head`, as
DeepSeek-V3 ships them and vLLM / SGLang's DeepSeek MTP modules load them by those names; when
specjax dropped them on reading (equal to the target's), the target's embedding / lm_head are
written there, which the reader drops again. An MTP-only directory (`specjax_mtp_only`, what
scripts/train_mtp.py writes) is exported together with its target (`--target`): one directory
holding the target's tensors, the MTP tensors, the layer count and the target's tokenizer files.
transformers loads that as a plain causal LM (it ignores the MTP tensors, with a warning).

EAGLE-3 heads go back in the layout they came from (`Eagle3Config.layout`: SafeAILab, SpecForge,
speculators, ModelOpt or DeepSpec; convert/eagle3_layouts.py writes each config.json and convert/eagle3.py
reads it back): the producer's config fields (the taps in its numbering) and its tensor names and key set
(`eagle3_tensors`: which of d2t / t2d / lm_head / embed_tokens each producer saves). The source is a loaded
head (`drafter.cfg`, `drafter.params`, from Python: `export_eagle3`), an EAGLE-3 head directory re-written with
its target (`specjax export HEAD DST --target T`), or an EAGLE-3 training run (see `scripts/train_eagle3.py`:
its orbax checkpoints and `eagle3_head.json`; SafeAILab's layout).

DFlash heads (z-lab, `DFlashDraftModel`) and DSpark heads (DeepSpec, `Qwen3DSparkModel`) are written
in their originals' formats (convert/dflash.py, convert/dspark.py read them back): config.json and
model.safetensors with fc, hidden_norm, norm and layers.{i}.* (DSpark adds markov_head.* and
confidence_head.proj.* and its embed_tokens / lm_head copies). `export_dflash` / `export_dspark`
write one from a config and params (what scripts/train_block.py ships); `specjax export` of such a
directory re-writes it in the original's format: a DFlash directory as it is (cast to --dtype), a
DSpark directory with the embed_tokens / lm_head copies DeepSpec's loader needs taken from the target
(--target, or the directory's `specjax_tables_from_target` reference) when the directory left them out.

Every write goes to a temporary sibling directory renamed into place at the end (an existing
destination is replaced only with overwrite, and survives until the new one is complete).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from tokenizers import Tokenizer

from specjax.config import ModelConfig
from specjax.convert import checkpoint, eagle3_layouts
from specjax.convert.dflash import LAYER_KEYS as BLOCK_LAYER_KEYS
from specjax.convert.dflash import TOP_KEYS as BLOCK_TOP_KEYS
from specjax.convert.dflash import is_dflash_config
from specjax.convert.dspark import CALIBRATION_FILE, TABLES_FROM_TARGET, is_dspark_config
from specjax.convert.eagle3 import _LAYER_KEYS as HEAD_LAYER_KEYS
from specjax.convert.eagle3 import load_eagle3
from specjax.convert.hf import load_hf
from specjax.convert.hf_files import LAYER_KEYS as MODEL_LAYER_KEYS
from specjax.convert.hf_files import read_json, read_tensors, safetensors_files
from specjax.convert.moe import moe_hf_tensors
from specjax.convert.mtp import MTP_ONLY_KEY, is_mtp_only, mtp_hf_tensors, read_mtp_only_dir
from specjax.convert.qwen35 import hybrid_hf_tensors, text_model_config
from specjax.drafters.dflash import BlockConfig
from specjax.drafters.dspark import DSparkConfig
from specjax.drafters.eagle3 import Eagle3Config
from specjax.models.decoder import layer_list, unstack_layers

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
EAGLE3_RUN_FILE = "eagle3_head.json"  # in a training run dir: {"config": head config.json, "d2t": [...]}


# ---- writing a directory -----------------------------------------------------------------------------------


def write_hf_dir(dst: str | Path, config: dict, tensors: dict[str, np.ndarray], *,
                 extra_files: dict[str, Path] | None = None, extra_json: dict[str, dict] | None = None,
                 overwrite: bool = False) -> Path:
    """config.json + model.safetensors (+ files copied, + JSON files written) at dst, atomically (temp dir + rename)."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; choose a new destination or pass overwrite=True "
                              "(specjax export --overwrite)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        checkpoint.copy_files(extra_files or {}, tmp)
        for name, content in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
        _publishable(tmp)
        checkpoint._replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _publishable(directory: Path) -> None:
    """Ordinary permissions under the umask (mkdtemp makes 0700; safetensors may write 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


def _cast(x, dtype: str) -> np.ndarray:
    if dtype not in NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(NP_DTYPES)}, got {dtype!r}")
    return np.asarray(x).astype(NP_DTYPES[dtype])


# ---- targets and draft models -----------------------------------------------------------------------------


def model_tensors(params: dict, cfg: ModelConfig, dtype: str) -> dict[str, np.ndarray]:
    """transformers' tensors ([out, in]) of a decoder's params (stacked or per-layer; a hybrid's per-layer)."""
    if cfg.is_hybrid:
        return {name: _cast(value, dtype) for name, value in hybrid_hf_tensors(params, cfg).items()}
    per_layer = layer_list(unstack_layers(params))
    if len(per_layer) != cfg.num_layers:
        raise ValueError(f"params have {len(per_layer)} layers but config.json says {cfg.num_layers}")
    tensors = {"model.embed_tokens.weight": _cast(params["embed"], dtype),
               "model.norm.weight": _cast(params["final_norm"], dtype)}
    for i, p in enumerate(per_layer):
        for key, value in p.items():
            if key == "moe":  # Qwen3-MoE publishes one tensor per expert
                moe = moe_hf_tensors(value, f"model.layers.{i}.", fused=False)
                tensors.update({name: _cast(t, dtype) for name, t in moe.items()})
                continue
            if key not in MODEL_LAYER_KEYS:
                raise ValueError(f"layer {i} has a parameter '{key}' with no Hugging Face name")
            name, transpose = MODEL_LAYER_KEYS[key]
            tensors[f"model.layers.{i}.{name}"] = _cast(np.asarray(value).T if transpose else value, dtype)
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = _cast(np.asarray(params["lm_head"]).T, dtype)
    return tensors


def mtp_tensors(stored: dict, params: dict, cfg: ModelConfig, dtype: str) -> dict[str, np.ndarray]:
    """The checkpoint tensors of stored MTP layers (`Target.mtp`) in their own layout, cast to dtype.

    DeepSeek-V3 layers get `embed_tokens` / `shared_head.head` (the target's when not their own).
    """
    tensors = {name: _cast(value, dtype) for name, value in mtp_hf_tensors(stored, cfg).items()}
    if "fc" not in stored:  # deepseek: per-layer tables, as DeepSeek-V3 ships them
        embed = _cast(params["embed"], dtype)
        head = embed if cfg.tie_word_embeddings else _cast(np.asarray(params["lm_head"]).T, dtype)
        for j in stored["layers"]:
            prefix = f"model.layers.{cfg.num_layers + int(j)}."
            tensors.setdefault(prefix + "embed_tokens.weight", embed)
            tensors.setdefault(prefix + "shared_head.head.weight", head)
    return tensors


def mtp_config_keys(stored: dict) -> dict[str, int]:
    """The config.json layer count of stored MTP layers, under their layout's key."""
    key = "mtp_num_hidden_layers" if "fc" in stored else "num_nextn_predict_layers"
    return {key: len(stored["layers"])}


def _hf_config(hf_config: dict, dtype: str, stored_mtp: dict | None) -> dict:
    """config.json of an export: the source's (a multimodal Qwen3.5 as its text model, whose tensors are written)."""
    config = {k: v for k, v in text_model_config(hf_config).items() if k not in ("dtype", MTP_ONLY_KEY)}
    if stored_mtp is not None:
        config.update(mtp_config_keys(stored_mtp))
    config["torch_dtype"] = dtype
    return config


def side_configs(directory: Path, hf_config: dict) -> dict[str, dict]:
    """generation_config.json and tokenizer_config.json for a model directory that lacks them (the source's own are
    copied instead): without them transformers' AutoTokenizer loads bos/eos as None and generate stops nowhere.
    Both are made from config.json's token ids; the token strings come from the source's tokenizer.json."""
    out: dict[str, dict] = {}
    ids = {k: hf_config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if not (directory / "generation_config.json").is_file():
        out["generation_config.json"] = {**{k: v for k, v in ids.items() if v is not None}, "_from_model_config": True}
    if (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))

        def token(key: str) -> str | None:
            value = ids[key][0] if isinstance(ids[key], list) and ids[key] else ids[key]
            return None if value is None else tokenizer.id_to_token(int(value))

        fields = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos_token_id"),
                  "eos_token": token("eos_token_id"), "pad_token": token("pad_token_id"),
                  "model_max_length": hf_config.get("max_position_embeddings"), "clean_up_tokenization_spaces": False}
        out["tokenizer_config.json"] = {k: v for k, v in fields.items() if v is not None}
    return out


def export_model(src: str | Path, dst: str | Path, *, dtype: str | None = None, overwrite: bool = False) -> Path:
    """A converted specjax checkpoint (target or draft model, with its MTP layers) -> a Hugging Face directory."""
    src = Path(src)
    params, hf_config, meta = checkpoint.restore(src)
    dtype = dtype or meta.get("dtype", "float32")
    cfg = ModelConfig.from_hf(hf_config, dtype=dtype)
    stored = params.get("mtp")
    tensors = model_tensors(params, cfg, dtype)
    if stored is not None:
        tensors.update(mtp_tensors(stored, params, cfg, dtype))
    return write_hf_dir(dst, _hf_config(hf_config, dtype, stored), tensors,
                        extra_files=checkpoint.tokenizer_files(src), extra_json=side_configs(src, hf_config),
                        overwrite=overwrite)


def _read_target(target: Path, dtype: str | None) -> tuple[dict, dict, str]:
    """(host params, config.json, dtype) of a target: a converted specjax checkpoint or a Hugging Face dir."""
    if checkpoint.is_checkpoint(target):
        params, hf_config, meta = checkpoint.restore(target)
        return params, hf_config, dtype or meta.get("dtype", "float32")
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"target {target} is neither a converted specjax checkpoint nor a Hugging Face "
                                "model directory (config.json + safetensors)")
    hf_config = read_json(target / "config.json")
    if isinstance(hf_config, dict) and is_mtp_only(hf_config):
        raise ValueError(f"target {target} is itself an MTP-only directory; --target is the model the MTP layers "
                         "were made for")
    hf_config, cfg, params = load_hf(target, dtype=dtype)
    return params, hf_config, cfg.dtype


def export_mtp_only(src: str | Path, target: str | Path, dst: str | Path, *, dtype: str | None = None,
                    overwrite: bool = False) -> Path:
    """An MTP-only directory + its target -> one Hugging Face directory carrying the MTP layers.

    The target's tensors, config.json (+ the MTP layer count) and tokenizer files, and the MTP
    tensors under the names they have inside a target's checkpoint (DeepSeek-V3's
    model.layers.{L + j}.* for the DeepSeek layout): what `specjax.load` / `load_drafter` and
    MTP-aware servers read. dtype defaults to the target's.
    """
    src, target = Path(src), Path(target)
    if not target.exists():
        raise FileNotFoundError(f"target {target} does not exist")
    params, hf_config, dtype = _read_target(target, dtype)
    if params.get("mtp") is not None:
        raise ValueError(f"target {target} already carries MTP layers; export it alone, or pass a target without "
                         f"them to add the layers of {src}")
    cfg = ModelConfig.from_hf(hf_config, dtype=dtype)
    stored = read_mtp_only_dir(src, cfg)  # ValueError when it was made for a target of another shape
    tensors = model_tensors(params, cfg, dtype)
    tensors.update(mtp_tensors(stored, params, cfg, dtype))
    return write_hf_dir(dst, _hf_config(hf_config, dtype, stored), tensors,
                        extra_files=checkpoint.tokenizer_files(target), extra_json=side_configs(target, hf_config),
                        overwrite=overwrite)


# ---- EAGLE-3 heads ----------------------------------------------------------------------------------------


def eagle3_hf_config(cfg: Eagle3Config, dtype: str | None = None, source: dict | None = None) -> dict[str, Any]:
    """The config.json of a head in its layout (cfg.layout): what `convert.eagle3.eagle3_config` reads back to
    `cfg`; `source`, the producer's own config.json, keeps its other keys."""
    return eagle3_layouts.write_config(cfg, dtype or cfg.dtype, source)


def check_eagle3_layout(cfg: Eagle3Config, layout: str) -> None:
    """A head can be written in `layout` only when that layout can hold it (and its producer can run it)."""
    if layout not in eagle3_layouts.LAYOUTS:
        raise ValueError(f"EAGLE-3 layout must be one of {eagle3_layouts.LAYOUTS}, got {layout!r}")
    problems = []
    if cfg.num_layers > 1 and layout not in ("speculators", "modelopt"):
        problems.append(f"{cfg.num_layers} decoder layers (only speculators and ModelOpt heads have several)")
    if cfg.qk_norm and layout not in ("speculators", "deepspec"):
        problems.append("q/k norms (speculators' qwen3 heads and DeepSpec's have them)")
    if not cfg.qk_norm and layout == "deepspec":
        problems.append("no q/k norms (DeepSpec's Qwen3Eagle3Model has them)")
    if cfg.lm_head != "own" and layout != "modelopt":
        problems.append("no lm_head of its own (only ModelOpt exports may leave it to the target)")
    if layout == "deepspec" and (cfg.draft_vocab_size != cfg.vocab_size or cfg.num_taps != 5):
        problems.append("DeepSpec heads draft over the whole vocabulary from five taps")
    if cfg.num_taps != 3 and layout in ("safeailab", "specforge"):
        problems.append(f"{cfg.num_taps} taps (SafeAILab and SpecForge heads read three)")
    if cfg.norm_before_residual and layout not in ("speculators", "modelopt"):
        problems.append("norm_before_residual (a speculators / vLLM flag)")
    if cfg.norm_output and layout in ("safeailab", "specforge"):
        problems.append("norm_output (SpecForge's versions read it two ways; eagle3_layouts.NORM_OUTPUT_VERSIONS)")
    if (cfg.fc_norm or cfg.norm_before_fc) and layout == "deepspec":
        problems.append("fc_norm / norm_before_fc (DeepSpec's Qwen3Eagle3Model has neither)")
    if problems:
        raise ValueError(f"this EAGLE-3 head cannot be written in the {layout} layout: it has {'; '.join(problems)}")


def _layer_tensors(prefix: str, layer: dict, names: dict[str, tuple[str, bool]], dtype: str) -> dict[str, np.ndarray]:
    return {prefix + names[k][0]: _cast(np.asarray(v).T if names[k][1] else v, dtype) for k, v in layer.items()}


def eagle3_tensors(params: dict, dtype: str, *, layout: str = "safeailab", vocab_size: int,
                   include_embed: bool | None = None) -> dict[str, np.ndarray]:
    """The tensors of a head's params ([in, out] -> [out, in]) under its layout's names, as its producer saves them:
    SafeAILab / SpecForge keep d2t (int64) and t2d (bool) always; speculators both when the draft vocabulary is
    reduced (its DraftVocabMixin); ModelOpt d2t only then, never t2d or the embedding (EagleExporter); DeepSpec
    neither map. lm_head is written when params hold one (a head scored by the target's has none). The embedding (`params["embed"]`) by default where the producer saves it: speculators, DeepSpec."""
    d2t = np.asarray(params["d2t"]).astype(np.int64)
    tensors = {"fc.weight": _cast(np.asarray(params["fc"]).T, dtype), "norm.weight": _cast(params["final_norm"], dtype)}
    for i, w in enumerate(params.get("fc_norm", ())):  # EAGLE-3.1 norms, named as vLLM, speculators, SpecForge read
        tensors[f"fc_norm.{i}.weight"] = _cast(w, dtype)
    if "input_norm" in params:
        tensors["input_norm.weight"] = _cast(params["input_norm"], dtype)
    if "lm_head" in params:
        tensors["lm_head.weight"] = _cast(np.asarray(params["lm_head"]).T, dtype)
    first = {k: (name, not k.endswith("norm")) for k, name in HEAD_LAYER_KEYS.items()}
    tensors.update(_layer_tensors(eagle3_layouts.layer_prefix(layout, 0), params["layer"], first, dtype))
    for i, layer in (params.get("extra_layers") or {}).items():
        tensors.update(_layer_tensors(eagle3_layouts.layer_prefix(layout, int(i) + 1), layer, MODEL_LAYER_KEYS, dtype))
    target_ids = np.arange(len(d2t)) + d2t
    if target_ids.min() < 0 or target_ids.max() >= vocab_size:
        raise ValueError(f"d2t maps draft ids outside the target's vocabulary of {vocab_size} tokens")
    reduced = len(d2t) < vocab_size
    if layout in ("safeailab", "specforge") or (layout == "speculators" and reduced):
        t2d = np.zeros(vocab_size, bool)
        t2d[target_ids] = True
        tensors["d2t"], tensors["t2d"] = d2t, t2d
    elif layout == "modelopt" and reduced:
        tensors["d2t"] = d2t
    if include_embed is None:
        include_embed = layout in ("speculators", "deepspec")
    if include_embed:
        if "embed" not in params:
            raise ValueError(f"a {layout} head is saved with its embedding table; pass params with 'embed' (the "
                             "target's table)")
        tensors["embed_tokens.weight"] = _cast(params["embed"], dtype)
    return tensors


def export_eagle3(cfg: Eagle3Config, params: dict, dst: str | Path, *, dtype: str | None = None,
                  layout: str | None = None, include_embed: bool | None = None, source_config: dict | None = None,
                  overwrite: bool = False) -> Path:
    """Write an EAGLE-3 head (config + params with `d2t`; a loaded drafter's `.cfg` / `.params`) in its layout
    (cfg.layout, or `layout` when it can hold the head): config.json (the producer's keys; `source_config`, the
    original config.json, keeps its other fields) and model.safetensors under the producer's tensor names."""
    dtype = dtype or cfg.dtype
    layout = layout or cfg.layout
    check_eagle3_layout(cfg, layout)
    cfg = dataclasses.replace(cfg, layout=layout)
    params = {k: v for k, v in params.items() if not (k == "lm_head" and cfg.lm_head != "own")}
    tensors = eagle3_tensors(params, dtype, layout=layout, vocab_size=cfg.vocab_size, include_embed=include_embed)
    return write_hf_dir(dst, eagle3_hf_config(cfg, dtype, source_config), tensors, overwrite=overwrite)


def is_eagle3_run(path: Path) -> bool:
    return (Path(path) / EAGLE3_RUN_FILE).is_file()


def export_eagle3_run(run_dir: str | Path, dst: str | Path, *, dtype: str | None = None,
                      overwrite: bool = False) -> Path:
    """The latest checkpoint of an EAGLE-3 training run -> the SafeAILab format."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    run_dir = Path(run_dir).absolute()
    spec = json.loads((run_dir / EAGLE3_RUN_FILE).read_text())
    with ocp.CheckpointManager(run_dir / "checkpoints") as mgr:
        step = mgr.latest_step()
        if step is None:
            raise FileNotFoundError(f"{run_dir / 'checkpoints'} holds no checkpoint yet: train first")
        params = mgr.restore(step, args=ocp.args.StandardRestore())["params"]
    config = spec["config"]
    dtype = dtype or config.get("torch_dtype", "float32")
    params = {**params, "d2t": np.asarray(spec["d2t"], np.int64)}
    tensors = eagle3_tensors(params, dtype, layout=eagle3_layouts.head_layout(config), vocab_size=config["vocab_size"])
    return write_hf_dir(dst, {**config, "torch_dtype": dtype}, tensors, overwrite=overwrite)


# ---- DFlash and DSpark heads ------------------------------------------------------------------------------


def _block_hf_config(cfg: BlockConfig, num_target_layers: int, dtype: str) -> dict[str, Any]:
    """The Qwen3 fields shared by the DFlash and DSpark config.json of a block backbone."""
    lc = cfg.layers
    if lc.rope.rope_type != "default":
        raise ValueError(f"block drafters are written with default RoPE; this one is {lc.rope.rope_type!r}")
    return {"model_type": "qwen3", "vocab_size": lc.vocab_size, "hidden_size": lc.hidden_size,
            "intermediate_size": lc.intermediate_size, "num_hidden_layers": lc.num_layers,
            "num_attention_heads": lc.num_heads, "num_key_value_heads": lc.num_kv_heads, "head_dim": lc.head_dim,
            "max_position_embeddings": lc.max_position_embeddings, "rms_norm_eps": lc.rms_norm_eps,
            "rope_theta": lc.rope.theta, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "layer_types": ["full_attention"] * lc.num_layers,
            "num_target_layers": num_target_layers, "torch_dtype": dtype}


def dflash_hf_config(cfg: BlockConfig, num_target_layers: int, dtype: str | None = None) -> dict[str, Any]:
    """z-lab's config.json of a DFlash drafter: what `convert.dflash.dflash_config` reads back to `cfg`."""
    config = {"architectures": ["DFlashDraftModel"], **_block_hf_config(cfg, num_target_layers, dtype or
                                                                        cfg.layers.dtype)}
    config["block_size"] = cfg.block_size
    config["dflash_config"] = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.causal:
        config["dflash_config"]["causal_head"] = True
    return config


def block_tensors(params: dict, dtype: str) -> dict[str, np.ndarray]:
    """The backbone's tensors under the originals' names ([in, out] -> torch [out, in]), stacked or per-layer."""

    tensors = {name: _cast(np.asarray(params[key]).T if tr else params[key], dtype)
               for key, (name, tr) in BLOCK_TOP_KEYS.items()}
    for i, p in enumerate(layer_list(unstack_layers(params))):
        for key, (name, tr) in BLOCK_LAYER_KEYS.items():
            tensors[f"layers.{i}.{name}"] = _cast(np.asarray(p[key]).T if tr else p[key], dtype)
    return tensors


def export_dflash(cfg: BlockConfig, params: dict, dst: str | Path, *, num_target_layers: int,
                  dtype: str | None = None, overwrite: bool = False) -> Path:
    """Write a DFlash drafter (block params: fc, hidden_norm, final_norm, layers) in z-lab's format."""
    dtype = dtype or cfg.layers.dtype
    return write_hf_dir(dst, dflash_hf_config(cfg, num_target_layers, dtype), block_tensors(params, dtype),
                        overwrite=overwrite)


def dspark_hf_config(cfg: DSparkConfig, num_target_layers: int, dtype: str | None = None,
                     num_anchors: int = 512) -> dict[str, Any]:
    """DeepSpec's config.json of a DSpark drafter (build_draft_config's fields): what `convert.dspark` reads back."""
    config = {"architectures": ["Qwen3DSparkModel"], **_block_hf_config(cfg.block, num_target_layers,
                                                                          dtype or cfg.block.layers.dtype)}
    config |= {"block_size": cfg.block_size, "mask_token_id": cfg.block.mask_token_id,
               "target_layer_ids": list(cfg.block.target_layer_ids), "num_anchors": num_anchors,
               "markov_rank": cfg.markov_rank, "enable_confidence_head": cfg.confidence}
    if cfg.markov_rank:
        config["markov_head_type"] = cfg.markov_head_type
    if cfg.confidence:
        config["confidence_head_with_markov"] = cfg.confidence_with_markov
    return config


def dspark_tensors(params: dict, cfg: DSparkConfig, dtype: str, include_tables: bool = True) -> dict[str, np.ndarray]:
    """DeepSpec's tensors of DSpark params: the backbone, markov_head.*, confidence_head.proj.* and (with
    include_tables) embed_tokens / lm_head [V, H] (a params dict without `lm_head` has a tied one: the embed)."""
    tensors = block_tensors(params, dtype)
    if cfg.markov_rank:
        tensors["markov_head.markov_w1.weight"] = _cast(params["markov_w1"], dtype)
        tensors["markov_head.markov_w2.weight"] = _cast(params["markov_w2"], dtype)
    if cfg.confidence:
        tensors["confidence_head.proj.weight"] = _cast(np.asarray(params["confidence_w"])[None, :], dtype)
        tensors["confidence_head.proj.bias"] = _cast(np.asarray(params["confidence_b"]).reshape(1), dtype)
    if include_tables:
        embed = _cast(params["embed"], dtype)
        tensors["embed_tokens.weight"] = embed
        tensors["lm_head.weight"] = _cast(np.asarray(params["lm_head"]).T, dtype) if "lm_head" in params else embed
    return tensors


def export_dspark(cfg: DSparkConfig, params: dict, dst: str | Path, *, num_target_layers: int,
                  dtype: str | None = None, tables_from: str | None = None, num_anchors: int = 512,
                  extra_files: dict[str, Path] | None = None, overwrite: bool = False) -> Path:
    """Write a DSpark drafter in DeepSpec's format; with `tables_from` (a path to the target, relative to dst) the
    embed_tokens / lm_head copies are left out and config.json names the target they come from instead."""

    if cfg.draft_vocab_size:
        raise ValueError(f"this DSpark drafter drafts over a pruned vocabulary of {cfg.draft_vocab_size} tokens "
                         "(speculators' d2t), which DeepSpec's format cannot hold; keep its speculators directory")
    dtype = dtype or cfg.block.layers.dtype
    config = dspark_hf_config(cfg, num_target_layers, dtype, num_anchors)
    if tables_from is not None:
        config[TABLES_FROM_TARGET] = {"target": tables_from,
                                   "note": "embed_tokens / lm_head are the target's (tied), not stored here; "
                                           "`specjax export` writes them in"}
    return write_hf_dir(dst, config, dspark_tensors(params, cfg, dtype, include_tables=tables_from is None),
                        extra_files=extra_files, overwrite=overwrite)


def _read_head_dir(src: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, every tensor by name) of a drafter directory."""

    return read_json(src / "config.json"), read_tensors(safetensors_files(src))


def export_dflash_dir(src: str | Path, dst: str | Path, *, dtype: str | None = None,
                      overwrite: bool = False) -> Path:
    """A DFlash directory (z-lab's format, e.g. checkpoints/tiny/dflash) re-written in z-lab's format, cast to dtype."""
    src = Path(src)
    config, tensors = _read_head_dir(src)
    dtype = dtype or config.get("torch_dtype") or "float32"
    config = {**{k: v for k, v in config.items() if k != "dtype"}, "torch_dtype": dtype}
    return write_hf_dir(dst, config, {k: _cast(v, dtype) for k, v in tensors.items()}, overwrite=overwrite)


def export_dspark_dir(src: str | Path, dst: str | Path, *, target: str | Path | None = None,
                      dtype: str | None = None, overwrite: bool = False) -> Path:
    """A DSpark directory re-written in DeepSpec's format, with the embed_tokens / lm_head copies DeepSpec loads.

    When src left them out, they come from `target` (default: the directory's `specjax_tables_from_target`
    reference, relative to src): its embedding, and its lm_head (the embedding when tied).
    A confidence_calibration.json is copied along.
    """
    src = Path(src)
    config, tensors = _read_head_dir(src)
    dtype = dtype or config.get("torch_dtype") or "float32"
    ref = config.pop(TABLES_FROM_TARGET, None)
    missing = [n for n in ("embed_tokens.weight", "lm_head.weight") if n not in tensors]
    if missing:
        if target is None and isinstance(ref, dict) and ref.get("target"):
            target = src / ref["target"]
        if target is None:
            raise ValueError(f"{src} has no {missing} (DSpark's copies of the target's tables): pass the target "
                             "with --target (export(..., target=...))")
        target = Path(target)
        if not target.exists():
            raise FileNotFoundError(f"target {target} does not exist (the DSpark head's embed_tokens / lm_head "
                                    "come from it)")
        params, hf_config, _ = _read_target(target, None)
        embed = np.asarray(params["embed"])
        if embed.shape != (config["vocab_size"], config["hidden_size"]):
            raise ValueError(f"target {target} has an embedding of shape {embed.shape}; the DSpark head needs "
                             f"[{config['vocab_size']}, {config['hidden_size']}]")
        tied = bool(hf_config.get("tie_word_embeddings", False))
        tensors["embed_tokens.weight"] = embed
        tensors["lm_head.weight"] = embed if tied else np.asarray(params["lm_head"]).T
    elif target is not None:
        raise ValueError(f"{src} already carries its embed_tokens / lm_head; --target is not needed")
    config = {**{k: v for k, v in config.items() if k != "dtype"}, "torch_dtype": dtype}
    calibration = src / CALIBRATION_FILE
    extra = {CALIBRATION_FILE: calibration} if calibration.is_file() else None
    return write_hf_dir(dst, config, {k: _cast(v, dtype) for k, v in tensors.items()}, extra_files=extra,
                        overwrite=overwrite)


def export_eagle3_dir(src: str | Path, dst: str | Path, target: str | Path, *, dtype: str | None = None,
                      overwrite: bool = False) -> Path:
    """An EAGLE-3 head directory (any producer's layout) re-written in its own layout, cast to dtype: read with the
    target it drafts for (its taps and, for a ModelOpt head without lm_head, its scoring depend on the target's
    config), written with the source's other config keys kept."""
    src, target = Path(src), Path(target)
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"target {target} has no config.json: pass the head's target (a specjax checkpoint or "
                                "a Hugging Face directory)")
    source = read_json(src / "config.json")
    tcfg = ModelConfig.from_hf(text_model_config(read_json(target / "config.json")))
    cfg, params = load_eagle3(src, tcfg, dtype or eagle3_layouts.torch_dtype(source))
    return export_eagle3(cfg, params, dst, include_embed="embed" in params, source_config=source, overwrite=overwrite)


def _head_family(path: Path) -> str | None:
    """'dflash' / 'dspark' / 'eagle3' for a DFlash, DSpark or EAGLE-3 directory (by its config.json), else None."""

    file = path / "config.json"
    if checkpoint.is_checkpoint(path) or not file.is_file():
        return None
    config = read_json(file)
    if not isinstance(config, dict):
        return None
    if is_dspark_config(config):
        return "dspark"
    if is_dflash_config(config):
        return "dflash"
    return "eagle3" if eagle3_layouts.is_eagle3_config(config) else None


def export(src: str | Path, dst: str | Path, *, dtype: str | None = None, overwrite: bool = False,
           target: str | Path | None = None) -> Path:
    """`specjax export`: a converted target / draft checkpoint, an EAGLE-3 training run, an MTP-only
    directory with its `target`, or a DFlash / DSpark head (a DSpark head without its tables takes them
    from `target` or its own reference), by what src holds."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory: pass a converted specjax checkpoint, an EAGLE-3 "
                                "training run directory or an MTP-only directory")
    if dtype is not None and dtype not in NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(NP_DTYPES)}, got {dtype!r}")
    if _is_mtp_only_dir(src):
        if target is None:
            raise ValueError(f"{src} holds only MTP layers (specjax_mtp_only): pass the target they were made for "
                             "with --target (export(..., target=...)); the export is the target with its MTP layers")
        return export_mtp_only(src, target, dst, dtype=dtype, overwrite=overwrite)
    family = _head_family(src)
    if family == "dspark":
        return export_dspark_dir(src, dst, target=target, dtype=dtype, overwrite=overwrite)
    if family == "dflash":
        if target is not None:
            raise ValueError(f"{src} is a DFlash head, which never carries the target's tables; --target is not "
                             "needed")
        return export_dflash_dir(src, dst, dtype=dtype, overwrite=overwrite)
    if family == "eagle3":
        if target is None:
            raise ValueError(f"{src} is an EAGLE-3 head: pass the target it drafts for with --target "
                             "(export(..., target=...)); the head is re-written in its own layout")
        return export_eagle3_dir(src, dst, target, dtype=dtype, overwrite=overwrite)
    if target is not None:
        raise ValueError(f"--target is for exporting an MTP-only directory, a DSpark or an EAGLE-3 head with its "
                         f"target; {src} is none of them")
    if checkpoint.is_checkpoint(src):
        return export_model(src, dst, dtype=dtype, overwrite=overwrite)
    if is_eagle3_run(src):
        return export_eagle3_run(src, dst, dtype=dtype, overwrite=overwrite)
    if (src / "config.json").is_file():
        raise ValueError(f"{src} is already a Hugging Face / SafeAILab directory (config.json without "
                         f"{checkpoint.MARKER}); export writes specjax checkpoints and training runs back to that format")
    raise ValueError(f"{src} is neither a converted specjax checkpoint ({checkpoint.MARKER}) nor an EAGLE-3 training "
                     f"run ({EAGLE3_RUN_FILE})")


def _is_mtp_only_dir(path: Path) -> bool:
    file = path / "config.json"
    if checkpoint.is_checkpoint(path) or not file.is_file():
        return False
    config = read_json(file)
    return isinstance(config, dict) and is_mtp_only(config)
