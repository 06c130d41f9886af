"""Quantized Qwen3.5 (hybrid) targets: block FP8 written by transformers' own quantizer (tests/hf_quant.py) keeps
linear_attn's projections, the gated attention (q_proj split per head into wq and wg with whole scale blocks) and
the MLPs quantized on the device, equals transformers' logits and the exact mode's greedy output, and speculation
on it is lossless: a draft model, and the bf16 base checkpoint's MTP layer loaded onto the FP8 copy that dropped
it (`load_drafter(base_dir, target)`) or on the FP8 copy's own MTP layer, kept quantized."""

from __future__ import annotations

from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from hf_quant import fp8_copy, reference_model, write_block_fp8
from hf_tiny import build_hf_model, build_qwen35, save_hf_model

import specjax
from specjax.config import LinearAttnConfig
from specjax.convert.quantized import split_columns
from specjax.convert.qwen35 import split_fused, split_gated_q, split_qkvz
from specjax.drafters import DraftModelDrafter, MtpDrafter
from specjax.quant.qarray import QuantizedWeight

MAX_NEW = 12
PROMPTS = [[5, 9, 14, 3, 77], [7, 7, 21]]
MTP_BASE = Path(__file__).parent / "fixtures" / "mtp" / "qwen3_5"  # a tiny Qwen3.5 with its mtp.* layer, f32
KEPT = {"linear_attention": ("w_qkv", "w_z", "w_out", "w_gate", "w_up", "w_down"),
        "full_attention": ("wq", "wg", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_block_fp8(build_qwen35("causal_lm"), tmp_path_factory.mktemp("qwen35_fp8"), block=(16, 16))


@pytest.fixture(scope="module")
def target(fp8_dir):
    # weight-only, as transformers' CPU reference computes block FP8 (activations: test_quantized_activations.py)
    return specjax.load(fp8_dir, dtype="float32", activation_quant=False)


@pytest.fixture(scope="module")
def plain(target):
    return specjax.generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[])


def test_hybrid_layers_stay_quantized_and_equal_transformers(fp8_dir, target):
    assert "quantized=fp8 block [16, 16]" in repr(target)
    for i, layer in target.params["layers"].items():
        for key in KEPT[target.cfg.layer_type(i)]:
            w = layer[key]
            assert isinstance(w, QuantizedWeight) and w.q.dtype == ml_dtypes.float8_e4m3fn, (i, key)
    assert target.params["layers"][3]["wq"].scale.shape == (4, 8)  # [D / 16, 4 heads x 32 / 16]
    with torch.no_grad():
        ref = reference_model(fp8_dir)(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    ours = np.asarray(target.model(np.array([PROMPTS[0]])))[0]
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max())


def test_qwen3_next_fused_projections_split_quantized_and_equal_transformers(tmp_path):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba, split per key head into [q | k | v], z, b, a: each part keeps its
    blocks (16 divides dk 16 and r dv 32; [b | a] is one ragged block); per-expert FP8 experts as well."""
    from hf_tiny import build_moe

    path = write_block_fp8(build_moe("qwen3_next"), tmp_path / "next", block=(16, 16))
    target = specjax.load(path, dtype="float32", activation_quant=False)  # transformers' reference is weight-only
    layer = target.params["layers"][0]
    assert all(isinstance(layer[k], QuantizedWeight) for k in ("w_qkv", "w_z", "w_out"))
    assert not isinstance(layer["w_b"], QuantizedWeight)  # [8, 64]: transformers' quantizer left it plain
    assert isinstance(layer["moe"]["w_up"], QuantizedWeight)
    with torch.no_grad():
        ref = reference_model(path)(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    ours = np.asarray(target.model(np.array([PROMPTS[0]])))[0]
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max())


def test_device_bytes_are_the_quantized_size_the_plan_counts(target):
    """The plan counts every linear_attn projection quantized; transformers' quantizer left in_proj_b / in_proj_a
    ([4 heads, 64]: not a whole block) plain without listing them, so the plan is under by their 3 bytes each."""
    from specjax.convert.quantized import read_scheme
    from specjax.planning.memory import weight_bytes

    held = sum(x.nbytes for x in jax.tree.leaves(target.params))
    assert held < 0.45 * 4 * target.cfg.num_params()
    plain_ba = sum(layer[k].size for layer in target.params["layers"].values() for k in ("w_b", "w_a") if k in layer)
    assert weight_bytes(target.cfg, None, read_scheme(target.hf_config)) + 3 * plain_ba == pytest.approx(held, rel=1e-3)


def test_greedy_equals_the_exact_mode_and_draft_model_speculation_is_lossless(fp8_dir, target, plain, tmp_path):
    exact = specjax.load(fp8_dir, dtype="float32", dequantize=True)
    assert "quantized" not in repr(exact)
    assert specjax.generate(exact, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[]).tokens == plain.tokens
    other = specjax.load(save_hf_model(build_hf_model("qwen3", seed=1, num_hidden_layers=1), tmp_path / "draft"))
    out = specjax.generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[], tree="chain:3",
                           drafter=DraftModelDrafter(other.cfg, other.params))
    assert out.tokens == plain.tokens


@pytest.mark.parametrize("mtp", ["dropped", "quantized"])
def test_mtp_on_an_fp8_copy_of_the_base(tmp_path, mtp):
    """FP8 releases often drop `mtp.*`: load_drafter(base_dir, fp8_target) reads the bf16 base's MTP layer onto
    the quantized target. Others keep it quantized too (its block's linears and fc in FP8): those stay quantized on
    the device as the target's layers do (the exact mode dequantizes them). Either way greedy MTP speculation
    equals plain decoding."""
    import re

    from hf_quant import LINEAR

    with_mtp = re.compile(rf"{LINEAR.pattern}|mtp\.fc\.weight|mtp\.layers\.\d+\.(self_attn|mlp)\.\w*proj\w*\.weight")
    fp8 = fp8_copy(MTP_BASE, tmp_path / "fp8", block=(8, 8), drop=lambda name: mtp == "dropped" and
                   name.startswith("mtp."), linear=with_mtp)
    target = specjax.load(fp8, dtype="float32")
    assert "quantized=fp8" in repr(target) and isinstance(target.params["layers"][3]["wq"], QuantizedWeight)
    if mtp == "dropped":
        assert target.mtp is None
        with pytest.raises(ValueError, match="draft with the target itself"):  # the FP8 copy alone has none
            specjax.load_drafter(fp8, target)
        drafter = specjax.load_drafter(MTP_BASE, target)
    else:
        from safetensors import safe_open

        with safe_open(fp8 / "model.safetensors", "np") as f:
            assert {"mtp.fc.weight_scale_inv", "mtp.layers.0.self_attn.q_proj.weight_scale_inv"} <= set(f.keys())
        # kept quantized as the target's layers are: the fc and the block's linears (q_proj split into wq / wg)
        block = target.mtp["layers"]["0"]["block"]
        for w in (target.mtp["fc"], block["wq"], block["wg"], block["wk"], block["w_down"]):
            assert isinstance(w, QuantizedWeight) and w.q.dtype == ml_dtypes.float8_e4m3fn
        base_fc = specjax.load(MTP_BASE, dtype="float32").mtp["fc"]
        fc = np.asarray(target.mtp["fc"].dequantize(np.float32))
        assert np.abs(fc - np.asarray(base_fc)).max() <= 2 ** -3 * np.abs(base_fc).max()
        exact = specjax.load(fp8, dtype="float32", dequantize=True)  # the exact mode: dequantized with the target
        np.testing.assert_array_equal(np.asarray(exact.mtp["fc"]), fc)
        drafter = specjax.load_drafter(fp8, target)
        fc = drafter.params["layers"][0]["fc"]  # on the device still FP8
        assert isinstance(fc, QuantizedWeight) and isinstance(fc.q, jax.Array) and fc.q.dtype == ml_dtypes.float8_e4m3fn
    assert isinstance(drafter, MtpDrafter)
    want = specjax.generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[])
    out = specjax.generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                           num_draft_tokens=2)
    assert out.tokens == want.tokens and out.stats["drafter_calls"] > 0


def test_a_per_head_split_keeps_whole_blocks_and_dequantizes_where_it_cuts_them():
    """Qwen3.5's q_proj [heads x (q | gate)]: split quantized when head_dim is a multiple of the block's output
    width (scales taken with their columns), dequantized where a block straddles a query and its gate."""
    rng = np.random.default_rng(0)
    heads, head_dim, d = 3, 16, 24
    q = rng.normal(size=(d, 2 * heads * head_dim)).astype(ml_dtypes.float8_e4m3fn)

    def split(w_OD):
        return split_gated_q(w_OD, heads, head_dim)

    for bo, kept in ((8, True), (16, True), (12, False)):
        scale = rng.uniform(0.5, 2, size=(-(-d // 8), -(-q.shape[1] // bo))).astype(np.float32)
        w = QuantizedWeight(q, scale, block=(8, bo), compute_dtype="float32")
        parts = split_columns(w, split, "q_proj")
        want = split(np.asarray(w.dequantize(np.float32)).T)
        for part, ref in zip(parts, want):
            assert isinstance(part, QuantizedWeight) == kept
            got = part.dequantize(np.float32) if kept else part
            np.testing.assert_array_equal(np.asarray(got), ref)


def test_qwen3_next_fused_splits_keep_blocks_where_they_align():
    """in_proj_qkvz per key head [q 16 | k 16 | v 32 | z 32] in output blocks of 16: kept; in_proj_ba per key head
    [b 2 | a 2] in blocks of 4 (b and a share one): dequantized, equal to the plain split."""
    rng = np.random.default_rng(1)
    lin = LinearAttnConfig(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16, conv_kernel=4)
    d = 32

    def quantized(o, bo):
        q = rng.normal(size=(d, o)).astype(ml_dtypes.float8_e4m3fn)
        scale = rng.uniform(0.5, 2, size=(d // 16, -(-o // bo))).astype(np.float32)
        return QuantizedWeight(q, scale, block=(16, bo), compute_dtype="float32")

    qkvz, ba = quantized(2 * 96, 16), quantized(8, 4)
    parts = split_fused(qkvz, ba, lin)
    want = split_qkvz(np.asarray(qkvz.dequantize(np.float32)).T, np.asarray(ba.dequantize(np.float32)).T, lin)
    assert [isinstance(p, QuantizedWeight) for p in parts] == [True, True, False, False]
    for part, ref in zip(parts, want.values()):
        got = part.dequantize(np.float32) if isinstance(part, QuantizedWeight) else part
        np.testing.assert_array_equal(np.asarray(got), ref)
