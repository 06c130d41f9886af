"""EAGLE-3 heads in every producer's layout: SpecForge, speculators, ModelOpt, DeepSpec (SafeAILab's: test_eagle3.py).

The fixtures in tests/fixtures/eagle3_layouts/ were written by scripts/make_eagle3_layout_fixtures.py: tiny heads
saved as each producer saves them (its key set, file types and config keys) with that producer's own code run on
them (the commit is in each case's meta.json; ModelOpt's numbers come from speculators' model, which runs the
semantics vLLM serves ModelOpt exports with). Every case is read back through `load_eagle3`, so parity covers the
layout's config rules (taps, RoPE, head_dim, q/k norms, norm_before_residual, layer count, the target's lm_head)
and its tensor names, shards and dtypes too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import build_hf_model, save_hf_model
from safetensors.numpy import load_file, save_file
from test_dynamic_tree import reference_tree
from test_eagle3_tree import chain_oracle, static_reference, to_target

import specjax
from specjax.cli import main as cli_main
from specjax.config import ModelConfig, SamplingConfig
from specjax.convert import export as ex
from specjax.convert.eagle3 import eagle3_config, load_eagle3, read_head_tensors
from specjax.convert.eagle3_layouts import head_layout
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import DynamicTreeSpec, chain, parse_tree
from specjax.drafters import eagle3
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.models.cache import KVCache

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3_layouts"
CASES = ("specforge", "speculators_llama", "speculators_qwen3", "modelopt", "deepspec")
ATOL = 1e-5
MAX_NEW = 16

# What each fixture's config.json must be read as (the layout's rules; see convert/eagle3_layouts.py).
EXPECTED = {
    "specforge": dict(layout="specforge", feature_layers=(2, 3, 4), head_dim=16, num_layers=1, qk_norm=False,
                      norm_before_residual=False, lm_head="own", theta=1e6, stored="bfloat16", draft_vocab=64),
    "speculators_llama": dict(layout="speculators", feature_layers=(1, 3, 5), head_dim=8, num_layers=2, qk_norm=False,
                              norm_before_residual=True, lm_head="own", theta=1e4, stored="float16", draft_vocab=64),
    "speculators_qwen3": dict(layout="speculators", feature_layers=(2, 3, 4), head_dim=8, num_layers=1, qk_norm=True,
                              norm_before_residual=False, lm_head="own", theta=1e6, stored="float32", draft_vocab=128),
    "modelopt": dict(layout="modelopt", feature_layers=(2, 3, 4), head_dim=8, num_layers=2, qk_norm=False,
                     norm_before_residual=False, lm_head="target", theta=1e4, stored="bfloat16", draft_vocab=128),
    "deepspec": dict(layout="deepspec", feature_layers=(1, 2, 3, 5, 6), head_dim=8, num_layers=1, qk_norm=True,
                     norm_before_residual=False, lm_head="own", theta=1e6, stored="bfloat16", draft_vocab=128),
}


def target_config(**overrides) -> ModelConfig:
    """A target the fixture heads fit: hidden 32, vocabulary 128, 7 layers, untied."""
    fields = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=7, num_heads=4, num_kv_heads=2,
                  head_dim=8)
    return ModelConfig(**{**fields, **overrides})


def io_of(case: str) -> dict:
    return dict(np.load(FIXTURES / case / "io.npz"))


def fixture_params(case: str, **kw) -> tuple[eagle3.Eagle3Config, dict]:
    """The case's head (fp32) with the tables it reads from its target taken from the fixture."""
    cfg, host = load_eagle3(FIXTURES / case, target_config(), "float32", **kw)
    io = io_of(case)
    params = dict(host)
    params.setdefault("embed", io.get("target_embed"))
    if cfg.lm_head == "target":
        params["lm_head"] = io["target_lm_head"].T
    return cfg, jax.tree.map(jnp.asarray, params)


