"""EAGLE-3 head: parity with the original PyTorch head, the checkpoint reader's checks, tap numbering.

The fixtures in tests/fixtures/eagle3/ were written by scripts/make_eagle3_fixtures.py from
SafeAILab/EAGLE's eagle/model/cnets.py (commit in each case's meta.json): a tiny random head
saved in the SafeAILab checkpoint format, its inputs and the original's outputs. Each case
is read back through specjax's checkpoint reader, so parity covers the reader's name and
[out, in] -> [in, out] mapping too.
"""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specjax.config import ModelConfig
from specjax.convert.eagle3 import default_feature_layers, feature_layers_from_config, load_eagle3
from specjax.drafters import eagle3

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
CASES = ("rope_theta", "rope_default")
ATOL = 1e-5


def target_config(num_layers: int = 8, **overrides) -> ModelConfig:
    """A target the fixture heads fit: hidden 64, vocabulary 256."""
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=num_layers, num_heads=4,
                  num_kv_heads=2, head_dim=16)
    return ModelConfig(**{**fields, **overrides})


def load_case(name: str):
    cfg, params = load_eagle3(FIXTURES / name, target_config())
    io = dict(np.load(FIXTURES / name / "io.npz"))
    params = {k: v for k, v in params.items()}
    params.setdefault("embed", io["target_embed"])
    return cfg, params, io


def kv_rows(cache, t: int):
    """The cache's first t positions in the original's layout [B, Hkv, T, D]."""
    (k,), (v,) = cache.k, cache.v
    return np.asarray(k[:, :t]).transpose(0, 2, 1, 3), np.asarray(v[:, :t]).transpose(0, 2, 1, 3)


@pytest.fixture(scope="module", params=CASES)
def case(request):
    cfg, params, io = load_case(request.param)
    b, t = io["ids_BT"].shape
    head = eagle3.head_of(cfg, params)
    cache = eagle3.init_head_cache(cfg, b, 32)
    h_BTD = head.fuse(jnp.asarray(io["features_BTF"]))
    h1, cache = head.midlayer(jnp.asarray(io["ids_BT"]), h_BTD, cache)
    first = dict(hidden=h1, logits=head.draft_logits(h1), kv=kv_rows(cache, t))
    cache = eagle3.KVCache(cache.k, cache.v, cache.lengths + t)
    h2, cache = head.midlayer(jnp.asarray(io["step2_ids"]), h1[:, -1:], cache)
    second = dict(hidden=h2, logits=head.draft_logits(h2), kv=kv_rows(cache, t + 1))
    return request.param, cfg, params, io, first, second


def test_first_step_matches_the_original(case):
    name, _, _, io, first, _ = case
    np.testing.assert_allclose(first["hidden"], io["step1_hidden"], atol=ATOL, rtol=0, err_msg=name)
    np.testing.assert_allclose(first["logits"], io["step1_logits"], atol=ATOL, rtol=0, err_msg=name)
    np.testing.assert_allclose(first["kv"][0], io["step1_k"], atol=ATOL, rtol=0, err_msg=name)
    np.testing.assert_allclose(first["kv"][1], io["step1_v"], atol=ATOL, rtol=0, err_msg=name)


def test_second_step_continues_the_cache_like_the_original(case):
    name, _, _, io, _, second = case
    np.testing.assert_allclose(second["hidden"], io["step2_hidden"], atol=ATOL, rtol=0, err_msg=name)
    np.testing.assert_allclose(second["logits"], io["step2_logits"], atol=ATOL, rtol=0, err_msg=name)
    np.testing.assert_allclose(second["kv"][0], io["step2_k"], atol=ATOL, rtol=0, err_msg=name)
    np.testing.assert_allclose(second["kv"][1], io["step2_v"], atol=ATOL, rtol=0, err_msg=name)


def test_draft_ids_map_to_the_target_ids_the_original_fed_back(case):
    _, cfg, params, io, first, _ = case
    draft_ids = jnp.argmax(first["logits"][:, -1], axis=-1)
    np.testing.assert_array_equal(eagle3.head_of(cfg, params).to_target_ids(draft_ids), io["step2_ids"][:, 0])


