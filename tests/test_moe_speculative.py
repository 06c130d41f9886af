"""Speculative decoding on MoE targets: greedy output equals plain decoding for every family (chains, static and
dynamic trees) on Qwen3-MoE (a dense layer among sparse ones), and for a rollback, trees and the block drafters on
Qwen3-Next (hybrid + MoE); the MTP layers Qwen3.5-MoE and Qwen3-Next ship (an MoE block with a shared expert) draft
losslessly, their block is transformers' decoder layer; a sampled tree keeps an MoE target's distribution."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import build_hf_model, build_moe, fuse_expert_tensors, save_hf_model
from safetensors.numpy import load_file, save_file
from test_hybrid_speculative import CASES, MAX_NEW, make
from test_lossless_sampling import NEW, PROMPT, ROWS, VOCAB, chi_square_passes, exact_distribution, tiny

import specjax
from specjax.config import ModelConfig, MoeConfig, SamplingConfig
from specjax.drafters import DraftModelDrafter
from specjax.drafters.mtp import MtpDrafter, head_of
from specjax.loading.drafter import mtp_drafter
from specjax.models.cache import init_cache
from specjax.models.layers import causal_mask, rope_inv_freq
from specjax.models.model import init_params
from specjax.models.target import Target

# Four layers (the shared cases tap layers 1..4); Qwen3-MoE's layer 1 and Qwen3-Next's layer 2 are dense.
TARGETS = {"qwen3_moe": dict(num_hidden_layers=4), "qwen3_next": {}}
# Qwen3-MoE runs every shared case; Qwen3-Next (whose DeltaNet rollback test_hybrid_speculative.py checks case by
# case on Qwen3.5) a rollback at depth 2, a static and a dynamic tree, and both block drafters.
NEXT_CASES = [("wrong-at-2", "chain:4"), ("draft-model", "kary:3,2"),
              ("eagle3", "dynamic:top_k=2,depth=2,total_tokens=5"), ("dflash", "chain:3"), ("dspark", "chain:4")]
RUNS = [("qwen3_moe", n, t) for n, t in CASES] + [("qwen3_next", n, t) for n, t in NEXT_CASES]


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory):
    hf = build_moe(request.param, **TARGETS[request.param])
    return specjax.load(save_hf_model(hf, tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return specjax.load(save_hf_model(build_hf_model("qwen3", seed=1, num_hidden_layers=1),
                                      tmp_path_factory.mktemp("draft")))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 23, 1)]


@pytest.fixture(scope="module")
def plain(target, prompts):
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])
    assert all(len(set(t)) > MAX_NEW // 2 for t in out.tokens)
    return out


@pytest.mark.parametrize("target, name, tree", RUNS, indirect=["target"],
                         ids=[f"{a}-{n}-{t if isinstance(t, str) else 'list'}" for a, n, t in RUNS])
def test_greedy_speculative_equals_plain(target, other, prompts, plain, name, tree):
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[],
                           drafter=make(name, target, other, plain), tree=tree)
    assert out.tokens == plain.tokens
    if name.startswith("wrong-at-"):
        depth = int(name.rsplit("-", 1)[1])
        assert out.stats["per_position_acceptance"][depth - 1] == 0.0


@pytest.mark.parametrize("target", ["qwen3_next"], indirect=True)  # hybrid + MoE: both caches' narrow widths
def test_prefix_scheduler_on_an_moe_target(target, prompts, plain):
    drafter = specjax.replay_drafter(plain.tokens, 256, corrupt_prob=0.4, confidence=True, confidence_noise=0.2)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                           num_draft_tokens=6, scheduler="confidence")
    assert out.tokens == plain.tokens


# ---- the MTP layers MoE checkpoints ship -------------------------------------------------------------------


def with_mtp(src, dst, fused: bool, seed: int = 0):
    """Copy an HF dir and add one random MTP layer in the Qwen3-Next / Qwen3.5 layout whose block is a copy of the
    target's full-attention layer 3 (an MoE layer: fused experts for Qwen3.5-MoE, per expert for Qwen3-Next)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    rng = np.random.default_rng(seed)

    def rand_like(shape, name):
        if "norm" in name:
            return (0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (0.5 * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    h = tensors["model.embed_tokens.weight"].shape[1]
    block = {k[len("model.layers.3."):]: t for k, t in tensors.items() if k.startswith("model.layers.3.")}
    added = {f"mtp.layers.0.{k}": rand_like(t.shape, k) for k, t in block.items()}
    added |= {f"mtp.{n}.weight": rand_like((h,), "norm") for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                   "norm")}
    added["mtp.fc.weight"] = rand_like((h, 2 * h), "fc")
    if fused:
        tensors, added = fuse_expert_tensors(tensors), fuse_expert_tensors(added)
    save_file(tensors | added, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return dst, added


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def mtp_target(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(request.param)
    src = save_hf_model(build_moe(request.param), base / "hf")
    path, added = with_mtp(src, base / "with_mtp", fused=request.param == "qwen3_5_moe")
    return request.param, specjax.load(path), added


def test_moe_mtp_layers_are_read(mtp_target):
    arch, target, added = mtp_target
    if arch == "qwen3_5_moe":  # fuse (4) + attention (8) + router, fused experts (2), shared expert and gate (4)
        assert len(added) == 19
    drafter = mtp_drafter(target)
    assert isinstance(drafter, MtpDrafter) and drafter.cfg.sparse_blocks == (0,)
    moe = target.mtp["layers"]["0"]["block"]["moe"]
    assert moe["w_gate"].shape == (8, 64, 32) and moe["shared_gate"].shape == (64, 48)


def test_moe_mtp_block_is_transformers_decoder_layer(mtp_target):
    """The MTP block (a sparse full-attention layer) against transformers' own decoder layer holding its weights
    (fused experts, as transformers holds them in memory)."""
    import transformers
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next

    arch, target, added = mtp_target
    hf = json.loads((target.path / "config.json").read_text())
    if arch == "qwen3_5_moe":
        config = transformers.Qwen3_5MoeTextConfig(**hf)
        layer, rotary = modeling_qwen3_5_moe.Qwen3_5MoeDecoderLayer(config, 3), \
            modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding(config)
    else:
        config = transformers.Qwen3NextConfig(**hf)
        layer, rotary = modeling_qwen3_next.Qwen3NextDecoderLayer(config, 3), \
            modeling_qwen3_next.Qwen3NextRotaryEmbedding(config)
    prefix = "mtp.layers.0."
    block = fuse_expert_tensors({k[len(prefix):]: v for k, v in added.items() if k.startswith(prefix)})
    layer.eval().load_state_dict({k: torch.tensor(v) for k, v in block.items()})
    x = np.random.default_rng(2).standard_normal((1, 9, 64)).astype(np.float32)
    positions = torch.arange(9)[None]
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]  # eager attention's additive mask
    with torch.no_grad():
        want = layer(torch.tensor(x), position_embeddings=rotary(torch.tensor(x), positions),
                     attention_mask=causal, position_ids=positions)
    want = (want[0] if isinstance(want, tuple) else want).numpy()
    drafter = mtp_drafter(target)
    head = head_of(drafter.cfg, drafter.params)
    block_cfg = drafter.cfg.block
    cache = init_cache(block_cfg, 1, 16, per_layer=True)
    inv_freq = rope_inv_freq(block_cfg.rope, block_cfg.rotary_dim)
    got, _, _ = head.layers[0].block(jnp.asarray(x), cache.k[0], cache.v[0], None, jnp.zeros((1,), jnp.int32),
                                     jnp.arange(9)[None], causal_mask(9)[None], inv_freq, "xla")
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mtp_target, k", [("qwen3_5_moe", 1), ("qwen3_5_moe", 3), ("qwen3_next", 3)],
                         indirect=["mtp_target"])
def test_moe_mtp_drafts_losslessly(mtp_target, k):
    _, target, _ = mtp_target
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (6, 19)]
    plain = specjax.generate(target, prompts, max_new_tokens=32, eos_token_id=[])
    out = specjax.generate(target, prompts, max_new_tokens=32, eos_token_id=[], drafter=mtp_drafter(target),
                           num_draft_tokens=k)
    assert out.tokens == plain.tokens


