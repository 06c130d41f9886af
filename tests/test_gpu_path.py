"""The accelerator production path, exercised without an accelerator.

On a GPU, targets keep stacked layers under `lax.scan`, one stacked KV cache carried through
the scan, and the Pallas kernel indexing the layer itself. CPU targets use per-layer arrays, so
nothing else on CPU runs that graph. Here it runs end to end in interpret mode and must give
the per-layer XLA path's greedy tokens; and the plain and speculative loops are lowered for
CUDA from this CPU (StableHLO with the Triton custom call) for a Llama-3-8B-shaped config.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_tiny import build_hf_model, save_hf_model

import specjax
import specjax.kernels
from specjax.aot.graphs import abstract_request
from specjax.config import ModelConfig, RopeConfig, SamplingConfig
from specjax.decoding.decode import LoopConfig, ar_generate
from specjax.decoding.drafter import Settings
from specjax.decoding.speculative import spec_generate
from specjax.decoding.tree import chain, kary
from specjax.drafters import DraftModelDrafter
from specjax.models.decoder import has_layer_list
from specjax.models.model import param_shapes

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = build_hf_model("llama", seed=4, num_hidden_layers=2, tie_word_embeddings=False)
    return save_hf_model(model, tmp_path_factory.mktemp("gpu_path"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, size=n).tolist() for n in (6, 19, 2)]


def test_stacked_pallas_path_equals_per_layer_xla_path(model_dir, prompts):
    """Stacked params + stacked cache + scan + kernel (interpret) = per-layer params + buffers + XLA attention."""
    gpu_like = specjax.load(model_dir, attn_impl="pallas", layout="stacked")
    cpu = specjax.load(model_dir, attn_impl="xla", layout="per_layer")
    assert not has_layer_list(gpu_like.params) and has_layer_list(cpu.params)
    kwargs = dict(max_new_tokens=12, eos_token_id=[])
    want = specjax.generate(cpu, prompts, **kwargs).tokens
    assert specjax.generate(gpu_like, prompts, **kwargs).tokens == want
    for shape in ({"num_draft_tokens": 3}, {"tree": "kary:2,1"}):
        drafter = DraftModelDrafter(gpu_like.cfg, gpu_like.params, attn_impl="pallas")
        out = specjax.generate(gpu_like, prompts, drafter=drafter, **shape, **kwargs)
        assert out.tokens == want
        assert out.stats["acceptance_length"] > 2.0  # self-drafting: the kernel path verifies what it drafts


def llama3_8b_shaped(layers: int, dtype: str) -> ModelConfig:
    """Llama-3-8B's widths (GQA 32/8, head_dim 128, vocab 128256, llama3 rope) with few layers."""
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
    return ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=layers,
                       num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope=rope,
                       max_position_embeddings=131072, eos_token_ids=(128001,), dtype=dtype)


def abstract_params(cfg: ModelConfig) -> dict:
    """Stacked-layout params as shapes only: lowering needs no weights."""
    dtype = jnp.dtype(cfg.dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))


