"""DSpark: parity with DeepSpec's drafter, the checkpoint reader's checks, lossless drafting, calibration.

The fixtures in tests/fixtures/dspark/ were written by scripts/make_dspark_fixtures.py, which runs
deepseek-ai/DeepSpec's own `Qwen3DSparkModel` and its evaluator's draft functions (commit in each
case's meta.json) on tiny random weights: a DSpark drafter (Markov rank 8, confidence head with
the Markov embedding) and a Markov-rank-0 one (DeepSpec's `dflash_*_block7` class), saved in
DeepSpec's format and read back here through specjax's reader, so parity covers the tensor names
and [out, in] -> [in, out] mapping too. Rounds 2 follow 0, some and all drafts accepted.
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
from test_lossless_sampling import NEW, PROMPT, ROWS, chi_square_passes, exact_distribution, tiny

import specjax
from specjax.config import ModelConfig, SamplingConfig
from specjax.convert.dspark import CALIBRATION_FILE, load_dspark
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.sampling import sampling_probs
from specjax.decoding.tree import chain
from specjax.decoding.verify import Verdict
from specjax.drafters import DSparkDrafter, confidence, dspark
from specjax.drafters.dflash import BlockConfig
from specjax.loading.drafter import drafter_family, dspark_drafter
from specjax.models.cache import init_cache
from specjax.models.model import forward, init_params, lm_head
from specjax.models.target import Target
from specjax.train import confidence as confidence_fit

FIXTURES = Path(__file__).parent / "fixtures" / "dspark"
CASES = ("dspark", "rank0")


def close(got, want, what):
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-5, atol=1e-5, err_msg=what)


def fixture_target_config(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of the tiny Qwen3 target the fixture drafter was built on (from meta.json)."""
    t = json.loads((FIXTURES / name / "meta.json").read_text())["target"]
    fields = dict(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                  num_layers=t["num_hidden_layers"], num_heads=t["num_attention_heads"],
                  num_kv_heads=t["num_key_value_heads"], head_dim=t["head_dim"], qk_norm=True, family="qwen3")
    return ModelConfig(**{**fields, **overrides})


# ---------------------------------------------------------------- parity with DeepSpec


@pytest.fixture(scope="module", params=CASES)
def case(request):
    """(name, io, meta, the drafter read from the fixture through specjax's reader, configured for gamma drafts)."""
    name = request.param
    tcfg = fixture_target_config(name)
    cfg, block, heads = load_dspark(FIXTURES / name, tcfg, "float32")
    params = dspark.drafter_params(jax.tree.map(jnp.asarray, block), jax.tree.map(jnp.asarray, heads), per_layer=True)
    settings = Settings(chain(cfg.block_size), SamplingConfig(), 64, 32, record_logits=True)
    drafter = DSparkDrafter(cfg, params, attn_impl="xla").configure(settings)
    io = dict(np.load(FIXTURES / name / "io.npz"))
    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    return name, io, meta, drafter


def taps(drafter, feats_TF):
    """The concatenated taps [T, n*H] as the per-tap [1, T, H] arrays the loop hands a drafter."""
    h = drafter.cfg.block.hidden_size
    return tuple(jnp.asarray(feats_TF[None, :, i * h:(i + 1) * h]) for i in range(drafter.cfg.block.num_taps))


def one_round(drafter, state, anchor: int):
    """propose once; also the backbone logits U the Markov step started from."""
    params = drafter.params
    net = dspark.networks(drafter.cfg, params)
    anchor_B = jnp.asarray([anchor], jnp.int32)
    h_BGH, _ = net.backbone.block_hidden(net.tables.block_embeddings(anchor_B), state, attn_impl="xla")
    draft, _ = drafter.propose(params, state, anchor_B, jax.random.split(jax.random.key(0), 1))
    return draft, net.tables.logits(h_BGH)[0]


