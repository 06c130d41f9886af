"""A loaded target model: params on the device, its config, tokenizer, and compiled loops."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from tokenizers import Tokenizer

from . import checkpoint
from .config import ModelConfig
from .convert.hf import load_hf
from .models.decoder import unstack_layers


@dataclasses.dataclass(eq=False)
class Target:
    params: dict
    cfg: ModelConfig
    hf_config: dict
    tokenizer: Tokenizer | None = None
    path: Path | None = None
    attn_impl: str = "auto"
    compiled: dict[Any, Any] = dataclasses.field(default_factory=dict)  # loop key -> compiled executable

    def __post_init__(self):
        self.params = serving_layout(self.params)

    def encode(self, text: str) -> list[int]:
        return self._need_tokenizer().encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._need_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{self.path or 'this model'} has no tokenizer.json; pass token-id lists, not strings")
        return self.tokenizer


def _check_dtype(dtype: str | None) -> None:
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16' (or None: the checkpoint's), got {dtype!r}")


def _read_tokenizer(path: Path) -> Tokenizer | None:
    file = path / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.is_file() else None


def load(path: str | Path, *, dtype: str | None = None, attn_impl: str = "auto") -> Target:
    """Load a converted specjax checkpoint or a Hugging Face model directory.

    dtype ("float32" | "bfloat16" | "float16") overrides the stored dtype.
    attn_impl: "xla", "pallas" or "auto" (Pallas on GPU, XLA elsewhere).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass a converted specjax checkpoint or a Hugging Face"
                                " model directory (config.json + safetensors)")
    _check_dtype(dtype)
    if attn_impl not in ("xla", "pallas", "auto"):
        raise ValueError(f"attn_impl must be 'xla', 'pallas' or 'auto', got {attn_impl!r}")
    if checkpoint.is_checkpoint(path):
        params, hf_config, meta = checkpoint.restore(path)
        cfg = ModelConfig.from_hf(hf_config, dtype=dtype or meta["dtype"])
        params = jax.tree.map(lambda x: jnp.asarray(x, cfg.dtype), params)
    else:
        hf_config, cfg, host_params = load_hf(path, dtype=dtype)
        params = jax.tree.map(jnp.asarray, host_params)
    return Target(params, cfg, hf_config, _read_tokenizer(path), path, attn_impl)


def serving_layout(params: dict) -> dict:
    """Per-layer weight arrays on CPU (3x less memory traffic there), stacked layers elsewhere."""
    return unstack_layers(params) if jax.default_backend() == "cpu" else params


def convert(src: str | Path, dst: str | Path, *, dtype: str | None = None, overwrite: bool = False) -> Path:
    """Hugging Face directory -> orbax checkpoint with config and tokenizer files, written atomically."""
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist: pass a Hugging Face model directory")
    _check_dtype(dtype)
    hf_config, cfg, host_params = load_hf(src, dtype=dtype)
    extra = {name: src / name for name in checkpoint.TOKENIZER_FILES if (src / name).is_file()}
    return checkpoint.save(dst, host_params, hf_config, dtype=cfg.dtype, extra_files=extra,
                           meta={"source": str(src.absolute())}, overwrite=overwrite)