@pytest.fixture
def pretend_gpu(monkeypatch):
    """Make attention choose the compiled (not interpreted) kernel, as it does on a GPU."""
    monkeypatch.setattr(specjax.kernels, "on_gpu", lambda: True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_loop_lowers_for_cuda_with_the_triton_kernel(pretend_gpu, dtype):
    cfg = llama3_8b_shaped(layers=2, dtype=dtype)
    lc = LoopConfig(cfg, False, out_len=32, cache_len=256, attn_impl="auto")
    lowered = ar_generate.trace(abstract_params(cfg), *abstract_request(4, 64), lc=lc).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert TRITON_CALL in text
    assert "stablehlo.while" in text  # the decode loop stays one while loop on the device


@pytest.mark.parametrize("dtype,sampled,tree,penalties,logprobs", [
    ("float32", False, chain(4), False, -1),
    ("bfloat16", True, kary([3, 2, 1]), True, 2),
])
def test_speculative_loop_lowers_for_cuda_with_the_triton_kernel(pretend_gpu, dtype, sampled, tree, penalties,
                                                                 logprobs):
    cfg = llama3_8b_shaped(layers=2, dtype=dtype)
    draft_cfg = dataclasses.replace(cfg, hidden_size=2048, intermediate_size=8192, num_layers=1, num_heads=32,
                                    num_kv_heads=8, head_dim=64)
    cache_len = 256
    lc = LoopConfig(cfg, sampled, out_len=32, cache_len=cache_len, attn_impl="auto", penalties=penalties,
                    logprobs=logprobs)
    drafter = DraftModelDrafter(draft_cfg, None, attn_impl="auto").configure(
        Settings(tree, lc.drafting, cache_len, lc.out_len))
    lowered = spec_generate.trace(abstract_params(cfg), abstract_params(draft_cfg), *abstract_request(8, 64),
                                  lc=lc, drafter=drafter).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    # Target verify + prefill and the drafter's passes all use the kernel.
    assert text.count(TRITON_CALL) >= 2


def qwen35_9b_shaped(layers: int) -> ModelConfig:
    """Qwen3.5-9B's widths (bench preset qwen35_9b) with few layers: 3 Gated DeltaNet + 1 gated attention per 4."""
    from specjax.bench.ar import PRESETS

    return ModelConfig.from_hf({**PRESETS["qwen35_9b"], "num_hidden_layers": layers}, dtype="bfloat16")


@pytest.mark.parametrize("tree", [None, chain(3), kary([3, 2])], ids=["plain", "mtp-chain", "draft-tree"])
def test_hybrid_loops_lower_for_cuda_with_the_triton_kernel(pretend_gpu, tree):
    """Qwen3.5-9B widths: the plain loop, an MTP chain and a dense draft model's tree (the DeltaNet's tree-masked
    verify block and commit) lower for CUDA, attention through the kernel (head_dim 256)."""
    from specjax.drafters import MtpDrafter, mtp
    from specjax.models.state import shapes_of

    cfg = qwen35_9b_shaped(layers=4)
    lc = LoopConfig(cfg, False, out_len=32, cache_len=256, attn_impl="auto")
    if tree is None:
        lowered = ar_generate.trace(abstract_params(cfg), *abstract_request(2, 64), lc=lc).lower(
            lowering_platforms=("cuda",))
    else:
        settings = Settings(tree, SamplingConfig(), 256, lc.out_len)
        if tree.is_chain:
            mcfg = mtp.MtpConfig("qwen3_next", 1, cfg)
            shapes = shapes_of(lambda: mtp.MtpHead(mcfg, rngs=nnx.Rngs(0)))
            draft_params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), shapes,
                                        is_leaf=lambda x: isinstance(x, tuple))
            drafter = MtpDrafter(mcfg, None, attn_impl="auto").configure(settings)
        else:
            draft_cfg = dataclasses.replace(llama3_8b_shaped(1, "bfloat16"), vocab_size=cfg.vocab_size)
            draft_params = abstract_params(draft_cfg)
            drafter = DraftModelDrafter(draft_cfg, None, attn_impl="auto").configure(settings)
        lowered = spec_generate.trace(abstract_params(cfg), draft_params, *abstract_request(2, 64), lc=lc,
                                      drafter=drafter).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert TRITON_CALL in text and "stablehlo.while" in text


def qwen3_30b_a3b_shaped(layers: int) -> ModelConfig:
    """Qwen3-30B-A3B's widths (bench preset qwen3_30b_a3b: 128 experts of 768, 8 per token) with few layers."""
    from specjax.bench.ar import PRESETS

    return ModelConfig.from_hf({**PRESETS["qwen3_30b_a3b"], "num_hidden_layers": layers}, dtype="bfloat16")


@pytest.mark.parametrize("tree", [None, kary([3, 2])], ids=["plain", "draft-tree"])
def test_moe_loops_lower_for_cuda_with_the_triton_kernel(pretend_gpu, tree):
    """Qwen3-30B-A3B widths, stacked layers under scan: the plain loop at batch 1 (decode by the gather path, prefill
    by the sorted blocks) and a dense draft model's tree at batch 2 (verification by the sorted blocks) lower for
    CUDA, attention through the kernel."""
    from specjax.models.moe import expert_path

    cfg = qwen3_30b_a3b_shaped(layers=2)
    assert not cfg.mixed_layers and expert_path(cfg.moe, 1) == "gather" and expert_path(cfg.moe, 2) == "sorted"
    lc = LoopConfig(cfg, False, out_len=32, cache_len=256, attn_impl="auto")
    if tree is None:
        lowered = ar_generate.trace(abstract_params(cfg), *abstract_request(1, 64), lc=lc).lower(
            lowering_platforms=("cuda",))
    else:
        draft_cfg = dataclasses.replace(llama3_8b_shaped(1, "bfloat16"), vocab_size=cfg.vocab_size)
        drafter = DraftModelDrafter(draft_cfg, None, attn_impl="auto").configure(
            Settings(tree, SamplingConfig(), 256, lc.out_len))
        lowered = spec_generate.trace(abstract_params(cfg), abstract_params(draft_cfg), *abstract_request(2, 64),
                                      lc=lc, drafter=drafter).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert TRITON_CALL in text and "stablehlo.while" in text
    assert "stablehlo.sort" in text  # the sorted path's argsort of the slots by expert
