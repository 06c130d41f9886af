"""speculators-format DSpark (vllm-project/speculators `DSparkDraftModel`): sample_from_anchor, a pruned draft
vocabulary with d2t, Markov and confidence heads.

tests/fixtures/dspark_speculators was run and saved by speculators' own code
(scripts/make_dspark_speculators_fixtures.py, commit in meta.json): every anchor's block of its training forward,
teacher-forced (slot k's Markov bias from the block token before it), recorded before the loss. specjax reads it into
the target's vocabulary and must give the same hidden states, the same logits at the draft ids (-inf elsewhere) and
the same confidences, then decode losslessly on a tiny target.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_eagle3_layouts import target_config
from test_eagle3_layouts import plain, prompts, target  # noqa: F401 (module-scope fixtures: a 7-layer llama, V 128)

import specjax
from specjax.config import SamplingConfig
from specjax.convert.dspark_speculators import load_speculators_dspark
from specjax.convert.export import export_dspark
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import chain
from specjax.drafters import dspark
from specjax.drafters.dspark import DSparkDrafter
from specjax.loading.drafter import drafter_family

FIXTURE = Path(__file__).parent / "fixtures" / "dspark_speculators"
ATOL = 1e-5


@pytest.fixture(scope="module")
def loaded():
    cfg, block, heads = load_speculators_dspark(FIXTURE, target_config(), "float32")
    params = dspark.drafter_params(jax.tree.map(jnp.asarray, block), jax.tree.map(jnp.asarray, heads), per_layer=True)
    return cfg, params, dict(np.load(FIXTURE / "io.npz"))


def test_config_is_read_as_speculators_writes_it(loaded):
    cfg, params, _ = loaded
    assert drafter_family(FIXTURE) == "dspark"
    assert cfg.block.feature_layers == (1, 3, 5) and cfg.block.target_layer_ids == (0, 2, 4)  # vLLM's numbering
    assert (cfg.block_size, cfg.markov_rank, cfg.draft_vocab_size) == (4, 8, 64)
    assert cfg.confidence and cfg.confidence_with_markov and cfg.block.mask_token_id == 127
    assert params["lm_head"].shape == (32, 128) and int(jnp.isfinite(params["vocab_mask"]).sum()) == 64


def test_every_block_matches_speculators(loaded):
    """Each anchor p: context rows 0..p-1, block [x_p, MASK x 3] at positions p..p+3; the final-normed hidden states,
    the Markov-biased logits (bias from x_{p+k} at slot k) at the draft ids, and the confidence logits."""
    cfg, params, io = loaded
    anchors, ids = io["anchors"], io["input_ids"][0]
    a, t, h = len(anchors), ids.shape[0], cfg.block.hidden_size
    drafter = DSparkDrafter(cfg, params, attn_impl="xla").configure(
        Settings(chain(cfg.block_size), SamplingConfig(), 32, 16))
    feats = tuple(jnp.broadcast_to(jnp.asarray(io["features_BTF"][:, :, i * h:(i + 1) * h]), (a, t, h))
                  for i in range(cfg.block.num_taps))
    root_A = jnp.asarray(ids[anchors], jnp.int32)
    ctx = PrefillContext(jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (a, t)), jnp.asarray(anchors, jnp.int32),
                         root_A, feats)
    state = drafter.init(params, ctx)
    net = dspark.networks(cfg, params)
    h_AGH, _ = net.backbone.block_hidden(net.tables.block_embeddings(root_A), state, attn_impl="xla")
    np.testing.assert_allclose(h_AGH, io["hidden"], atol=ATOL, rtol=0)
    prev_AG = jnp.asarray(ids[anchors[:, None] + np.arange(cfg.block_size)], jnp.int32)  # sample_from_anchor
    u_AGV = net.tables.logits(h_AGH)
    g, v = cfg.block_size, cfg.block.layers.vocab_size
    logits_AGV = net.markov(u_AGV.reshape(a * g, v), prev_AG.reshape(-1)).reshape(a, g, v)
    draft_ids = np.nonzero(np.isfinite(np.asarray(params["vocab_mask"])))[0]  # sorted, as d2t's target ids are
    np.testing.assert_allclose(logits_AGV[..., draft_ids], io["logits"], atol=ATOL, rtol=0)
    assert not np.isfinite(np.delete(np.asarray(logits_AGV), draft_ids, axis=-1)).any()
    np.testing.assert_allclose(net.confidence_logits(h_AGH, prev_AG), io["confidence_logits"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("tree", ["chain:4", "dynamic:top_k=2,depth=3,total_tokens=8"])
def test_greedy_speculative_equals_plain(target, prompts, plain, tree):  # noqa: F811
    drafter = specjax.load_drafter(FIXTURE, target)
    assert isinstance(drafter, DSparkDrafter) and drafter.cfg.draft_vocab_size == 64
    out = specjax.generate(target, prompts, max_new_tokens=16, eos_token_id=[], drafter=drafter, tree=tree)
    assert out.tokens == plain.tokens and out.stats["rounds"] > 0


def test_drafts_stay_in_the_draft_vocabulary(target, prompts):  # noqa: F811
    drafter = specjax.load_drafter(FIXTURE, target)
    allowed = set(np.nonzero(np.isfinite(np.asarray(drafter.params["vocab_mask"])))[0].tolist())
    for prompt in prompts:
        d = specjax.inspect_draft(target, drafter, prompt, num_draft_tokens=4)
        assert set(np.asarray(d.tokens).tolist()) <= allowed


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(sample_from_anchor=False), r"sample_from_anchor false"),
    (lambda c: c.update(markov_head_type="rnn"), r"markov_head_type is 'rnn'"),
    (lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention"], sliding_window=4),
     r"sliding"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[1, 3, 7]), r"\[7\] outside the target's layers"),
    (lambda c: c.update(mask_token_id=128), r"mask_token_id 128 is outside"),
])
def test_what_is_not_implemented_or_does_not_fit_is_refused(change, match, tmp_path):
    head = tmp_path / "head"
    shutil.copytree(FIXTURE, head)
    config = json.loads((head / "config.json").read_text())
    change(config)
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_speculators_dspark(head, target_config())


def test_export_to_deepspecs_format_is_refused(loaded, tmp_path):
    cfg, params, _ = loaded
    with pytest.raises(ValueError, match=r"pruned vocabulary of 64 tokens .* DeepSpec's format cannot hold"):
        export_dspark(cfg, params, tmp_path / "x", num_target_layers=7)
