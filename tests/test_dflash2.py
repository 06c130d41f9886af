"""DFlash2: parity with z-lab's own DFlash2 code, the checkpoint reader's checks, lossless decoding.

The fixture in tests/fixtures/dflash2/basic was written by scripts/make_dflash2_fixtures.py from z-lab's code
(z-lab/vllm-fork's qwen3_dflash2.py: the convolutions, candidates and selector; z-lab/dflash's model.py: the
attention layers; sources in meta.json): a tiny random DFlash2 head (a sliding-window layer, then a full one) saved
in z-lab's tensor names, the target's tables, the context features, and z-lab's head output, candidates, selector
scores and greedy walk. The head is read back through `load_drafter`'s reader and driven through the Drafter
protocol, so parity covers the reader and the tap numbering too.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_dflash import favoured_target, split_taps, target_config
from test_lossless_sampling import NEW, PROMPT, ROWS, VOCAB, chi_square_passes, exact_distribution, tiny

import specjax
from specjax.config import SamplingConfig
from specjax.convert.dflash import load_dflash
from specjax.convert.dflash2 import load_dflash2
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import chain
from specjax.drafters.dflash import BlockConfig, backbone, drafter_params, init_params, tables
from specjax.drafters.dflash2 import DFlash2Drafter, DFlash2Head, block_hidden, conv_prepare, grouped_conv, \
    head_param_shapes
from specjax.loading.drafter import dflash2_drafter, load_drafter

FIXTURE = Path(__file__).parent / "fixtures" / "dflash2" / "basic"
ATOL = 1e-5
K = 4  # drafts per round: block_size 5 - 1


@pytest.fixture(scope="module")
def io():
    return dict(np.load(FIXTURE / "io.npz"))


@pytest.fixture(scope="module")
def round1(io):
    """The fixture head over the fixture target's tables: one block pass through init / score / propose (jitted)."""
    cfg, head, host = load_dflash2(FIXTURE, target_config())
    tables_ = {"embed": jnp.asarray(io["target_embed"]), "lm_head": jnp.asarray(io["target_lm_head"].T)}
    params = drafter_params(jax.tree.map(jnp.asarray, host), tables_, tie_word_embeddings=False, per_layer=True)
    settings = Settings(chain(K), SamplingConfig(), cache_len=32, max_new_tokens=16, record_logits=True)
    drafter = DFlash2Drafter(cfg, params, attn_impl="xla", head=head).configure(settings)
    prompt = jnp.asarray(io["prompt_ids"])
    b, t = prompt.shape
    root = jnp.asarray(io["anchor"])
    state = jax.jit(drafter.init)(params, PrefillContext(prompt, jnp.full((b,), t, jnp.int32), root,
                                                         split_taps(io["features"])))
    hidden = jax.jit(lambda p, s: block_hidden(backbone(cfg, p), head, p, tables(cfg, p).block_embeddings(root),
                                               s)[0])(params, state)
    scores, ids, _ = jax.jit(drafter.score)(params, state, root)
    draft, _ = jax.jit(drafter.propose)(params, state, root, None)
    return drafter, state, hidden, scores, ids, draft


