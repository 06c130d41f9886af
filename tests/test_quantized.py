"""Quantized targets: block FP8 checkpoints written by transformers' own quantizer at test time (tests/hf_quant.py)
load as they are, keep their weights quantized on the device, and compute what transformers' dequantized model
computes; speculation on them stays lossless. Format detection and bad input: test_quantized_formats.py."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from hf_quant import reference_model, write_block_fp8
from hf_tiny import build_hf_model
from test_hybrid_speculative import make

import specjax
from specjax.quant.qarray import QuantizedWeight, is_quantized

MAX_NEW = 16
PROMPT = [1, 5, 9, 33, 100, 7, 61, 200]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """A 4-layer Qwen3 in block FP8 (32 x 32 blocks, bf16 scales as Qwen ships them); every o_proj left plain
    and listed in modules_to_not_convert."""
    model = build_hf_model("qwen3", seed=0, num_hidden_layers=4)
    return write_block_fp8(model, tmp_path_factory.mktemp("fp8"), block=(32, 32), scale_dtype=torch.bfloat16,
                           skip=lambda name: "o_proj" in name)


@pytest.fixture(scope="module")
def reference(fp8_dir):
    return reference_model(fp8_dir)


@pytest.fixture(scope="module")
def target(fp8_dir):
    # weight-only: transformers' CPU load of block FP8 (the reference here) dequantizes and does not quantize the
    # activations its config declares; specjax's default does (test_quantized_activations.py)
    return specjax.load(fp8_dir, dtype="float32", activation_quant=False)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    from hf_tiny import save_hf_model
    return specjax.load(save_hf_model(build_hf_model("qwen3", seed=1, num_hidden_layers=1),
                                      tmp_path_factory.mktemp("draft")))


@pytest.fixture(scope="module")
def plain(target):
    return specjax.generate(target, [PROMPT, PROMPT[:3]], max_new_tokens=MAX_NEW, eos_token_id=[])


def reference_logits(reference, tokens):
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0].numpy()


def test_logits_equal_transformers_dequantized_model(target, reference):
    ours = np.asarray(target.model(np.array([PROMPT])))[0]
    ref = reference_logits(reference, PROMPT)
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max())


def first_layer(params):
    """Layer 0's weights, whichever layout the target runs (the suite runs stacked layers)."""
    layers = params["layers"]
    return layers[0] if 0 in layers else jax.tree.map(lambda x: x[0], layers)


def test_weights_stay_quantized_on_the_device(target):
    layer = first_layer(target.params)
    for key in ("wq", "wk", "wv", "w_gate", "w_up", "w_down"):
        w = layer[key]
        assert isinstance(w, QuantizedWeight) and isinstance(w.q, jax.Array), key
        assert w.q.dtype == ml_dtypes.float8_e4m3fn and w.scale.dtype == ml_dtypes.bfloat16
    assert not is_quantized(layer["wo"])  # modules_to_not_convert: stored plain, read plain
    assert "quantized=fp8 block [32, 32]" in repr(target)


def test_greedy_output_equals_transformers(target, reference, plain):
    with torch.no_grad():
        out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_NEW, do_sample=False)
    assert plain.tokens[0] == out[0, len(PROMPT):].tolist()


def test_exact_mode_dequantizes_at_load_to_the_same_numbers(fp8_dir, target):
    exact = specjax.load(fp8_dir, dtype="float32", dequantize=True)
    assert not any(is_quantized(x) for x in jax.tree.leaves(exact.params, is_leaf=is_quantized))
    np.testing.assert_allclose(np.asarray(exact.model(np.array([PROMPT]))),
                               np.asarray(target.model(np.array([PROMPT]))), rtol=1e-5, atol=1e-5)


def test_convert_writes_the_dequantized_model(fp8_dir, target, tmp_path):
    from specjax.loading.target import convert

    converted = specjax.load(convert(fp8_dir, tmp_path / "ckpt", dtype="float32"))
    assert "quantized" not in repr(converted)
    np.testing.assert_allclose(np.asarray(converted.model(np.array([PROMPT]))),
                               np.asarray(target.model(np.array([PROMPT]))), rtol=1e-5, atol=1e-5)


def test_stacked_layout_scans_the_quantized_layers(fp8_dir, target):
    stacked = specjax.load(fp8_dir, dtype="float32", layout="stacked", activation_quant=False)
    assert stacked.params["layers"]["wq"].q.shape == (4, 64, 128)  # [L, in, out], scales [L, 2, 4] beside
    assert stacked.params["layers"]["wq"].scale.shape == (4, 2, 4)
    np.testing.assert_allclose(np.asarray(stacked.model(np.array([PROMPT]))),
                               np.asarray(target.model(np.array([PROMPT]))), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, tree", [("draft-model", "chain:3"), ("eagle3", "chain:3"), ("dflash", "chain:3"),
                                        ("mtp", "chain:3")])
