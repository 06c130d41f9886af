"""Read a Hugging Face model directory (config.json + safetensors) into specjax params.

Torch stores linear weights as [out, in]; specjax keeps [in, out] so activations
multiply on the left (x @ W). Per-layer tensors are stacked on a leading layer axis
on the host (numpy), then moved to the device once.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from ..config import ModelConfig
from ..models.decoder import param_shapes

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# specjax layer key -> (Hugging Face name inside model.layers.{i}, transpose?)
_LAYER_KEYS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def read_hf_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: a Hugging Face model directory needs its config.json")
    return json.loads(path.read_text())


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: from model.safetensors.index.json when sharded, else model.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json with its shards"
        " (pytorch_model.bin is not read; re-save with safetensors)"
    )


def read_tensors(files: list[Path]) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        with safe_open(str(f), framework="np") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)
    return tensors


def hf_to_params(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Map HF tensor names to the specjax param tree, checking every name and shape."""
    dtype = _NP_DTYPES[cfg.dtype]
    shapes = param_shapes(cfg)

    def take(name: str, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"checkpoint lacks tensor '{name}' (expected by the config, shape {shape})")
        t = tensors[name].T if transpose else tensors[name]
        if t.shape != shape:
            stored = tensors[name].shape
            raise ValueError(f"tensor '{name}' has shape {stored}; the config implies "
                             f"{shape[::-1] if transpose else shape}")
        return t.astype(dtype)

    layers = {}
    for key, shape in shapes["layers"].items():
        hf_name, transpose = _LAYER_KEYS[key]
        layers[key] = np.stack([take(f"model.layers.{i}.{hf_name}", shape[1:], transpose)
                                for i in range(cfg.num_layers)])
    params = {
        "embed": take("model.embed_tokens.weight", shapes["embed"], False),
        "layers": layers,
        "final_norm": take("model.norm.weight", shapes["final_norm"], False),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = take("lm_head.weight", shapes["lm_head"], True)
    return params


def load_hf(model_dir: Path, dtype: str | None = None) -> tuple[dict, ModelConfig, dict[str, np.ndarray]]:
    """(raw config.json dict, ModelConfig, host params) from a Hugging Face model directory."""
    hf_cfg = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf_cfg, dtype=dtype)
    params = hf_to_params(read_tensors(safetensors_files(model_dir)), cfg)
    return hf_cfg, cfg, params