def test_convolution_matches_z_labs(io, round1):
    drafter = round1[0]
    p, gs = drafter.params, drafter.head.conv_group_size
    x = jnp.asarray(io["conv_x"]).reshape(2, 5, -1)  # z-lab's flat rows, two blocks of 5
    out0, coef1 = conv_prepare(x, p["attn_conv_base"][0], p["attn_conv_proj"][0], gs)
    np.testing.assert_allclose(out0.reshape(10, -1), io["conv_out0"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(coef1.reshape(io["conv_coef1"].shape), io["conv_coef1"], atol=ATOL, rtol=0)
    flipped = jnp.asarray(io["conv_x"][::-1].copy()).reshape(2, 5, -1)
    out1 = grouped_conv(flipped, coef1, p["attn_conv_base"][0][1], gs)
    np.testing.assert_allclose(out1.reshape(10, -1), io["conv_out1"], atol=ATOL, rtol=0)


def test_head_candidates_selector_and_walk_match_z_labs(io, round1):
    _, _, hidden, scores, ids, draft = round1
    np.testing.assert_allclose(hidden, io["hidden"], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(ids, io["ids"])
    np.testing.assert_allclose(scores, io["scores"], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(draft.tokens[:, 0], io["anchor"])
    np.testing.assert_array_equal(draft.tokens[:, 1:], io["drafts"])
    # the walk is the selector's, not the unary argmax: the fixture's rows differ somewhere
    assert not np.array_equal(io["drafts"], io["ids"][:, :, 0])
    # the recorded distribution is each pick's selector row, -inf off the candidates
    np.testing.assert_array_equal(np.argmax(draft.logits[:, 1:], -1), io["drafts"])
    assert np.isinf(draft.logits[:, 1:]).sum(-1).min() == 128 - 6


def test_the_window_and_the_convolutions_matter(io, round1):
    """Reading the head without its sliding window or with its convolutions off would not match z-lab's output."""
    drafter, state, hidden = round1[:3]
    root = jnp.asarray(io["anchor"])
    emb = tables(drafter.cfg, drafter.params).block_embeddings(root)
    bb = backbone(drafter.cfg, drafter.params)
    full = dataclasses.replace(drafter.head, sliding_windows=(None, None))
    assert np.abs(block_hidden(bb, full, drafter.params, emb, state)[0] - hidden).max() > 1e-3
    flat = {**drafter.params, "attn_conv_proj": jnp.zeros_like(drafter.params["attn_conv_proj"])}
    assert np.abs(block_hidden(bb, drafter.head, flat, emb, state)[0] - hidden).max() > 1e-3


# ---- the reader --------------------------------------------------------------------------------------------------


def rewrite(tmp_path: Path, edit=None, tensors=None) -> Path:
    """A copy of the fixture checkpoint with config.json changed by edit(dict) and/or tensors by tensors(dict)."""
    out = tmp_path / "head"
    shutil.copytree(FIXTURE, out)
    if edit is not None:
        hf = json.loads((out / "config.json").read_text())
        edit(hf)
        (out / "config.json").write_text(json.dumps(hf))
    if tensors is not None:
        state = load_file(out / "model.safetensors")
        tensors(state)
        save_file(state, out / "model.safetensors")
    return out


def test_the_reader_reads_every_field():
    cfg, head, _ = load_dflash2(FIXTURE, target_config())
    assert head == DFlash2Head(conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=6,
                               sliding_windows=(6, None), final_logit_softcapping=5.0, output_multiplier=0.8,
                               input_embedding_scale=1.5)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids, cfg.causal) == (5, 127, (0, 2, 4), False)


@pytest.mark.parametrize("edit, words", [
    (lambda hf: hf["dflash_config"].pop("selector_rank"), "selector_rank is None"),
    (lambda hf: hf["dflash_config"].update(conv_group_size=5), "conv_group_size=5 does not divide"),
    (lambda hf: hf.pop("is_causal"), "mixes sliding .* and full"),
    (lambda hf: hf.update(sliding_window=3), "window 3 is shorter than its block"),
    (lambda hf: hf.update(layer_types=["sliding_attention", "chunked"]), "each must be 'full_attention'"),
    (lambda hf: hf.pop("layer_types") and hf.update(use_sliding_window=True), "use_sliding_window with no layer_types"),
], ids=["no-selector", "group", "mixed-causal", "window", "layer-type", "qwen-window"])
def test_misfits_are_refused_with_what_would_fit(tmp_path, edit, words):
    with pytest.raises(ValueError, match=words):
        load_dflash2(rewrite(tmp_path, edit), target_config())


def test_missing_or_misshapen_head_tensors_and_dflash_loading_are_refused(tmp_path):
    with pytest.raises(ValueError, match="lacks tensor 'candidate_selector.successor_codebook'"):
        load_dflash2(rewrite(tmp_path / "a", tensors=lambda s: s.pop("candidate_selector.successor_codebook")),
                     target_config())
    with pytest.raises(ValueError, match="'layers.1.mlp_conv.base_kernel' has shape"):
        load_dflash2(rewrite(tmp_path / "b", tensors=lambda s: s.update(
            {"layers.1.mlp_conv.base_kernel": np.zeros((2, 2, 32), np.float32)})), target_config())
    with pytest.raises(ValueError, match="is a DFlash2 drafter .*would be dropped as DFlash"):
        load_dflash(FIXTURE, target_config())


# ---- decoding ------------------------------------------------------------------------------------------------


MAX_NEW = 23


@pytest.fixture(scope="module")
def target():
    return favoured_target()  # its lm_head favours tokens 3, 4, 5, so drafts get accepted


@pytest.fixture(scope="module")
def drafter(target):
    return load_drafter(FIXTURE, target)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(6, 127, size=n).tolist() for n in (5, 17, 1)]


@pytest.fixture(scope="module")
def plain(target, prompts):
    return specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])


