"""W8A8 activation quantization (quant/activations.py) against the producers' own code.

The rounding itself equals the compressed-tensors package's `forward_quantize` bit for bit (INT8 and FP8, per token,
per tensor dynamic and static, per group), and block FP8's equals vLLM's `per_token_group_quant_fp8` (transcribed
below: vLLM is not installed, and transformers 5.x leaves it to a hub kernel). Whole checkpoints written by the
package (tests/hf_quant.py) give transformers' logits: its CPU load of a compressed-tensors W8A8 checkpoint runs the
package's quantized forward (activations rounded, weights decompressed). Block FP8's reference is transformers'
dequantized model with vLLM's rounding applied to each quantized linear's input. Greedy speculation on a W8A8
target equals plain decoding.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hf_quant import LINEAR, reference_model, write_block_fp8, write_compressed_tensors
from hf_tiny import build_hf_model, save_hf_model

import specjax
from specjax.convert.quantized import QuantScheme, activation_spec
from specjax.quant.activations import Activations, fake_quantize

PROMPT = [1, 5, 9, 33, 100, 7]
MAX_NEW = 12


def random_activations(seed: int = 0) -> np.ndarray:
    """[2, 5, 256] rows of very different sizes (a zero row too), as hidden states are."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 5, 256)) * rng.uniform(0.01, 30, size=(2, 5, 1))
    x[1, 2] = 0.0
    return x.astype(np.float32)


def ct_spec(args) -> Activations:
    """The spec specjax reads from a compressed-tensors config group with these input_activations."""
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"},
             "input_activations": args.model_dump(mode="json")}
    return activation_spec(QuantScheme("compressed-tensors", (), {"config_groups": {"group_0": group}}), "m")


@pytest.mark.parametrize("preset, update", [
    ("W8A8", {}),                                                   # INT8 per token, dynamic
    ("FP8_DYNAMIC", {}),                                            # FP8 per token, dynamic
    ("FP8", {}),                                                    # FP8 per tensor, static (input_scale)
    ("FP8_BLOCK", {}),                                              # FP8 per group of 128, dynamic
    ("W8A8", {"strategy": "tensor"}),                               # INT8 per tensor, dynamic
    ("FP8", {"dynamic": True, "observer": None}),                   # FP8 per tensor, dynamic
])
def test_rounding_equals_compressed_tensors_forward_quantize(preset, update):
    from compressed_tensors.quantization import QuantizationStatus, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    args = preset_name_to_scheme(preset, ["Linear"]).input_activations.model_copy(update=update)
    spec = ct_spec(args)
    x = random_activations()
    module = torch.nn.Linear(1, 1)
    module.quantization_status = QuantizationStatus.FROZEN
    input_scale = None
    if not args.dynamic:  # a calibrated scale, as the checkpoint stores it
        input_scale = np.float32(np.abs(x).max() / 448 * 0.7)  # 0.7: the largest inputs clamp
        module.input_scale = torch.nn.Parameter(torch.tensor([input_scale]), requires_grad=False)
        module.input_zero_point = torch.nn.Parameter(torch.zeros(1, dtype=args.zp_dtype), requires_grad=False)
    want = forward_quantize(module, torch.from_numpy(x), "input", args).numpy()
    got = np.asarray(fake_quantize(x, spec, input_scale))
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - x).max() > 0  # it rounds


def vllm_per_token_group_quant_fp8(x: torch.Tensor, group_size: int, eps: float = 1e-10):
    """vLLM's definition (vllm-project/vllm vllm/model_executor/layers/quantization/utils/fp8_utils.py
    `per_token_group_quant_fp8` and its Triton kernel `_per_token_group_quant_fp8`), transcribed: each group of
    `group_size` along the last axis in fp32, s = max(max |y|, eps) / 448, y_q = clamp(y / s, -448, 448) cast to
    float8_e4m3fn. Returns (y_q, s); y_q * s is what its block-FP8 GEMM multiplies."""
    y = x.float().unflatten(-1, (-1, group_size))
    s = torch.clamp(y.abs().amax(-1, keepdim=True), min=eps) / torch.finfo(torch.float8_e4m3fn).max
    y_q = torch.clamp(y / s, -448.0, 448.0).to(torch.float8_e4m3fn)
    return y_q, s


