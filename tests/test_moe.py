"""Mixture-of-experts targets against transformers on tiny random checkpoints: Qwen3-MoE (a dense layer among
sparse ones), Qwen3.5-MoE (both published layouts, fused experts, a shared expert) and Qwen3-Next (hybrid + MoE,
fused DeltaNet projections): logits, greedy generation on ragged batches, routing corner cases, both expert
paths, both expert storage forms, export round trips, the configs' rules."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import (
    assert_convert_export_round_trip,
    assert_greedy_matches_transformers,
    build_moe,
    fuse_expert_tensors,
    hf_greedy,
    hf_logits,
    save_fused_experts,
    save_hf_model,
)
from safetensors.numpy import load_file, save_file

import specjax
from specjax.config import ModelConfig
from specjax.models.model import merge
from specjax.models.moe import EXPERT_PATHS, block_rows, route, sorted_experts

LOGIT_ATOL = 1e-4
ARCHS = [("qwen3_moe", "causal_lm"), ("qwen3_5_moe", "causal_lm"), ("qwen3_5_moe", "conditional"),
         ("qwen3_next", "causal_lm")]
IDS = ["qwen3_moe", "qwen3_5_moe", "qwen3_5_moe-conditional", "qwen3_next"]


@pytest.fixture(scope="module", params=ARCHS, ids=IDS)
def pair(request, tmp_path_factory):
    """(arch, transformers model, specjax target loaded from its saved directory)."""
    arch, layout = request.param
    hf_model = build_moe(arch, layout)
    path = save_hf_model(hf_model, tmp_path_factory.mktemp(arch))
    if arch == "qwen3_5_moe":  # as Qwen3.5-MoE publishes its experts (transformers 5 saves them per expert)
        save_fused_experts(path)
    return arch, hf_model, specjax.load(path)


def with_path(cfg: ModelConfig, impl: str) -> ModelConfig:
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, impl=impl))


def hf_routed_experts(hf_model, tokens: np.ndarray, top_k: int) -> list[np.ndarray]:
    """Per sparse layer, the experts transformers routes each token to ([B x T, k]), from its router logits."""
    with torch.no_grad():
        out = hf_model(torch.tensor(tokens), output_router_logits=True)
    return [torch.topk(logits.float(), top_k, dim=-1).indices.numpy() for logits in out.router_logits]


def test_config_reads_the_moe(pair):
    arch, _, target = pair
    cfg = target.cfg
    moe = cfg.moe
    assert cfg.family == arch and (moe.num_experts, moe.top_k, moe.expert_size) == (8, 2, 32)
    dense = {"qwen3_moe": (1,), "qwen3_5_moe": (), "qwen3_next": (2,)}[arch]
    assert moe.sparse_layers == tuple(i for i in range(cfg.num_layers) if i not in dense)
    assert moe.shared_size == (0 if arch == "qwen3_moe" else 48)
    assert moe.norm_topk_prob == (arch != "qwen3_moe")
    assert cfg.num_params() == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(target.params))
    assert cfg.num_params(active=True) < cfg.num_params()


@pytest.mark.parametrize("t", [5, 70])
def test_logits_match_transformers(pair, t):
    """Logits within 1e-4 on a batch of two (70 tokens: two DeltaNet chunks), by the auto path and both paths."""
    _, hf_model, target = pair
    tokens = np.random.default_rng(t).integers(3, target.cfg.vocab_size, size=(2, t))
    ref = hf_logits(hf_model, tokens)
    assert np.abs(ref).max() > 5
    np.testing.assert_allclose(np.asarray(target.model(tokens, attn_impl="xla")), ref, atol=LOGIT_ATOL, rtol=0)
    for impl in ("gather", "sorted", "ragged"):
        ours = merge(with_path(target.cfg, impl), target.params)(tokens, attn_impl="xla")
        np.testing.assert_allclose(np.asarray(ours), ref, atol=LOGIT_ATOL, rtol=0, err_msg=impl)


@pytest.mark.parametrize("tokens", [1, 3, 50, 700])
@pytest.mark.parametrize("one_expert", [False, True], ids=["spread", "all-on-expert-5"])
def test_expert_paths_equal_every_expert_on_every_token(tokens, one_expert):
    """Each path against the dense definition (every expert on every token, weighted by the routing matrix), from
    blocks of one row up to 32 rows, and every slot on one expert (one full group, the rest empty)."""
    e, k, d, i = 8, 2, 16, 12
    keys = jax.random.split(jax.random.key(tokens), 5)
    x = jax.random.normal(keys[0], (tokens, d))
    w_gate, w_up = (jax.random.normal(key, (e, d, i)) / d ** 0.5 for key in keys[1:3])
    w_down = jax.random.normal(keys[3], (e, i, d)) / i ** 0.5
    router = jax.random.normal(keys[4], (d, e))
    if one_expert:
        x, router = x.at[:, 0].set(10.0), router.at[0, 5].set(10.0)
    weights, experts = route(x, router, k, True)
    if one_expert:
        assert (experts == 5).any(axis=-1).all()
    dense_NE = jnp.zeros((tokens, e)).at[jnp.arange(tokens)[:, None], experts].set(weights)
    every_NED = jnp.einsum("nei,eid->ned", jax.nn.silu(jnp.einsum("nd,edi->nei", x, w_gate))
                           * jnp.einsum("nd,edi->nei", x, w_up), w_down)
    want = jnp.einsum("ned,ne->nd", every_NED, dense_NE)
    assert block_rows(tokens * k, e) == {1: 1, 3: 2, 50: 8, 700: 32}[tokens]  # sqrt(S / E x 13 rows per read)
    for name, fn in EXPERT_PATHS.items():
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(x, weights, experts, w_gate, w_up, w_down)),
                                   np.asarray(want), atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("tokens", [1, 3, 50])
def test_expert_parallel_shares_sum_to_the_whole(tokens):
    """Expert parallelism's local step on one device: with the experts split into 4 devices' quarters, each quarter
    running only the slots routed to it (sorted_experts with kept_NK), the four shares sum to every expert's output;
    a quarter no slot reaches gives zeros (all its slots dropped)."""
    e, k, d, i, n = 8, 2, 16, 12, 4
    keys = jax.random.split(jax.random.key(tokens), 5)
    x = jax.random.normal(keys[0], (tokens, d))
    w_gate, w_up = (jax.random.normal(key, (e, d, i)) / d ** 0.5 for key in keys[1:3])
    w_down = jax.random.normal(keys[3], (e, i, d)) / i ** 0.5
    weights, experts = route(x, jax.random.normal(keys[4], (d, e)), k, True)
    want = sorted_experts(x, weights, experts, w_gate, w_up, w_down)
    shares = []
    for device in range(n):
        part = slice(device * e // n, (device + 1) * e // n)
        local = experts - part.start
        kept = (local >= 0) & (local < e // n)
        share = jax.jit(sorted_experts)(x, weights, jnp.where(kept, local, 0), w_gate[part], w_up[part], w_down[part],
                                        kept)
        if not kept.any():
            assert not np.asarray(share).any()
        shares.append(share)
    np.testing.assert_allclose(np.asarray(sum(shares)), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_greedy_generation_matches_transformers(pair):
    """64 tokens on a ragged batch (prompts of 3, 37 and 70 tokens), each row against transformers' generate."""
    _, hf_model, target = pair
    assert_greedy_matches_transformers(hf_model, target)


