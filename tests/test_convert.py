"""Hugging Face -> specjax conversion: `specjax.convert` and `scripts/convert_hf.py`.

A converted checkpoint must restore to exactly the params of loading the HF directory
directly; the write must be atomic (nothing at the destination, no temporary sibling
left behind, after a failure) and must not clobber an existing destination by accident.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import specjax
from specjax import checkpoint

from hf_tiny import FAMILIES, build_hf_model, save_hf_model

REPO = Path(__file__).resolve().parents[1]
CONVERT_SCRIPT = REPO / "scripts" / "convert_hf.py"
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def assert_same_params(a: dict, b: dict) -> None:
    """Same tree structure, dtypes and values, leaf by leaf (exact equality)."""
    paths_a = jax.tree_util.tree_flatten_with_path(a)[0]
    paths_b = jax.tree_util.tree_flatten_with_path(b)[0]
    assert [jax.tree_util.keystr(p) for p, _ in paths_a] == [jax.tree_util.keystr(p) for p, _ in paths_b]
    for (path, x), (_, y) in zip(paths_a, paths_b):
        assert x.dtype == y.dtype, jax.tree_util.keystr(path)
        assert x.shape == y.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                      err_msg=jax.tree_util.keystr(path))


def run_convert_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CONVERT_SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def make_tokenizer(vocab_size: int) -> Tokenizer:
    """A whitespace WordLevel tokenizer that fills the model's vocabulary exactly."""
    words = ["<pad>", "<s>", "</s>", "<unk>", "the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<pad>", "<s>", "</s>", "<unk>"])
    return tok


def leftovers(parent: Path, name: str) -> list[str]:
    """Anything in `parent` that belongs to destination `name` (the dir itself or a temporary sibling)."""
    return sorted(p.name for p in parent.iterdir() if name in p.name) if parent.exists() else []


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf_model(build_hf_model("llama", **SMALL), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def hf_target(hf_dir):
    return specjax.load(hf_dir)


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_converted_params_equal_loading_hf_dir(family, tmp_path):
    src = save_hf_model(build_hf_model(family, **SMALL), tmp_path / "hf")
    dst = specjax.convert(src, tmp_path / "ckpt")
    assert dst == (tmp_path / "ckpt").absolute()
    assert checkpoint.is_checkpoint(dst)
    direct, converted = specjax.load(src), specjax.load(dst)
    assert converted.cfg == direct.cfg
    assert converted.cfg.dtype == "float32"
    assert_same_params(converted.params, direct.params)
    assert json.loads((dst / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_bf16_conversion_gives_bf16_params(hf_dir, hf_target, tmp_path):
    dst = specjax.convert(hf_dir, tmp_path / "ckpt", dtype="bfloat16")
    target = specjax.load(dst)
    assert target.cfg.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(target.params)} == {jnp.dtype(jnp.bfloat16)}
    # Same values as rounding the fp32 weights to bf16.
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16), hf_target.params)
    assert_same_params(target.params, rounded)


def test_bf16_hf_checkpoint_loads_as_bf16(tmp_path):
    src = save_hf_model(build_hf_model("qwen2", **SMALL), tmp_path / "hf", dtype=torch.bfloat16)
    dst = specjax.convert(src, tmp_path / "ckpt")
    direct, converted = specjax.load(src), specjax.load(dst)
    assert direct.cfg.dtype == converted.cfg.dtype == "bfloat16"
    assert_same_params(converted.params, direct.params)


