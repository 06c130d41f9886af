"""Reading a Hugging Face directory's files: config.json, (sharded) safetensors, and the decoder layer's names.

Shared by every converter (the dense target in hf.py, its MTP layers in mtp.py, the heads).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from specjax.convert.lazy import RAW_DTYPES, read_raw
from specjax.convert.moe import take_moe

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# specjax layer key -> (Hugging Face name inside model.layers.{i}, transpose?)
LAYER_KEYS = {
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


def take_layer(take, tensors: dict[str, np.ndarray], prefix: str, shapes: dict) -> dict[str, np.ndarray]:
    """One dense-family decoder layer's params (its MLP dense or, with `moe` in shapes, sparse)."""
    layer = {k: take(prefix + LAYER_KEYS[k][0], s, LAYER_KEYS[k][1]) for k, s in shapes.items() if k != "moe"}
    if "moe" in shapes:
        layer["moe"] = take_moe(take, tensors, prefix, shapes["moe"])
    return layer


def read_hf_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: a Hugging Face model directory needs its config.json")
    return read_json(path)


def read_json(path: Path):
    """Parse a JSON file, naming the file when it is not valid JSON (a truncated download, say)."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); re-download or re-save it") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: from model.safetensors.index.json when sharded, else model.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        contents = read_json(index)
        weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object (tensor name -> shard file); re-save the model")
        names = sorted(set(weight_map.values()))
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
    """Every tensor of every file, by name."""
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors(f))
    return tensors


def read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """One file's tensors; a truncated or corrupt file is a one-line ValueError naming it, not a traceback."""
    try:
        with safe_open(str(file), framework="np") as st:
            return {name: read_raw(file, name) if st.get_slice(name).get_dtype() in RAW_DTYPES else st.get_tensor(name)
                    for name in st.keys()}
    except (SafetensorError, OSError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ValueError(f"{file}: not a readable safetensors file ({reason}); it may be truncated or corrupt "
                         "(an interrupted download or save): re-download or re-save it") from None
