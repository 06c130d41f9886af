"""User mistakes get a ValueError / FileNotFoundError whose message names what was wrong.

Most checks here fail before anything is compiled, so the module stays fast; only the
sliding-window case compiles once, to show that a window that does not matter is accepted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model
from safetensors.numpy import load_file, save_file

import specjax

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 Hugging Face directory (untied, with q/k/v biases)."""
    return save_hf_model(build_hf_model("qwen2", **SMALL), tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def target(hf_dir):
    return specjax.load(hf_dir)


def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    """Copy an HF directory, applying `changes` to its config.json (None deletes a key)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _copy_with_tensors(src: Path, dst: Path, edit) -> Path:
    """Copy an HF directory, rewriting model.safetensors through `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------- loading: config


def test_unsupported_architecture(hf_dir, tmp_path):
    path = _copy_with_config(hf_dir, tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"architectures.*GPT2LMHeadModel.*supports.*LlamaForCausalLM"):
        specjax.load(path)


def test_unknown_rope_scaling_type(hf_dir, tmp_path):
    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = {**(cfg.get("rope_parameters") or {}), "rope_type": "yarn", "factor": 4.0}
    path = _copy_with_config(hf_dir, tmp_path / "m", rope_parameters=rope)
    with pytest.raises(ValueError, match=r"rope.*'yarn'.*not implemented"):
        specjax.load(path)


def test_legacy_rope_scaling_type_is_checked_too(hf_dir, tmp_path):
    """Older transformers wrote `rope_theta` + `rope_scaling` (with `type`) instead of `rope_parameters`."""
    path = _copy_with_config(hf_dir, tmp_path / "m", rope_parameters=None, rope_theta=10000.0,
                             rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"'dynamic'.*not implemented"):
        specjax.load(path)


def test_rope_scaling_next_to_rope_parameters_is_not_ignored(hf_dir, tmp_path):
    path = _copy_with_config(hf_dir, tmp_path / "m", rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"'dynamic'"):
        specjax.load(path)


def test_hidden_act_not_silu(hf_dir, tmp_path):
    path = _copy_with_config(hf_dir, tmp_path / "m", hidden_act="gelu")
    with pytest.raises(ValueError, match=r"hidden_act.*'gelu'.*silu"):
        specjax.load(path)


def test_mlp_bias(hf_dir, tmp_path):
    path = _copy_with_config(hf_dir, tmp_path / "m", mlp_bias=True)
    with pytest.raises(ValueError, match=r"mlp_bias"):
        specjax.load(path)


def test_missing_required_config_field(hf_dir, tmp_path):
    path = _copy_with_config(hf_dir, tmp_path / "m", intermediate_size=None)
    with pytest.raises(ValueError, match=r"lacks required field 'intermediate_size'"):
        specjax.load(path)


# ---------------------------------------------------------------- loading: files and tensors


def test_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=r"no_such_model.*does not exist"):
        specjax.load(missing)
    with pytest.raises(FileNotFoundError, match=r"no_such_model.*does not exist"):
        specjax.convert(missing, tmp_path / "out")


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        specjax.load(tmp_path / "empty")


def test_directory_without_weights(hf_dir, tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    shutil.copyfile(hf_dir / "config.json", path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no weights.*model\.safetensors"):
        specjax.load(path)


def test_missing_tensor(hf_dir, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    path = _copy_with_tensors(hf_dir, tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=rf"lacks tensor '{name}'"):
        specjax.load(path)


def test_mis_shaped_tensor(hf_dir, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(tensors):
        tensors[name] = np.zeros((tensors[name].shape[0] + 1, tensors[name].shape[1]), np.float32)
        return tensors

    path = _copy_with_tensors(hf_dir, tmp_path / "m", edit)
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(17, 32\).*config implies \(16, 32\)"):
        specjax.load(path)


def test_bad_load_dtype(hf_dir, tmp_path):
    converted = specjax.convert(hf_dir, tmp_path / "ckpt")
    for path in (hf_dir, converted):
        with pytest.raises(ValueError, match=r"dtype.*'int8'"):
            specjax.load(path, dtype="int8")


def test_bad_attn_impl(hf_dir):
    with pytest.raises(ValueError, match=r"attn_impl.*'cuda'"):
        specjax.load(hf_dir, attn_impl="cuda")


# ---------------------------------------------------------------- generate: prompts and lengths


def test_empty_prompt_list(target):
    with pytest.raises(ValueError, match=r"prompts is empty"):
        specjax.generate(target, [], max_new_tokens=4)


def test_an_empty_prompt(target):
    with pytest.raises(ValueError, match=r"prompt 1 is empty"):
        specjax.generate(target, [[5, 6], []], max_new_tokens=4)


def test_a_bare_string_is_not_a_prompt_list(target):
    with pytest.raises(ValueError, match=r"list of token-id lists or a list of strings"):
        specjax.generate(target, "hello", max_new_tokens=4)


@pytest.mark.parametrize("bad", [128, 1000, -1])
def test_token_id_out_of_range(target, bad):
    with pytest.raises(ValueError, match=rf"prompt 0 has token ids \[{bad}\] outside the vocabulary \[0, 128\)"):
        specjax.generate(target, [[3, bad, 4]], max_new_tokens=4)


@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_max_new_tokens(target, bad):
    with pytest.raises(ValueError, match=rf"max_new_tokens must be positive, got {bad}"):
        specjax.generate(target, [[3, 4]], max_new_tokens=bad)


def test_prompt_longer_than_the_cache(target):
    with pytest.raises(ValueError, match=r"longest prompt has 10 tokens.*max_new_tokens=10.*cache of 20.*max_len=16"):
        specjax.generate(target, [[3] * 10, [4] * 2], max_new_tokens=10, max_len=16)


def test_prompt_longer_than_the_context(target):
    with pytest.raises(ValueError, match=r"longest prompt has 250 tokens.*max_new_tokens=10.*context of 256.*"
                                         r"max_position_embeddings"):
        specjax.generate(target, [[3] * 250], max_new_tokens=10)


@pytest.mark.parametrize("temperature", [-0.5, -1e-9])
def test_bad_temperature(target, temperature):
    with pytest.raises(ValueError, match=r"temperature must be a number >= 0"):
        specjax.generate(target, [[3, 4]], max_new_tokens=4, temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5])
def test_bad_top_p(target, top_p):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        specjax.generate(target, [[3, 4]], max_new_tokens=4, temperature=1.0, top_p=top_p)


def test_bad_top_k(target):
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 0"):
        specjax.generate(target, [[3, 4]], max_new_tokens=4, temperature=1.0, top_k=-2)


def test_strings_without_a_tokenizer(target):
    assert target.tokenizer is None
    with pytest.raises(ValueError, match=r"no tokenizer\.json.*token-id lists"):
        specjax.generate(target, ["hello world"], max_new_tokens=4)


# ---------------------------------------------------------------- sliding window


@pytest.fixture(scope="module")
def mistral_window_target(tmp_path_factory):
    model = build_hf_model("mistral", **{**SMALL, "sliding_window": 32})
    return specjax.load(save_hf_model(model, tmp_path_factory.mktemp("mistral")))


def test_sliding_window_that_matters_is_refused(mistral_window_target):
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 32\).*within 32 tokens"):
        specjax.generate(mistral_window_target, [[3] * 20], max_new_tokens=20)


def test_sliding_window_that_does_not_matter_is_accepted(mistral_window_target):
    out = specjax.generate(mistral_window_target, [[3] * 20], max_new_tokens=12, eos_token_id=[])
    assert len(out.tokens[0]) == 12


# ---------------------------------------------------------------- benchmark presets


def test_gpu_benchmark_preset_is_refused_off_gpu():
    import jax

    from specjax.bench.ar import ArBenchConfig, run_ar

    if jax.default_backend() == "gpu":
        pytest.skip("runs on a GPU here")
    with pytest.raises(ValueError, match=r"8b preset needs a GPU.*backend is 'cpu'.*tiny20m"):
        run_ar(ArBenchConfig(preset="8b", batches=(1,)))
    with pytest.raises(ValueError, match=r"unknown preset 'huge'"):
        ArBenchConfig(preset="huge").validate()


# ---------------------------------------------------------------- truncated or corrupt files


def _truncated(src: Path, dst: Path, keep: float = 0.5) -> Path:
    """Copy an HF directory with model.safetensors cut short (a half-written download)."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)])
    return dst


@pytest.mark.parametrize("keep", [0.5, 0.0001, 0.0])
def test_truncated_weight_file_names_the_file(hf_dir, tmp_path, keep):
    path = _truncated(hf_dir, tmp_path / "m", keep)
    file = path / "model.safetensors"
    with pytest.raises(ValueError, match=rf"{file}: not a readable safetensors file \(.+\).*truncated") as err:
        specjax.load(path)
    assert "\n" not in str(err.value)


def test_garbage_weight_file_names_the_file(hf_dir, tmp_path):
    path = shutil.copytree(hf_dir, tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"<html>404 not found</html>" * 40)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        specjax.load(path)


def test_corrupt_shard_index_names_the_file(hf_dir, tmp_path):
    path = shutil.copytree(hf_dir, tmp_path / "m")
    (path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001')
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: not valid JSON"):
        specjax.load(path)
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json has no 'weight_map'"):
        specjax.load(path)


def test_corrupt_config_names_the_file(hf_dir, tmp_path):
    path = shutil.copytree(hf_dir, tmp_path / "m")
    (path / "config.json").write_text('{"architectures": ["Qwen2')
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        specjax.load(path)


# ---------------------------------------------------------------- the CLI: one line, exit code 2


def _cli(capsys, *argv) -> tuple[int, str]:
    from specjax.cli import main

    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def _assert_one_line_error(rc: int, err: str, *fragments: str) -> None:
    assert rc == 2
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_cli_convert_truncated_file_is_one_line(hf_dir, tmp_path, capsys):
    src = _truncated(hf_dir, tmp_path / "m")
    rc, err = _cli(capsys, "convert", src, tmp_path / "ckpt")
    _assert_one_line_error(rc, err, "specjax convert: error:", str(src / "model.safetensors"),
                           "not a readable safetensors file")
    assert not (tmp_path / "ckpt").exists()


def test_cli_user_errors_are_one_line_for_every_subcommand(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    _assert_one_line_error(*_cli(capsys, "convert", missing, tmp_path / "out"), "specjax convert: error:",
                           "does not exist")
    _assert_one_line_error(*_cli(capsys, "generate", missing, "--prompt", "1 2"), "specjax generate: error:",
                           "does not exist")
    _assert_one_line_error(*_cli(capsys, "demo", "--target", missing), "specjax demo: error:", "no embedded model")
    _assert_one_line_error(*_cli(capsys, "bench", "ar", "--batch", "0", "--dry-run"), "specjax bench: error:",
                           "batch sizes must be positive")
    _assert_one_line_error(*_cli(capsys, "bench", "spec", "--target", missing), "specjax bench: error:",
                           "does not exist")


def test_cli_folds_multi_line_messages(monkeypatch, capsys):
    import specjax.loading.target

    def convert(*args, **kwargs):
        raise ValueError("first line\nsecond line")

    monkeypatch.setattr(specjax.loading.target, "convert", convert)
    _assert_one_line_error(*_cli(capsys, "convert", "a", "b"), "first line second line")
