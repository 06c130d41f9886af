"""`specjax export`: specjax models back to Hugging Face, EAGLE-3 heads back to the SafeAILab format.

transformers must load an exported target and give specjax's logits (1e-4); an exported head
must read back into identical params; writes are atomic and refuse to clobber.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import build_hf_model, save_hf_model
from safetensors.numpy import load_file
from test_mtp import add_mtp

import specjax
from specjax.cli import main as cli_main
from specjax.convert import export as ex
from specjax.convert.eagle3 import load_eagle3
from specjax.drafters import MtpDrafter
from specjax.models.cache import init_cache
from specjax.models.decoder import has_layer_list
from specjax.models.model import forward, lm_head

REPO = Path(__file__).resolve().parents[1]
EMBEDDED = REPO / "checkpoints" / "tiny"
FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"


def specjax_logits(target, tokens_BT: np.ndarray) -> np.ndarray:
    cache = init_cache(target.cfg, tokens_BT.shape[0], 128, per_layer=has_layer_list(target.params))
    h, _, _ = forward(target.params, target.cfg, jnp.asarray(tokens_BT), cache, attn_impl="xla")
    return np.asarray(lm_head(target.params, target.cfg, h))


def transformers_logits(path: Path, tokens_BT: np.ndarray) -> np.ndarray:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens_BT, dtype=torch.long)).logits.numpy()


def test_embedded_target_runs_in_transformers(tmp_path):
    target = specjax.load(EMBEDDED / "target")
    dst = ex.export(EMBEDDED / "target", tmp_path / "target-hf")
    assert (dst / "tokenizer.json").read_bytes() == (EMBEDDED / "target" / "tokenizer.json").read_bytes()
    config = json.loads((dst / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    tokens = np.asarray([target.encode("def quicksort(xs):\n    return sorted(xs)")], np.int32)
    np.testing.assert_allclose(transformers_logits(dst, tokens), specjax_logits(target, tokens), atol=1e-4, rtol=1e-4)
    # The source has no tokenizer_config.json / generation_config.json: the export writes both, so transformers'
    # tokenizer knows bos/eos and its generate stops where specjax's does.
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(dst)
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    assert tok.encode("def f(x):") == target.encode("def f(x):")  # the BOS from tokenizer.json included
    assert transformers.GenerationConfig.from_pretrained(dst).eos_token_id == config["eos_token_id"]


def test_converted_qwen3_round_trips_exactly(tmp_path):
    """HF -> specjax convert -> export: the same tensors, and transformers' logits equal specjax's."""
    model = build_hf_model("qwen3", seed=3)
    src = save_hf_model(model, tmp_path / "hf")
    specjax.convert(src, tmp_path / "sj")
    dst = ex.export(tmp_path / "sj", tmp_path / "back")
    original, exported = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 11)).astype(np.int32)
    got = transformers_logits(dst, tokens)
    np.testing.assert_allclose(got, specjax_logits(specjax.load(tmp_path / "sj"), tokens), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        np.testing.assert_allclose(got, model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy(), atol=1e-4)


def test_bf16_export_casts(tmp_path):
    dst = ex.export(EMBEDDED / "draft", tmp_path / "draft-bf16", dtype="bfloat16")
    tensors = load_file(dst / "model.safetensors")
    assert {str(v.dtype) for v in tensors.values()} == {"bfloat16"}
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("case", ["rope_theta", "rope_default"])
def test_eagle3_head_reads_back_identically(case, tmp_path):
    target_cfg = specjax.load(EMBEDDED / "target").cfg  # a stand-in with the fixtures' width, vocab and 7 layers
    hf = json.loads((FIXTURES / case / "config.json").read_text())
    stub = dataclasses.replace(target_cfg, hidden_size=hf["hidden_size"], vocab_size=hf["vocab_size"], num_layers=7)
    cfg, params = load_eagle3(FIXTURES / case, stub)
    dst = ex.export_eagle3(cfg, params, tmp_path / "head", include_embed="embed" in params)
    cfg2, params2 = load_eagle3(dst, stub)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, params2)
    original, exported = load_file(FIXTURES / case / "model.safetensors"), load_file(dst / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_eagle3_training_run_exports_through_the_cli(tmp_path):
    """A run dir (orbax checkpoints + eagle3_head.json) -> SafeAILab dir that load_eagle3 reads back."""
    import orbax.checkpoint as ocp

    from specjax.config import ModelConfig
    from specjax.train import eagle3 as ttt
    from specjax.train import trainer

    tcfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=16)
    cfg = ttt.head_config(tcfg, (1, 2, 3), draft_vocab_size=100, intermediate_size=96)
    d2t, _ = ttt.draft_vocab_from_counts(np.arange(256), 100)
    trainable = trainer.host(ttt.init_head(cfg, jax.random.key(0)))
    run = tmp_path / "run"
    tc = trainer.TrainConfig(steps=1)
    state = trainer.init_state(trainable, trainer.make_optimizer(tc))
    with trainer.checkpoint_manager(run, tc) as mgr:
        mgr.save(1, args=ocp.args.StandardSave(state))
    (run / ex.EAGLE3_RUN_FILE).write_text(json.dumps({"config": ex.eagle3_hf_config(cfg), "d2t": d2t.tolist()}))

    assert cli_main(["export", str(run), str(tmp_path / "head")]) == 0
    cfg2, params2 = load_eagle3(tmp_path / "head", tcfg)
    assert cfg2 == cfg and cfg2.feature_layers == (1, 2, 3)
    np.testing.assert_array_equal(params2["d2t"], d2t)
    jax.tree.map(np.testing.assert_array_equal, trainable, {k: v for k, v in params2.items() if k != "d2t"})


def test_refuses_to_clobber_and_bad_sources(tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    with pytest.raises(FileExistsError, match="overwrite"):
        ex.export(EMBEDDED / "draft", dst)
    assert cli_main(["export", str(EMBEDDED / "draft"), str(dst)]) == 2
    with pytest.raises(ValueError, match="neither"):
        ex.export(tmp_path, tmp_path / "x")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="already a Hugging Face"):
        ex.export(hf_dir, tmp_path / "x")
    with pytest.raises(ValueError, match="is an EAGLE-3 head: pass the target it drafts for with --target"):
        ex.export(FIXTURES / "rope_theta", tmp_path / "x")
    with pytest.raises(FileNotFoundError):
        ex.export(tmp_path / "missing", tmp_path / "x")
    assert "error" in capsys.readouterr().err


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    dst = ex.export(EMBEDDED / "draft", tmp_path / "draft-hf")
    before = (dst / "model.safetensors").read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.numpy.save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        ex.export(EMBEDDED / "draft", dst, overwrite=True)
    with pytest.raises(OSError):
        ex.export(EMBEDDED / "draft", tmp_path / "new")
    assert (dst / "model.safetensors").read_bytes() == before  # the old export survives
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft-hf"]  # no temp dirs, nothing at "new"


# ---------------------------------------------------------------- MTP layers


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def assert_same_drafts(target_a, drafter_a, target_b, drafter_b, prompts):
    for prompt in prompts:
        a = specjax.inspect_draft(target_a, drafter_a, prompt, num_draft_tokens=3)
        b = specjax.inspect_draft(target_b, drafter_b, prompt, num_draft_tokens=3)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logits, b.logits)


def _own_head(tensors):
    """DeepSeek layer 2 (the first MTP layer) with its own shared_head.head, unlike the target's lm_head."""
    head = np.random.default_rng(5).standard_normal((256, 64)).astype(np.float32) / 8
    return {**tensors, "model.layers.2.shared_head.head.weight": head}


