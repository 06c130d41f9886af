"""JetSpec (hao-ai-lab/JetSpec): its causal DFlash head and its one-pass tree, against JetSpec's own code.

The fixture in tests/fixtures/jetspec/causal was written by scripts/make_jetspec_fixtures.py from a fetched
JetSpec checkout (commit in meta.json): a tiny random head with `dflash_config.causal_head` true in the
published heads' config layout (8 layers), JetSpec's per-depth draft logits from one head pass, the tree its
`accum_logp` builds from them, the path its `tree_accept` takes given the target's logits at every node, and
the next round's logits after the accepted path's features became context. specjax reads the head with its
DFlash reader and drives it through the Drafter protocol with `tree="dynamic:..."`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dflash import split_taps, target_config

from specjax.config import SamplingConfig
from specjax.convert.dflash import dflash_config, load_dflash
from specjax.decoding.block_tree import build_block_tree, per_depth_children
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import DynamicTreeSpec, ancestor_mask
from specjax.decoding.verify import verify_greedy
from specjax.drafters import DFlashDrafter
from specjax.drafters.dflash import backbone, drafter_params, tables

FIXTURE = Path(__file__).parent / "fixtures" / "jetspec" / "causal"
ATOL = 1e-5  # relative to the largest |logit| (the favoured tokens' logits reach ~300: fp32 rounds at ~3e-5)
SPEC = DynamicTreeSpec(top_k=3, depth=4, total_tokens=20)  # JetSpec's width 3, budget 20, block_size 6 (5 depths)


@pytest.fixture(scope="module")
def io():
    return dict(np.load(FIXTURE / "io.npz"))


def head(io, cfg=None) -> DFlashDrafter:
    read_cfg, host = load_dflash(FIXTURE, target_config())
    block = jax.tree.map(jnp.asarray, host)
    target = {"embed": jnp.asarray(io["target_embed"]), "lm_head": jnp.asarray(io["target_lm_head"].T)}
    settings = Settings(SPEC, SamplingConfig(), cache_len=48, max_new_tokens=16, record_logits=True)
    return DFlashDrafter(cfg or read_cfg, drafter_params(block, target, False, per_layer=False),
                         attn_impl="xla").configure(settings)


def close(got, want, what: str):
    got, want = np.asarray(got), np.asarray(want)
    diff, scale = float(np.max(np.abs(got - want))), max(1.0, float(np.max(np.abs(want))))
    assert diff <= ATOL * scale, f"{what}: max |specjax - JetSpec| {diff:.2e} > {ATOL:g} x {scale:.1f}"


def block_logits(drafter, state, root):
    vocab = tables(drafter.cfg, drafter.params)
    h, _ = backbone(drafter.cfg, drafter.params).block_hidden(vocab.block_embeddings(root), state, attn_impl="xla")
    return np.asarray(vocab.logits(h[:, 1:]))


@pytest.fixture(scope="module")
def rounds(io):
    """Round 1 (propose a tree, verify it against the fixture's node logits), the update, round 2's logits."""
    drafter = head(io)
    params = drafter.params
    prompt = jnp.asarray(io["prompt_ids"])
    b, t = prompt.shape
    root = jnp.asarray(io["r1_anchor"])
    state = drafter.init(params, PrefillContext(prompt, jnp.full((b,), t, jnp.int32), root,
                                                split_taps(io["r1_features"])))
    draft, state1 = jax.jit(drafter.propose)(params, state, root, None)
    verdict = verify_greedy(draft, ancestor_mask(draft.parents), jnp.asarray(io["r1_target_logits"]))
    feats = np.random.default_rng(0).normal(size=(b, SPEC.total_tokens, io["r2_features"].shape[-1]))
    for row in range(b):  # the accepted nodes' features are the fixture's; the others are junk
        a = int(io["r1_accepted"][row]) + 1
        feats[row, io["r1_path"][row, :a]] = io["r2_features"][row, :a]
    state2 = drafter.update(params, state1, draft, verdict, split_taps(feats.astype(np.float32)))
    root2 = verdict.bonus
    return drafter, state, draft, verdict, state2, root2


def test_head_forward_matches_jetspec(rounds, io):
    drafter, state, *_ = rounds
    assert drafter.cfg.causal and drafter.cfg.layers.num_layers == 8
    close(block_logits(drafter, state, jnp.asarray(io["r1_anchor"])), io["r1_logits"], "round-1 draft logits")


def test_tree_matches_jetspecs_accum_logp(rounds, io):
    _, _, draft, *_ = rounds
    np.testing.assert_array_equal(draft.tokens, io["r1_tokens"])
    np.testing.assert_array_equal(draft.parents, io["r1_parents"])
    # The construction alone, from JetSpec's own logits: the same tree and its cumulative log-probabilities.
    lp = jax.nn.log_softmax(jnp.asarray(io["r1_logits"]), -1)
    tree = build_block_tree(SPEC, jnp.asarray(io["r1_anchor"]), per_depth_children(lp, SPEC.top_k))
    np.testing.assert_array_equal(tree.tokens, io["r1_tokens"])
    np.testing.assert_array_equal(tree.depths, io["r1_depths"])
    close(tree.scores, io["r1_scores"], "cumulative log-probabilities")
    # Recorded logits: each node's depth's distribution, JetSpec's draft_logits row depth - 1.
    depth = io["r1_depths"]
    want = np.take_along_axis(io["r1_logits"], np.maximum(depth - 1, 0)[:, :, None], axis=1)
    close(np.asarray(draft.logits)[:, 1:], want[:, 1:], "node logits")


def test_accepted_path_matches_jetspecs_tree_accept(rounds, io):
    _, _, _, verdict, _, root2 = rounds
    np.testing.assert_array_equal(verdict.num_accepted, io["r1_accepted"] + 1)
    np.testing.assert_array_equal(verdict.path, io["r1_path"])
    np.testing.assert_array_equal(root2, io["r1_correction"])


def test_next_round_after_the_accepted_path_matches_jetspec(rounds, io):
    drafter, _, _, verdict, state2, root2 = rounds
    np.testing.assert_array_equal(state2.lengths, io["prompt_ids"].shape[1] + io["r1_accepted"] + 1)
    close(block_logits(drafter, state2, root2), io["r2_logits"], "round-2 draft logits")


def test_ignoring_causal_head_would_change_the_drafts(rounds, io):
    """The flag is read into the mask: the same weights without it give other logits."""
    import dataclasses

    drafter, state, *_ = rounds
    bidirectional = head(io, dataclasses.replace(drafter.cfg, causal=False))
    got = block_logits(bidirectional, state, jnp.asarray(io["r1_anchor"]))
    assert np.max(np.abs(got - io["r1_logits"])) > 1e-2


def test_the_published_heads_config_layout_is_read():
    """JetSpec/jetspec-Qwen3.6-35B-A3B's config.json essentials (8 layers, taps 1,10,19,28,37, mask 248070)."""
    from specjax.config import ModelConfig

    hf = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
          "block_size": 16, "dflash_config": {"causal_head": True, "mask_token_id": 248070,
                                              "target_layer_ids": [1, 10, 19, 28, 37]},
          "dtype": "bfloat16", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 8,
          "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_target_layers": 40,
          "vocab_size": 248320, "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
          "rms_norm_eps": 1e-6}
    target = ModelConfig(vocab_size=248320, hidden_size=2048, intermediate_size=512, num_layers=40, num_heads=16,
                         num_kv_heads=2, head_dim=256)
    cfg = dflash_config(hf, target)
    assert cfg.causal and cfg.block_size == 16 and cfg.mask_token_id == 248070
    assert cfg.layers.num_layers == 8 and cfg.feature_layers == (2, 11, 20, 29, 38)
    assert cfg.layers.rope.theta == 1e7 and cfg.layers.dtype == "bfloat16"
    from specjax.convert.export import dflash_hf_config

    assert dflash_config(dflash_hf_config(cfg, 40), target).causal  # exported in JetSpec's key, read back
    with pytest.raises(ValueError, match="causal_head is 'yes'"):
        dflash_config({**hf, "dflash_config": {**hf["dflash_config"], "causal_head": "yes"}}, target)
    with pytest.raises(ValueError, match="HiddenDimAdapter"):
        dflash_config({**hf, "dflash_config": {**hf["dflash_config"], "target_hidden_size": 4096}}, target)
