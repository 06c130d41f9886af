"""Each quantized checkpoint format against the format's own code, and the errors bad input gets.

compressed-tensors checkpoints are written by the compressed-tensors package and read back by transformers (which
decompresses them on a CPU); AWQ and asymmetric INT4 are decompressed by the package itself (its AutoAWQ converter
and pack-quantized compressor), since transformers cannot load those on a CPU. Block FP8 scales of every dtype are
compared with transformers' own FP8 dequantization. (Whole-model FP8 parity and speculation: test_quantized.py.)
"""

from __future__ import annotations

import dataclasses
import json

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from hf_quant import decompressed_copy, reference_model, write_awq, write_block_fp8, write_compressed_tensors
from hf_tiny import build_hf_model
from safetensors.torch import load_file, save_file

import specjax
from specjax.convert.quantized import QuantScheme, read_linear, read_scheme, unpack_int32
from specjax.quant.qarray import QuantizedWeight

PROMPT = [1, 5, 9, 33, 100, 7]


def tiny():
    return build_hf_model("qwen3", seed=0, num_hidden_layers=2)


def layer(target, i):
    """Layer i's weights, whichever layout the target runs (the suite runs stacked layers)."""
    import jax
    layers = target.params["layers"]
    return layers[i] if 0 in layers else jax.tree.map(lambda x: x[i], layers)


def logits(target):
    return np.asarray(target.model(np.array([PROMPT])))[0]


def reference_logits(path):
    with torch.no_grad():
        return reference_model(path)(torch.tensor([PROMPT])).logits[0].numpy()


# preset, format, weight overrides, the format specjax reports
CT_CASES = [
    ("FP8_DYNAMIC", "float-quantized", {}, "fp8 per channel"),
    ("FP8", "float-quantized", {}, "fp8 per tensor"),
    ("FP8_BLOCK", "float-quantized", dict(block_structure=[32, 32]), "fp8 block [32, 32]"),
    ("W8A8", "int-quantized", {}, "int8 per channel"),
    ("W4A16", "pack-quantized", dict(group_size=32), "int4 group 32"),
    ("W8A16", "pack-quantized", dict(group_size=32), "int8 group 32"),
]


@pytest.mark.parametrize("preset, fmt, args, name", CT_CASES, ids=[c[0] for c in CT_CASES])
def test_compressed_tensors_logits_equal_transformers(tmp_path, preset, fmt, args, name):
    path = write_compressed_tensors(tiny(), tmp_path / "ct", preset, fmt, **args)
    target = specjax.load(path, dtype="float32")
    assert f"quantized={name}" in repr(target)
    ref = reference_logits(path)
    np.testing.assert_allclose(logits(target), ref, atol=2e-4 * np.abs(ref).max())


def test_asymmetric_int4_equals_the_packages_decompression(tmp_path):
    path = write_compressed_tensors(tiny(), tmp_path / "asym", "W4A16_ASYM", "pack-quantized", group_size=32)
    target = specjax.load(path, dtype="float32")
    w = layer(target, 0)["w_up"]
    assert w.zero is not None and w.q.dtype == ml_dtypes.int4
    ref = reference_logits(decompressed_copy(path, tmp_path / "ref", group_size=32))
    np.testing.assert_allclose(logits(target), ref, atol=2e-4 * np.abs(ref).max())


def test_awq_equals_the_packages_awq_unpacking(tmp_path):
    path = write_awq(tiny(), tmp_path / "awq", group=32)
    ref_dir = decompressed_copy(path, tmp_path / "ref", group_size=32)
    target = specjax.load(path, dtype="float32")
    assert "quantized=awq int4 group 32" in repr(target)
    # weights: the package dequantizes in the scales' f16, specjax in fp32: equal to f16 rounding
    ours = np.asarray(layer(target, 1)["wq"].dequantize(np.float32)).T
    theirs = load_file(ref_dir / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=2 ** -10, atol=2 ** -14)
    ref = reference_logits(ref_dir)
    np.testing.assert_allclose(logits(target), ref, atol=2e-3 * np.abs(ref).max())


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_fp8_scales_of_every_dtype_dequantize_as_transformers_does(scale_dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    w = (torch.randn(256, 384) * 0.05).to(torch.float8_e4m3fn)
    s = (torch.rand(2, 3) + 0.5).to(scale_dtype)
    ref = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.float32).numpy()
    scheme = QuantScheme("fp8", (), {"weight_block_size": [128, 128]})
    tensors = {"m.weight": w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), "m.weight_scale_inv":
               s.float().numpy().astype(ml_dtypes.bfloat16 if scale_dtype == torch.bfloat16 else
                                        torch.empty(0, dtype=scale_dtype).numpy().dtype)}
    qw, used = read_linear(tensors, "m", scheme, "float32")
    assert sorted(used) == ["m.weight", "m.weight_scale_inv"]
    np.testing.assert_array_equal(qw.dequantize(np.float32).T, ref)