@pytest.mark.parametrize("layout, num, edit", [("deepseek", 2, _own_head), ("qwen3_next", 2, None)])
def test_converted_target_exports_its_mtp_layers_in_their_layout(layout, num, edit, tmp_path):
    """HF with MTP tensors -> convert -> export: same target, same Target.mtp, same MTP drafts."""
    base = save_hf_model(build_hf_model("llama", seed=0, num_hidden_layers=2, tie_word_embeddings=False),
                         tmp_path / "base")
    src = add_mtp(base, tmp_path / "hf", layout, num, seed=1, edit=edit)
    specjax.convert(src, tmp_path / "sj")
    dst = ex.export(tmp_path / "sj", tmp_path / "back")
    config = json.loads((dst / "config.json").read_text())
    assert config["num_nextn_predict_layers" if layout == "deepseek" else "mtp_num_hidden_layers"] == num
    original, exported = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    for name, value in original.items():  # every original tensor under its own name, [out, in]
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    added = sorted(set(exported) - set(original))
    if layout == "deepseek":  # the per-layer tables DeepSeek-V3 ships: the target's where the layer had none
        assert added == ["model.layers.2.embed_tokens.weight", "model.layers.3.embed_tokens.weight",
                         "model.layers.3.shared_head.head.weight"]
        np.testing.assert_array_equal(exported["model.layers.3.shared_head.head.weight"], original["lm_head.weight"])
        np.testing.assert_array_equal(exported["model.layers.2.embed_tokens.weight"],
                                      original["model.embed_tokens.weight"])
    else:
        assert added == []
        assert all(n.startswith("mtp.") for n in set(original) - set(load_file(base / "model.safetensors")))

    want, got = specjax.load(tmp_path / "sj"), specjax.load(dst)
    assert_same_tree(got.params, want.params)
    assert_same_tree(got.mtp, want.mtp)
    assert ("lm_head" in got.mtp["layers"]["0"]) == (edit is not None)
    drafter = specjax.load_drafter(dst, got)
    assert isinstance(drafter, MtpDrafter) and drafter.cfg.layout == layout and drafter.cfg.num_layers == num
    assert_same_drafts(want, specjax.load_drafter(tmp_path / "sj", want), got, drafter, [[7, 30, 12, 5], [200]])