def row_chains(head: eagle3.Eagle3Head, cfg, io: dict) -> dict:
    """The head's steps over the fixture: step 1 the prefill of every row; step s >= 2 run per row p as a chain
    after the prefix 0..p (a batch of B*T rows, row (b, p) with p + 1 cached positions), fed io's step-s tokens."""
    b, t = io["step1_ids"].shape
    cache = eagle3.init_head_cache(cfg, b, 32)
    h_BTD, cache = head.midlayer(jnp.asarray(io["step1_ids"]), head.fuse(jnp.asarray(io["features_BTF"])), cache,
                                 attn_impl="xla")
    out = {"step1_hidden": h_BTD, "step1_logits": head.draft_logits(h_BTD)}
    k = tuple(jnp.repeat(x, t, axis=0) for x in cache.k)
    v = tuple(jnp.repeat(x, t, axis=0) for x in cache.v)
    lengths_R = jnp.tile(jnp.arange(1, t + 1, dtype=jnp.int32), b)
    h_R1D = h_BTD.reshape(b * t, 1, -1)
    s = 2
    while f"step{s}_ids" in io:
        ids_R1 = jnp.asarray(io[f"step{s}_ids"]).reshape(b * t, 1)
        h_R1D, c = head.midlayer(ids_R1, h_R1D, KVCache(k, v, lengths_R + s - 2), attn_impl="xla")
        k, v = c.k, c.v
        out[f"step{s}_hidden"] = h_R1D.reshape(b, t, -1)
        out[f"step{s}_logits"] = head.draft_logits(h_R1D).reshape(b, t, -1)
        s += 1
    return out


# ---- parity with the producers' code ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_config_is_read_by_the_producers_rules(case):
    want = EXPECTED[case]
    hf = json.loads((FIXTURES / case / "config.json").read_text())
    cfg, _ = load_eagle3(FIXTURES / case, target_config())
    assert head_layout(hf) == cfg.layout == want["layout"]
    assert cfg.feature_layers == want["feature_layers"] and cfg.head_dim == want["head_dim"]
    assert (cfg.num_layers, cfg.qk_norm, cfg.norm_before_residual) == \
        (want["num_layers"], want["qk_norm"], want["norm_before_residual"])
    assert cfg.lm_head == want["lm_head"] and cfg.rope.theta == want["theta"]
    assert cfg.rope.rope_type == ("yarn" if case == "modelopt" else "default")
    assert cfg.dtype == want["stored"] and cfg.draft_vocab_size == want["draft_vocab"]
    assert cfg.num_taps * cfg.target_hidden_size == io_of(case)["features_BTF"].shape[-1]


@pytest.mark.parametrize("case", [c for c in CASES if c != "deepspec"])
def test_every_step_matches_the_producers_code(case):
    """Prefill logits and hidden states of every row, then two more chain steps per row (the producer's
    training-time test: row p at step s is the chain drafted after prefix 0..p), at 1e-5 in fp32."""
    cfg, params = fixture_params(case)
    io = io_of(case)
    ours = row_chains(eagle3.head_of(cfg, params), cfg, io)
    assert set(ours) == {k for k in io if k.endswith(("_hidden", "_logits"))} and "step3_logits" in ours
    for name, value in ours.items():
        np.testing.assert_allclose(value, io[name], atol=ATOL, rtol=0, err_msg=f"{case} {name}")


def deepspec_first_round(record: bool = True):
    cfg, params = fixture_params("deepspec")
    io = io_of("deepspec")
    ids_BT = jnp.asarray(io["step1_ids"])
    b, t = ids_BT.shape
    k = io["chain_logits"].shape[1]
    drafter = Eagle3Drafter(cfg, params, attn_impl="xla").configure(
        Settings(chain(k), SamplingConfig(), 32, 16, record_logits=record))
    feats = tuple(jnp.split(jnp.asarray(io["features_BTF"]), cfg.num_taps, axis=-1))
    # Feature row p pairs with ids_BT[p] (_init_context's shifted prompt): the prompt is any t_0 then ids[:-1].
    prompt_BT = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), ids_BT[:, :-1]], axis=1)
    state = drafter.init(params, PrefillContext(prompt_BT, jnp.full((b,), t, jnp.int32), ids_BT[:, -1], feats))
    draft, _ = drafter.propose(params, state, ids_BT[:, -1], jax.random.split(jax.random.key(0), b))
    return drafter, draft, io


