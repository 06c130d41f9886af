"""Qwen3.5 (Gated DeltaNet + gated attention) against transformers on tiny random checkpoints in both published
layouts: logits across chunk boundaries, cached decoding, greedy generation on ragged batches, and the loading
rules (vision tower skipped, media tokens refused, per-layer only)."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import (
    assert_convert_export_round_trip,
    assert_greedy_matches_transformers,
    build_qwen35,
    hf_logits,
    save_hf_model,
)

import specjax
from specjax.config import ModelConfig
from specjax.models.hybrid import GatedDeltaNetLayer, HybridDecoder

LOGIT_ATOL = 1e-4  # observed: 4e-5 at 300 tokens; transformers' own fp32 run differs from its fp64 run as much
LAYOUTS = ["causal_lm", "conditional"]


@pytest.fixture(scope="module", params=LAYOUTS)
def pair(request, tmp_path_factory):
    """(layout, transformers model, specjax target loaded from its saved directory)."""
    hf_model = build_qwen35(request.param)
    return request.param, hf_model, specjax.load(save_hf_model(hf_model, tmp_path_factory.mktemp(request.param)))


def test_config_reads_both_layouts(pair):
    layout, _, target = pair
    cfg = target.cfg
    assert cfg.is_hybrid and cfg.family == "qwen3_5"
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.rotary_dim == 8 and cfg.attn_output_gate and cfg.norm_offset
    assert cfg.linear.conv_dim == 2 * 2 * 16 + 4 * 16
    model = target.model
    assert isinstance(model, HybridDecoder)
    assert [type(layer).__name__ for layer in model.layers] == ["GatedDeltaNetLayer"] * 3 + ["DecoderLayer"]
    assert cfg.num_params() == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(target.params))


@pytest.mark.parametrize("t", [5, 70, 300])
def test_logits_match_transformers(pair, t):
    """5 tokens (one chunk), 70 (two), 300 (five): the chunked prefill across chunk boundaries."""
    _, hf_model, target = pair
    tokens = np.random.default_rng(t).integers(3, target.cfg.vocab_size, size=(2, t))
    ref = hf_logits(hf_model, tokens)
    ours = np.asarray(target.model(tokens, attn_impl="xla"))
    assert np.abs(ref).max() > 5  # logits of a real spread, not a degenerate model
    np.testing.assert_allclose(ours, ref, atol=LOGIT_ATOL, rtol=0)


def test_cached_decoding_equals_one_pass(pair):
    """Prefill 25 tokens (chunked), then one at a time (the recurrence) through the HybridCache."""
    _, _, target = pair
    tokens = jnp.asarray(np.random.default_rng(4).integers(3, target.cfg.vocab_size, size=(2, 40)), jnp.int32)
    model = target.model
    cache = model.init_cache(2, 128)
    h, _, cache = model.forward(tokens[:, :25], cache, attn_impl="xla")
    steps = [model.logits(h)]
    cache = cache.with_lengths(cache.lengths + 25)
    for t in range(25, 40):
        h, _, cache = model.forward(tokens[:, t:t + 1], cache, attn_impl="xla")
        cache = cache.with_lengths(cache.lengths + 1)
        steps.append(model.logits(h))
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(model(tokens, attn_impl="xla")),
                               atol=LOGIT_ATOL, rtol=0)


def test_greedy_generation_matches_transformers(pair):
    """64 tokens on a ragged batch (right-padded prompts of 3, 37 and 70 tokens: padding must not reach the state),
    each row against transformers' generate of that prompt alone."""
    _, hf_model, target = pair
    assert_greedy_matches_transformers(hf_model, target)


def test_hidden_state_capture_follows_transformers_numbering(pair):
    """capture=(i,) is transformers' hidden_states[i] (0 = embeddings; the last one before the final norm)."""
    _, hf_model, target = pair
    tokens = np.random.default_rng(2).integers(3, target.cfg.vocab_size, size=(1, 12))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens), output_hidden_states=True).hidden_states
    model = target.model
    _, captured, _ = model.forward(jnp.asarray(tokens, jnp.int32), model.init_cache(1, 128), capture=(0, 1, 3),
                                   attn_impl="xla")
    for i, h in zip((0, 1, 3), captured):
        np.testing.assert_allclose(np.asarray(h), ref[i].numpy(), atol=1e-4, rtol=0)