def test_sharded_safetensors_with_index(hf_dir, hf_target, tmp_path):
    model = build_hf_model("llama", **SMALL)  # same seed -> same weights as hf_dir
    src = save_hf_model(model, tmp_path / "hf", shard_size="50KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (src / "model.safetensors").exists()
    assert_same_params(specjax.load(src).params, hf_target.params)
    assert_same_params(specjax.load(specjax.convert(src, tmp_path / "ckpt")).params, hf_target.params)


def test_sharded_index_naming_a_missing_shard(tmp_path):
    src = save_hf_model(build_hf_model("llama", **SMALL), tmp_path / "hf", shard_size="50KB")
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"missing.*{shard.name}"):
        specjax.load(src)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_is_copied_and_strings_work(hf_dir, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    tok = make_tokenizer(SMALL["vocab_size"])
    tok.save(str(src / "tokenizer.json"))
    dst = specjax.convert(src, tmp_path / "ckpt")
    assert (dst / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()

    target = specjax.load(dst)
    assert target.tokenizer is not None
    prompts = ["the cat sat on a mat", "a dog ran"]
    ids = [tok.encode(p).ids for p in prompts]
    assert target.encode(prompts[0]) == ids[0] and 3 not in ids[0] + ids[1]  # no <unk>
    from_text = specjax.generate(target, prompts, max_new_tokens=6, eos_token_id=[])
    from_ids = specjax.generate(target, ids, max_new_tokens=6, eos_token_id=[])
    assert from_text.tokens == from_ids.tokens
    assert [len(t) for t in from_text.tokens] == [6, 6]
    assert from_text.texts == [tok.decode(t) for t in from_text.tokens]
    assert all(isinstance(t, str) for t in from_text.texts)
    # Loading the HF directory directly reads the same tokenizer.
    assert specjax.load(src).encode(prompts[1]) == ids[1]


# ---------------------------------------------------------------- atomicity and overwrite


def test_failed_conversion_missing_tensor_leaves_nothing(hf_dir, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=r"lacks tensor 'model.layers.1.self_attn.v_proj.weight'"):
        specjax.convert(src, out / "ckpt")
    assert leftovers(out, "ckpt") == []


def test_failed_conversion_mis_shaped_tensor_leaves_nothing(hf_dir, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.norm.weight"] = np.ones((7,), np.float32)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(7,\)"):
        specjax.convert(src, tmp_path / "out" / "ckpt")
    assert leftovers(tmp_path / "out", "ckpt") == []


def test_failure_while_saving_leaves_nothing(hf_dir, tmp_path, monkeypatch):
    """A crash midway through writing (after config and tokenizer files) removes the temporary directory."""
    def broken_save(self, *args, **kwargs):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", broken_save)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated"):
        specjax.convert(hf_dir, out / "ckpt")
    assert leftovers(out, "ckpt") == []


def test_failure_while_overwriting_keeps_the_old_checkpoint(hf_dir, hf_target, tmp_path, monkeypatch):
    dst = specjax.convert(hf_dir, tmp_path / "ckpt")

    def broken_save(self, *args, **kwargs):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", broken_save)
    with pytest.raises(RuntimeError, match="simulated"):
        specjax.convert(hf_dir, dst, dtype="bfloat16", overwrite=True)
    monkeypatch.undo()
    assert leftovers(tmp_path, "ckpt") == ["ckpt"]
    assert_same_params(specjax.load(dst).params, hf_target.params)


def test_existing_destination_is_refused_unless_overwrite(hf_dir, tmp_path):
    dst = tmp_path / "ckpt"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"ckpt already exists.*overwrite"):
        specjax.convert(hf_dir, dst)
    assert (dst / "precious.txt").read_text() == "keep me"

    specjax.convert(hf_dir, dst, dtype="bfloat16", overwrite=True)
    assert not (dst / "precious.txt").exists()
    assert specjax.load(dst).cfg.dtype == "bfloat16"
    assert leftovers(tmp_path, "ckpt") == ["ckpt"]


def test_bad_dtype_is_refused(hf_dir, tmp_path):
    with pytest.raises(ValueError, match=r"dtype must be .*float32.*bfloat16.*float16.*got 'int8'"):
        specjax.convert(hf_dir, tmp_path / "ckpt", dtype="int8")
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------- the script


def test_convert_script_bf16_and_refusal(hf_dir, hf_target, tmp_path):
    dst = tmp_path / "ckpt"
    done = run_convert_script(hf_dir, dst, "--dtype", "bf16")
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and str(dst) in done.stdout
    target = specjax.load(dst)
    assert {x.dtype for x in jax.tree.leaves(target.params)} == {jnp.dtype(jnp.bfloat16)}
    assert_same_params(target.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), hf_target.params))

    again = run_convert_script(hf_dir, dst, "--dtype", "fp32")
    assert again.returncode == 2
    assert "already exists" in again.stderr and "Traceback" not in again.stderr
    assert specjax.load(dst).cfg.dtype == "bfloat16"  # untouched


def test_convert_script_fp32_default(hf_dir, hf_target, tmp_path):
    done = run_convert_script(hf_dir, tmp_path / "ckpt", "--dtype", "fp32")
    assert done.returncode == 0, done.stderr
    assert_same_params(specjax.load(tmp_path / "ckpt").params, hf_target.params)
    missing = run_convert_script(tmp_path / "nope", tmp_path / "ckpt2")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert not (tmp_path / "ckpt2").exists()