def check_round(drafter, io, prefix: str, draft, u, state, what: str):
    close(u, io[prefix + "U"], f"{what}: backbone logits U")
    markov = io.get(prefix + "markov", io[prefix + "U"])  # rank 0: no Markov step, logits = U
    close(draft.logits[0, 1:], markov, f"{what}: Markov logits")
    np.testing.assert_array_equal(draft.tokens[0], [int(io[prefix + "anchor"]), *io[prefix + "tokens"]], what)
    if prefix + "conf" in io:
        close(draft.confidence[0, 1:], io[prefix + "conf"], f"{what}: confidences")
    assert float(draft.confidence[0, 0]) == 1.0
    if prefix + "k0" in io:
        rows = io[prefix + "k0"].shape[1]
        assert int(state.lengths[0]) == rows == int(io[prefix + "start"]), what
        for layer in range(drafter.cfg.block.layers.num_layers):
            close(np.asarray(state.k[layer][0, :rows]).transpose(1, 0, 2), io[prefix + f"k{layer}"], f"{what} K{layer}")
            close(np.asarray(state.v[layer][0, :rows]).transpose(1, 0, 2), io[prefix + f"v{layer}"], f"{what} V{layer}")


@pytest.fixture(scope="module")
def round1(case):
    name, io, _, drafter = case
    t = len(io["prompt"])
    ctx = PrefillContext(jnp.asarray(io["prompt"])[None], jnp.asarray([t], jnp.int32),
                         jnp.asarray([io["root"]], jnp.int32), taps(drafter, io["prompt_features"]))
    state = drafter.init(drafter.params, ctx)
    draft, u = one_round(drafter, state, int(io["root"]))
    return state, draft, u


def test_round1_matches_deepspec(case, round1):
    """U, Markov logits, greedy drafts, confidences and the context cache after the prompt, at 1e-5."""
    name, io, _, drafter = case
    state, draft, u = round1
    check_round(drafter, io, "r1_", draft, u, state, f"{name} round 1")


def test_round2_after_0_some_all_accepted_matches_deepspec(case, round1):
    """update() with the verify pass's features projects only the accepted rows; round 2 then matches."""
    name, io, meta, drafter = case
    state, draft, _ = round1
    gamma = drafter.cfg.block_size
    for a in meta["accepted"]:
        path = np.zeros((1, gamma + 1), np.int32)
        path[0, : a + 1] = np.arange(a + 1)
        verdict = Verdict(jnp.asarray(path), jnp.asarray([a + 1], jnp.int32), jnp.asarray([io["verify_argmax"][a]]))
        state2 = drafter.update(drafter.params, state, draft, verdict, taps(drafter, io["verify_features"]))
        assert int(state2.lengths[0]) == len(io["prompt"]) + a + 1
        d2, u2 = one_round(drafter, state2, int(io[f"r2_acc{a}_anchor"]))
        check_round(drafter, io, f"r2_acc{a}_", d2, u2, state2, f"{name} round 2 after {a} accepted")


def test_fixture_configs_are_read_as_stored(case):
    name, _, meta, drafter = case
    cfg = drafter.cfg
    assert cfg.block_size == (5 if name == "dspark" else 4) and drafter.max_draft_tokens == cfg.block_size
    assert cfg.markov_rank == (8 if name == "dspark" else 0)
    assert cfg.confidence == cfg.confidence_with_markov == (name == "dspark")
    # target_layer_ids count outputs of layers (-1: the embeddings) -> HF hidden_states numbering.
    assert drafter.feature_layers == tuple(i + 1 for i in meta["model_args"]["target_layer_ids"])
    assert drafter.calls_per_round() == 1
    assert drafter_family(FIXTURES / name) == "dspark"
    tcfg = fixture_target_config(name)
    target = Target(init_params(tcfg, jax.random.key(0)), tcfg, hf_config={})
    loaded = specjax.load_drafter(FIXTURES / name, target)
    assert isinstance(loaded, DSparkDrafter) and loaded.cfg == cfg
    np.testing.assert_array_equal(loaded.params["embed"], drafter.params["embed"])  # its own copy, not the target's
    assert "DSparkDrafter(layers=" in repr(loaded) and dspark_drafter(FIXTURES / name, target).cfg == cfg


# ---------------------------------------------------------------- loading and its checks