def test_block_fp8_rounding_equals_vllms_per_token_group_quant():
    x = torch.from_numpy(random_activations(1))
    x[0, 0, :128] = 0.0  # one group all zero: the eps keeps its scale finite
    y_q, s = vllm_per_token_group_quant_fp8(x, 128)
    want = (y_q.float() * s).flatten(-2).numpy()
    spec = activation_spec(QuantScheme("fp8", (), {"activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
                           "m")
    assert spec.name == "fp8 dynamic group 128"
    np.testing.assert_array_equal(np.asarray(fake_quantize(x.numpy(), spec)), want)


def logits(target, tokens=PROMPT):
    return np.asarray(target.model(np.array([tokens])))[0]


@pytest.fixture(scope="module")
def w8a8_dir(tmp_path_factory):
    return write_compressed_tensors(build_hf_model("qwen3", seed=0, num_hidden_layers=2),
                                    tmp_path_factory.mktemp("w8a8"), "W8A8", "int-quantized", activations=True)


# preset, format, what specjax reports
W8A8_CASES = [
    ("W8A8", "int-quantized", "int8 per channel, activations int8 dynamic per token"),
    ("FP8_DYNAMIC", "float-quantized", "fp8 per channel, activations fp8 dynamic per token"),
    ("FP8", "float-quantized", "fp8 per tensor, activations fp8 static per tensor"),
]


@pytest.mark.parametrize("preset, fmt, name", W8A8_CASES, ids=[c[0] for c in W8A8_CASES])
def test_w8a8_checkpoints_equal_transformers(w8a8_dir, tmp_path, preset, fmt, name):
    """Logits equal transformers' (the package's quantized forward) to fp32 summation order: both round each
    activation identically (above), so the remaining differences are fp32 sums, ~1e-6 of the logits (measured
    4e-7); the tolerance, 2e-4 of the largest logit, is 1/50 of what activation quantization itself moves them
    (weight-only against the reference: 1.5% to 5%, asserted). INT8's 127.5 divisor puts each row's largest
    negative value on a rounding tie (docs/quantization.md), which a different fp32 sum upstream could flip by one
    step; none flips on this model."""
    path = w8a8_dir if preset == "W8A8" else write_compressed_tensors(
        build_hf_model("qwen3", seed=0, num_hidden_layers=2), tmp_path / "ct", preset, fmt, activations=True,
        calibration=PROMPT)
    target = specjax.load(path, dtype="float32")
    assert f"quantized={name}" in repr(target)
    with torch.no_grad():
        ref = reference_model(path)(torch.tensor([PROMPT])).logits[0].numpy()
    tol = 2e-4 * np.abs(ref).max()
    np.testing.assert_allclose(logits(target), ref, atol=tol)
    weight_only = logits(specjax.load(path, dtype="float32", activation_quant=False))
    assert np.abs(weight_only - ref).max() > 50 * tol
    if preset == "FP8":  # the exact mode is the dequantized model: weight-only numbers
        exact = specjax.load(path, dtype="float32", dequantize=True)
        np.testing.assert_allclose(logits(exact), weight_only, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_block_fp8_computes_vllms_activation_rounding(tmp_path):
    """Block FP8 (`activation_scheme: "dynamic"`, 32 x 32 blocks, every o_proj left plain): specjax's logits equal
    transformers' dequantized model with vLLM's per-token-group rounding (group 32, the block's input size) on the
    input of each quantized linear (forward pre-hooks)."""
    path = write_block_fp8(build_hf_model("qwen3", seed=0, num_hidden_layers=2), tmp_path / "fp8", block=(32, 32),
                           skip=lambda name: "o_proj" in name)
    target = specjax.load(path, dtype="float32")
    assert "quantized=fp8 block [32, 32], activations fp8 dynamic group 32" in repr(target)
    model = reference_model(path)

    def rounded_input(module, args):
        q, s = vllm_per_token_group_quant_fp8(args[0], 32)
        return (q.float() * s).flatten(-2)

    hooked = [module.register_forward_pre_hook(rounded_input) for name, module in model.named_modules()
              if LINEAR.fullmatch(f"{name}.weight") and "o_proj" not in name]
    assert len(hooked) == 2 * 6
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    tol = 2e-4 * np.abs(ref).max()
    np.testing.assert_allclose(logits(target), ref, atol=tol)
    assert np.abs(logits(specjax.load(path, dtype="float32", activation_quant=False)) - ref).max() > 20 * tol


def test_greedy_speculation_on_a_w8a8_target_equals_plain_decoding(w8a8_dir, tmp_path):
    """Per-token scales depend on each row alone, so verifying drafted tokens computes what decoding them one at
    a time does: a draft model's chain keeps the W8A8 target's greedy output."""
    from specjax.drafters import DraftModelDrafter

    target = specjax.load(w8a8_dir, dtype="float32")
    other = specjax.load(save_hf_model(build_hf_model("qwen3", seed=1, num_hidden_layers=1), tmp_path / "draft"))
    prompts = [PROMPT, PROMPT[:3]]
    plain = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], tree="chain:3",
                           drafter=DraftModelDrafter(other.cfg, other.params))
    assert out.tokens == plain.tokens and out.stats["drafter_calls"] > 0


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme 'static'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size None"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "input_activations": {
        "num_bits": 8, "type": "int", "symmetric": False, "strategy": "token", "dynamic": True}}}},
     "'symmetric': False"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "input_activations": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "dynamic": "local"}}}}, "'num_bits': 4"),
])
def test_activations_specjax_does_not_compute_are_refused_naming_the_way_out(config, match):
    with pytest.raises(ValueError, match=match) as err:
        activation_spec(QuantScheme(config["quant_method"], (), config), "model.layers.0.mlp.up_proj")
    assert "activation_quant=False" in str(err.value) and "\n" not in str(err.value)