def test_deepspec_matches_its_evaluator():
    """DeepSpec's Qwen3Eagle3Evaluator: the prefill (every row) and its three-draft proposal, token for token, with
    the logits each draft came from."""
    drafter, draft, io = deepspec_first_round()
    ours = row_chains(eagle3.head_of(drafter.cfg, drafter.params), drafter.cfg, io)
    for name in ("step1_hidden", "step1_logits"):
        np.testing.assert_allclose(ours[name], io[name], atol=ATOL, rtol=0, err_msg=name)
    np.testing.assert_array_equal(draft.tokens, io["chain_tokens"])
    np.testing.assert_allclose(draft.logits[:, 1:], io["chain_logits"], atol=ATOL, rtol=0)


def test_sharded_bf16_fp16_and_pytorch_bin_read_the_same_weights(tmp_path):
    """SpecForge's fixture is sharded (model.safetensors.index.json) bf16; speculators' llama one is fp16; as a
    pytorch_model.bin (SafeAILab's published file type) the same tensors come back."""
    torch = pytest.importorskip("torch")
    assert (FIXTURES / "specforge" / "model.safetensors.index.json").is_file()
    tensors = read_head_tensors(FIXTURES / "specforge")
    assert {str(t.dtype) for k, t in tensors.items() if k not in ("d2t", "t2d")} == {"bfloat16"}
    assert "midlayer.self_attn.q_proj.weight" in tensors and "fc.weight" in tensors
    src = FIXTURES / "speculators_llama"
    head = tmp_path / "bin"
    head.mkdir()
    shutil.copy(src / "config.json", head / "config.json")
    torch.save({k: torch.from_numpy(np.array(v)) for k, v in load_file(src / "model.safetensors").items()},
               head / "pytorch_model.bin")
    (_, a), (_, b) = load_eagle3(src, target_config()), load_eagle3(head, target_config())
    jax.tree.map(np.testing.assert_array_equal, a, b)
    state = torch.load(head / "pytorch_model.bin", weights_only=True)  # two shards with an index
    names = sorted(state)
    (head / "pytorch_model.bin").unlink()
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        torch.save({k: state[k] for k in part}, head / f"pytorch_model-0000{i + 1}-of-00002.bin")
    weight_map = {k: f"pytorch_model-0000{1 + (k not in names[: len(names) // 2])}-of-00002.bin" for k in names}
    (head / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    jax.tree.map(np.testing.assert_array_equal, a, load_eagle3(head, target_config())[1])


# ---- speculative decoding on a tiny target ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 7-layer random Llama the heads fit (hidden 32, vocabulary 128), tied embeddings: a ModelOpt head without
    lm_head is scored by the target's embedding table."""
    model = build_hf_model("llama", seed=0, num_hidden_layers=7, hidden_size=32, intermediate_size=64, vocab_size=128)
    return specjax.load(save_hf_model(model, tmp_path_factory.mktemp("target")))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 128, size=n).tolist() for n in (6, 13)]


@pytest.fixture(scope="module")
def plain(target, prompts):
    return specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])


# Every layout drafts a chain and a tree, static or dynamic, each kind on a one-layer and a two-layer head
# (inspect_draft shows a static tree of each below; test_multi_layer_trees_... checks both kinds node by node).
STATIC, DYNAMIC = "kary:2,2", "dynamic:top_k=2,depth=2,total_tokens=6"
TREES = {"specforge": STATIC, "speculators_llama": DYNAMIC, "speculators_qwen3": DYNAMIC, "modelopt": STATIC,
         "deepspec": DYNAMIC}
RUNS = [(c, t) for c in CASES for t in ("chain:3", TREES[c])]


@pytest.mark.parametrize("case, tree", RUNS)
def test_greedy_speculative_equals_plain(target, prompts, plain, case, tree):
    drafter = specjax.load_drafter(FIXTURES / case, target)
    assert isinstance(drafter, Eagle3Drafter) and drafter.cfg.layout == EXPECTED[case]["layout"]
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter, tree=tree)
    assert out.tokens == plain.tokens and out.stats["rounds"] > 0


