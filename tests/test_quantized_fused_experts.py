"""Fused block-FP8 MoE experts (`mlp.experts.gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I] with `<name>_scale_inv`,
as transformers' FP8Experts holds them and its Fp8Quantize saves them) load as [E, ...] QuantizedWeights.

transformers 5 cannot load such a checkpoint on a CPU (its FP8 dequantization pairs per-expert `weight` /
`weight_scale_inv` only and reports the fused scales UNEXPECTED, leaving the raw FP8 values as weights), so the
references are the same model quantized per expert by the same quantizer, loaded by transformers (the blocks are the
same blocks), and transformers' own `Fp8Dequantize` applied to the fused tensors.
"""

from __future__ import annotations

import logging
import shutil

import jax
import numpy as np
import pytest
import torch
from hf_quant import reference_model, write_block_fp8, write_fused_fp8
from hf_tiny import build_moe
from safetensors.torch import load_file, save_file

import specjax
from specjax.quant.qarray import QuantizedWeight

PROMPTS = [[5, 9, 14, 3], [7, 7, 21]]
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def model():
    return build_moe("qwen3_moe", num_hidden_layers=2)  # layer 1 dense (mlp_only_layers)


@pytest.fixture(scope="module")
def fused_dir(model, tmp_path_factory):
    return write_fused_fp8(model, tmp_path_factory.mktemp("fused"), block=(16, 16))


@pytest.fixture(scope="module")
def target(fused_dir):
    # weight-only, as transformers' CPU reference computes block FP8 (activations: test_quantized_activations.py)
    return specjax.load(fused_dir, dtype="float32", activation_quant=False)


def transformers_dequantized(path, name):
    """transformers' own Fp8Dequantize of one fused tensor [E, out, in] (fp32)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    class Quantizer:
        quantization_config = FineGrainedFP8Config(weight_block_size=[16, 16])

    tensors = load_file(path / "model.safetensors")
    return Fp8Dequantize(Quantizer())._dequantize_one(tensors[name], tensors[f"{name}_scale_inv"],
                                                       torch.float32).numpy()


def test_fused_experts_stay_quantized_and_equal_transformers(model, target, tmp_path):
    """Experts held [E, ...] in FP8 with [E, D / 16, I / 16] scales, the same weights the per-expert form gives;
    logits equal transformers' on that per-expert copy, and w_gate / w_up / w_down equal transformers' own
    dequantization of the fused tensors (gate rows first, [out, in] per expert)."""
    moe = target.params["layers"][0]["moe"]
    for key, shape in (("w_gate", (8, 64, 32)), ("w_up", (8, 64, 32)), ("w_down", (8, 32, 64))):
        w = moe[key]
        assert isinstance(w, QuantizedWeight) and w.shape == shape and w.q.dtype == np.dtype("float8_e4m3fn"), key
        assert w.scale.shape == (8, shape[1] // 16, shape[2] // 16), key
    dequantized = transformers_dequantized(target.path, GATE_UP)  # [E, 2I, D]
    np.testing.assert_array_equal(np.asarray(moe["w_gate"].dequantize(np.float32)),
                                  dequantized[:, :32].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(moe["w_up"].dequantize(np.float32)),
                                  dequantized[:, 32:].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(moe["w_down"].dequantize(np.float32)),
                                  transformers_dequantized(target.path, "model.layers.0.mlp.experts.down_proj")
                                  .transpose(0, 2, 1))
    per_expert = write_block_fp8(model, tmp_path / "per_expert", block=(16, 16))
    with torch.no_grad():
        ref = reference_model(per_expert)(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    ours = np.asarray(target.model(np.array([PROMPTS[0]])))[0]
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max())


def test_greedy_equals_the_exact_mode_and_the_plan_counts_the_experts_quantized(fused_dir, target):
    from specjax.convert.quantized import read_scheme
    from specjax.planning.memory import weight_bytes

    exact = specjax.load(fused_dir, dtype="float32", dequantize=True)
    assert not isinstance(exact.params["layers"][0]["moe"]["w_up"], QuantizedWeight)
    assert specjax.generate(target, PROMPTS, max_new_tokens=8, eos_token_id=[]).tokens == \
        specjax.generate(exact, PROMPTS, max_new_tokens=8, eos_token_id=[]).tokens
    held = sum(x.nbytes for x in jax.tree.leaves(target.params))
    planned = weight_bytes(target.cfg, None, read_scheme(target.hf_config))
    assert planned == pytest.approx(held, rel=0.05) and planned < 0.5 * weight_bytes(target.cfg, None)


@pytest.mark.parametrize("case, match", [
    ("wrong scale", rf"tensor '{GATE_UP}_scale_inv' has shape \[8, 4, 2\]; 8 fused experts of \[64, 64\] \(out, in\) "
                    r"in blocks of \[16, 16\] needs \[8, 4, 4\]"),
    ("missing scale", f"tensor '{GATE_UP}' is stored as float8_e4m3fn but has no '{GATE_UP}_scale_inv'"),
])
def test_a_bad_fused_scale_is_one_line_naming_the_tensor(fused_dir, tmp_path, case, match):
    bad = tmp_path / "bad"
    shutil.copytree(fused_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    if case == "wrong scale":
        tensors[f"{GATE_UP}_scale_inv"] = tensors[f"{GATE_UP}_scale_inv"][:, :, :2].contiguous()
    else:
        del tensors[f"{GATE_UP}_scale_inv"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match) as err:
        specjax.load(bad)
    assert "\n" not in str(err.value)


def test_a_gate_up_split_inside_a_block_dequantizes_and_says_so(tmp_path, caplog):
    """I = 24 in 16-row blocks: gate and up share gate_up_proj's second block. w_gate (rows 0-23: whole blocks, the
    last ragged) stays quantized; w_up (rows 24-47) would cut a block, so it is dequantized at load (logged). Both
    equal transformers' dequantization. down_proj [E, 64, 24] is not a whole number of blocks: the quantizer left it
    plain."""
    path = write_fused_fp8(build_moe("qwen3_moe", num_hidden_layers=2, moe_intermediate_size=24), tmp_path / "cut",
                           block=(16, 16))
    with caplog.at_level(logging.WARNING, logger="specjax"):
        target = specjax.load(path, dtype="float32", activation_quant=False)  # against the exact mode below
    assert f"'{GATE_UP}' (fp8 block [16, 16]): splitting it cuts a scale block" in caplog.text
    moe = target.params["layers"][0]["moe"]
    assert [isinstance(moe[k], QuantizedWeight) for k in ("w_gate", "w_up", "w_down")] == [True, False, False]
    dequantized = transformers_dequantized(path, GATE_UP)
    np.testing.assert_array_equal(np.asarray(moe["w_gate"].dequantize(np.float32)),
                                  dequantized[:, :24].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(moe["w_up"]), dequantized[:, 24:].transpose(0, 2, 1))
    exact = specjax.load(path, dtype="float32", dequantize=True)  # the mixed experts compute the same numbers
    np.testing.assert_allclose(np.asarray(target.model(np.array([PROMPTS[0]]))),
                               np.asarray(exact.model(np.array([PROMPTS[0]]))), rtol=1e-5, atol=1e-5)