@pytest.fixture
def head_dir(tmp_path):
    """A writable copy of the dspark fixture drafter."""
    dst = tmp_path / "head"
    shutil.copytree(FIXTURES / "dspark", dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, target_overrides, match", [
    ({}, dict(vocab_size=256), r"vocab_size is 128 but the target's vocabulary has 256"),
    ({}, dict(hidden_size=96, num_heads=6), r"hidden_size is 64 but the target's is 96"),
    ({}, dict(num_layers=6), r"num_target_layers=4 layers but the target has 6"),
    (dict(target_layer_ids=[0, 1, 3]), {}, r"\[3\] out of range .* -1\.\.2 .*last layer's output is never a tap"),
    (dict(target_layer_ids=[1, 0, 2]), {}, "not strictly increasing"),
    (dict(mask_token_id=128), {}, r"mask_token_id 128 is outside the target's vocabulary \(0\.\.127\)"),
    (dict(block_size=0), {}, r"block_size is 0; it must be an integer >= 1"),
    (dict(markov_head_type="rnn"), {}, r"markov_head_type is 'rnn'; specjax implements \['vanilla'\]"),
    (dict(markov_rank=0), {}, "confidence_head_with_markov true but markov_rank 0"),
    (dict(architectures=["Gemma4DSparkModel"]), {}, "not the Gemma-4 variant"),
])
def test_config_that_does_not_fit_is_refused(head_dir, changes, target_overrides, match):
    edit_config(head_dir, **changes)
    with pytest.raises(ValueError, match=match):
        load_dspark(head_dir, fixture_target_config("dspark", **target_overrides))


