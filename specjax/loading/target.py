"""Loading a target: a converted specjax checkpoint or a Hugging Face directory, and conversion between them.

EOS ids follow transformers' `generate`: when the directory has a `generation_config.json`
with an `eos_token_id` (Llama 3 and Qwen2.5 Instruct list their end-of-turn ids there), those
ids replace config.json's. A generation_config.json without one leaves config.json's ids in
place (transformers would then not stop at all; keeping the model's EOS is the safer reading).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from specjax.config import ModelConfig
from specjax.convert import checkpoint
from specjax.convert.hf import load_hf
from specjax.models.model import merge
from specjax.models.sharding import abstract, param_shardings, place, replicated, resolve_mesh, with_expert_parallel
from specjax.models.target import Target, serving_layout
from specjax.quant.qarray import dequantize_tree
from specjax.quant.quantize import check_matmul, with_matmul


def _check_dtype(dtype: str | None) -> None:
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16' (or None: the checkpoint's), got {dtype!r}")


def _read_tokenizer(path: Path) -> Tokenizer | None:
    file = path / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.is_file() else None


def load(path: str | Path, *, dtype: str | None = None, attn_impl: str = "auto", layout: str = "auto", mesh=None,
         tensor_parallel: int | None = None, rules: dict | None = None, dequantize: bool = False,
         quantized_matmul: str = "blocks", activation_quant: bool = True) -> Target:
    """Load a converted specjax checkpoint or a Hugging Face model directory.

    A quantized checkpoint (block FP8, compressed-tensors, AWQ, GPTQ: convert/quantized.py) keeps its weights
    quantized on the device, dequantized inside each matmul in `dtype`.

    Args:
        path: a directory written by `specjax convert`, or a Hugging Face model directory (safetensors).
        dtype: "float32", "bfloat16" or "float16": overrides the stored dtype.
        attn_impl: "xla", "pallas" or "auto" (Pallas on GPU, XLA elsewhere).
        layout: "auto", "stacked" or "per_layer" (see serving_layout).
        mesh: a jax.sharding.Mesh with axes ("data", "model"): the weights split over "model" by models/sharding.py's
            rules, the batch over "data"; each device reads only its slice of every weight.
        tensor_parallel: n: the same over a (1, n) mesh of the job's first n devices (jax.devices()).
        rules: logical axis name -> mesh axis, in place of models/sharding.py's RULES (e.g. its EXPERT_PARALLEL).
        dequantize: for a quantized checkpoint, dequantize the weights to `dtype` once, here (the exact mode).
        quantized_matmul: how a quantized weight multiplies: "blocks" (the default: dequantized inside the matmul,
            each block times its scale), "ktile" (one dot per 128-row input block, each partial product scaled),
            or "per_channel" (opt-in, changes the numbers: FP8 block weights re-quantized at load to one scale per
            output column; docs/quantization.md reports its error).
        activation_quant: for a W8A8 checkpoint (compressed-tensors `input_activations`, block FP8's
            `activation_scheme: "dynamic"`), quantize each quantized linear's input as the format says (the
            default: what the format computes, quant/activations.py); False runs the weights alone (weight-only
            numbers, what transformers' CPU load of block FP8 computes). The exact mode (dequantize=True) runs the
            dequantized model, without activation quantization.

    Returns:
        A `Target`.

    Raises:
        ValueError: an architecture or config field specjax does not implement (named), a tensor the config does not
            account for, a bad dtype / attn_impl / layout, an activation quantization specjax
            does not compute (named; activation_quant=False loads the weights alone), or a mesh that does not fit.
        TypeError: activation_quant not a bool.
        FileNotFoundError: no checkpoint at `path`.

    Example:
        ```python
        target = specjax.load(specjax.embedded("target"))
        target = specjax.load("ckpt/llama-3.1-8b", tensor_parallel=8)
        ```
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass a converted specjax checkpoint or a Hugging Face"
                                " model directory (config.json + safetensors)")
    _check_dtype(dtype)
    if attn_impl not in ("xla", "pallas", "auto"):
        raise ValueError(f"attn_impl must be 'xla', 'pallas' or 'auto', got {attn_impl!r}")
    check_matmul(quantized_matmul)
    if not isinstance(activation_quant, bool):
        raise TypeError(f"activation_quant must be True (quantize a W8A8 checkpoint's activations as its format "
                        f"says) or False (its weights alone), got {activation_quant!r}")
    mesh = resolve_mesh(mesh, tensor_parallel, rules)
    if checkpoint.is_checkpoint(path):
        hf_config, meta = checkpoint.read_configs(path)
        cfg = ModelConfig.from_hf(hf_config, dtype=dtype or meta["dtype"])
        if mesh is None:
            params = jax.tree.map(lambda x: jnp.asarray(x, cfg.dtype), checkpoint.restore(path)[0])
        else:
            params = restore_sharded(path, cfg, mesh, rules)
    else:
        hf_config, cfg, params = load_hf(path, dtype=dtype, lazy=mesh is not None,
                                         activation_quant=activation_quant and not dequantize)
        if dequantize:
            params = dequantize_tree(params, cfg.dtype)
        params = with_matmul(params, quantized_matmul)
    generation = read_generation_config(path / "generation_config.json")
    cfg = with_generation_eos(cfg, generation, path / "generation_config.json")
    mtp = params.pop("mtp", None)  # MTP layers ride along for the MTP drafter; the target's graph never sees them
    if mtp is not None and mesh is not None:
        mtp = jax.tree.map(np.asarray, mtp)  # the MTP drafter places them (sharded as its layers say)
    params = serving_layout(params, layout, mixed=cfg.mixed_layers)
    cfg = with_expert_parallel(cfg, mesh, rules)
    return Target(placed(params, cfg, mesh, rules), cfg, hf_config, _read_tokenizer(path), path, attn_impl,
                  layout=layout, mtp=mtp, generation_config=generation, mesh=mesh, rules=rules)


