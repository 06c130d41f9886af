"""DFlash: parity with the original PyTorch drafter, the checkpoint reader's checks, lossless decoding.

The fixture in tests/fixtures/dflash/basic was written by scripts/make_dflash_fixtures.py from
z-lab/dflash's dflash/model.py (commit in meta.json): a tiny random drafter saved in the z-lab
checkpoint format, the target's embedding / lm_head, the context features, and the original's
block logits and draft cache for round 1 and, after 0, 2 and all 4 drafts were accepted, round 2.
The drafter is read back through specjax's checkpoint reader and driven through the Drafter
protocol (init / propose / update), so parity covers the reader, the context cache bookkeeping
and the tap numbering too.
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
from test_lossless_sampling import NEW, PROMPT, ROWS, VOCAB, chi_square_passes, exact_distribution, tiny

import specjax
from specjax.config import ModelConfig, RopeConfig, SamplingConfig
from specjax.convert.dflash import default_target_layer_ids, dflash_config, load_dflash
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import chain
from specjax.decoding.verify import Verdict
from specjax.drafters import DFlashDrafter
from specjax.drafters.dflash import BlockConfig, backbone, drafter_params, init_params, tables
from specjax.loading.drafter import dflash_drafter, load_drafter
from specjax.models.model import init_params as init_target_params
from specjax.models.target import Target

FIXTURE = Path(__file__).parent / "fixtures" / "dflash" / "basic"
ATOL = 1e-5
ACCEPTED = (0, 2, 4)
K = 4  # drafts per round in the fixture: block_size 5 - 1


def target_config(**overrides) -> ModelConfig:
    """The fixture's target: Qwen3, 6 layers, hidden 32, vocabulary 128."""
    fields = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4, num_kv_heads=2,
                  head_dim=16, qk_norm=True, family="qwen3", rope=RopeConfig(theta=1e6))
    return ModelConfig(**{**fields, **overrides})


def split_taps(features_BTF: np.ndarray, n: int = 3) -> tuple[jax.Array, ...]:
    """The original's concatenated context features as specjax's per-tap [B, T, H] arrays."""
    return tuple(jnp.asarray(f) for f in np.split(features_BTF, n, axis=-1))


def cache_rows(cache, t: int) -> tuple[np.ndarray, np.ndarray]:
    """The first t cache rows of every layer in the original's layout [L, B, Hkv, T, D]."""
    def rows(buf):
        stacked = np.stack([np.asarray(b) for b in buf]) if isinstance(buf, tuple) else np.asarray(buf)
        return stacked[:, :, :t].transpose(0, 1, 3, 2, 4)
    return rows(cache.k), rows(cache.v)


@pytest.fixture(scope="module")
def io():
    return dict(np.load(FIXTURE / "io.npz"))


def fixture_drafter(io, per_layer: bool, record_logits: bool = True) -> DFlashDrafter:
    """The fixture checkpoint as a configured DFlashDrafter over the fixture target's embed / lm_head."""
    cfg, host = load_dflash(FIXTURE, target_config())
    block = jax.tree.map(jnp.asarray, host)
    target = {"embed": jnp.asarray(io["target_embed"]), "lm_head": jnp.asarray(io["target_lm_head"].T)}
    params = drafter_params(block, target, tie_word_embeddings=False, per_layer=per_layer)
    settings = Settings(chain(K), SamplingConfig(), cache_len=32, max_new_tokens=16, record_logits=record_logits)
    return DFlashDrafter(cfg, params, attn_impl="xla").configure(settings)