def test_unaccounted_and_missing_tensors_are_refused_by_name(head_dir):
    target = fixture_target_config("dspark")
    tensors = load_file(head_dir / "model.safetensors")
    save_file({**tensors, "markov_head.gate_proj.weight": np.zeros((8, 72), np.float32)},
              str(head_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) .* 'markov_head.gate_proj.weight'.*refuses to drop"):
        load_dspark(head_dir, target)
    save_file({k: v for k, v in tensors.items() if k != "confidence_head.proj.bias"},
              str(head_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks tensor 'confidence_head.proj.bias'"):
        load_dspark(head_dir, target)
    save_file({k: v for k, v in tensors.items() if k != "layers.1.mlp.up_proj.weight"},
              str(head_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks backbone tensor\(s\) 'layers.1.mlp.up_proj.weight'"):
        load_dspark(head_dir, target)
    save_file(tensors, str(head_dir / "model.safetensors"))
    edit_config(head_dir, enable_confidence_head=False)
    with pytest.raises(ValueError, match="confidence head tensors but config.json enable_confidence_head is false"):
        load_dspark(head_dir, target)


def test_a_head_sharing_the_targets_tables_loads_them_from_the_target(head_dir):
    """specjax's shipped heads omit the embed/lm_head copies (TABLES_FROM_TARGET); the target supplies them."""
    from specjax.convert.dspark import TABLES_FROM_TARGET

    target = fixture_target_config("dspark")
    _, _, own = load_dspark(head_dir, target, "float32")
    tensors = load_file(head_dir / "model.safetensors")
    tables = (tensors["embed_tokens.weight"].astype(np.float32), tensors["lm_head.weight"].astype(np.float32).T)
    save_file({k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "lm_head.weight")},
              str(head_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks tensor 'embed_tokens.weight'"):
        load_dspark(head_dir, target)
    edit_config(head_dir, **{TABLES_FROM_TARGET: True})
    with pytest.raises(ValueError, match=r"load it with load_drafter\(path, target\)"):
        load_dspark(head_dir, target)
    _, _, shared = load_dspark(head_dir, target, "float32", target_tables=tables)
    for name in own:
        np.testing.assert_array_equal(shared[name], own[name], err_msg=name)


def test_more_drafts_than_a_block_is_refused(case):
    _, _, _, drafter = case
    k = drafter.cfg.block_size + 1
    with pytest.raises(ValueError, match=rf"num_draft_tokens={k} is more than one DSpark block gives"):
        drafter.configure(Settings(chain(k), SamplingConfig(), 64, 32))


# ---------------------------------------------------------------- the speculative loop: greedy and sampled

V = 96


@pytest.fixture(scope="module")
def bigram_pair():
    """A tiny random target whose greedy next token depends mostly on the last token, and a DSpark drafter
    whose Markov head holds that bigram table (backbone logits damped): it drafts with real acceptance, and
    its drafts depend on the previous *drafted* token, so the Markov chain is what is being verified."""
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16)
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    params["embed"] = params["embed"] * 30.0
    target = Target(params, cfg, hf_config={}, attn_impl="xla", layout="per_layer")  # as the drafter below
    h, _, _ = forward(target.params, cfg, jnp.arange(V, dtype=jnp.int32)[:, None],
                      init_cache(cfg, V, 8, per_layer=True), attn_impl="xla")
    nxt = jnp.argmax(lm_head(target.params, cfg, h)[:, 0], axis=-1)
    layers = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=16, qk_norm=True, family="qwen3")
    dcfg = dspark.DSparkConfig(block=BlockConfig(layers, (0, 1), 4, V - 1), markov_rank=V, confidence=True,
                               confidence_with_markov=True)
    dp = dspark.init_params(dcfg, jax.random.key(1))
    dp["lm_head"] = dp["lm_head"] * 0.01
    dp["markov_w1"] = jnp.eye(V) * 10.0
    dp["markov_w2"] = jax.nn.one_hot(nxt, V).T  # bias[x] = 10 * onehot(next(x))
    return target, DSparkDrafter(dcfg, dspark.drafter_params(dp, {}, per_layer=True), attn_impl="xla")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, V, size=n).tolist() for n in (5, 17, 1)]


@pytest.fixture(scope="module")
def plain(bigram_pair, prompts):
    return specjax.generate(bigram_pair[0], prompts, max_new_tokens=23, eos_token_id=[])


def test_greedy_equals_plain_decoding_ragged_batch_budget_mid_block(bigram_pair, prompts, plain):
    """Ragged prompts, K = 4 drafts: 23 tokens is not a multiple of any round's size."""
    target, drafter = bigram_pair
    out = specjax.generate(target, prompts, max_new_tokens=23, eos_token_id=[], drafter=drafter, num_draft_tokens=4)
    assert out.tokens == plain.tokens
    assert out.stats["acceptance_length"] > 1.5  # the Markov chain's drafts really are accepted
    assert out.stats["drafter_calls"] == out.stats["rounds"]


def test_greedy_equals_plain_decoding_with_eos_mid_block(bigram_pair, prompts, plain):
    """An EOS in the middle of an accepted block stops the row exactly where plain decoding stops."""
    target, drafter = bigram_pair
    row = plain.tokens[1]
    eos = next(t for i, t in enumerate(row) if i >= 6 and t not in row[:i])
    want = specjax.generate(target, prompts, max_new_tokens=23, eos_token_id=eos).tokens
    out = specjax.generate(target, prompts, max_new_tokens=23, eos_token_id=eos, drafter=drafter, num_draft_tokens=3)
    assert out.tokens == want and want[1][-1] == eos and len(want[1]) < 23


@pytest.mark.parametrize("tree_markov, tree", [("parent", "dynamic:top_k=3,depth=3,total_tokens=16"),
                                               ("chain", "dynamic:top_k=3,depth=3,total_tokens=16"),
                                               ("parent", "kary:2,2,1")])
def test_greedy_equals_plain_decoding_with_one_pass_trees(bigram_pair, prompts, plain, tree_markov, tree):
    """A one-pass tree whose children lean on their own parent's token (the Markov step per node) or on the greedy
    chain's (per depth): plain decoding's tokens either way, one backbone pass a round."""
    target, drafter = bigram_pair
    drafter = dataclasses.replace(drafter, tree_markov=tree_markov)
    out = specjax.generate(target, prompts, max_new_tokens=23, eos_token_id=[], drafter=drafter, tree=tree)
    assert out.tokens == plain.tokens
    assert out.stats["acceptance_length"] > 1.5 and out.stats["drafter_calls"] == out.stats["rounds"]


def test_tree_markov_is_checked():
    with pytest.raises(ValueError, match="tree_markov must be one of"):
        DSparkDrafter(None, {}, tree_markov="sibling")


@pytest.mark.parametrize("mode", ["confidence", "prefix"])
def test_greedy_equals_plain_decoding_with_the_prefix_scheduler(bigram_pair, prompts, plain, mode):
    """DSpark's own confidences drive the scheduler; verifying fewer drafts never changes the output."""
    target, drafter = bigram_pair
    out = specjax.generate(target, prompts, max_new_tokens=23, eos_token_id=[], drafter=drafter, num_draft_tokens=4,
                           scheduler=mode, scheduler_profile="roofline")
    assert out.tokens == plain.tokens
    assert out.stats["scheduler"]["mode"] == mode and sum(out.stats["verified_width_rounds"].values()) > 0


def test_inspect_draft_returns_markov_logits_and_confidences(bigram_pair, prompts):
    target, drafter = bigram_pair
    out = specjax.inspect_draft(target, drafter, prompts[0], num_draft_tokens=4)
    assert out.logits.shape == (4, V) and out.confidence.shape == (4,)
    np.testing.assert_array_equal(out.logits.argmax(-1), out.tokens)  # greedy over the Markov-adjusted logits
    assert np.all((out.confidence > 0) & (out.confidence < 1))
    # The Markov step: draft k + 1 leans on draft k (here: the bigram table dominates the backbone).
    assert out.tokens[1:].tolist() == [int(np.argmax(drafter.params["markov_w2"][:, x])) for x in out.tokens[:-1]]


@pytest.mark.parametrize("tree", ["chain:3", "dynamic:top_k=2,depth=2,total_tokens=6"])
def test_sampled_dspark_output_has_the_target_distribution(tree):
    """Markov sampling with q over the target vocabulary, and one-pass top-k trees (deterministic: q one-hot),
    keep the target's distribution (chi-square)."""
    target = tiny(0, layers=2)
    layers = ModelConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=16, qk_norm=True, family="qwen3")
    dcfg = dspark.DSparkConfig(block=BlockConfig(layers, (-1, 0), 3, 5), markov_rank=4, confidence=True,
                               confidence_with_markov=True)
    dp = dspark.init_params(dcfg, jax.random.key(5), embed=target.params["embed"])
    drafter = DSparkDrafter(dcfg, dspark.drafter_params(dp, {}, per_layer=True), attn_impl="xla")
    out = specjax.generate(target, [PROMPT] * ROWS, max_new_tokens=NEW, temperature=1.0, seed=17, drafter=drafter,
                           tree=tree, eos_token_id=[])
    ok, stat, threshold = chi_square_passes(np.array(out.tokens), exact_distribution(target, SamplingConfig(1.0)))
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}: sampled output is not the target's distribution"
    assert out.stats["acceptance_length"] > 1.0


