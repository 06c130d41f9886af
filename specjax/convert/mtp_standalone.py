"""Standalone MTP repositories: a target's multi-token-prediction layers published apart from it.

The writer followed is mlx-vlm's MTP splitter (Blaizzy/mlx-vlm mlx_vlm/speculative/drafters/mtp_split.py
`MTPSplitter.split`, with qwen3_5_mtp/split.py `Qwen3_5MTPSplitter` and qwen3_5_mtp.py
`Qwen3_5MTPDraftModel.sanitize`), the code that makes `model_type: "qwen3_5_mtp"` repositories (Qwen3.5,
Qwen3.5-MoE and Qwen3-Next targets):

    config.json        {"model_type": "qwen3_5_mtp", "text_config": the target's text config (with
                       mtp_num_hidden_layers), "block_size", "tie_word_embeddings"[, "quantization"]}
    model.safetensors  the target's `mtp.*` tensors with `mtp.` stripped (fc, pre_fc_norm_embedding,
                       pre_fc_norm_hidden, norm, layers.{j}.*), metadata {"format": "mlx"}; every 1-D float norm
                       (`ONE_PLUS_W`: the layer norms, q/k norms, `norm`, both pre-fc norms) stored as 1 + w
                       (MLX's RMSNorm multiplies by the weight; Qwen3.5's checkpoint keeps the zero-centred w,
                       x * (1 + w)). A source already in MLX form had the 1 added by
                       its own conversion; the splitter then only strips the prefix, so the file says the same.

Runtimes disagree on reading such a file without the marker (mlx-vlm's loader re-sanitizes only `mtp.`-prefixed
names, so unmarked stripped norms are taken as 1 + w; a reader of Hugging Face checkpoints takes them as w). specjax
follows the writer: with {"format": "mlx"} it subtracts the 1 and reads the layers as the target's own `mtp.*`
tensors (convert/mtp.py `read_mtp`); without it, refuses. Quantized (`*.scales`) and MoE (`switch_mlp`, the
splitter's unfused experts) files are refused by name: not implemented.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import safe_open

from specjax.config import ModelConfig
from specjax.convert.hf_files import read_hf_config, read_tensors, safetensors_files
from specjax.convert.mtp import read_mtp

STANDALONE_TYPES = ("qwen3_5_mtp",)  # mlx-vlm's MTP_SPLITTERS output types specjax reads
# the keys whose 1-D float weights the splitter stores as 1 + w (qwen3_5_mtp.py `sanitize`'s norm_suffixes)
ONE_PLUS_W = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight",
              "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "family", "rms_norm_eps")


def is_standalone_mtp(hf: dict) -> bool:
    return hf.get("model_type") in STANDALONE_TYPES


def _stored_as_mlx(files: list[Path]) -> bool:
    formats = set()
    for f in files:
        with safe_open(str(f), framework="np") as handle:
            formats.add((handle.metadata() or {}).get("format"))
    return formats == {"mlx"}


def read_standalone_mtp_dir(path: str | Path, cfg: ModelConfig) -> dict:
    """The stored MTP params (convert/mtp.py's form) of a standalone MTP repository, for the target `cfg`.

    ValueError naming both sides when it was split from a target of another shape, and for what is refused
    (module docstring)."""
    path = Path(path)
    hf = read_hf_config(path)
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{path}/config.json (model_type {hf.get('model_type')!r}) lacks the target's "
                         "'text_config', which mlx-vlm's MTP splitter writes")
    mine = ModelConfig.from_hf(text)
    differ = [f"{k} {getattr(mine, k)!r} vs the target's {getattr(cfg, k)!r}" for k in _SHAPE
              if getattr(mine, k) != getattr(cfg, k)]
    if differ:
        raise ValueError(f"the MTP layers in {path} were split from another target: " + "; ".join(differ))
    files = safetensors_files(path)
    if not _stored_as_mlx(files):
        raise ValueError(f"{path}'s safetensors lack the metadata {{'format': 'mlx'}} that mlx-vlm's MTP splitter "
                         "writes: without it the norms may be stored as w or as 1 + w (runtimes read such files both "
                         "ways), so specjax refuses to guess")
    tensors = read_tensors(files)
    if any(k.endswith(".scales") for k in tensors) or "quantization" in hf:
        raise ValueError(f"{path} holds quantized MTP layers (MLX affine '*.scales'); specjax reads unquantized ones")
    if any(".switch_mlp." in k for k in tensors):
        raise ValueError(f"{path} holds MoE MTP layers in MLX's unfused form ('switch_mlp'), not implemented; load "
                         "the target's own checkpoint with its mtp.* tensors instead")
    renamed = {}
    for key, value in tensors.items():
        if key.endswith(ONE_PLUS_W) and value.ndim == 1:  # 1 + w -> Qwen3.5's zero-centred w
            value = np.asarray(value, np.float32) - 1.0
        renamed["mtp." + key] = value
    return read_mtp(renamed, sorted(renamed), cfg, text)