@pytest.fixture(scope="module", params=["per_layer", "stacked"])
def rounds(request, io):
    """Round 1 and, for each accepted count, round 2, run through init / propose / update (jitted: few compiles)."""
    drafter = fixture_drafter(io, per_layer=request.param == "per_layer")
    params = drafter.params
    init, propose, update = jax.jit(drafter.init), jax.jit(drafter.propose), jax.jit(drafter.update)
    prompt = jnp.asarray(io["prompt_ids"])
    b, t = prompt.shape
    root = jnp.asarray(io["r1_anchor"])
    state = init(params, PrefillContext(prompt, jnp.full((b,), t, jnp.int32), root,
                                                split_taps(io["r1_features"])))
    draft1, state1 = propose(params, state, root, None)
    hidden1, _ = jax.jit(lambda params, state: backbone(drafter.cfg, params).block_hidden(
        tables(drafter.cfg, params).block_embeddings(root), state, attn_impl="xla"))(params, state)
    second = {}
    rng = np.random.default_rng(0)
    for a in ACCEPTED:
        feats = io[f"a{a}_features"]  # [B, a + 1, 3H]: the anchor and the accepted drafts
        junk = rng.normal(size=(b, K + 1 - (a + 1), feats.shape[-1])).astype(np.float32)  # unaccepted nodes
        node_feats = split_taps(np.concatenate([feats, junk], axis=1))
        path = jnp.asarray(np.where(np.arange(K + 1) <= a, np.arange(K + 1), 0)[None].repeat(b, 0), jnp.int32)
        anchor2 = jnp.asarray(io[f"a{a}_anchor"])
        verdict = Verdict(path, jnp.full((b,), a + 1, jnp.int32), anchor2)
        state2 = update(params, state1, draft1, verdict, node_feats)
        draft2, _ = propose(params, state2, anchor2, None)
        second[a] = (draft2, state2)
    return request.param, drafter, draft1, state1, hidden1, second


def test_round1_matches_the_original(rounds, io):
    layout, _, draft1, state1, hidden1, _ = rounds
    t = io["prompt_ids"].shape[1]
    np.testing.assert_allclose(hidden1, io["r1_hidden"], atol=ATOL, rtol=0, err_msg=layout)
    np.testing.assert_allclose(draft1.logits[:, 1:], io["r1_logits"], atol=ATOL, rtol=0, err_msg=layout)
    np.testing.assert_array_equal(draft1.tokens[:, 0], io["r1_anchor"])
    np.testing.assert_array_equal(draft1.tokens[:, 1:], io["r1_drafts"])
    k, v = cache_rows(state1, t)
    np.testing.assert_allclose(k, io["r1_k"], atol=ATOL, rtol=0, err_msg=layout)
    np.testing.assert_allclose(v, io["r1_v"], atol=ATOL, rtol=0, err_msg=layout)
    assert np.all(np.asarray(state1.lengths) == t)


@pytest.mark.parametrize("a", ACCEPTED)
def test_round2_after_accepting_a_drafts_matches_the_original(rounds, io, a):
    layout, _, _, _, _, second = rounds
    draft2, state2 = second[a]
    t = io["prompt_ids"].shape[1]
    msg = f"{layout}, {a} accepted"
    assert np.all(np.asarray(state2.lengths) == t + a + 1)
    np.testing.assert_allclose(draft2.logits[:, 1:], io[f"a{a}_logits"], atol=ATOL, rtol=0, err_msg=msg)
    np.testing.assert_array_equal(draft2.tokens[:, 1:], io[f"a{a}_drafts"])
    k, v = cache_rows(state2, t + a + 1)
    np.testing.assert_allclose(k, io[f"a{a}_k"], atol=ATOL, rtol=0, err_msg=msg)
    np.testing.assert_allclose(v, io[f"a{a}_v"], atol=ATOL, rtol=0, err_msg=msg)


def test_update_projects_only_the_accepted_rows(rounds, io):
    """Committed context rows are left bit for bit; only rows P .. P+a-1 are written (never the whole prefix)."""
    _, _, _, state1, _, second = rounds
    t = io["prompt_ids"].shape[1]
    for a in ACCEPTED:
        _, state2 = second[a]
        before, after = cache_rows(state1, t + K + 1), cache_rows(state2, t + K + 1)
        for old, new in zip(before, after):
            np.testing.assert_array_equal(new[:, :, :, :t], old[:, :, :, :t])
            assert not np.allclose(new[:, :, :, t:t + a + 1], old[:, :, :, t:t + a + 1])