def test_routing_corner_cases(pair):
    """A 3-token prompt leaves experts without a token in every sparse layer (6 slots, 8 experts): the grouped
    matmul's empty groups give transformers' logits."""
    arch, hf_model, target = pair
    short = np.asarray([[5, 17, 9]])
    for experts in hf_routed_experts(hf_model, short, 2):
        assert len(set(experts.ravel())) < 8
    np.testing.assert_allclose(np.asarray(target.model(short, attn_impl="xla")), hf_logits(hf_model, short),
                               atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "qwen3_next"])
def test_every_token_on_one_expert(arch, tmp_path):
    """A router that sends every token to expert 0 and none to expert 7: logits by both paths and the greedy
    continuation match transformers'."""
    hf_model = build_moe(arch, forced_expert=True)
    target = specjax.load(save_hf_model(hf_model, tmp_path / arch))
    rng = np.random.default_rng(5)
    tokens = rng.integers(3, target.cfg.vocab_size, size=(2, 24))
    for experts in hf_routed_experts(hf_model, tokens, 2):
        assert (experts == 0).any(axis=-1).all() and not (experts == 7).any()
    ref = hf_logits(hf_model, tokens)
    for impl in ("gather", "sorted"):
        ours = merge(with_path(target.cfg, impl), target.params)(tokens, attn_impl="xla")
        np.testing.assert_allclose(np.asarray(ours), ref, atol=LOGIT_ATOL, rtol=0, err_msg=impl)
    prompt = tokens[0, :9].tolist()
    out = specjax.generate(target, [prompt], max_new_tokens=24, eos_token_id=[])
    assert out.tokens[0] == hf_greedy(hf_model, prompt, 24)


