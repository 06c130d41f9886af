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
from hf_tiny import FAMILIES, build_hf_model, save_hf_model
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import specjax
from specjax.convert import checkpoint

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


# ---------------------------------------------------------------- tensors the config does not account for


def copy_with_tensors(src: Path, dst: Path, edit) -> Path:
    """Copy an HF directory, rewriting model.safetensors through `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def with_extra(**extra: np.ndarray):
    """An `edit` that adds tensors."""
    return lambda tensors: {**tensors, **extra}


def test_qkv_biases_without_attention_bias_are_refused(hf_dir, tmp_path):
    """Llama with attention_bias false: stored q/k/v biases would be silently dropped."""
    bias = {f"model.layers.0.self_attn.{p}_proj.bias": np.ones((n,), np.float32)
            for p, n in (("q", 32), ("k", 16), ("v", 16))}
    src = copy_with_tensors(hf_dir, tmp_path / "hf", with_extra(**bias))
    with pytest.raises(ValueError, match=r"3 tensor\(s\) the config does not account for: "
                                         r"'model.layers.0.self_attn.k_proj.bias'.*'attention_bias' false"):
        specjax.load(src)
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        specjax.convert(src, tmp_path / "out" / "ckpt")
    assert leftovers(tmp_path / "out", "ckpt") == []


def test_layer_beyond_num_hidden_layers_is_refused(hf_dir, tmp_path):
    extra = {"model.layers.2.mlp.up_proj.weight": np.ones((64, 32), np.float32),
             "model.layers.2.input_layernorm.weight": np.ones((32,), np.float32)}
    src = copy_with_tensors(hf_dir, tmp_path / "hf", with_extra(**extra))
    with pytest.raises(ValueError, match=r"'model.layers.2.input_layernorm.weight', 'model.layers.2.mlp.up_proj"
                                         r".weight'.*layers up to 2 present but config.json 'num_hidden_layers' is 2"):
        specjax.load(src)


def test_tied_lm_head_equal_to_embedding_is_accepted(hf_dir, hf_target, tmp_path):
    """transformers ties the two when both are stored and equal; specjax loads the same params."""
    src = copy_with_tensors(hf_dir, tmp_path / "hf",
                            lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].copy()})
    assert specjax.load(src).cfg.tie_word_embeddings
    assert_same_params(specjax.load(src).params, hf_target.params)


def test_tied_lm_head_different_from_embedding_is_refused(hf_dir, tmp_path):
    """The config says tied but the checkpoint has its own head: transformers 5 would untie, older ones ignore it."""
    src = copy_with_tensors(hf_dir, tmp_path / "hf",
                            lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"] + 1.0})
    with pytest.raises(ValueError, match=r"'lm_head.weight'.*differs from 'model.embed_tokens.weight'.*"
                                         r"'tie_word_embeddings' is true"):
        specjax.load(src)


def test_rotary_inv_freq_buffers_are_harmless(hf_dir, hf_target, tmp_path):
    """Non-persistent RoPE buffers some exporters saved: specjax recomputes them from the config."""
    inv = np.ones((4,), np.float32)
    src = copy_with_tensors(hf_dir, tmp_path / "hf", with_extra(**{
        "model.rotary_emb.inv_freq": inv, "model.layers.0.self_attn.rotary_emb.inv_freq": inv,
        "model.layers.1.self_attn.rotary_emb.inv_freq": inv}))
    assert_same_params(specjax.load(src).params, hf_target.params)


@pytest.mark.parametrize("style", ["deepseek", "qwen3_next"])
def test_incomplete_mtp_tensors_are_refused_naming_what_is_wrong(hf_dir, tmp_path, style):
    """MTP tensors are routed to the MTP reader (tests/test_mtp.py), which checks them as strictly."""
    if style == "deepseek":  # one extra layer at index num_hidden_layers with the MTP modules
        names = ["model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
                 "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.q_proj.weight"]
        message = r"MTP tensor 'model.layers.2.enorm.weight' has shape \(4,\) but the target's hidden_size 32 implies"
    else:
        names = ["mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"]
        message = r"checkpoint lacks MTP tensor 'mtp.pre_fc_norm_embedding.weight'"
    src = copy_with_tensors(hf_dir, tmp_path / "hf", with_extra(**{n: np.ones((4,), np.float32) for n in names}))
    with pytest.raises(ValueError, match=message) as err:
        specjax.load(src)
    assert "does not account for" not in str(err.value)  # all recognised as MTP, nothing unknown


def test_unaccounted_check_returns_names_for_the_caller():
    """The check is split so a known family (MTP) is routed to its own reader (convert/mtp.py)."""
    from specjax.config import ModelConfig
    from specjax.convert.hf import split_known_extras, unaccounted_tensors

    cfg = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=4)
    tensors = {n: np.zeros((1,)) for n in ("a", "model.rotary_emb.inv_freq", "mtp.fc.weight", "used",
                                           "model.layers.1.enorm.weight", "model.layers.1.mlp.up_proj.weight")}
    leftover = unaccounted_tensors(tensors, {"used"}, cfg)
    assert leftover == ["a", "model.layers.1.enorm.weight", "model.layers.1.mlp.up_proj.weight", "mtp.fc.weight"]
    assert split_known_extras(leftover, cfg) == {
        "mtp": ["model.layers.1.enorm.weight", "model.layers.1.mlp.up_proj.weight", "mtp.fc.weight"],
        "unknown": ["a"]}


def test_many_unaccounted_tensors_are_listed_briefly(hf_dir, tmp_path):
    extra = {f"model.extra.{i:02d}.weight": np.ones((2,), np.float32) for i in range(20)}
    src = copy_with_tensors(hf_dir, tmp_path / "hf", with_extra(**extra))
    with pytest.raises(ValueError, match=r"20 tensor\(s\).*'model.extra.07.weight' and 12 more") as err:
        specjax.load(src)
    assert "model.extra.08" not in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- overwrite keeps the old checkpoint until the end


def test_crash_while_swapping_in_the_new_checkpoint_keeps_the_old(hf_dir, hf_target, tmp_path, monkeypatch):
    """Renaming the finished new checkpoint into place fails: the old one must still be at dst, intact."""
    dst = specjax.convert(hf_dir, tmp_path / "ckpt")
    real_rename = Path.rename

    def rename(self, target):
        if self.name.startswith(".ckpt.tmp-") and Path(target).name == "ckpt":
            raise OSError("crash while renaming (simulated)")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="simulated"):
        specjax.convert(hf_dir, dst, dtype="bfloat16", overwrite=True)
    monkeypatch.undo()
    assert leftovers(tmp_path, "ckpt") == ["ckpt"]
    assert specjax.load(dst).cfg.dtype == "float32"
    assert_same_params(specjax.load(dst).params, hf_target.params)


def test_overwrite_replaces_the_old_checkpoint_without_leftovers(hf_dir, tmp_path):
    dst = specjax.convert(hf_dir, tmp_path / "ckpt")
    (dst / "stale.txt").write_text("from the old checkpoint")
    specjax.convert(hf_dir, dst, dtype="bfloat16", overwrite=True)
    assert not (dst / "stale.txt").exists()
    assert specjax.load(dst).cfg.dtype == "bfloat16"
    assert leftovers(tmp_path, "ckpt") == ["ckpt"]


def test_overwrite_keeps_the_old_one_until_the_new_one_is_in_place(hf_dir, tmp_path, monkeypatch):
    """The old checkpoint is only deleted after the new one has been renamed into place."""
    dst = specjax.convert(hf_dir, tmp_path / "ckpt")
    seen = []
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        seen.append((Path(path).name, checkpoint.is_checkpoint(dst) and json.loads(
            (dst / checkpoint.MARKER).read_text())["dtype"]))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    specjax.convert(hf_dir, dst, dtype="bfloat16", overwrite=True)
    # Whatever was deleted, the new checkpoint was already at dst at that moment.
    assert seen and all(dtype == "bfloat16" for _, dtype in seen)
    assert leftovers(tmp_path, "ckpt") == ["ckpt"]
