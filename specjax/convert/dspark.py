"""Read a DeepSpec DSpark checkpoint (`Qwen3DSparkModel`) and check it fits a target.

DeepSpec saves the drafter with `save_pretrained`: config.json is the target's Qwen3 config
(deep-copied) with architectures ["Qwen3DSparkModel"], num_hidden_layers = the drafter's layers,
and these fields added:
    target_layer_ids      taps, "output of layer id" (HF hidden_states[id + 1]; -1 = the embeddings);
                          strictly increasing, never the target's last layer
    num_target_layers     the target's layer count
    block_size            gamma: rows per block, the anchor included; every row is a draft
    mask_token_id         the token whose embedding fills rows 1..gamma-1
    markov_rank           r; 0 = no Markov head (DeepSpec's `dflash_*_block7` checkpoints)
    markov_head_type      "vanilla" (required when r > 0; "gated" / "rnn" are refused)
    enable_confidence_head, confidence_head_with_markov (the latter required when the former is true)
Tensors (no prefix; torch [out, in]):
    the DFlash backbone (convert/dflash.py): fc.weight [H, n*H], hidden_norm.weight, norm.weight,
        layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
        layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.{input,post_attention}_layernorm.weight;
    embed_tokens.weight [V, H], lm_head.weight [V, H]: DSpark's own frozen copies of the target's;
    markov_head.markov_w1.weight [V, r] (an Embedding), markov_head.markov_w2.weight [V, r] (Linear(r, V));
    confidence_head.proj.weight [1, H (+ r)], confidence_head.proj.bias [1].
Every tensor must be accounted for. A `confidence_calibration.json` beside them (written by
drafters/confidence.save_calibration) gives the confidence temperatures; without it they are 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from specjax.config import _DTYPE_NAMES, ModelConfig, _rope_from_hf
from specjax.convert.dflash import HARMLESS_SUFFIXES, LAYER_KEYS, TOP_KEYS, block_params, check_layer_fields
from specjax.convert.hf_files import NP_DTYPES, read_hf_config, read_tensors, safetensors_files
from specjax.drafters.dflash import BlockConfig
from specjax.drafters.dspark import MARKOV_HEAD_TYPES, DSparkConfig, param_shapes

ARCHITECTURE = "Qwen3DSparkModel"
CALIBRATION_FILE = "confidence_calibration.json"
# config.json flag of a directory without embed_tokens / lm_head copies: they are the target's (shipped heads).
TABLES_FROM_TARGET = "specjax_tables_from_target"
_DSPARK_FIELDS = ("markov_rank", "enable_confidence_head", "num_anchors")


def is_dspark_config(hf: dict[str, Any]) -> bool:
    """A DeepSpec DSpark (or DeepSpec DFlash, markov_rank 0) config: a *DSparkModel architecture or its fields."""
    archs = hf.get("architectures") or []
    return any(a.endswith("DSparkModel") for a in archs) or all(k in hf for k in _DSPARK_FIELDS)


def _need(hf: dict[str, Any], key: str):
    if key not in hf:
        raise ValueError(f"the DSpark drafter's config.json lacks required field '{key}' (DeepSpec's "
                         "build_draft_config writes it)")
    return hf[key]


def target_layer_ids(hf: dict[str, Any], target: ModelConfig) -> tuple[int, ...]:
    """The taps (original numbering), checked against the target: ints in -1 .. L-2, strictly increasing."""
    ids = _need(hf, "target_layer_ids")
    num_target = hf.get("num_target_layers")
    if num_target is not None and int(num_target) != target.num_layers:
        raise ValueError(f"the DSpark drafter was trained for a target of num_target_layers={num_target} layers but "
                         f"the target has {target.num_layers}; use the drafter trained for this target")
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"the DSpark drafter's target_layer_ids is {ids!r}; it must be a non-empty list of integer "
                         "layer ids")
    bad = [i for i in ids if not -1 <= i <= target.num_layers - 2]
    if bad:
        raise ValueError(f"the DSpark drafter's target_layer_ids {list(ids)} have {bad} out of range for the target: "
                         f"with {target.num_layers} layers a tap ('output of layer id', HF hidden_states[id + 1]; -1 "
                         f"the embeddings) must lie in -1..{target.num_layers - 2} (the last layer's output is never "
                         "a tap: HF's is final-normed)")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"the DSpark drafter's target_layer_ids {list(ids)} are not strictly increasing, as DeepSpec "
                         "requires")
    return tuple(int(i) for i in ids)


def dspark_config(hf: dict[str, Any], target: ModelConfig, dtype: str | None = None) -> DSparkConfig:
    """DSparkConfig from the drafter's config.json, checked against the target (ValueError naming both sides)."""
    archs = hf.get("architectures") or []
    if archs != [ARCHITECTURE]:
        raise ValueError(f"the DSpark drafter's config.json architectures is {archs!r}; specjax implements "
                         f"[{ARCHITECTURE!r}] (DeepSpec's Qwen3 DSpark / DFlash drafters), not the Gemma-4 variant")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"the DSpark drafter's config.json hidden_act is {hf['hidden_act']!r}; only 'silu' is "
                         "implemented")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("the DSpark drafter's config.json has attention_bias or mlp_bias true; specjax implements "
                         "the released Qwen3 DSpark layers, which have no biases")
    _need(hf, "vocab_size")  # DeepSpec always writes it
    layers, heads, kv_heads = check_layer_fields("DSpark", hf, target, _need)
    hidden = target.hidden_size
    block_size = _need(hf, "block_size")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"the DSpark drafter's block_size is {block_size!r}; it must be an integer >= 1 (the anchor "
                         "row and gamma - 1 MASK rows; DeepSpec releases block 7)")
    mask = _need(hf, "mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        raise ValueError(f"the DSpark drafter's mask_token_id {mask!r} is outside the target's vocabulary "
                         f"(0..{target.vocab_size - 1}); it must be a token id of the target's tokenizer")
    rank = _need(hf, "markov_rank")
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"the DSpark drafter's markov_rank is {rank!r}; it must be an integer >= 0 (0 = no Markov "
                         "head)")
    head_type = "vanilla"
    if rank:
        head_type = str(_need(hf, "markov_head_type")).lower()
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"the DSpark drafter's markov_head_type is {head_type!r}; specjax implements "
                             f"{list(MARKOV_HEAD_TYPES)} (the released DSpark checkpoints' head)")
    confidence = bool(_need(hf, "enable_confidence_head"))
    with_markov = bool(_need(hf, "confidence_head_with_markov")) if confidence else False
    if with_markov and not rank:
        raise ValueError("the DSpark drafter's config.json has confidence_head_with_markov true but markov_rank 0: "
                         "the confidence head reads the Markov embedding, so it needs a Markov head")
    torch_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    layer_cfg = ModelConfig(
        vocab_size=target.vocab_size, hidden_size=hidden, intermediate_size=_need(hf, "intermediate_size"),
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=int(hf.get("head_dim") or 128),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope=_rope_from_hf(hf), qkv_bias=False, qk_norm=True,
        family="qwen3", dtype=dtype or _DTYPE_NAMES.get(str(torch_dtype), "float32"))
    block = BlockConfig(layers=layer_cfg, target_layer_ids=target_layer_ids(hf, target), block_size=block_size,
                        mask_token_id=mask)
    return DSparkConfig(block=block, markov_rank=rank, confidence=confidence, confidence_with_markov=with_markov,
                        markov_head_type=head_type)