def target_shardings(params: dict, cfg: ModelConfig, mesh, rules: dict | None = None) -> dict:
    """Each weight's NamedSharding on `mesh` by the rules (models/sharding.py), in the layout `params` are in."""
    return param_shardings(merge(cfg, abstract(params)), cfg, mesh, rules)


def placed(params: dict, cfg: ModelConfig, mesh, rules: dict | None = None) -> dict:
    """The target's weights on the device (one device), or split over `mesh`, each device reading its slice."""
    if mesh is None:
        return jax.tree.map(jnp.asarray, params)
    return place(params, target_shardings(params, cfg, mesh, rules))


def restore_sharded(path: Path, cfg: ModelConfig, mesh, rules: dict | None = None) -> dict:
    """An orbax checkpoint restored straight into the target's shardings (in its stored layout; MTP layers
    replicated, the MTP drafter splits them), cast to cfg's dtype: each device reads its own slices."""
    stored = checkpoint.stored_shapes(path)
    mtp = stored.pop("mtp", None)
    shardings = target_shardings(stored, cfg, mesh, rules)
    if mtp is not None:
        stored["mtp"], shardings["mtp"] = mtp, replicated(mtp, mesh)
    into = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, jnp.dtype(cfg.dtype), sharding=sharding),
                        stored, shardings)
    return checkpoint.restore(path, into)[0]


def with_generation_eos(cfg: ModelConfig, generation: dict, file: Path) -> ModelConfig:
    """`cfg` with generation_config.json's EOS ids when it lists any (as transformers' generate uses them)."""
    eos = generation_eos_ids(generation, file)
    return cfg if eos is None else dataclasses.replace(cfg, eos_token_ids=eos)


def read_generation_config(file: Path) -> dict:
    """A generation_config.json as a dict ({} without the file)."""
    if not file.is_file():
        return {}
    try:
        generation = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: not a JSON object ({err}); re-download it or delete it") from None
    if not isinstance(generation, dict):
        raise ValueError(f"{file}: not a JSON object; re-download it or delete it")
    return generation


def generation_eos_ids(generation: dict, file: Path) -> tuple[int, ...] | None:
    """The `eos_token_id` (an int or a list) of a generation config; None without the key."""
    eos = generation.get("eos_token_id")
    if eos is None:
        return None
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: 'eos_token_id' must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def convert(src: str | Path, dst: str | Path, *, dtype: str | None = None, overwrite: bool = False) -> Path:
    """Hugging Face directory -> orbax checkpoint with config and tokenizer files, written atomically.

    MTP layers in the checkpoint are kept (params["mtp"] in the orbax tree, see convert/mtp.py). A quantized
    checkpoint is written dequantized to `dtype`: `specjax.load` of the Hugging Face directory itself keeps it
    quantized (docs/quantization.md).

    Args:
        src: the Hugging Face model directory (config.json, safetensors, tokenizer files).
        dst: the directory to write; written into a temporary directory renamed into place at the end.
        dtype: "float32", "bfloat16" or "float16"; default the stored dtype.
        overwrite: replace an existing `dst` (the old one stays intact until the new one is complete).

    Returns:
        The path of the written checkpoint.

    Raises:
        ValueError: an architecture, config field or tensor specjax does not implement, named; `src` already a
            specjax checkpoint.
        FileExistsError: `dst` exists and overwrite is False.
        FileNotFoundError: `src` missing, or its config.json or a safetensors shard.
    """
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist: pass a Hugging Face model directory")
    if checkpoint.is_checkpoint(src):
        raise ValueError(f"{src} is already a specjax checkpoint (it has {checkpoint.MARKER}): load it with "
                         f"specjax.load; to change its dtype, load(path, dtype=...) or convert its Hugging Face source")
    _check_dtype(dtype)
    hf_config, cfg, host_params = load_hf(src, dtype=dtype, activation_quant=False)  # written dequantized
    host_params = dequantize_tree(host_params, cfg.dtype)
    return checkpoint.save(dst, host_params, hf_config, dtype=cfg.dtype, extra_files=checkpoint.tokenizer_files(src),
                           meta={"source": str(src.absolute())}, overwrite=overwrite)
