"""Orbax save / restore of a model: params + the Hugging Face config + tokenizer files.

A converted checkpoint directory holds `config.json` (the HF config, unchanged),
`specjax.json` (format marker and dtype), `params/` (orbax) and the tokenizer files.
Saving is atomic: everything is written to a temporary sibling directory that is
renamed into place at the end, so a failed save leaves nothing at the destination.
Overwriting keeps the old checkpoint until the new one is complete: the old directory
is renamed to a backup sibling, the new one renamed into place, then the backup deleted
(or renamed back if the second rename fails). Only a crash between the two renames
leaves no directory at the destination, and then the old checkpoint is intact in
`.{name}.old-*` beside it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from specjax.chat import TEMPLATE_DIR, TEMPLATE_FILE

FORMAT = "specjax-orbax"
MARKER = "specjax.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   TEMPLATE_FILE)


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def tokenizer_files(directory: Path) -> dict[str, Path]:
    """A model directory's tokenizer files, by path relative to it: TOKENIZER_FILES present and the named chat
    templates (additional_chat_templates/*.jinja), so a conversion or an export renders chats as the source does."""
    names = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    names += [f"{TEMPLATE_DIR}/{p.name}" for p in sorted((directory / TEMPLATE_DIR).glob("*.jinja"))]
    return {name: directory / name for name in names}


def copy_files(files: dict[str, Path], dst: Path) -> None:
    """Copy `files` (path relative to dst -> source) into dst, making their folders."""
    for name, src in files.items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst / name)


def save(dst: Path, params, hf_config: dict, *, dtype: str, extra_files: dict[str, Path] | None = None,
         meta: dict | None = None, overwrite: bool = False) -> Path:
    """Write params and config to `dst` atomically; `extra_files` maps a path relative to dst -> source path."""
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; choose a new destination or pass overwrite=True "
                              "(specjax convert --overwrite)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "version": 1, "dtype": dtype, **(meta or {})},
                                             indent=2))
        copy_files(extra_files or {}, tmp)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "params", jax.tree.map(jax.numpy.asarray, params))
        checkpointer.wait_until_finished()
        _replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _replace(new: Path, dst: Path) -> None:
    """Move the finished directory `new` to `dst`; an existing `dst` survives until that has succeeded."""
    if not dst.exists() and not dst.is_symlink():
        _rename(new, dst)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    backup.rmdir()  # a fresh unique name; rename needs it absent
    _rename(dst, backup)
    try:
        _rename(new, dst)
    except BaseException:
        _rename(backup, dst)
        raise
    _remove(backup)


def _rename(src: Path, dst: Path) -> None:
    """One atomic rename (a seam for tests that simulate a crash)."""
    src.rename(dst)


def _remove(path: Path) -> None:
    """Delete a replaced checkpoint: a directory tree, or a file or link that stood at the destination."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def read_configs(path: Path) -> tuple[dict, dict]:
    """(hf_config, specjax meta) of a directory written by `save`, without its weights."""
    path = Path(path).absolute()
    meta = json.loads((path / MARKER).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path / MARKER} says format {meta.get('format')!r}; expected {FORMAT!r}")
    return json.loads((path / "config.json").read_text()), meta


def stored_shapes(path: Path) -> dict:
    """The stored params as ShapeDtypeStructs (per-layer weights keyed 0, 1, ...), read from orbax's metadata."""
    tree = ocp.StandardCheckpointer().metadata(Path(path).absolute() / "params").item_metadata.tree
    return with_layer_indices(jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree))


def restore(path: Path, into: dict | None = None) -> tuple[dict, dict, dict]:
    """(params, hf_config, specjax meta) from a directory written by `save`.

    into: ShapeDtypeStructs with a sharding (and dtype) per leaf, shaped as `stored_shapes`: each device then reads
    only its slice of every array, cast to that dtype; None restores every array whole."""
    hf_config, meta = read_configs(path)
    item = Path(path).absolute() / "params"
    if into is None:
        params = ocp.StandardCheckpointer().restore(item)
    else:
        params = ocp.StandardCheckpointer().restore(item, with_layer_names(into))
    return with_layer_indices(params), hf_config, meta


def with_layer_indices(params: dict) -> dict:
    """Per-layer weights keyed 0, 1, ... again: orbax stores dict keys as strings, and a per-layer tree (a hybrid
    target's, whose layers are of two kinds and never stacked) is keyed by layer index."""
    layers = params.get("layers")
    if isinstance(layers, dict) and layers and all(isinstance(k, str) and k.isdigit() for k in layers):
        return {**params, "layers": {int(k): v for k, v in layers.items()}}
    return params


def with_layer_names(params: dict) -> dict:
    """The inverse of with_layer_indices: per-layer keys as the strings orbax stored."""
    layers = params.get("layers")
    if isinstance(layers, dict) and layers and all(isinstance(k, int) for k in layers):
        return {**params, "layers": {str(k): v for k, v in layers.items()}}
    return params