def test_ragged_last_blocks_take_their_blocks_scale():
    """A [200, 130] weight in 128 x 128 blocks: scale [2, 2], the last row / column blocks partial (DeepSeek's
    definition: element (o, i) times scale[o // 128, i // 128])."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(200, 130)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.5, 2, size=(2, 2)).astype(np.float32)
    qw, _ = read_linear({"m.weight": q, "m.weight_scale_inv": s}, "m",  # the weight alone: no activation rounding
                        QuantScheme("fp8", (), {"weight_block_size": [128, 128]}, activation_quant=False), "float32")
    want = np.empty((200, 130), np.float32)
    for o in range(200):
        for i in range(130):
            want[o, i] = float(q[o, i]) * s[o // 128, i // 128]
    np.testing.assert_array_equal(np.asarray(qw.dequantize(np.float32)).T, want)
    x = rng.normal(size=(3, 130)).astype(np.float32)  # and the jitted matmul computes with it
    import jax
    for matmul in ("blocks", "ktile"):  # the K-tile form too (input padded to whole blocks)
        w = jax.tree.map(np.asarray, dataclasses.replace(qw, matmul=matmul))
        np.testing.assert_allclose(np.asarray(jax.jit(lambda x, w: x @ w)(x, w)), x @ want.T, rtol=1e-5, atol=1e-5)


def test_int4_unpacking_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    v = torch.randint(-8, 8, (6, 40), dtype=torch.int8)
    np.testing.assert_array_equal(unpack_int32(pack_to_int32(v, 4).numpy(), 4, 40, axis=1, signed=True), v.numpy())
    np.testing.assert_array_equal(unpack_int32(pack_to_int32(v, 4, packed_dim=0).numpy(), 4, 6, axis=0,
                                               signed=True), v.numpy())


# ---- which format: config.json, per tensor ----

def test_unknown_methods_are_refused_by_name():
    for method in ("modelopt", "bitsandbytes", "hqq"):
        with pytest.raises(ValueError, match=f"quant_method '{method}'"):
            read_scheme({"quantization_config": {"quant_method": method}})
    nvfp4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}}
    with pytest.raises(ValueError, match="nvfp4-pack-quantized"):
        read_scheme({"quantization_config": nvfp4})
    assert read_scheme({}) is None
    assert read_scheme({"compression_config": {"quant_method": "fp8"}}).method == "fp8"  # the older key


def test_ignore_patterns_name_modules_exactly_or_by_regex():
    scheme = QuantScheme("compressed-tensors", ("lm_head", "re:.*mlp\\.down_proj$", "model.layers.3"), {})
    assert scheme.ignored("lm_head") and scheme.ignored("model.layers.1.mlp.down_proj")
    assert scheme.ignored("model.layers.3.self_attn.q_proj")
    assert not scheme.ignored("model.layers.1.mlp.up_proj") and not scheme.ignored("model.layers.13.mlp.up_proj")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_block_fp8(tiny(), tmp_path_factory.mktemp("fp8"), block=(32, 32))


def broken_copy(src, dst, edit_tensors=None, edit_config=None):
    import shutil
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    return dst


SCALE = "model.layers.1.mlp.up_proj.weight_scale_inv"


@pytest.mark.parametrize("case, match", [
    ("truncated scale", f"tensor '{SCALE}' has shape \\[4, 1\\]; a weight of shape \\[128, 64\\] in blocks of "
                        "\\[32, 32\\] needs \\[4, 2\\]"),
    ("transposed scale", f"tensor '{SCALE}' has shape \\[2, 4\\]"),
    ("missing scale", "tensor 'model.layers.1.mlp.up_proj.weight' is stored as float8_e4m3fn but has no"),
    ("block size", r"tensor 'model\.layers\.\d\.\w+\.\w+\.weight_scale_inv' has shape \[\d, \d\]; a weight of shape "
                   r"\[\d+, \d+\] in blocks of \[48, 48\] needs"),
    ("ignored yet quantized", "'model.layers.1.mlp.up_proj' is stored quantized but config.json's ignore"),
])
def test_bad_input_is_one_line_naming_the_tensor(fp8_dir, tmp_path, case, match):
    edits = {
        "truncated scale": dict(edit_tensors=lambda t: t.update({SCALE: t[SCALE][:, :1].contiguous()})),
        "transposed scale": dict(edit_tensors=lambda t: t.update({SCALE: t[SCALE].T.contiguous()})),
        "missing scale": dict(edit_tensors=lambda t: t.pop(SCALE)),
        "block size": dict(edit_config=lambda qc: qc.update(weight_block_size=[48, 48])),
        "ignored yet quantized": dict(edit_config=lambda qc: qc.update(
            modules_to_not_convert=["lm_head", "model.layers.1.mlp.up_proj"])),
    }[case]
    with pytest.raises(ValueError, match=match) as err:
        specjax.load(broken_copy(fp8_dir, tmp_path / "bad", **edits))
    assert "\n" not in str(err.value)


def test_group_size_that_does_not_divide_is_refused():
    scheme = QuantScheme("compressed-tensors", (), {"config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 48}}}})
    tensors = {"m.weight_packed": np.zeros((8, 8), np.int32), "m.weight_shape": np.array([8, 64]),
               "m.weight_scale": np.ones((8, 2), np.float32)}
    with pytest.raises(ValueError, match="'m': group_size 48 does not divide its 64 input features"):
        read_linear(tensors, "m", scheme, "float32")


def test_a_quantized_weight_is_a_pytree_of_its_parts():
    import jax
    qw = QuantizedWeight(np.zeros((4, 8), ml_dtypes.float8_e4m3fn), np.ones((1, 1), np.float32), block=(4, 8))
    assert len(jax.tree.leaves(qw)) == 2 and qw.nbytes == 32 + 4 and qw.shape == (4, 8)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_quantized_random_targets_compute_their_dequantized_weights(fmt):
    """quant/quantize.py (random quantized targets for benchmarks): the quantized forward equals the forward of the
    weights it dequantizes to, and those stay near the originals (FP8's 3 mantissa bits, INT4's 16 levels)."""
    import jax

    from specjax.bench.ar import MICRO_PRESET
    from specjax.config import ModelConfig
    from specjax.models.model import init_params, sequence_forward
    from specjax.quant.qarray import dequantize_tree
    from specjax.quant.quantize import quantize_params

    cfg = ModelConfig.from_hf(MICRO_PRESET, dtype="float32")
    params = init_params(cfg, jax.random.key(0))
    quantized = quantize_params(params, fmt)
    assert isinstance(quantized["layers"]["w_up"], QuantizedWeight) and not isinstance(quantized["embed"],
                                                                                       QuantizedWeight)
    tokens = np.array([[1, 5, 9, 33]])
    ours = jax.jit(lambda p: sequence_forward(p, cfg, tokens)[2])(quantized)
    exact = sequence_forward(dequantize_tree(quantized, "float32"), cfg, tokens)[2]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(exact), rtol=1e-5, atol=1e-5)
    w, back = params["layers"]["w_up"], dequantize_tree(quantized, "float32")["layers"]["w_up"]
    assert float(np.abs(np.asarray(back - w)).max() / np.abs(np.asarray(w)).max()) < {"fp8": 0.07, "int8": 0.01,
                                                                                        "int4": 0.1}[fmt]


@pytest.mark.parametrize("case", ["4bit", "4bit_act_order", "8bit_act_order"])
def test_gptq_matmul_equals_autogptqs(case):
    """GPTQ v1 tensors packed by AutoGPTQ's own QuantLinear.pack, and its own CPU matmul's output
    (scripts/make_gptq_fixtures.py): x @ W through specjax's reader and dequantizing matmul gives the same."""
    import jax
    from pathlib import Path

    f = np.load(Path(__file__).parent / "fixtures" / "gptq" / f"{case}.npz")
    scheme = QuantScheme("gptq", (), {"bits": int(f["bits"]), "group_size": int(f["group_size"]),
                                      "desc_act": bool(f["desc_act"])})
    tensors = {f"m.{k}": f[k] for k in ("qweight", "qzeros", "scales", "g_idx")}
    qw, used = read_linear(tensors, "m", scheme, "float32")
    assert sorted(used) == ["m.g_idx", "m.qweight", "m.qzeros", "m.scales"]
    assert (qw.g_idx is not None) == bool(f["desc_act"])
    y = jax.jit(lambda x, w: x @ w)(f["x"], jax.tree.map(np.asarray, qw))
    np.testing.assert_allclose(np.asarray(y), f["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["v2_4bit", "v2_4bit_act_order", "v2_8bit_act_order"])
def test_gptq_v2_matmul_equals_gptqmodels(case):
    """`checkpoint_format: gptq_v2` tensors packed by GPTQModel's own TorchLinear.pack_block (zero points stored as
    they are, a 0 among them) and its CPU matmul's output (scripts/make_gptq_v2_fixtures.py): specjax reads the
    zero points GPTQModel packed and gives its output (GPTQModel dequantizes in f16: equal to that rounding); read
    as v1 (zero - 1 stored) the same tensors are off by a whole step."""
    from pathlib import Path

    f = np.load(Path(__file__).parent / "fixtures" / "gptq" / f"{case}.npz")
    tensors = {f"m.{k}": f[k] for k in ("qweight", "qzeros", "scales", "g_idx")}
    ys = {}
    for fmt in ("gptq_v2", "gptq"):
        scheme = QuantScheme("gptq", (), {"bits": int(f["bits"]), "group_size": int(f["group_size"]),
                                          "desc_act": bool(f["desc_act"]), "checkpoint_format": fmt})
        qw, _ = read_linear(tensors, "m", scheme, "float32")
        ys[fmt] = np.asarray(jax.jit(lambda x, w: x @ w)(f["x"], jax.tree.map(np.asarray, qw)))
        if fmt == "gptq_v2":
            np.testing.assert_array_equal(np.asarray(qw.zero, np.int32), f["zeros"])
            if qw.g_idx is None:  # the K-tile form subtracts the zero point per group: the same output
                ktile = jax.tree.map(np.asarray, dataclasses.replace(qw, matmul="ktile"))
                np.testing.assert_allclose(np.asarray(jax.jit(lambda x, w: x @ w)(f["x"], ktile)), ys[fmt],
                                           rtol=1e-5, atol=1e-5)
    scale = np.abs(f["y"]).max()
    np.testing.assert_allclose(ys["gptq_v2"], f["y"], atol=1e-3 * scale)
    assert np.abs(ys["gptq"] - f["y"]).max() > 0.03 * scale


def test_moe_fp8_checkpoint_equals_transformers(tmp_path):
    """Block FP8 on Qwen3-MoE (every expert, one module each): the experts ([E, ...] values and block scales),
    attention and dense layers stay quantized. Logits equal transformers' dequantized model; greedy decoding (the
    experts' one-token path) equals the exact mode's. (Qwen3.5's hybrid layers: test_quantized_hybrid.py.)"""
    from hf_tiny import build_moe

    path = write_block_fp8(build_moe("qwen3_moe", num_hidden_layers=2), tmp_path / "moe", block=(16, 16))
    target = specjax.load(path, dtype="float32", activation_quant=False)  # transformers' reference is weight-only
    assert "quantized=fp8" in repr(target)
    ref = reference_logits(path)
    np.testing.assert_allclose(logits(target), ref, atol=2e-4 * np.abs(ref).max())
    experts = target.params["layers"][0]["moe"]
    assert all(isinstance(experts[k], QuantizedWeight) and experts[k].shape[0] == 8
               for k in ("w_gate", "w_up", "w_down"))
    exact = specjax.load(path, dtype="float32", dequantize=True)
    prompts = [[5, 9, 14, 3], [7, 7, 21]]
    assert specjax.generate(target, prompts, max_new_tokens=8, eos_token_id=[]).tokens == \
        specjax.generate(exact, prompts, max_new_tokens=8, eos_token_id=[]).tokens


@pytest.mark.parametrize("path", ["gather", "sorted", "ragged", "accelerator"])
def test_quantized_experts_equal_their_dequantized_arrays_on_every_expert_path(monkeypatch, path):
    """[E, D, I] block-FP8 experts through each expert path (and the accelerator's batched gather, taken on this
    CPU by saying it is a GPU) equal the same path on the dequantized arrays."""
    from specjax.models import moe

    rng = np.random.default_rng(0)
    e, d, i, n, k = 4, 32, 48, 6, 2

    def block_fp8(shape):
        q = rng.normal(size=shape).astype(ml_dtypes.float8_e4m3fn)
        scale = rng.uniform(0.01, 0.05, size=shape[:-2] + (-(-shape[-2] // 16), -(-shape[-1] // 16)))
        return QuantizedWeight(q, scale.astype(np.float32), block=(16, 16), fmt="fp8 block 16x16",
                               compute_dtype="float32")

    weights = [block_fp8((e, d, i)), block_fp8((e, d, i)), block_fp8((e, i, d))]
    x_ND = jax.numpy.asarray(rng.normal(size=(n, d)), np.float32)
    weights_NK, experts_NK = moe.route(x_ND, rng.normal(size=(d, e)).astype(np.float32), k, True)
    fn = moe.EXPERT_PATHS["gather" if path == "accelerator" else path]
    if path == "accelerator":
        monkeypatch.setattr(moe.kernels, "on_gpu", lambda: True)
    run = jax.jit(lambda *ws: fn(x_ND, weights_NK, experts_NK, *ws))
    want = run(*(w.dequantize(np.float32) for w in weights))
    np.testing.assert_allclose(np.asarray(run(*weights)), np.asarray(want), rtol=1e-5, atol=1e-5)