def test_mtp_only_dir_exports_with_its_target(tmp_path):
    """checkpoints/tiny/mtp + --target: one HF dir; specjax reads the same target and MTP drafter,
    transformers loads it as a plain causal LM with the same logits."""
    dst = tmp_path / "with-mtp"
    assert cli_main(["export", str(EMBEDDED / "mtp"), str(dst), "--target", str(EMBEDDED / "target")]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and "specjax_mtp_only" not in config
    assert config["torch_dtype"] == "float32" and config["num_hidden_layers"] == 4
    assert (dst / "tokenizer.json").read_bytes() == (EMBEDDED / "target" / "tokenizer.json").read_bytes()
    tensors = load_file(dst / "model.safetensors")
    mtp_names = sorted(n for n in tensors if n.startswith("model.layers.4."))
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens",
                 "self_attn.q_proj", "mlp.down_proj"):
        assert f"model.layers.4.{name}.weight" in mtp_names, name
    assert "lm_head.weight" not in tensors  # tied, as the target
    np.testing.assert_array_equal(tensors["model.layers.4.shared_head.head.weight"],
                                  tensors["model.embed_tokens.weight"])

    target, got = specjax.load(EMBEDDED / "target"), specjax.load(dst)
    assert target.mtp is None and got.mtp is not None
    assert_same_tree(got.params, target.params)
    tokens = np.asarray([target.encode("def quicksort(xs):\n    return sorted(xs)")], np.int32)
    want_logits = specjax_logits(target, tokens)
    np.testing.assert_array_equal(specjax_logits(got, tokens), want_logits)
    drafter = specjax.load_drafter(dst, got)
    assert isinstance(drafter, MtpDrafter) and drafter.cfg.layout == "deepseek"
    assert_same_drafts(target, specjax.load_drafter(EMBEDDED / "mtp", target), got, drafter,
                       [target.encode("def add(a, b):"), [5, 9, 14]])
    np.testing.assert_allclose(transformers_logits(dst, tokens), want_logits, atol=1e-4, rtol=1e-4)


def test_mtp_only_export_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="holds only MTP layers.*--target"):
        ex.export(EMBEDDED / "mtp", tmp_path / "x")
    assert cli_main(["export", str(EMBEDDED / "mtp"), str(tmp_path / "x")]) == 2
    assert "--target" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--target is for exporting an MTP-only directory"):
        ex.export(EMBEDDED / "draft", tmp_path / "x", target=EMBEDDED / "target")
    with pytest.raises(ValueError, match="made for another target"):
        ex.export(EMBEDDED / "mtp", tmp_path / "x", target=EMBEDDED / "draft")
    with pytest.raises(ValueError, match="itself an MTP-only directory"):
        ex.export(EMBEDDED / "mtp", tmp_path / "x", target=EMBEDDED / "mtp")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ex.export(EMBEDDED / "mtp", tmp_path / "x", target=tmp_path / "missing")
    with_mtp = ex.export(EMBEDDED / "mtp", tmp_path / "with-mtp", target=EMBEDDED / "target")
    with pytest.raises(ValueError, match="already carries MTP layers"):
        ex.export(EMBEDDED / "mtp", tmp_path / "x", target=with_mtp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["with-mtp"]  # nothing written by the refusals