def test_vision_tower_is_skipped_once_and_media_tokens_refused(tmp_path, caplog):
    path = save_hf_model(build_qwen35("conditional"), tmp_path / "vl")
    with caplog.at_level(logging.WARNING, logger="specjax"):
        target = specjax.load(path)
    said = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(said) == 1 and "model.visual." in said[0]
    image = json.loads((path / "config.json").read_text())["image_token_id"]
    assert image >= target.cfg.vocab_size  # the tiny vocabulary cannot hold the real ids: give one in range
    target.hf_config["image_token_id"] = 7
    with pytest.raises(ValueError, match="image_token_id placeholders.*text part only"):
        specjax.generate(target, [[5, 6, 7, 8]], max_new_tokens=2)


def test_stacked_layout_is_refused(pair):
    *_, target = pair
    with pytest.raises(ValueError, match="layers differ.*per-layer"):
        specjax.load(target.path, layout="stacked")


SMALL = dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=16,
             num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, linear_num_key_heads=1,
             linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4)


def test_full_attention_interval_gives_the_layer_types():
    base = SMALL
    cfg = ModelConfig.from_hf({**base, "full_attention_interval": 4})
    assert cfg.attention_layers == (3, 7) and cfg.linear_layers == (0, 1, 2, 4, 5, 6)
    with pytest.raises(ValueError, match="mamba_ssm_dtype"):
        ModelConfig.from_hf({**base, "mamba_ssm_dtype": "bfloat16"})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf({**base, "layer_types": ["linear_attention"] * 7})


def test_module_declares_named_axes():
    """Every DeltaNet weight carries logical axis names (sharding metadata) like the attention layers'."""
    from flax import nnx

    cfg = ModelConfig.from_hf(SMALL)
    layer = GatedDeltaNetLayer(cfg, rngs=nnx.Rngs(0))
    params = [(path, var) for path, var in nnx.iter_graph(layer) if isinstance(var, nnx.Param)]
    assert len(params) == len(jax.tree.leaves(nnx.state(layer))) == 14  # every weight is an annotated Param
    for path, var in params:
        assert len(var.out_sharding) == var[...].ndim, path
    assert {a for _, var in params for a in var.out_sharding} <= {"embed", "conv", "v_heads", "mlp", None}


def qwen35_9b() -> ModelConfig:
    """Qwen3.5-9B's text config (transformers' Qwen3_5TextConfig defaults are that model's), in bf16."""
    import transformers

    hf = transformers.Qwen3_5TextConfig().to_dict()
    return ModelConfig.from_hf({**hf, "architectures": ["Qwen3_5ForCausalLM"]}, dtype="bfloat16")


def test_roofline_counts_the_deltanet_state():
    """Per row: the state read by the pass, read and written by the commit; each node's kept results written and
    read back; KV only for the 8 attention layers (docs/architecture_targets.md, Hybrid targets)."""
    from specjax.planning.profile import DEVICES, Roofline, hybrid_bytes

    cfg = qwen35_9b()
    assert len(cfg.linear_layers) == 24 and len(cfg.attention_layers) == 8
    state, node, _ = hybrid_bytes(cfg)
    assert state == 24 * 32 * 128 * 128 * 4 == 48 * 2 ** 20
    assert node == 24 * (8192 * 2 + 32 * (128 + 128 + 1) * 4)  # 1.13 MiB per node per row
    roof = Roofline.for_config(cfg, DEVICES["h100"], cache_len=1000)
    assert roof.kv_bytes_per_position == 2 * 8 * 4 * 256 * 2
    bw = DEVICES["h100"].bandwidth
    for batch, nodes in ((1, 1), (8, 16), (64, 4)):
        kv = batch * 1000 * roof.kv_bytes_per_position / bw
        extra = roof.verify_s(batch, nodes) - roof._pass_s(batch * nodes, 0) - kv  # beyond weights/compute and KV
        assert extra == pytest.approx(batch * (3 * state + 2 * nodes * node) / bw, rel=1e-6)
    assert roof.plain_s(64) < roof.verify_s(64, 1)  # a plain step touches the state twice, a round three times
    assert hybrid_bytes(ModelConfig(16, 8, 16, 2, 2, 1, 4)) == (0.0, 0.0, 0.0)


def test_convert_load_and_export_round_trip(pair, tmp_path):
    """Converted, it gives transformers' logits; exported as Qwen3_5ForCausalLM (a multimodal source as its text
    model), transformers loads it to the same logits."""
    _, hf_model, target = pair
    assert_convert_export_round_trip(hf_model, target, tmp_path, "Qwen3_5ForCausalLM", LOGIT_ATOL)