def test_update_has_no_matmul_over_the_cache_length(io):
    """The update pass's matrix products run over the N verified nodes, never over the cache's S rows."""
    drafter = fixture_drafter(io, per_layer=True)
    b, n, s = 2, K + 1, 80  # S chosen so no weight or activation dimension equals it
    state = backbone(drafter.cfg, drafter.params).init_cache(b, s)
    feats = tuple(jnp.zeros((b, n, 32)) for _ in range(3))
    draft, _ = drafter.propose(drafter.params, state, jnp.zeros((b,), jnp.int32), None)
    verdict = Verdict(jnp.zeros((b, n), jnp.int32), jnp.ones((b,), jnp.int32), jnp.zeros((b,), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda st: drafter.update(drafter.params, st, draft, verdict, feats))(state)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots, "expected the context projections in the update pass"
    for e in dots:
        for var in e.invars:
            assert s not in var.aval.shape, f"update multiplies an operand of shape {var.aval.shape} (cache length {s})"


# ---- loading -------------------------------------------------------------------------------------------------


def rewrite(tmp_path: Path, edit) -> Path:
    """A copy of the fixture checkpoint with config.json changed by edit(dict)."""
    dst = tmp_path / "dflash"
    shutil.copytree(FIXTURE, dst)
    hf = json.loads((dst / "config.json").read_text())
    edit(hf)
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def newer_style(hf: dict) -> None:
    """The newer config layout: block_size inside dflash_config, rope_parameters instead of rope_theta."""
    hf["dflash_config"]["block_size"] = hf.pop("block_size")
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}


def test_both_config_styles_give_the_same_drafter(tmp_path):
    old_cfg, old = load_dflash(FIXTURE, target_config())
    new_cfg, new = load_dflash(rewrite(tmp_path, newer_style), target_config())
    assert new_cfg == old_cfg
    assert old_cfg.block_size == 5 and old_cfg.mask_token_id == 127 and old_cfg.target_layer_ids == (0, 2, 4)
    assert old_cfg.feature_layers == (1, 3, 5) and old_cfg.layers.rope.theta == 1e6 and old_cfg.layers.head_dim == 16
    jax.tree.map(np.testing.assert_array_equal, new, old)


def test_default_taps_follow_the_original():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B, 5 draft layers (REFERENCE.md)
    assert default_target_layer_ids(36, 1) == (18,)


def test_default_taps_when_the_config_names_none(tmp_path):
    src = rewrite(tmp_path, lambda hf: hf["dflash_config"].pop("target_layer_ids"))
    hf = json.loads((src / "config.json").read_text())
    assert dflash_config(hf, target_config()).target_layer_ids == (1, 3)  # 2 draft layers over 1 .. L-3
    with pytest.raises(ValueError, match=r"fc.weight.*\(32, 96\).*2 taps"):  # the checkpoint's fc takes 3 taps
        load_dflash(src, target_config())


def _set(path: str, value):
    """An edit that sets config.json field path ('a' or 'a.b') to value."""
    def edit(hf):
        *outer, last = path.split(".")
        node = hf
        for key in outer:
            node = node[key]
        node[last] = value
    return edit


@pytest.mark.parametrize("edit, target_overrides, words", [
    (_set("block_size", 1), {}, ["block_size is 1", ">= 2"]),
    (_set("dflash_config.mask_token_id", 128), {}, ["mask_token_id 128", "outside", "0..127"]),
    (_set("dflash_config.target_layer_ids", [0, 2, 5]), {}, ["[5]", "out of range", "0..4"]),
    (_set("dflash_config.target_layer_ids", [-1, 2]), {}, ["[-1]", "0..4"]),
    (_set("num_target_layers", 8), {}, ["num_target_layers=8", "has 6"]),
    (None, {"hidden_size": 64}, ["hidden_size is 32", "target's is 64"]),
    (None, {"vocab_size": 256}, ["vocab_size is 128", "256 tokens"]),
    (_set("dflash_config.block_size", 8), {}, ["block_size=5", "dflash_config.block_size=8"]),
    (_set("layer_types", ["full_attention", "sliding_attention"]), {}, ["sliding_attention", "full attention"]),
])
def test_misfits_are_refused_with_what_would_fit(tmp_path, edit, target_overrides, words):
    src = FIXTURE if edit is None else rewrite(tmp_path, edit)
    with pytest.raises(ValueError) as err:
        load_dflash(src, target_config(**target_overrides))
    for word in words:
        assert word in str(err.value), str(err.value)