def backbone_names(cfg: DSparkConfig) -> set[str]:
    """The checkpoint names of the DFlash backbone's tensors for this config."""
    names = {name for name, _ in TOP_KEYS.values()}
    return names | {f"layers.{i}.{name}" for i in range(cfg.block.layers.num_layers)
                    for name, _ in LAYER_KEYS.values()}


def head_params(tensors: dict[str, np.ndarray], cfg: DSparkConfig,
                tables: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """DSpark's own tables and heads (numpy, [in, out]) from the checkpoint, shapes checked against config.json.

    tables: (embed [V, H], lm_head [H, V]) to use instead of the checkpoint's copies, for a directory
    that says its tables are the target's (TABLES_FROM_TARGET in config.json).
    """
    dtype = NP_DTYPES[cfg.block.layers.dtype]
    h, v, r = cfg.block.hidden_size, cfg.block.layers.vocab_size, cfg.markov_rank
    shapes = param_shapes(cfg)  # [in, out]; the checkpoint's matrices are torch [out, in]

    def take(name: str, shape: tuple[int, ...], why: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"DSpark checkpoint lacks tensor '{name}' (shape {shape}, {why})")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"DSpark checkpoint tensor '{name}' has shape {tuple(tensors[name].shape)} but {why} "
                             f"implies {shape}")
        return np.asarray(tensors[name])

    table = f"the target's vocabulary of {v} tokens and hidden_size {h}"
    if tables is not None:
        heads = {"embed": np.asarray(tables[0]).astype(dtype), "lm_head": np.asarray(tables[1]).astype(dtype)}
    else:
        heads = {"embed": take("embed_tokens.weight", shapes["embed"], table).astype(dtype),
                 "lm_head": take("lm_head.weight", shapes["lm_head"][::-1], table).T.astype(dtype)}
    if r:
        markov = f"config.json markov_rank {r} and the vocabulary of {v} tokens"
        heads["markov_w1"] = take("markov_head.markov_w1.weight", shapes["markov_w1"], markov).astype(dtype)
        heads["markov_w2"] = take("markov_head.markov_w2.weight", shapes["markov_w2"], markov).astype(dtype)
    if cfg.confidence:  # torch Linear(width, 1): weight [1, width], bias [1]
        why = (f"a confidence head over [hidden {h}" + (f"; Markov rank {r}]" if cfg.confidence_with_markov else "]")
               + " (config.json confidence_head_with_markov)")
        heads["confidence_w"] = take("confidence_head.proj.weight", (1, *shapes["confidence_w"]), why)[0].astype(dtype)
        heads["confidence_b"] = take("confidence_head.proj.bias", (1, *shapes["confidence_b"]), why)[0].astype(dtype)
        heads["confidence_temperature"] = np.ones(shapes["confidence_temperature"], np.float32)
    return heads