def test_tables_come_from_the_checkpoint_or_the_target(target):
    """speculators and DeepSpec save their embedding (used); SpecForge's export drops it (the target's, shared); a
    ModelOpt head without lm_head scores with the target's tied embedding."""
    own = specjax.load_drafter(FIXTURES / "deepspec", target)
    assert own.params["embed"] is not target.params["embed"] and own.params["lm_head"].shape == (32, 128)
    shared = specjax.load_drafter(FIXTURES / "specforge", target)
    assert shared.params["embed"] is target.params["embed"]
    modelopt = specjax.load_drafter(FIXTURES / "modelopt", target)
    assert modelopt.cfg.lm_head == "target_embed" and "lm_head" not in modelopt.params
    head = modelopt.model
    h_BTD = jnp.ones((1, 1, 32), jnp.float32)
    x_BTD = eagle3.rms_norm(h_BTD, head.final_norm[...], modelopt.cfg.rms_norm_eps)
    np.testing.assert_allclose(head.draft_logits(h_BTD), x_BTD @ target.params["embed"].T, rtol=1e-5, atol=1e-5)


def test_multi_layer_trees_are_what_chain_drafting_each_path_gives():
    """Static and dynamic trees of the two-layer speculators head (layers 1.. see the tree through the same
    window mask): every node is the head's chain draft along its path."""
    cfg, params = fixture_params("speculators_llama")
    rng = np.random.default_rng(3)
    lens, t = (6,), 6
    prompts = [rng.integers(0, 128, size=n).tolist() for n in lens]
    prompt_BT = np.asarray(prompts, np.int32)
    feats = [rng.standard_normal((1, t, 32)).astype(np.float32) for _ in range(3)]
    roots = rng.integers(0, 128, size=1).astype(np.int32)
    oracles = None
    for tree in ("kary:2,2,1", "dynamic:top_k=2,depth=3,total_tokens=8"):
        spec = parse_tree(tree, None)
        drafter = Eagle3Drafter(cfg, params, attn_impl="xla").configure(Settings(spec, SamplingConfig(), 64, 16))
        ctx = PrefillContext(jnp.asarray(prompt_BT), jnp.asarray(lens, jnp.int32), jnp.asarray(roots),
                             tuple(jnp.asarray(f) for f in feats))
        draft, _ = drafter.propose(params, drafter.init(params, ctx), jnp.asarray(roots),
                                   jax.random.split(jax.random.key(0), 1))
        oracles = oracles or [chain_oracle(drafter, p, int(roots[row]), [f[row, :lens[row]] for f in feats])
                              for row, p in enumerate(prompts)]
        for row, oracle in enumerate(oracles):
            if isinstance(spec, DynamicTreeSpec):
                tokens, parents, _ = reference_tree(int(roots[row]), oracle, spec.top_k, spec.depth,
                                                    spec.total_tokens, to_token=to_target(drafter))
                np.testing.assert_array_equal(np.asarray(draft.parents[row]), parents)
            else:
                tokens = static_reference(spec, int(roots[row]), oracle, to_target(drafter))
            np.testing.assert_array_equal(np.asarray(draft.tokens[row]), tokens, err_msg=f"{tree} row {row}")


@pytest.mark.parametrize("case", CASES)
def test_inspect_draft_shows_trees(target, case):
    """The first round's tree with the logits each node came from (its chains: test_deepspec_matches_its_evaluator
    and the speculative runs above)."""
    drafter = specjax.load_drafter(FIXTURES / case, target)
    t = specjax.inspect_draft(target, drafter, [5, 9, 14, 3], tree="kary:2,1")
    assert list(t.tree_parents) == [-1, 0, 0, 1, 2] and t.logits.shape == (4, 128)
    first = int(np.argmax(t.logits[0]))  # node 1 is its parent's (the root's) best draft, node 2 the second
    assert first == int(t.tokens[0]) and int(np.argsort(-t.logits[1])[1]) == int(t.tokens[1])


# ---- export back to the producer's layout ------------------------------------------------------------------------


def producer_keys(case: str) -> set[str]:
    return set(read_head_tensors(FIXTURES / case))