def test_unaccounted_and_missing_tensors_are_refused(tmp_path):
    dst = rewrite(tmp_path, lambda hf: None)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": np.zeros((128, 32), np.float32)}, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'lm_head.weight'.*target's embedding and lm_head"):
        load_dflash(dst, target_config())
    save_file({k: v for k, v in tensors.items() if k != "layers.1.self_attn.k_norm.weight"},
              str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks tensor 'layers.1.self_attn.k_norm.weight'"):
        load_dflash(dst, target_config())


# ---- decoding ------------------------------------------------------------------------------------------------

MAX_NEW = 23  # ends mid-block for most rows


def favoured_target() -> Target:
    """A random 6-layer Qwen3 target the fixture drafters fit. Its lm_head favours tokens 3, 4, 5 (4 the most),
    the tokens the random fixture drafters tend to guess, so whole blocks as well as parts of blocks get
    accepted (tau about 1.5) and update's bookkeeping runs for every accepted count."""
    cfg = target_config()
    params = init_target_params(cfg, jax.random.key(0), scale=0.4)
    favour = jnp.full((cfg.vocab_size,), 0.01).at[3:6].set(jnp.array([50.0, 100.0, 50.0]))
    params["lm_head"] = params["lm_head"] * favour
    return Target(params, cfg, hf_config={}, attn_impl="xla")


@pytest.fixture(scope="module")
def target():
    return favoured_target()


@pytest.fixture(scope="module")
def drafter(target):
    return dflash_drafter(FIXTURE, target)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(6, 127, size=n).tolist() for n in (5, 17, 1)]


@pytest.fixture(scope="module")
def plain(target, prompts):
    return specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])


def test_load_drafter_detects_dflash(target, drafter):
    loaded = load_drafter(FIXTURE, target)
    assert isinstance(loaded, DFlashDrafter) and loaded.cfg == drafter.cfg
    assert loaded.params["embed"] is target.params["embed"] and loaded.params["lm_head"] is target.params["lm_head"]
    assert repr(loaded) == ("DFlashDrafter(layers=2, block_size=5, taps=[1, 3, 5], hidden=32, vocab=128, "
                            "dtype=float32, attn_impl=xla)")


def test_greedy_equals_plain_on_a_ragged_batch(target, drafter, prompts, plain):
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                           num_draft_tokens=K)
    assert out.tokens == plain.tokens
    assert out.stats["acceptance_length"] > 1.4  # several drafts accepted: update's bookkeeping is exercised
    assert out.stats["drafter_calls"] == out.stats["rounds"]


def test_greedy_equals_plain_with_eos_mid_block(target, drafter, prompts, plain):
    eos = 5  # first emitted at different offsets in each row, after runs of accepted 4s
    assert all(eos in t[1:] for t in plain.tokens)
    ref = [t[:t.index(eos, 1) + 1] for t in plain.tokens]  # plain decoding stops right after its first EOS
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[eos], drafter=drafter,
                           num_draft_tokens=3)
    assert out.tokens == ref
    assert all(len(t) < MAX_NEW and t[-1] == eos for t in out.tokens)
    assert out.stats["acceptance_length"] > 1.0


def test_chain_too_long_static_tree_or_tree_too_deep_is_refused(target, drafter, prompts):
    with pytest.raises(ValueError, match="at most 4 tokens.*num_draft_tokens <= 4"):
        specjax.generate(target, prompts, max_new_tokens=4, drafter=drafter, num_draft_tokens=5)
    with pytest.raises(ValueError, match="a tree 5 deep is more than one DFlash block gives"):
        specjax.generate(target, prompts, max_new_tokens=4, drafter=drafter, tree="kary:2,1,1,1,1")
    with pytest.raises(ValueError, match="reaches depth 5 .*pass depth <= 3"):
        specjax.generate(target, prompts, max_new_tokens=4, drafter=drafter,
                         tree="dynamic:top_k=2,depth=4,total_tokens=8")