def test_bad_activation_quant_and_a_missing_input_scale(tmp_path):
    with pytest.raises(TypeError, match="activation_quant must be True .* or False .*, got 'yes'"):
        specjax.load(tmp_path, activation_quant="yes")
    from specjax.convert.quantized import read_linear

    scheme = QuantScheme("compressed-tensors", (), {"config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}})
    tensors = {"m.weight": np.ones((4, 8), ml_dtypes.float8_e4m3fn), "m.weight_scale": np.ones(1, np.float32)}
    with pytest.raises(ValueError, match="'m' has static activation quantization .* no 'm.input_scale'"):
        read_linear(tensors, "m", scheme, "float32")
    qw, used = read_linear({**tensors, "m.input_scale": np.float32([0.5])}, "m", scheme, "float32")
    assert qw.input_scale.shape == () and "m.input_scale" in used
    off, _ = read_linear(tensors, "m", QuantScheme(scheme.method, (), scheme.config, activation_quant=False),
                         "float32")
    assert off.activations is None and off.input_scale is None


def test_the_gpu_kernel_multiplies_the_quantized_input(monkeypatch):
    """Traced for a GPU, a block-FP8 weight with activation quantization still takes the fused kernel (here in
    Pallas's interpreter), fed the rounded input: the same numbers as the CPU's dequantizing matmul."""
    import dataclasses

    import jax

    from specjax import kernels
    from specjax.quant.quantize import quantize_weight

    rng = np.random.default_rng(2)
    w = quantize_weight(rng.normal(size=(256, 192)).astype(np.float32) * 0.05, "fp8", "float32")
    w = dataclasses.replace(w, activations=Activations("fp8", "group", group=128, min_amax=1e-10))
    x = random_activations(3)[0, :3]
    want = np.asarray(jax.jit(lambda x, w: x @ w)(x, w))
    calls = []

    def interpreted(*args, **kwargs):
        calls.append(kwargs)
        return kernels.fp8_matmul.block_fp8_matmul(*args, interpret=True, **kwargs)

    monkeypatch.setattr(kernels, "block_fp8_matmul", interpreted)
    with kernels.targeting_gpu():
        got = np.asarray(jax.jit(lambda x, w: x @ w)(x, w))
    assert len(calls) == 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    weight_only = x @ np.asarray(w.dequantize(np.float32))
    assert np.abs(weight_only - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("spec", [Activations("fp8", "group", group=16, min_amax=1e-10), Activations("fp8", "token"),
                                  Activations("fp8", "tensor", static=True)], ids=lambda s: s.name)
@pytest.mark.parametrize("path", ["gather", "sorted", "ragged", "accelerator"])
def test_every_expert_path_rounds_each_experts_input(monkeypatch, spec, path):
    """Quantized [E, ...] experts with activation quantization (a static one: one input_scale per expert) through
    each expert path (the accelerator's batched gather taken on this CPU by saying it is a GPU) equal a per-slot
    loop: each token's input, and each expert's hidden state, rounded as that expert's linear says. (Not INT8 per
    token here: compressed-tensors' 127.5 divisor puts a row's largest negative value on a rounding tie, so the
    hidden state's fp32 summation order, which differs between a block of rows and one row, can flip it a step.)"""
    import dataclasses

    import jax

    from specjax.models import moe
    from specjax.quant.qarray import QuantizedWeight

    rng = np.random.default_rng(0)
    e, d, i, n, k = 4, 32, 48, 6, 2

    def experts(shape):
        q = rng.normal(size=shape).astype(ml_dtypes.float8_e4m3fn)
        scale = rng.uniform(0.01, 0.05, size=shape[:-2] + (-(-shape[-2] // 16), -(-shape[-1] // 16)))
        input_scale = rng.uniform(0.01, 0.03, size=shape[0]).astype(np.float32) if spec.static else None
        return QuantizedWeight(q, scale.astype(np.float32), block=(16, 16), compute_dtype="float32",
                               activations=spec, input_scale=input_scale)

    weights = [experts((e, d, i)), experts((e, d, i)), experts((e, i, d))]
    x_ND = rng.normal(size=(n, d)).astype(np.float32)
    weights_NK, experts_NK = moe.route(jax.numpy.asarray(x_ND), rng.normal(size=(d, e)).astype(np.float32), k, True)
    want = np.zeros_like(x_ND)
    for t in range(n):
        for j in range(k):
            ex = int(experts_NK[t, j])
            gate, up, down = (w[ex] for w in weights)  # expert ex's matrix, its input scale with it
            row = jax.numpy.asarray(x_ND[t:t + 1])
            hidden = jax.nn.silu(row @ gate) * (row @ up)  # `x @ w` rounds its input itself
            want[t] += np.asarray(hidden @ down)[0] * float(weights_NK[t, j])
    fn = moe.EXPERT_PATHS["gather" if path == "accelerator" else path]
    if path == "accelerator":
        monkeypatch.setattr(moe.kernels, "on_gpu", lambda: True)
    run = jax.jit(lambda x, *ws: fn(x, weights_NK, experts_NK, *ws))
    np.testing.assert_allclose(np.asarray(run(x_ND, *weights)), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    unrounded = np.asarray(run(x_ND, *(dataclasses.replace(w, activations=None, input_scale=None) for w in weights)))
    assert np.abs(unrounded - want).max() > 1e-3 * np.abs(want).max()