def test_greedy_speculative_equals_plain(target, other, plain, name, tree):
    """Every drafter family on the FP8 target (the MTP case: a random Qwen3.5-layout MTP layer on its widths, as a
    quantizer that dropped `mtp.*` leaves the base checkpoint's to load_drafter)."""
    from specjax.bench.spec import random_mtp

    drafter = random_mtp(target) if name == "mtp" else make(name, target, other, plain)
    out = specjax.generate(target, [PROMPT, PROMPT[:3]], max_new_tokens=MAX_NEW, eos_token_id=[],
                           drafter=drafter, tree=tree)
    assert out.tokens == plain.tokens


def test_device_memory_is_the_quantized_size_and_the_plan_counts_it(fp8_dir, target):
    from specjax.convert.quantized import read_scheme
    from specjax.planning.memory import format_memory, memory_plan, weight_bytes
    from specjax.planning.profile import DEVICES

    cfg = target.cfg
    d, f, qd, kvd, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, \
        cfg.num_kv_heads * cfg.head_dim, cfg.num_layers, cfg.vocab_size
    quantized = L * (d * qd + 2 * d * kvd + 3 * d * f)  # q, k, v, gate, up, down: FP8, one byte each
    scales = L * (quantized // L) // (32 * 32) * 2  # one bf16 scale per 32 x 32 block
    plain = cfg.num_params() - quantized  # embedding, lm_head, norms, every o_proj: fp32
    held = sum(x.nbytes for x in jax.tree.leaves(target.params))
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(target.params))
    assert held == quantized + scales + 4 * plain
    assert held < 0.6 * 4 * cfg.num_params()
    scheme = read_scheme(target.hf_config)
    assert weight_bytes(cfg, None) == 4 * cfg.num_params()
    assert weight_bytes(cfg, None, scheme) == pytest.approx(held, rel=2e-3)  # the plan assumes f32 scales
    plan = memory_plan(cfg, "fp8", DEVICES["h100"], 1, 1, 128, scheme=scheme)
    assert plan.weight_bytes == weight_bytes(cfg, {}, scheme) and "| fp8 (fp8) |" in format_memory([plan])


def test_the_plan_counts_quantized_moe_experts_at_their_size(tmp_path):
    """Block-FP8 Qwen3-MoE: experts (and attention, dense layers) held quantized; the memory plan's weights equal
    what the device holds (scales counted at 4 bytes, as the plan assumes)."""
    from hf_quant import write_block_fp8
    from hf_tiny import build_moe

    from specjax.convert.quantized import read_scheme
    from specjax.planning.memory import weight_bytes

    path = write_block_fp8(build_moe("qwen3_moe", num_hidden_layers=2), tmp_path / "moe", block=(16, 16))
    target = specjax.load(path, dtype="float32")
    held = sum(x.nbytes for x in jax.tree.leaves(target.params))
    planned = weight_bytes(target.cfg, None, read_scheme(target.hf_config))
    assert planned == pytest.approx(held, rel=0.05) and planned < 0.5 * weight_bytes(target.cfg, None)


def test_ktile_and_per_channel_matmuls(fp8_dir, target):
    """quantized_matmul="ktile" (one dot per 32-row block, each partial product scaled) computes the format's
    numbers; "per_channel" (opt-in) re-quantizes each FP8 block weight to one scale per output column, which moves
    the weights by FP8 rounding (measured on a larger weight: docs/records/bench_quant_alternatives_cpu.json)."""
    from specjax.quant.qarray import dequantize_tree

    want = np.asarray(target.model(np.array([PROMPT])))
    ktile = specjax.load(fp8_dir, dtype="float32", quantized_matmul="ktile", activation_quant=False)
    assert first_layer(ktile.params)["wq"].matmul == "ktile"
    np.testing.assert_allclose(np.asarray(ktile.model(np.array([PROMPT]))), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    per_channel = specjax.load(fp8_dir, dtype="float32", quantized_matmul="per_channel", activation_quant=False)
    w = first_layer(per_channel.params)["w_up"]
    assert w.scale.shape == (1, w.shape[1]) and "re-quantized from fp8 block [32, 32]" in repr(per_channel)
    exact, moved = (np.asarray(first_layer(dequantize_tree(t.params, "float32"))["w_up"])
                    for t in (target, per_channel))
    assert 0 < np.abs(moved - exact).max() <= 2 ** -3 * np.abs(exact).max()  # FP8's 3 mantissa bits, per column
    with pytest.raises(ValueError, match="quantized_matmul must be one of"):
        specjax.load(fp8_dir, quantized_matmul="tiles")