@pytest.mark.parametrize("case", CASES)
def test_export_writes_the_layout_it_came_from(case, tmp_path):
    """A head read from the producer's layout, written back: the producer's key set, a config read as the same
    head, identical params (in the stored dtype) and identical logits."""
    tcfg = target_config()
    cfg, host = load_eagle3(FIXTURES / case, tcfg)
    source = json.loads((FIXTURES / case / "config.json").read_text())
    dst = ex.export_eagle3(cfg, host, tmp_path / "out", include_embed="embed" in host, source_config=source)
    assert set(read_head_tensors(dst)) == producer_keys(case)
    cfg2, host2 = load_eagle3(dst, tcfg)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, host, host2)
    config = json.loads((dst / "config.json").read_text())
    kept = {k for k in source if k not in ("dtype", "rope_parameters", "auto_map")}
    assert kept <= set(config), kept - set(config)  # the producer's keys survive


def test_cli_rewrites_a_head_directory_with_its_target(target, tmp_path):
    out = tmp_path / "head"
    assert cli_main(["export", str(FIXTURES / "modelopt"), str(out), "--target", str(target.path)]) == 0
    assert set(read_head_tensors(out)) == producer_keys("modelopt")
    want = specjax.inspect_draft(target, specjax.load_drafter(FIXTURES / "modelopt", target), [7, 8, 9],
                                 num_draft_tokens=2)
    got = specjax.inspect_draft(target, specjax.load_drafter(out, target), [7, 8, 9], num_draft_tokens=2)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logits, want.logits)


def test_a_head_the_layout_cannot_hold_is_refused(tmp_path):
    cfg, host = load_eagle3(FIXTURES / "speculators_llama", target_config())
    with pytest.raises(ValueError, match=r"cannot be written in the specforge layout: it has 2 decoder layers"):
        ex.export_eagle3(cfg, host, tmp_path / "x", layout="specforge")
    cfg, host = load_eagle3(FIXTURES / "deepspec", target_config())
    with pytest.raises(ValueError, match=r"q/k norms.*5 taps"):
        ex.export_eagle3(cfg, host, tmp_path / "x", layout="safeailab")
    assert not (tmp_path / "x").exists()


# ---- RoPE: YaRN (ModelOpt's default export) and the override ------------------------------------------------------


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048},  # ModelOpt's exporter default
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "truncate": False,
     "attention_factor": 1.1},
])
def test_yarn_frequencies_and_scale_are_transformers(params):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specjax.convert.eagle3_layouts import transformers_rope
    from specjax.models.layers import rope_inv_freq

    hf = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=131072, rope_theta=50000.0)
    config = transformers.LlamaConfig(**hf, rope_parameters={**params, "rope_theta": 50000.0})
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = transformers_rope({**hf, "rope_scaling": params})
    np.testing.assert_allclose(rope_inv_freq(rope, 16), want_inv.numpy(), rtol=1e-6)
    assert rope.attention_factor == pytest.approx(want_scale)


def test_the_modelopt_fixture_depends_on_its_yarn():
    """Read without its YaRN (the base alone), the ModelOpt head's logits move: the parity above checks the scaling."""
    cfg, params = fixture_params("modelopt")
    assert cfg.rope.factor == 32.0 and cfg.rope.attention_factor == pytest.approx(0.1 * np.log(32.0) + 1)
    import dataclasses

    plain_cfg = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, rope_type="default", attention_factor=1.0))
    io = io_of("modelopt")
    moved = row_chains(eagle3.head_of(plain_cfg, params), plain_cfg, io)["step1_logits"]
    assert np.abs(np.asarray(moved) - io["step1_logits"]).max() > 1e-2



def test_rope_theta_override_changes_the_base_and_the_drafts(target, tmp_path):
    drafter = specjax.load_drafter(FIXTURES / "specforge", target, rope_theta=10000.0)
    assert drafter.cfg.rope.theta == 10000.0 and drafter.cfg.head_dim == 16
    cfg, params = fixture_params("specforge", rope_theta=10000.0)
    io = io_of("specforge")
    moved = row_chains(eagle3.head_of(cfg, params), cfg, io)["step2_logits"]
    assert np.abs(np.asarray(moved) - io["step2_logits"]).max() > 1e-3  # positions 1.. rotate at another base
    draft_dir = save_hf_model(build_hf_model("llama", seed=5, num_hidden_layers=1, hidden_size=32, vocab_size=128,
                                             intermediate_size=64), tmp_path / "draft")
    with pytest.raises(ValueError, match=r"rope_theta= overrides .* is a draft_model drafter"):
        specjax.load_drafter(draft_dir, target, rope_theta=1e4)