def test_sampled_drafts_carry_q_of_the_markov_adjusted_logits(bigram_pair):
    """Each sampled draft comes with q = the sampling distribution of its Markov-adjusted logits."""
    target, drafter = bigram_pair
    sampling = SamplingConfig(0.7, top_k=5)
    d = drafter.configure(Settings(chain(4), sampling, 64, 32, record_logits=True))
    b, t = 2, 6
    feats = tuple(jax.random.normal(jax.random.key(i), (b, t, 32)) for i in range(2))
    ctx = PrefillContext(jnp.ones((b, t), jnp.int32), jnp.asarray([6, 4], jnp.int32), jnp.asarray([3, 9]), feats)
    draft, _ = d.propose(d.params, d.init(d.params, ctx), jnp.asarray([3, 9]), jax.random.split(jax.random.key(2), b))
    np.testing.assert_allclose(draft.q[:, 1:], sampling_probs(draft.logits[:, 1:], sampling), atol=1e-6)
    chosen = np.take_along_axis(np.asarray(draft.q[:, 1:]), np.asarray(draft.tokens[:, 1:])[..., None], -1)
    assert np.all(chosen > 0)  # every draft was drawn from its q
    # The Markov step: draft k + 1's logits carry the bias of draft k (10 x the bigram row, dominating U).
    nxt = np.argmax(np.asarray(d.params["markov_w2"]), axis=0)
    np.testing.assert_array_equal(np.argmax(draft.logits[:, 2:], -1), nxt[np.asarray(draft.tokens[:, 1:4])])


# ---------------------------------------------------------------- calibration