def test_rope_base_comes_from_the_head_config():
    assert load_case("rope_theta")[0].rope.theta == 500000.0
    assert load_case("rope_default")[0].rope.theta == 10000.0


def test_target_logits_place_draft_logits_at_their_target_ids():
    cfg, params, io = load_case("rope_theta")
    logits = jnp.asarray(io["step1_logits"][0, -1])
    head = eagle3.head_of(cfg, params)
    full = head.target_logits(logits)
    ids = head.to_target_ids(jnp.arange(cfg.draft_vocab_size))
    np.testing.assert_array_equal(full[ids], logits)
    assert int(jnp.sum(jnp.isfinite(full))) == cfg.draft_vocab_size
    assert int(jnp.argmax(full)) == int(ids[jnp.argmax(logits)])


# ---- tap numbering ---------------------------------------------------------------------------------------


def test_default_taps_are_hidden_states_2_mid_and_l_minus_3():
    assert default_feature_layers(32) == (2, 16, 29)  # Llama-3.1-8B
    assert feature_layers_from_config({}, 32) == (2, 16, 29)
    assert feature_layers_from_config({}, 7) == (2, 3, 4)


def test_aux_layer_ids_count_outputs_of_layers():
    hf = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert feature_layers_from_config(hf, 32) == (2, 16, 29)
    assert load_case("rope_theta")[0].feature_layers == (2, 4, 6)  # ids [1, 3, 5]
    assert load_case("rope_default")[0].feature_layers == (2, 4, 5)  # default for 8 layers


def test_default_taps_of_a_shallow_target_are_refused():
    with pytest.raises(ValueError, match=r"not distinct for a target of 6 layers.*eagle_aux_hidden_state_layer_ids"):
        feature_layers_from_config({}, 6)


@pytest.mark.parametrize("ids, match", [
    ([1, 3, 7], r"\[7\] outside the target's layers: with 8 layers .* 0\.\.6"),
    ([-1, 3, 5], r"\[-1\] outside"),
    ([1, 3, 3], "repeats a layer"),
    ([1, 3], "three integer layer ids"),
])
def test_bad_aux_layer_ids_are_refused(ids, match):
    with pytest.raises(ValueError, match=match):
        feature_layers_from_config({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}, 8)


# ---- checkpoint reader -----------------------------------------------------------------------------------


@pytest.fixture
def head_dir(tmp_path):
    """A writable copy of the rope_theta fixture head."""
    dst = tmp_path / "head"
    shutil.copytree(FIXTURES / "rope_theta", dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, **changes) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    for k, v in changes.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    save_file(tensors, str(path / "model.safetensors"))


