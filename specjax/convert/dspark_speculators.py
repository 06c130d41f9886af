"""Read a speculators-format DSpark drafter (vllm-project/speculators `DSparkDraftModel`) and check it fits a target.

What speculators writes (src/speculators/models/dspark/{config,core,model_definitions}.py over its DFlash,
models/dflash/{config,core,model_definitions}.py; saved by `save_pretrained`):

    config.json   speculators_model_type "dspark", architectures ["DSparkDraftModel"]; transformer_layer_config (the
                  draft layers' config: hidden, heads, head_dim, intermediate, rms_norm_eps, rope, layer_types,
                  num_hidden_layers = the draft layers, vocab_size = the verifier's); draft_vocab_size; block_size;
                  aux_hidden_state_layer_ids (vLLM's hidden_states numbering, as speculators' EAGLE-3 configs count
                  them; absent: speculators' default 2, L//2, L-3); mask_token_id; sample_from_anchor (DSpark's
                  default true: the anchor row is already a guess, block_size drafts per pass); markov_rank,
                  markov_head_type; enable_confidence_head, confidence_head_with_markov
    tensors       the DFlash backbone under DeepSpec's names (fc, hidden_norm, norm, layers.{i}.*: Qwen3DFlash
                  layers, q/k norms, no biases), embed_tokens.weight [V, H], lm_head.weight [Vd, H],
                  markov_head.markov_w1.weight [V, r] (indexed by the verifier's token), markov_head.markov_w2.weight
                  [Vd, r], confidence_head.proj.{weight [1, H (+ r)], bias [1]}, d2t [Vd] and t2d [V] when Vd < V

The computation is DeepSpec's DSpark (drafters/dspark.py) over the draft vocabulary: logits_k = lm_head(h_k) +
W2 W1[x_{k-1}] with x_{k-1} the block token before slot k (the anchor for slot 0: dspark/core.py
`prev_token_ids = block_tokens` under sample_from_anchor), a draft id mapped to the target's as draft_id +
d2t[draft_id]. specjax reads the pruned rows into the target's vocabulary (DSparkConfig.draft_vocab_size).

Refused by name: sample_from_anchor false (DFlash's convention, the anchor not a guess), the gated / rnn Markov
heads, sliding-window draft layers, attention biases, a target_hidden_size other than the layers' width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specjax.config import _DTYPE_NAMES, ModelConfig, _rope_from_hf
from specjax.convert.dflash import HARMLESS_SUFFIXES, block_params, check_layer_fields
from specjax.convert.dspark import backbone_names
from specjax.convert.eagle3_layouts import hidden_state_taps
from specjax.convert.hf_files import NP_DTYPES, read_hf_config, read_tensors, safetensors_files
from specjax.drafters.dflash import BlockConfig
from specjax.drafters.dspark import MARKOV_HEAD_TYPES, DSparkConfig


def is_speculators_dspark(hf: dict[str, Any]) -> bool:
    return hf.get("speculators_model_type") == "dspark"


def _need(hf: dict[str, Any], key: str, where: str = "config.json"):
    if hf.get(key) is None:
        raise ValueError(f"the speculators DSpark drafter's {where} lacks required field '{key}'")
    return hf[key]


def speculators_dspark_config(hf: dict[str, Any], target: ModelConfig, dtype: str | None = None) -> DSparkConfig:
    """DSparkConfig of a speculators DSpark config.json, checked against the target (ValueError naming both sides)."""
    layer = hf.get("transformer_layer_config")
    where = "config.json transformer_layer_config"
    if not isinstance(layer, dict):
        raise ValueError("the speculators DSpark drafter's config.json lacks 'transformer_layer_config'")
    if not hf.get("sample_from_anchor", True):
        raise ValueError("the speculators DSpark drafter's config.json has sample_from_anchor false (the anchor row "
                         "is the bonus token, DFlash's convention); specjax's DSpark drafts from the anchor row, as "
                         "DSpark's default true does")
    head_type = str(hf.get("markov_head_type", "vanilla")).lower()
    rank = int(hf.get("markov_rank", 256))
    if rank and head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(f"the speculators DSpark drafter's markov_head_type is {head_type!r}; specjax implements "
                         f"{list(MARKOV_HEAD_TYPES)}")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise ValueError(f"the speculators DSpark drafter's {where} has attention_bias or mlp_bias true; its "
                         "Qwen3DFlash layers are implemented without biases")
    target_hidden = hf.get("target_hidden_size")
    if target_hidden is not None and target_hidden != layer.get("hidden_size"):
        raise ValueError(f"the speculators DSpark drafter's target_hidden_size {target_hidden} differs from its "
                         f"layers' hidden_size {layer.get('hidden_size')}; not implemented")
    layers, heads, kv_heads = check_layer_fields("DSpark", layer, target, lambda h, k: _need(h, k, where))
    ids = hf.get("aux_hidden_state_layer_ids")
    if ids is None:  # speculators' models/utils.py resolve_target_layer_ids default, same numbering
        ids = [2, target.num_layers // 2, target.num_layers - 3]
    taps = hidden_state_taps(ids, "aux_hidden_state_layer_ids", target.num_layers)  # hidden_states k, 1..L-1
    vocab = target.vocab_size
    draft_vocab = int(hf.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise ValueError(f"the speculators DSpark drafter's draft_vocab_size is {draft_vocab}; it must lie in "
                         f"1..{vocab} (the target's vocabulary)")
    mask = _need(hf, "mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < vocab:
        raise ValueError(f"the speculators DSpark drafter's mask_token_id {mask!r} is outside the target's vocabulary "
                         f"(0..{vocab - 1})")
    block_size = _need(hf, "block_size")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"the speculators DSpark drafter's block_size is {block_size!r}; it must be an integer >= 1")
    confidence = bool(hf.get("enable_confidence_head", True))
    with_markov = confidence and bool(hf.get("confidence_head_with_markov", True))
    if with_markov and not rank:
        raise ValueError("the speculators DSpark drafter has confidence_head_with_markov true but markov_rank 0 (its "
                         "own config validation refuses this too)")
    torch_dtype = hf.get("torch_dtype") or hf.get("dtype") or layer.get("dtype") or "float32"
    layer_cfg = ModelConfig(
        vocab_size=vocab, hidden_size=target.hidden_size, intermediate_size=_need(layer, "intermediate_size", where),
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=int(layer.get("head_dim") or target.hidden_size // heads),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope=_rope_from_hf(layer), qkv_bias=False, qk_norm=True,
        family="qwen3", dtype=dtype or _DTYPE_NAMES.get(str(torch_dtype), "float32"))
    block = BlockConfig(layers=layer_cfg, target_layer_ids=tuple(t - 1 for t in taps), block_size=block_size,
                        mask_token_id=mask)
    return DSparkConfig(block=block, markov_rank=rank, confidence=confidence, confidence_with_markov=with_markov,
                        markov_head_type=head_type, draft_vocab_size=draft_vocab if draft_vocab < vocab else 0)


def _draft_ids(tensors: dict[str, np.ndarray], draft_vocab: int, vocab: int) -> np.ndarray:
    """The target ids of the draft vocabulary (draft id + d2t), checked: inside the vocabulary, distinct, = t2d."""
    if "d2t" not in tensors:
        raise ValueError(f"the speculators DSpark checkpoint lacks tensor 'd2t' but its draft vocabulary "
                         f"({draft_vocab}) is smaller than the target's ({vocab})")
    d2t = np.asarray(tensors["d2t"]).astype(np.int64)
    if d2t.shape != (draft_vocab,):
        raise ValueError(f"tensor 'd2t' has shape {d2t.shape} but config.json draft_vocab_size is {draft_vocab}")
    ids = np.arange(draft_vocab) + d2t
    if ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != draft_vocab:
        raise ValueError(f"d2t must map the {draft_vocab} draft ids to distinct target ids in 0..{vocab - 1}")
    if "t2d" in tensors:
        t2d = np.zeros(vocab, bool)
        t2d[ids] = True
        if not np.array_equal(np.asarray(tensors["t2d"]).astype(bool), t2d):
            raise ValueError("t2d and d2t disagree: t2d must be true exactly at the target ids d2t maps to")
    return ids


def head_params(tensors: dict[str, np.ndarray], cfg: DSparkConfig) -> tuple[dict[str, np.ndarray], set[str]]:
    """DSpark's tables and heads ([in, out], the target's vocabulary) from a speculators checkpoint, and the names
    of the tensors they came from."""
    dtype = NP_DTYPES[cfg.block.layers.dtype]
    h, v, r = cfg.block.hidden_size, cfg.block.layers.vocab_size, cfg.markov_rank
    vd = cfg.draft_vocab_size or v
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"the speculators DSpark checkpoint lacks tensor '{name}' (shape {shape})")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor '{name}' has shape {tuple(tensors[name].shape)} but config.json implies {shape}")
        used.add(name)
        return np.asarray(tensors[name], np.float32)

    ids = _draft_ids(tensors, vd, v) if cfg.draft_vocab_size else np.arange(v)
    used |= {"d2t", "t2d"} & set(tensors)

    def to_target_rows(rows_VdX: np.ndarray) -> np.ndarray:  # draft-vocabulary rows at their target ids, else 0
        full = np.zeros((v, rows_VdX.shape[1]), np.float32)
        full[ids] = rows_VdX
        return full

    heads = {"embed": take("embed_tokens.weight", (v, h)).astype(dtype),
             "lm_head": to_target_rows(take("lm_head.weight", (vd, h))).T.astype(dtype)}
    if r:
        heads["markov_w1"] = take("markov_head.markov_w1.weight", (v, r)).astype(dtype)
        heads["markov_w2"] = to_target_rows(take("markov_head.markov_w2.weight", (vd, r))).astype(dtype)
    if cfg.draft_vocab_size:
        mask = np.full(v, -np.inf, np.float32)
        mask[ids] = 0.0
        heads["vocab_mask"] = mask
    if cfg.confidence:
        heads["confidence_w"] = take("confidence_head.proj.weight", (1, cfg.confidence_width))[0].astype(dtype)
        heads["confidence_b"] = take("confidence_head.proj.bias", (1,))[0].astype(dtype)
        heads["confidence_temperature"] = np.ones(cfg.block_size, np.float32)
    return heads, used


def load_speculators_dspark(model_dir: str | Path, target: ModelConfig, dtype: str | None = None
                            ) -> tuple[DSparkConfig, dict[str, Any], dict[str, np.ndarray]]:
    """(config, host block params, host head params) of a speculators DSpark drafter, checked against the target;
    every tensor accounted for."""
    model_dir = Path(model_dir)
    cfg = speculators_dspark_config(read_hf_config(model_dir), target, dtype)
    tensors = read_tensors(safetensors_files(model_dir))
    backbone = backbone_names(cfg)
    missing = sorted(backbone - set(tensors))
    if missing:
        raise ValueError(f"the speculators DSpark checkpoint lacks backbone tensor(s) "
                         f"{', '.join(repr(n) for n in missing[:8])}")
    block = block_params({n: t for n, t in tensors.items() if n in backbone or n.endswith(HARMLESS_SUFFIXES)},
                         cfg.block)
    heads, used = head_params(tensors, cfg)
    used |= backbone
    leftover = sorted(n for n in tensors if n not in used and not n.endswith(HARMLESS_SUFFIXES))
    if leftover:
        raise ValueError(f"the speculators DSpark checkpoint has tensor(s) a DSpark drafter with this config.json does "
                         f"not have: {', '.join(repr(n) for n in leftover[:8])}; specjax refuses to drop weights")
    return cfg, block, heads
