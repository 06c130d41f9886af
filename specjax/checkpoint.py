"""Orbax save / restore of a model: params + the Hugging Face config + tokenizer files.

A converted checkpoint directory holds `config.json` (the HF config, unchanged),
`specjax.json` (format marker and dtype), `params/` (orbax) and the tokenizer files.
Saving is atomic: everything is written to a temporary sibling directory that is
renamed into place at the end, so a failed save leaves nothing at the destination.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jax
import orbax.checkpoint as ocp

FORMAT = "specjax-orbax"
MARKER = "specjax.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save(dst: Path, params, hf_config: dict, *, dtype: str, extra_files: dict[str, Path] | None = None,
         meta: dict | None = None, overwrite: bool = False) -> Path:
    """Write params and config to `dst` atomically; `extra_files` maps file name -> source path."""
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; choose a new destination or pass overwrite=True")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "version": 1, "dtype": dtype, **(meta or {})},
                                             indent=2))
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "params", jax.tree.map(jax.numpy.asarray, params))
        checkpointer.wait_until_finished()
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def restore(path: Path) -> tuple[dict, dict, dict]:
    """(params, hf_config, specjax meta) from a directory written by `save`."""
    path = Path(path).absolute()
    meta = json.loads((path / MARKER).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path / MARKER} says format {meta.get('format')!r}; expected {FORMAT!r}")
    params = ocp.StandardCheckpointer().restore(path / "params")
    return params, json.loads((path / "config.json").read_text()), meta