# ---- losslessness of sampling ------------------------------------------------------------------------------


def tiny_moe(seed: int) -> Target:
    """A 6-token MoE target: two sparse layers of 4 experts, 2 per token, a shared expert."""
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, qk_norm=True, family="qwen3_moe",
                      moe=MoeConfig(num_experts=4, top_k=2, expert_size=16, shared_size=16, sparse_layers=(0, 1)))
    return Target(init_params(cfg, jax.random.key(seed), scale=0.25), cfg, hf_config={})


def test_sampled_output_has_the_target_distribution():
    """A sampled tree on an MoE target (a node with one child verifies as a chain does; test_lossless_sampling.py
    checks chains and trees on dense targets)."""
    target, draft = tiny_moe(2), tiny(7, layers=1)  # seed 2: 0.36 of the mass shared with the draft
    sampling = SamplingConfig(1.0)
    out = specjax.generate(target, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=1.0, seed=11, tree="kary:2,2",
                           eos_token_id=[], drafter=DraftModelDrafter(draft.cfg, draft.params))
    samples = np.array(out.tokens)
    ok, stat, threshold = chi_square_passes(samples, exact_distribution(target, sampling))
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}: sampled output is not the target's distribution"
    ok_draft, stat_draft, _ = chi_square_passes(samples, exact_distribution(draft, sampling))
    assert not ok_draft and stat_draft > 3 * threshold
    probs = exact_distribution(target, sampling)
    assert probs.max() < 0.2 and np.isclose(probs.sum(), 1.0)