def test_fused_and_per_expert_tensors_load_the_same(tmp_path):
    """Qwen3-MoE as transformers saves it (one tensor per expert) and re-saved with fused expert tensors
    ([E, 2I, D] gate_up_proj, [E, D, I] down_proj, the layout Qwen3.5-MoE publishes)."""
    hf_model = build_moe("qwen3_moe")
    path = save_hf_model(hf_model, tmp_path / "per_expert")
    fused = fuse_expert_tensors(load_file(path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    assert "model.layers.0.mlp.experts.0.up_proj.weight" not in fused
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    (tmp_path / "fused" / "config.json").write_text((path / "config.json").read_text())
    a, b = specjax.load(path), specjax.load(tmp_path / "fused")
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    del fused["model.layers.0.mlp.experts.down_proj"]
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    with pytest.raises(ValueError, match="mlp.experts.down_proj"):
        specjax.load(tmp_path / "fused")


def test_convert_load_and_export_round_trip(pair, tmp_path):
    """Converted, it gives transformers' logits; exported in its family's layout (the text model), transformers loads
    it to the same logits."""
    arch, hf_model, target = pair
    cls = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
           "qwen3_next": "Qwen3NextForCausalLM"}[arch]
    assert_convert_export_round_trip(hf_model, target, tmp_path, cls, LOGIT_ATOL)


BASE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=4)