def test_load_drafter_detects_dflash2(target, drafter):
    assert isinstance(drafter, DFlash2Drafter) and drafter.params["embed"] is target.params["embed"]
    assert repr(drafter) == ("DFlash2Drafter(layers=2, block_size=5, taps=[1, 3, 5], conv=3x8, selector=top6/rank8, "
                             "hidden=32, vocab=128, dtype=float32)")


@pytest.mark.parametrize("tree", [f"chain:{K}", "dynamic:top_k=3,depth=3,total_tokens=16", "kary:3,2,1"])
def test_greedy_equals_plain(target, drafter, prompts, plain, tree):
    """The selector's walk (a chain) or a selector tree from one pass: plain decoding's tokens, drafts accepted."""
    kw = {"num_draft_tokens": K} if tree.startswith("chain") else {"tree": tree}
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter, **kw)
    assert out.tokens == plain.tokens
    assert out.stats["acceptance_length"] > 1.3
    assert out.stats["drafter_calls"] == out.stats["rounds"]


def test_a_tree_wider_than_the_candidates_is_refused(target, drafter, prompts):
    with pytest.raises(ValueError, match="selector_top_k=6 candidates a row"):
        specjax.generate(target, prompts, max_new_tokens=4, drafter=drafter, tree="dynamic:top_k=7,depth=2,"
                         "total_tokens=8")


def random_head(target, key) -> DFlash2Drafter:
    """A random 2-layer DFlash2 head (one sliding layer) for `target`, every weight mattering."""
    layers = dataclasses.replace(target.cfg, num_layers=2, qk_norm=True)
    cfg = BlockConfig(layers=layers, target_layer_ids=(0,), block_size=3, mask_token_id=VOCAB - 1)
    head = DFlash2Head(conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4,
                       sliding_windows=(4, None), final_logit_softcapping=10.0)
    k1, k2 = jax.random.split(key)
    params = drafter_params(init_params(cfg, k1), target.params, False, per_layer=True)
    for (name, shape), k in zip(head_param_shapes(cfg, head).items(), jax.random.split(k2, 8)):
        params[name] = jax.random.normal(k, shape) * shape[-2] ** -0.5 + (1.0 if "base" in name else 0.0)
    params["final_norm"] = params["final_norm"] * 4.0  # sharper draft logits, like the target's
    return DFlash2Drafter(cfg, params, attn_impl="xla", head=head)


def test_sampled_dflash2_output_has_the_target_distribution():
    """The walk drawn at temperature 1 (z-lab's sampled walk, its distribution as q) verified by rejection sampling
    keeps the target's distribution exactly."""
    target = tiny(0, layers=2)
    sampling = SamplingConfig(1.0)
    out = specjax.generate(target, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=1.0, seed=17,
                           drafter=random_head(target, jax.random.key(5)), num_draft_tokens=2, eos_token_id=[])
    ok, stat, threshold = chi_square_passes(np.array(out.tokens), exact_distribution(target, sampling))
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}: sampled output is not the target's distribution"
    assert out.stats["acceptance_length"] > 1.0


def test_dflash2_drafter_is_built_by_its_loader(target):
    assert isinstance(dflash2_drafter(FIXTURE, target), DFlash2Drafter)