@pytest.mark.parametrize("causal, tree", [(False, "dynamic:top_k=3,depth=3,total_tokens=16"),
                                         (True, "dynamic:top_k=3,depth=3,total_tokens=16"), (False, "kary:3,2,1")],
                         ids=["dynamic", "dynamic-causal_head", "static"])
def test_greedy_equals_plain_with_one_pass_trees(target, drafter, prompts, plain, causal, tree):
    """JetSpec's tree (or a static template) from one block pass (decoding/block_tree.py), verified as a tree: plain
    decoding's tokens; with the fixture's (bidirectional) head, more tokens a round than the chain of the block."""
    head = dataclasses.replace(drafter, cfg=dataclasses.replace(drafter.cfg, causal=causal))
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=head,
                           tree=tree)
    assert out.tokens == plain.tokens
    assert out.stats["drafter_calls"] == out.stats["rounds"]  # one block pass a round, whatever the tree
    if causal or tree.startswith("kary"):  # the same weights under a causal mask they were not made for: losslessness is the point
        return
    chain_tau = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=head,
                                 num_draft_tokens=K).stats["acceptance_length"]
    assert out.stats["acceptance_length"] > chain_tau


def test_auto_plans_chains_no_longer_than_a_block(target, drafter, prompts, plain, monkeypatch):
    """num_draft_tokens="auto" never asks a block drafter for more drafts than one block gives."""
    from specjax.planning import auto, planner

    seen = {}
    real_plan = planner.plan

    def spy(*args, **kwargs):
        seen["max_chain"] = kwargs["max_chain"]
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(auto, "plan", spy)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                           num_draft_tokens="auto")
    assert seen["max_chain"] == drafter.max_draft_tokens == K
    assert out.tokens == plain.tokens and out.stats["plan"]["kind"] in ("off", "chain")
    assert len(out.stats["plan"]["parents"] or []) <= K + 1


def test_inspect_draft_shows_dflash_tokens_and_logits(target, drafter, prompts):
    ins = specjax.inspect_draft(target, drafter, prompts[1], num_draft_tokens=K)
    assert ins.tokens.shape == (K,) and ins.logits.shape == (K, 128)
    np.testing.assert_array_equal(ins.tokens, ins.logits.argmax(-1))
    probs = jax.nn.softmax(jnp.asarray(ins.logits), axis=-1)
    np.testing.assert_allclose(ins.confidence, probs[jnp.arange(K), ins.tokens], rtol=1e-5)
    np.testing.assert_array_equal(ins.tree_parents, [-1, 0, 1, 2, 3])


# ---- losslessness of sampled decoding ------------------------------------------------------------------------


@pytest.mark.parametrize("tree", ["chain:2", "dynamic:top_k=2,depth=1,total_tokens=4"])
def test_sampled_dflash_output_has_the_target_distribution(tree):
    """Argmax drafts and one-pass top-k trees (q one-hot) verified by rejection sampling keep the target's
    distribution exactly."""
    target = tiny(0, layers=2)
    layers = dataclasses.replace(target.cfg, num_layers=2, qk_norm=True)
    cfg = BlockConfig(layers=layers, target_layer_ids=(0,), block_size=3, mask_token_id=VOCAB - 1)
    params = drafter_params(init_params(cfg, jax.random.key(5)), target.params, False, per_layer=True)
    params["final_norm"] = params["final_norm"] * 4.0  # sharper draft logits, like the target's
    head = DFlashDrafter(cfg, params, attn_impl="xla")
    sampling = SamplingConfig(1.0)
    out = specjax.generate(target, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=1.0, seed=17, drafter=head,
                           tree=tree, eos_token_id=[])
    ok, stat, threshold = chi_square_passes(np.array(out.tokens), exact_distribution(target, sampling))
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}: sampled output is not the target's distribution"
    assert out.stats["acceptance_length"] > 1.0