# ---- SpecForge's EAGLE-3 head for Qwen3-30B-A3B ----------------------------------------------------------------

# sgl-project/SpecForge configs/qwen3-30B-eagle3.json, as published (the fields specjax reads and the rest).
SPECFORGE_QWEN3_30B_A3B_HEAD = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 2048, "max_window_layers": 48,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.53.2", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936, "draft_vocab_size": 32000}


def test_specforge_qwen3_30b_a3b_head_config_loads_as_published():
    """head_dim 128 with hidden / heads = 64: q/k/v/o and RoPE are sized by head_dim, as SpecForge trains it."""
    from specjax.convert.eagle3 import eagle3_config
    from specjax.drafters.eagle3 import param_shapes
    from specjax.planning.profile import QWEN3_30B_A3B

    cfg = eagle3_config(SPECFORGE_QWEN3_30B_A3B_HEAD, ModelConfig.from_hf(QWEN3_30B_A3B))
    assert cfg.head_dim == 128 and cfg.feature_layers == (2, 24, 45) and cfg.dtype == "bfloat16"
    assert cfg.rope.theta == 1e6 and cfg.draft_vocab_size == 32000
    layer = param_shapes(cfg)["layer"]
    assert layer["wq"] == (4096, 32 * 128) and layer["wk"] == (4096, 4 * 128) and layer["wo"] == (32 * 128, 2048)


@pytest.mark.parametrize("target, tree", [("qwen3_moe", "chain:3"), ("qwen3_next", "kary:2,2")], indirect=["target"])
def test_eagle3_head_with_its_own_head_dim_is_lossless(target, prompts, plain, tree, tmp_path):
    """A tiny head shaped like SpecForge's (head_dim 32 with hidden / heads 16), written in its layout and loaded back
    through load_drafter on an MoE target."""
    from specjax.convert.export import export_eagle3
    from specjax.drafters.eagle3 import Eagle3Config
    from specjax.drafters.eagle3 import init_params as eagle_init

    cfg = Eagle3Config(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=256,
                       draft_vocab_size=256, target_hidden_size=64, feature_layers=(1, 2, 3), config_head_dim=32)
    path = export_eagle3(cfg, eagle_init(cfg, jax.random.key(3), target.params["embed"]), tmp_path / "head")
    assert json.loads((path / "config.json").read_text())["head_dim"] == 32
    drafter = specjax.load_drafter(path, target)
    assert drafter.cfg.head_dim == 32
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter, tree=tree)
    assert out.tokens == plain.tokens


@pytest.mark.parametrize("target", ["qwen3_moe"], indirect=True)  # the draft model's experts are the point
@pytest.mark.parametrize("tree", ["chain:3", "kary:2,2", "dynamic:top_k=2,depth=2,total_tokens=5"])
def test_an_moe_draft_model_is_lossless(target, prompts, plain, tree, tmp_path):
    """A one-layer Qwen3-MoE as the draft model (its own experts and KV cache in the draft loop)."""
    draft = specjax.load(save_hf_model(build_moe("qwen3_moe", seed=3, num_hidden_layers=1, mlp_only_layers=[]),
                                       tmp_path / "moe_draft"))
    assert draft.cfg.moe.sparse_layers == (0,)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[],
                           drafter=DraftModelDrafter(draft.cfg, draft.params), tree=tree)
    assert out.tokens == plain.tokens