def test_rope_theta_override_reaches_block_drafters_and_is_refused_for_mtp():
    target = specjax.load(specjax.embedded("target"))
    dflash = specjax.load_drafter(specjax.embedded("dflash"), target, rope_theta=123456.0)
    assert dflash.cfg.layers.rope.theta == 123456.0
    dspark = specjax.load_drafter(specjax.embedded("dspark"), target, rope_theta=123456.0)
    assert dspark.cfg.block.layers.rope.theta == 123456.0
    with pytest.raises(ValueError, match=r"is a mtp drafter \(MTP layers run with the target's RoPE\)"):
        specjax.load_drafter(specjax.embedded("mtp"), target, rope_theta=1e4)


# ---- refusals: what does not fit the target, what is not implemented ----------------------------------------------


def copy_case(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(FIXTURES / case, dst)
    return dst


def edit(path: Path, change) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("case", CASES)
def test_hidden_size_and_vocabulary_mismatches_name_both_sides(case):
    with pytest.raises(ValueError, match=r"features of width 32 .*target's hidden_size is 48"):
        load_eagle3(FIXTURES / case, target_config(hidden_size=48, head_dim=12))
    with pytest.raises(ValueError, match=r"vocab_size is 128 but the target's vocabulary has 160"):
        load_eagle3(FIXTURES / case, target_config(vocab_size=160))


@pytest.mark.parametrize("case, layers, match", [
    ("speculators_llama", 5, r"eagle_aux_hidden_state_layer_ids \[1, 3, 5\] has \[5\] outside the target's layers: "
                             r"with 5 layers the ids \(hidden_states\) must lie in 1\.\.4"),
    ("modelopt", 4, r"eagle_config.eagle_aux_hidden_state_layer_ids \[1, 2, 3\] has \[3\] outside .* with 4 layers "
                    r"the ids \('output of layer i'\) must lie in 0\.\.2"),
    ("deepspec", 7 + 2, r"built for a target of 7 layers \(config.json num_target_layers\) but the target has 9"),
    ("specforge", 6, r"default EAGLE-3 feature layers .* not distinct for a target of 6 layers"),
])
def test_taps_that_do_not_fit_the_target_are_refused(case, layers, match):
    with pytest.raises(ValueError, match=match):
        load_eagle3(FIXTURES / case, target_config(num_layers=layers))


def test_deepspec_tap_rules(tmp_path):
    head = copy_case("deepspec", tmp_path)
    edit(head, lambda c: c.update(target_layer_ids=[0, 1, 2, 4, 6]))
    with pytest.raises(ValueError, match=r"include the target's last layer 6"):
        load_eagle3(head, target_config())
    edit(head, lambda c: c.update(target_layer_ids=[0, 2, 1, 4, 5]))
    with pytest.raises(ValueError, match=r"strictly increasing"):
        load_eagle3(head, target_config())
    edit(head, lambda c: c.update(target_layer_ids=[0, 1, 2, 4, 5], num_hidden_layers=2,
                                  draft_num_hidden_layers=2))
    with pytest.raises(ValueError, match=r"runs draft_num_hidden_layers == 1 only"):
        load_eagle3(head, target_config())


@pytest.mark.parametrize("case, change, match", [
    ("specforge", lambda c: c.update(num_hidden_layers=2), r"num_hidden_layers=2; a SafeAILab / SpecForge head"),
    ("specforge", lambda c: c.update(fc_norm=True, norm_output=True), r"sets norm_output=True, whose meaning"),
    ("speculators_llama", lambda c: c.update(norm_before_fc=True), r"lacks tensor 'input_norm.weight'"),
    ("speculators_llama", lambda c: c.update(speculators_model_type="dflash"),
     r"speculators_model_type is 'dflash'"),
    ("speculators_llama", lambda c: c["transformer_layer_config"].update(model_type="qwen3_next"),
     r"model_type 'qwen3_next'; specjax implements \['llama', 'qwen3'\]"),
    ("speculators_qwen3", lambda c: c["transformer_layer_config"].update(attention_bias=True),
     r"attention_bias=true"),
    ("modelopt", lambda c: c["eagle_config"].update(use_aux_hidden_state=False), r"use_aux_hidden_state is False"),
    ("modelopt", lambda c: c.update(model_type="kimi_k2", architectures=["Eagle3DeepseekV2ForCausalLM"]),
     r"'kimi_k2' head .*MLA attention"),
    ("modelopt", lambda c: c.update(draft_vocab_size=64), r"lacks tensor 'd2t'|no lm_head.weight of its own"),
    ("deepspec", lambda c: c.update(hidden_act="gelu"), r"hidden_act is 'gelu'"),
])
def test_unimplemented_or_inconsistent_heads_are_refused(case, change, match, tmp_path):
    head = copy_case(case, tmp_path)
    edit(head, change)
    with pytest.raises(ValueError, match=match):
        load_eagle3(head, target_config())


def test_speculators_norm_before_residual_defaults_as_vllm_reads_it(tmp_path):
    """vLLM's speculators config reader (algos.py update_eagle3) takes an absent norm_before_residual as true."""
    head = copy_case("speculators_qwen3", tmp_path)
    edit(head, lambda c: c.pop("norm_before_residual"))
    assert load_eagle3(head, target_config())[0].norm_before_residual


def test_modelopt_missing_lm_head_needs_the_whole_vocabulary_and_missing_d2t_is_the_identity():
    cfg, params = load_eagle3(FIXTURES / "modelopt", target_config())
    assert cfg.lm_head == "target" and "lm_head" not in params and not np.asarray(params["d2t"]).any()
    assert load_eagle3(FIXTURES / "modelopt", target_config(tie_word_embeddings=True))[0].lm_head == "target_embed"
    hf = json.loads((FIXTURES / "modelopt" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"draft vocabulary of 64 tokens but no lm_head.weight of its own"):
        eagle3_config({**hf, "draft_vocab_size": 64}, target_config(), tensor_names={"fc.weight", "d2t"})
    for case in ("specforge", "speculators_llama", "deepspec"):
        other = json.loads((FIXTURES / case / "config.json").read_text())
        with pytest.raises(ValueError, match=r"lacks tensor 'lm_head.weight'; only ModelOpt exports may leave it out"):
            eagle3_config(other, target_config(), tensor_names={"fc.weight"})


def test_extra_tensors_are_refused_naming_the_layout(tmp_path):
    head = copy_case("speculators_qwen3", tmp_path)
    tensors = load_file(head / "model.safetensors")
    save_file({**tensors, "layers.1.self_attn.q_proj.weight": np.zeros((32, 32), np.float32)},
              str(head / "model.safetensors"))
    with pytest.raises(ValueError, match=r"in the speculators layout does not have: 'layers.1.self_attn.q_proj"):
        load_eagle3(head, target_config())


# ---- SpecForge heads with an `eagle_config`: the tensors decide the layout ------------------------------------------


def test_specforge_head_with_eagle_config_is_read_by_its_tensors(target, prompts, plain):
    """SpecForge's own configs (and AQ-MedAI's Kimi-K2 / Qwen3.5 heads) carry `eagle_config` with custom ids and
    `use_aux_hidden_state` (a ModelOpt flag) over `midlayer.*` tensors: the tensors make it a SpecForge head, its
    ids count SGLang's way (+ 1), and every step matches SpecForge's code."""
    case = "specforge_eagle_config"
    hf = json.loads((FIXTURES / case / "config.json").read_text())
    assert head_layout(hf) == "modelopt"  # the config alone reads as ModelOpt's ...
    cfg, params = fixture_params(case)
    assert cfg.layout == "specforge" and cfg.feature_layers == (1, 4, 6)  # ... its midlayer.* tensors do not
    io = io_of(case)
    for name, value in row_chains(eagle3.head_of(cfg, params), cfg, io).items():
        np.testing.assert_allclose(value, io[name], atol=ATOL, rtol=0, err_msg=name)
    drafter = specjax.load_drafter(FIXTURES / case, target)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter, tree="chain:3")
    assert out.tokens == plain.tokens and out.stats["rounds"] > 0