def test_sparse_layer_rules_and_errors():
    """transformers' rule: layer i sparse unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0."""
    assert ModelConfig.from_hf({**BASE, "decoder_sparse_step": 2}).moe.sparse_layers == (1, 3)
    assert ModelConfig.from_hf({**BASE, "mlp_only_layers": [0, 3]}).moe.sparse_layers == (1, 2)
    uniform = ModelConfig.from_hf(BASE)
    assert uniform.moe.sparse_layers == (0, 1, 2, 3) and not uniform.mixed_layers
    assert ModelConfig.from_hf({**BASE, "mlp_only_layers": [0]}).mixed_layers
    assert ModelConfig.from_hf({**{k: v for k, v in BASE.items() if k != "num_experts"},
                                "num_local_experts": 4}).moe.num_experts == 4
    with pytest.raises(ValueError, match="num_experts_per_tok.*1..num_experts"):
        ModelConfig.from_hf({**BASE, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf({k: v for k, v in BASE.items() if k != "num_experts"})
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelConfig.from_hf({**BASE, "architectures": ["Qwen3NextForCausalLM"], "linear_num_key_heads": 1,
                             "linear_num_value_heads": 1, "linear_key_head_dim": 4, "linear_value_head_dim": 4})


def test_both_layouts_run_uniform_moe_and_stacked_refuses_mixed(tmp_path):
    """All layers sparse: both layouts (stacked: the accelerator's, scanned) give transformers' logits; a dense
    layer among them: stacked is refused."""
    hf_model = build_moe("qwen3_moe", mlp_only_layers=[])
    path = save_hf_model(hf_model, tmp_path / "uniform")
    tokens = np.random.default_rng(6).integers(3, 256, size=(2, 12))
    for layout in ("stacked", "per_layer"):
        target = specjax.load(path, layout=layout)
        np.testing.assert_allclose(np.asarray(target.model(tokens, attn_impl="xla")), hf_logits(hf_model, tokens),
                                   atol=LOGIT_ATOL, rtol=0)
    mixed = save_hf_model(build_moe("qwen3_moe"), tmp_path / "mixed")
    with pytest.raises(ValueError, match="layers differ.*per-layer"):
        specjax.load(mixed, layout="stacked")


# ---- the expert-aware cost model ---------------------------------------------------------------------------


def test_roofline_reads_the_experts_a_pass_routes_to():
    """Shared weights once, per sparse layer E (1 - (1 - k/E)^T) experts (k at one token, all E at many); FLOPs of
    the active params; so verify_s grows with nodes below the knee, where a dense model's stays flat."""
    from specjax.planning.profile import DEVICES, QWEN3_30B_A3B, Roofline

    cfg = ModelConfig.from_hf(QWEN3_30B_A3B)
    assert cfg.num_params() == pytest.approx(30.5e9, rel=0.01) and cfg.num_params(active=True) == pytest.approx(
        3.35e9, rel=0.01)
    roof = Roofline.for_config(cfg, DEVICES["h100"])
    expert = 48 * 3 * 2048 * 768 * 2  # one expert of every layer, bf16
    assert roof.expert_bytes == expert and roof.params == cfg.num_params(active=True)
    assert roof.weights_read(1) == pytest.approx(roof.weight_bytes + 8 * expert)
    assert roof.weights_read(4096) == pytest.approx(cfg.num_params() * 2, rel=1e-3)  # every expert read
    assert roof.experts_read(16) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 16))
    assert roof.verify_s(1, 16) > 5 * roof.verify_s(1, 1)  # 82 experts per layer instead of 8
    dense = Roofline(roof.device, roof.params, 2 * roof.params)
    assert dense.verify_s(1, 16) == dense.verify_s(1, 1) and roof.knee > 5 * dense.knee
    measured = roof.with_routing([(1, 8.0), (16, 41.0)])  # a skewed router reads fewer experts than uniform
    assert measured.experts_read(8) == pytest.approx(8 + (41 - 8) * 7 / 15)
    assert measured.experts_read(64) == pytest.approx(128 * (1 - (1 - 41 / 128) ** 4))  # the last point's miss rate
    assert measured.experts_read(100000) == pytest.approx(128)


def test_routing_curve_counts_distinct_experts(pair):
    from specjax.planning.profile import routing_curve

    _, _, target = pair
    prompts = np.random.default_rng(8).integers(3, 256, size=(3, 40)).tolist()
    curve = dict(routing_curve(target, prompts))
    assert curve[1] == 2.0 and max(curve) == 64  # 120 routed tokens: passes up to 64
    assert all(curve[a] <= curve[b] <= 8 for a, b in zip(sorted(curve), sorted(curve)[1:]))


def test_plan_moe_vs_dense_from_the_command_line(capsys):
    """`specjax plan --model-only --moe`: at concurrency 1 the MoE's best draft is far shorter than the dense model's
    (verifying more tokens reads more experts); at 64 it is longer (a batch already reads every expert)."""
    from specjax.cli import main

    assert main(["plan", "--model-only", "--moe", "--concurrency", "1,64", "--max-nodes", "64"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 64 |")][-2:]
    assert "shorter" in rows[0] and "longer" in rows[1], out
    assert "Qwen3-30B-A3B (30.5B, 3.35B active)" in out