def _expected_head_names(cfg: DSparkConfig, own_tables: bool = True) -> set[str]:
    names = {"embed_tokens.weight", "lm_head.weight"} if own_tables else set()
    if cfg.markov_rank:
        names |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    if cfg.confidence:
        names |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return names


def read_calibration(model_dir: Path, cfg: DSparkConfig) -> np.ndarray | None:
    """The confidence temperatures from `confidence_calibration.json`, or None when there is none."""
    path = Path(model_dir) / CALIBRATION_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    temps = data.get("temperatures") if isinstance(data, dict) else None
    if not cfg.confidence:
        raise ValueError(f"{path} holds confidence temperatures but the drafter has no confidence head "
                         "(enable_confidence_head false); remove the file")
    if (not isinstance(temps, list) or len(temps) != cfg.block_size
            or not all(isinstance(t, (int, float)) and t > 0 for t in temps)):
        raise ValueError(f"{path} must hold 'temperatures': a list of {cfg.block_size} positive numbers (one per block "
                         f"position); got {temps!r}")
    return np.asarray(temps, np.float32)


def load_dspark(model_dir: str | Path, target: ModelConfig, dtype: str | None = None,
                target_tables: tuple[np.ndarray, np.ndarray] | None = None
                ) -> tuple[DSparkConfig, dict[str, Any], dict[str, np.ndarray]]:
    """(config, host block params, host head params) of the DSpark drafter in model_dir, checked against the target.

    A directory whose config.json sets TABLES_FROM_TARGET (specjax's shipped heads, to save space)
    holds no embed/lm_head copies: `target_tables` (the target's embed [V, H], lm_head [H, V]) are used.
    ValueError for a config that does not fit the target, a missing or mis-shaped tensor, or any
    tensor the drafter does not have (named).
    """
    model_dir = Path(model_dir)
    hf = read_hf_config(model_dir)
    cfg = dspark_config(hf, target, dtype)
    own_tables = not hf.get(TABLES_FROM_TARGET, False)
    if not own_tables and target_tables is None:
        raise ValueError(f"{model_dir} shares the target's embedding and lm_head ({TABLES_FROM_TARGET} in config.json): "
                         "load it with load_drafter(path, target), which supplies them")
    tensors = read_tensors(safetensors_files(model_dir))
    backbone, heads_names = backbone_names(cfg), _expected_head_names(cfg, own_tables)
    leftover = sorted(n for n in tensors if n not in backbone and n not in heads_names
                      and not n.endswith(HARMLESS_SUFFIXES))
    if leftover:
        shown = ", ".join(f"'{n}'" for n in leftover[:8])
        hint = ""
        if any(n.startswith("markov_head.") for n in leftover) and not cfg.markov_rank:
            hint = " (Markov head tensors but config.json markov_rank is 0)"
        elif any(n.startswith("confidence_head.") for n in leftover) and not cfg.confidence:
            hint = " (confidence head tensors but config.json enable_confidence_head is false)"
        raise ValueError(f"DSpark checkpoint has {len(leftover)} tensor(s) a DSpark drafter with this config.json does "
                         f"not have: {shown}{' ...' if len(leftover) > 8 else ''}{hint}; specjax refuses to drop "
                         "weights")
    missing = sorted(backbone - set(tensors))
    if missing:
        raise ValueError(f"DSpark checkpoint lacks backbone tensor(s) {', '.join(repr(n) for n in missing[:8])}"
                         f"{' ...' if len(missing) > 8 else ''} (config.json num_hidden_layers="
                         f"{cfg.block.layers.num_layers} implies them)")
    block = block_params({n: t for n, t in tensors.items() if n in backbone or n.endswith(HARMLESS_SUFFIXES)},
                         cfg.block)
    heads = head_params(tensors, cfg, None if own_tables else target_tables)
    temps = read_calibration(model_dir, cfg)
    if temps is not None:
        heads["confidence_temperature"] = temps
    return cfg, block, heads