def test_reader_maps_names_and_transposes(head_dir):
    cfg, params = load_eagle3(head_dir, target_config())
    raw = load_file(str(head_dir / "model.safetensors"))
    np.testing.assert_array_equal(params["fc"], raw["fc.weight"].T)
    np.testing.assert_array_equal(params["layer"]["wk"], raw["midlayer.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(params["layer"]["embed_norm"], raw["midlayer.input_layernorm.weight"])
    np.testing.assert_array_equal(params["d2t"], raw["d2t"])
    assert "embed" not in params and params["d2t"].dtype == np.int32
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.draft_vocab_size) == (64, 4, 2, 16, 128)
    _, with_embed = load_eagle3(FIXTURES / "rope_default", target_config())
    assert with_embed["embed"].shape == (256, 64)


def test_hidden_size_mismatch_names_both_sides(head_dir):
    with pytest.raises(ValueError, match=r"features of width 64 .*target's hidden_size is 96"):
        load_eagle3(head_dir, target_config(hidden_size=96))


def test_target_hidden_size_is_what_must_match(head_dir):
    edit_config(head_dir, target_hidden_size=96)
    with pytest.raises(ValueError, match=r"width 96 \(config.json target_hidden_size\).*hidden_size is 64"):
        load_eagle3(head_dir, target_config())


def test_vocab_mismatch_names_both_sides(head_dir):
    with pytest.raises(ValueError, match=r"vocab_size is 256 but the target's vocabulary has 300"):
        load_eagle3(head_dir, target_config(vocab_size=300))


def test_t2d_length_must_be_the_target_vocabulary(head_dir):
    t2d = load_file(str(head_dir / "model.safetensors"))["t2d"]
    edit_tensors(head_dir, t2d=np.concatenate([t2d, np.zeros(4, bool)]))
    with pytest.raises(ValueError, match=r"'t2d' has 260 entries but the target's vocabulary has 256"):
        load_eagle3(head_dir, target_config())


def test_d2t_outside_the_target_vocabulary_is_refused(head_dir):
    d2t = load_file(str(head_dir / "model.safetensors"))["d2t"].copy()
    d2t[-1] += 1000
    edit_tensors(head_dir, d2t=d2t)
    with pytest.raises(ValueError, match=r"d2t maps draft ids \[127\] to target ids \[\d+\], outside the target's "
                                         r"vocabulary of 256"):
        load_eagle3(head_dir, target_config())


def test_d2t_inconsistent_with_t2d_is_refused(head_dir):
    t2d = load_file(str(head_dir / "model.safetensors"))["t2d"].copy()
    t2d[np.argmin(t2d)] = True
    edit_tensors(head_dir, t2d=t2d)
    with pytest.raises(ValueError, match="t2d and d2t disagree"):
        load_eagle3(head_dir, target_config())


def test_feature_layers_out_of_range_for_the_target_are_refused(head_dir):
    with pytest.raises(ValueError, match=r"\[5\] outside the target's layers: with 6 layers"):
        load_eagle3(head_dir, target_config(num_layers=6))


def test_missing_and_extra_tensors_are_refused(head_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(head_dir, other)
    edit_tensors(head_dir, **{"midlayer.hidden_norm.weight": None})
    with pytest.raises(ValueError, match=r"lacks tensor 'midlayer.hidden_norm.weight'"):
        load_eagle3(head_dir, target_config())
    edit_tensors(other, **{"midlayer.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"'midlayer.extra.weight'.*refuses to drop weights"):
        load_eagle3(other, target_config())


def test_shape_mismatch_is_refused(head_dir):
    edit_config(head_dir, intermediate_size=96)
    with pytest.raises(ValueError, match=r"'midlayer.mlp.gate_proj.weight' has shape \(128, 64\); config.json "
                                         r"implies \(96, 64\)"):
        load_eagle3(head_dir, target_config())


def test_unsupported_rope_scaling_is_refused(head_dir):
    edit_config(head_dir, rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_scaling has type 'dynamic'.*SafeAILab"):
        load_eagle3(head_dir, target_config())


def test_pytorch_bin_without_torch_asks_for_torch_or_safetensors(head_dir, monkeypatch):
    (head_dir / "model.safetensors").rename(head_dir / "pytorch_model.bin")
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(ValueError, match=r"pytorch_model.bin is a PyTorch pickle and torch is not installed: install "
                                         r"torch .* or convert the head to model.safetensors"):
        load_eagle3(head_dir, target_config())


def test_pytorch_bin_is_read_with_torch(head_dir):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as load_torch

    state = load_torch(str(head_dir / "model.safetensors"))
    (head_dir / "model.safetensors").unlink()
    torch.save(state, str(head_dir / "pytorch_model.bin"))
    _, params = load_eagle3(head_dir, target_config())
    _, expected = load_eagle3(FIXTURES / "rope_theta", target_config())
    np.testing.assert_array_equal(params["layer"]["wq"], expected["layer"]["wq"])
    np.testing.assert_array_equal(params["d2t"], expected["d2t"])


def test_no_weights_is_a_file_not_found(head_dir):
    (head_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="expected model.safetensors, model.safetensors.index.json with its "
                                                "shards, or pytorch_model.bin"):
        load_eagle3(head_dir, target_config())