def synthetic_rounds(temps, m: int = 20000, seed: int = 0):
    """Head logits z and accepted counts drawn with true c_k = sigmoid(z_k / T*_k), accepted left to right."""
    rng = np.random.default_rng(seed)
    k = len(temps)
    z = rng.normal(1.0, 2.0, size=(m, k))
    survive = rng.random((m, k)) < 1.0 / (1.0 + np.exp(-z / np.asarray(temps)))
    accepted = np.cumprod(survive, axis=1).sum(axis=1)
    return z, accepted


def test_ece_is_deepspecs_equal_width_binning():
    pred = np.array([0.05, 0.07, 0.93, 0.97, 0.5])
    label = np.array([0, 1, 1, 1, 0])
    # bins (20 of width 0.05): [0.05, 0.07] -> bin 1: |0.06 - 0.5| * 2/5; [0.93] -> bin 18: |0.93-1|; [0.97] bin 19.
    want = (abs(0.12 - 1) + abs(0.93 - 1) + abs(0.97 - 1) + abs(0.5 - 0)) / 5
    assert confidence.expected_calibration_error(pred, label) == pytest.approx(want)
    assert confidence.expected_calibration_error(label.astype(float), label) == pytest.approx(0.0, abs=1e-7)


def test_sequential_temperature_scaling_recovers_a_known_scaling():
    true_t = np.array([2.0, 0.5, 1.5, 3.0])
    z, accepted = synthetic_rounds(true_t)
    report = confidence.fit_report(z, accepted, block_size=5)
    fitted = np.asarray(report.temperatures)
    np.testing.assert_allclose(fitted[:4], true_t, rtol=0.15)
    assert fitted[4] == 1.0  # a position not calibrated keeps T = 1
    assert report.mean_ece_after < 0.25 * report.mean_ece_before
    assert all(a < b for a, b in zip(report.ece_after, report.ece_before))
    np.testing.assert_allclose(report.predicted_after, report.observed, atol=0.02)


def test_calibrate_end_to_end_and_saved_temperatures_are_loaded(bigram_pair, prompts, head_dir):
    """calibrate() runs greedy rounds, fits T and returns a drafter that applies them; the json round-trips."""
    target, drafter = bigram_pair
    logits, accepted = confidence_fit.collect_rounds(target, drafter, prompts, rounds=6, num_draft_tokens=4)
    assert logits.shape == (18, 4) and accepted.shape == (18,) and accepted.max() <= 4
    first = specjax.inspect_draft(target, drafter, prompts[0], num_draft_tokens=4)
    close(1.0 / (1.0 + np.exp(-logits[0])), first.confidence, "round 1 of row 0 = inspect_draft's confidences")
    calibrated, report = confidence_fit.calibrate(target, drafter, prompts, rounds=6)
    assert len(report.temperatures) == 4 and report.rounds == 18
    assert report.mean_ece_after <= report.mean_ece_before
    np.testing.assert_allclose(calibrated.params["confidence_temperature"], report.temperatures)
    after = specjax.inspect_draft(target, calibrated, prompts[0], num_draft_tokens=4)
    z = np.log(first.confidence) - np.log1p(-first.confidence)
    close(after.confidence, 1.0 / (1.0 + np.exp(-z / np.asarray(report.temperatures))), "calibrated confidences")
    # Saved beside a checkpoint, the temperatures are read back by the loader.
    fixture = dict(temperatures=[1.5, 2.0, 0.5, 1.0, 3.0], ece_before=[0.1], ece_after=[0.01],
                   predicted_before=[0.5], predicted_after=[0.4], observed=[0.4], rounds=1)
    confidence_fit.save_calibration(confidence.CalibrationReport(**fixture), head_dir)
    _, _, heads = load_dspark(head_dir, fixture_target_config("dspark"), "float32")
    np.testing.assert_allclose(heads["confidence_temperature"], fixture["temperatures"])
    (head_dir / CALIBRATION_FILE).write_text(json.dumps({"temperatures": [1.0, 2.0]}))
    with pytest.raises(ValueError, match="a list of 5 positive numbers"):
        load_dspark(head_dir, fixture_target_config("dspark"))
