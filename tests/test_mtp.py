"""MTP heads: parity with vLLM's MTP modules, lossless chains, conversion and its checks.

The fixtures in tests/fixtures/mtp/ were written by scripts/make_mtp_fixtures.py, which runs
vLLM's own deepseek_mtp.py / qwen3_next_mtp.py / qwen3_5_mtp.py / mimo_mtp.py (and layernorm.py)
on tiny random weights with the parallel layers and the inner decoder block stubbed (see the
script: the block is transformers' own Llama / Qwen3.5 / Qwen2 decoder layer). Each case is a
tiny target checkpoint (transformers' Llama, Qwen3.5 or Qwen2 = MiMo) carrying the MTP tensors,
read back through `specjax.load`, so parity covers the converter's names and layouts too; the
hidden state driving the MTP module is the target's own (after its final norm; MiMo before it),
computed by transformers.
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

import specjax
from specjax.config import SamplingConfig
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import chain
from specjax.decoding.verify import Draft, Verdict
from specjax.drafters import DraftModelDrafter, MtpDrafter, mtp
from specjax.loading.drafter import mtp_drafter
from specjax.models.decoder import POST_NORM

FIXTURES = Path(__file__).parent / "fixtures" / "mtp"
CASES = ("deepseek2", "deepseek1", "qwen3_next", "qwen3_5", "mimo")
LAYOUT = {"deepseek2": "deepseek", "deepseek1": "deepseek", "qwen3_next": "qwen3_next", "qwen3_5": "qwen3_next",
          "mimo": "mimo"}
# The suite runs dense targets stacked (conftest.py); deepseek1 runs CPU's per-layer layout, so vLLM's parity and
# lossless decoding are checked in both (MiMo's and Qwen3-Next's dense fixtures stacked, Qwen3.5's hybrid per-layer).
RUN_LAYOUT = {"deepseek1": "per_layer"}
MAX_NEW = 23  # not a multiple of any round size: budgets end mid-round


def close(got, want, what):
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-5, atol=1e-5, err_msg=what)


# ---------------------------------------------------------------- parity with vLLM's modules


@pytest.fixture(scope="module", params=CASES)
def case(request):
    target = specjax.load(FIXTURES / request.param, layout=RUN_LAYOUT.get(request.param, "auto"))
    return request.param, target, mtp_drafter(target), dict(np.load(FIXTURES / request.param / "io.npz"))


def test_parity_with_vllm_steps_and_kv(case):
    """Prefill through every layer, then later steps fed the previous hidden: hidden, logits, K/V at 1e-5."""
    name, _, drafter, io = case
    cfg, head = drafter.cfg, mtp.head_of(drafter.cfg, drafter.params)
    cache = mtp.init_head_cache(cfg, 1, 32)
    ks, vs = list(cache.k), list(cache.v)
    ids_BT, h_BTD = jnp.asarray(io["ids"])[None], jnp.asarray(io["h_prev"])[None]
    t = ids_BT.shape[1]
    first = {}
    for j in range(cfg.num_layers):
        out, ks[j], vs[j] = head.step(j, ids_BT, h_BTD, ks[j], vs[j], jnp.zeros((1,), jnp.int32))
        close(head.feedback(j, out)[0], io[f"step1_l{j}_hidden"], f"{name} step 1 layer {j} hidden")
        close(head.logits(j, out)[0], io[f"step1_l{j}_logits"], f"{name} step 1 layer {j} logits")
        first[j] = out
    last, prev_layer, uses, s = first[0][:, -1], 0, [0] * cfg.num_layers, 1
    while f"step{s + 1}_ids" in io:
        j = int(io[f"step{s + 1}_layer"])
        assert j == s % cfg.num_layers
        tok_B = jnp.argmax(head.logits(prev_layer, last), axis=-1)
        np.testing.assert_array_equal(tok_B, io[f"step{s + 1}_ids"])
        h_B1D = head.feedback(prev_layer, last)[:, None]
        out, ks[j], vs[j] = head.step(j, tok_B[:, None], h_B1D, ks[j], vs[j], jnp.asarray([t + uses[j]]),
                                      positions_BT=jnp.asarray([[t - 1 + s]]))
        uses[j] += 1
        close(head.feedback(j, out)[0], io[f"step{s + 1}_hidden"], f"{name} step {s + 1} hidden")
        close(head.logits(j, out)[0], io[f"step{s + 1}_logits"], f"{name} step {s + 1} logits")
        last, prev_layer, s = out[:, 0], j, s + 1
    assert s == 3
    for j in range(cfg.num_layers):
        rows = io[f"k{j}"].shape[1]
        close(np.asarray(ks[j][0, :rows]).transpose(1, 0, 2), io[f"k{j}"], f"{name} layer {j} K")
        close(np.asarray(vs[j][0, :rows]).transpose(1, 0, 2), io[f"v{j}"], f"{name} layer {j} V")


def test_first_round_drafts_are_vllms(case):
    """init + propose on the fixture's inputs draft the original's tokens (steps 2, 3, then step 3's argmax)."""
    _, _, drafter, io = case
    ids, t = jnp.asarray(io["ids"])[None], io["ids"].shape[0]
    drafter = drafter.configure(Settings(chain(3), SamplingConfig(), 32, 16))
    prompt_BT = jnp.concatenate([jnp.zeros((1, 1), jnp.int32), ids[:, :-1]], axis=1)  # row p pairs with ids[p]
    ctx = PrefillContext(prompt_BT, jnp.asarray([t], jnp.int32), ids[:, -1], (jnp.asarray(io["h_prev"])[None],))
    state = drafter.init(drafter.params, ctx)
    draft, _ = drafter.propose(drafter.params, state, ids[:, -1], jax.random.split(jax.random.key(0), 1))
    expected = [io["step2_ids"][0], io["step3_ids"][0], int(np.argmax(io["step3_logits"][0]))]
    np.testing.assert_array_equal(draft.tokens[0], [int(ids[0, -1]), *expected])


def test_fixture_layouts_are_read_as_stored(case):
    name, target, drafter, _ = case
    assert drafter.cfg.layout == LAYOUT[name]
    assert drafter.cfg.num_layers == (2 if name == "deepseek2" else 1)
    # The lm_head's input, as vLLM feeds these layouts; MiMo's pre-norm state (drafters/mtp.py cites the files).
    assert drafter.feature_layers == ((target.cfg.num_layers,) if name == "mimo" else (POST_NORM,))
    layer0 = drafter.params["layers"][0]
    # deepseek1 repeats the embedding (equal: not kept) and has its own head (different: kept).
    assert ("lm_head" in layer0) == (name == "deepseek1") and "embed" not in layer0
    assert drafter.params["embed"] is target.params["embed"]


def test_drafts_from_the_targets_own_hidden_state_match_vllm(case):
    """End to end from the prompt: specjax's target gives transformers' logits and the hidden state the layout
    reads (h_prev, computed by transformers), and the drafter's first round drafts vLLM's tokens from vLLM's
    logits (steps 1-3: the layer on the target's state, then on its own recycled output)."""
    _, target, drafter, io = case
    prompt = [int(t) for t in io["prompt"]]
    model = target.model
    h, (feature,), _ = model.forward(jnp.asarray([prompt], jnp.int32), model.init_cache(1, 32),
                                     capture=drafter.feature_layers, attn_impl="xla")
    np.testing.assert_allclose(np.asarray(model.logits(h))[0], io["target_logits"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(feature)[0], io["h_prev"], atol=1e-5, rtol=0)
    ins = specjax.inspect_draft(target, drafter, prompt, num_draft_tokens=3)
    assert ins.root == int(io["ids"][-1])
    want = [io["step1_l0_logits"][-1], io["step2_logits"][0], io["step3_logits"][0]]
    np.testing.assert_allclose(ins.logits, np.stack(want), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(ins.tokens, [int(io["step2_ids"][0]), int(io["step3_ids"][0]),
                                               int(np.argmax(io["step3_logits"][0]))])


@pytest.mark.parametrize("k", [1, 3])
def test_fixture_targets_decode_losslessly_with_their_mtp(case, k):
    """Every layout on its own target (Llama, Qwen3.5 hybrid, MiMo): greedy output equals plain decoding on a
    ragged batch whose budget ends mid-round."""
    _, target, drafter, _ = case
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, target.cfg.vocab_size, size=n).tolist() for n in (4, 11, 1)]
    plain = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter,
                           num_draft_tokens=k)
    assert out.tokens == plain.tokens


# ---------------------------------------------------------------- a tiny target carrying MTP tensors


def add_mtp(src: Path, dst: Path, layout: str, num: int, seed: int = 0, edit=None, config_edit=None) -> Path:
    """Copy an HF dir and add random MTP tensors in `layout` (shapes from its config.json)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    tensors = load_file(dst / "model.safetensors")
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    rng = np.random.default_rng(seed)
    block = {k[len("model.layers.0."):]: t for k, t in tensors.items() if k.startswith("model.layers.0.")}

    def rand_like(t, name):
        if "norm" in name:
            return (1.0 + 0.1 * rng.standard_normal(t.shape)).astype(np.float32)
        return (rng.standard_normal(t.shape) / np.sqrt(t.shape[-1])).astype(np.float32)

    def fuse(names):
        return {names[0]: rand_like(np.zeros(h), "norm"), names[1]: rand_like(np.zeros(h), "norm"),
                names[2]: rand_like(np.zeros((h, 2 * h)), "fc"), names[3]: rand_like(np.zeros(h), "norm")}

    if layout == "deepseek":
        for j in range(num):
            p = f"model.layers.{layers + j}."
            tensors |= {p + k: rand_like(t, k) for k, t in block.items()}
            tensors |= fuse([p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight",
                             p + "shared_head.norm.weight"])
        cfg["num_nextn_predict_layers"] = num
    else:
        for j in range(num):
            tensors |= {f"mtp.layers.{j}.{k}": rand_like(t, k) for k, t in block.items()}
        tensors |= fuse(["mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                         "mtp.norm.weight"])
        cfg["mtp_num_hidden_layers"] = num
    if edit is not None:
        tensors = edit(tensors)
    if config_edit is not None:
        cfg = config_edit(cfg)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    model = build_hf_model("llama", seed=0, num_hidden_layers=2, tie_word_embeddings=False)
    return save_hf_model(model, tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def mtp_dirs(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {"deepseek": add_mtp(base_dir, root / "deepseek", "deepseek", 2, seed=1),
            "qwen3_next": add_mtp(base_dir, root / "qwen3_next", "qwen3_next", 1, seed=2)}


@pytest.fixture(scope="module")
def targets(mtp_dirs):
    return {k: specjax.load(d) for k, d in mtp_dirs.items()}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 17, 1)]


@pytest.fixture(scope="module")
def plain(targets, prompts):
    return specjax.generate(targets["deepseek"], prompts, max_new_tokens=MAX_NEW, eos_token_id=[])


def test_target_runs_exactly_as_without_mtp(base_dir, targets):
    base = specjax.load(base_dir)
    assert base.mtp is None
    for target in targets.values():
        assert jax.tree.structure(target.params) == jax.tree.structure(base.params)
        for a, b in zip(jax.tree.leaves(target.params), jax.tree.leaves(base.params)):
            np.testing.assert_array_equal(a, b)


def test_load_drafter_on_the_target_dir_gives_its_mtp_drafter(mtp_dirs, targets, base_dir):
    for layout, d in mtp_dirs.items():
        drafter = specjax.load_drafter(d, targets[layout])
        assert isinstance(drafter, MtpDrafter) and drafter.cfg.layout == layout
    assert isinstance(specjax.load_drafter(base_dir, targets["deepseek"], mtp=True), MtpDrafter)
    # Another copy of the same model carrying MTP layers gives them too; mtp=False loads it as a draft model.
    base = specjax.load(base_dir)
    assert isinstance(specjax.load_drafter(mtp_dirs["qwen3_next"], base), MtpDrafter)
    with pytest.warns(UserWarning, match="has the target's own architecture and size"):  # a draft model that large
        assert isinstance(specjax.load_drafter(mtp_dirs["qwen3_next"], base, mtp=False), DraftModelDrafter)
    # The target's own directory without MTP layers is not a draft model: it would draft with the target itself.
    with pytest.raises(ValueError, match="draft with the target itself"):
        specjax.load_drafter(base_dir, base)


@pytest.mark.parametrize("layout, k, eos", [("deepseek", 3, False), ("qwen3_next", 4, True), ("deepseek", 1, True)])
def test_greedy_speculative_equals_plain(targets, prompts, plain, layout, k, eos):
    """Ragged batch, budget ending mid-round, EOS mid-round; K above the number of MTP layers reuses them."""
    target = targets[layout]
    drafter = mtp_drafter(target)
    eos_ids = [plain.tokens[0][6]] if eos else []
    want = plain if not eos else specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=eos_ids)
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=eos_ids, drafter=drafter,
                           num_draft_tokens=k)
    assert out.tokens == want.tokens
    if eos:
        assert len(out.tokens[0]) < MAX_NEW and out.tokens[0][-1] == eos_ids[0]
    assert out.stats["drafter_calls"] > 0


def test_sampled_speculation_runs_and_is_seeded(targets, prompts):
    drafter = mtp_drafter(targets["qwen3_next"])
    kw = dict(max_new_tokens=10, eos_token_id=[], drafter=drafter, num_draft_tokens=3, temperature=0.8, seed=3)
    a, b = (specjax.generate(targets["qwen3_next"], prompts, **kw) for _ in range(2))
    assert a.tokens == b.tokens and all(len(t) == 10 for t in a.tokens)


def test_sampled_draft_carries_q_it_was_drawn_from(targets):
    drafter = mtp_drafter(targets["deepseek"]).configure(Settings(chain(3), SamplingConfig(temperature=0.7), 32, 16))
    b, p, hsz = 2, 5, targets["deepseek"].cfg.hidden_size
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(3, 256, size=(b, p)), jnp.int32)
    ctx = PrefillContext(prompt, jnp.full((b,), p, jnp.int32), prompt[:, 0],
                         (jnp.asarray(rng.normal(size=(b, p, hsz)), jnp.float32),))
    state = drafter.init(drafter.params, ctx)
    draft, _ = drafter.propose(drafter.params, state, prompt[:, 0], jax.random.split(jax.random.key(1), b))
    assert draft.q.shape == (b, 4, 256)
    np.testing.assert_allclose(draft.q[:, 1:].sum(-1), 1.0, atol=1e-5)
    picked = jnp.take_along_axis(draft.q, draft.tokens[:, :, None], axis=2)[:, 1:, 0]
    assert bool(jnp.all(picked > 0))


def test_trees_are_refused(targets, prompts):
    with pytest.raises(ValueError, match="chains only"):
        specjax.generate(targets["deepseek"], prompts, max_new_tokens=4, drafter=mtp_drafter(targets["deepseek"]),
                         tree="kary:2,2")


@pytest.mark.parametrize("layout", ["deepseek", "qwen3_next"])
def test_update_leaves_every_layer_as_a_prefill_of_the_accepted_sequence_would(targets, layout):
    """After a round, each MTP layer's committed K/V and the last output equal init over prompt + accepted."""
    drafter = mtp_drafter(targets[layout])
    b, p, n, s = 2, 6, 4, 32
    hsz = targets[layout].cfg.hidden_size
    rng = np.random.default_rng(1)
    seq_BL = jnp.asarray(rng.integers(0, 256, size=(b, p + n + 1)), jnp.int32)
    feats_BLD = jnp.asarray(2.0 * rng.normal(size=(b, p + n, hsz)), jnp.float32)
    drafter = drafter.configure(Settings(chain(n - 1), SamplingConfig(), s, 16))
    params = drafter.params
    lens_B = jnp.full((b,), p, jnp.int32)
    state = drafter.init(params, PrefillContext(seq_BL[:, :p], lens_B, seq_BL[:, p], (feats_BLD[:, :p],)))
    _, state = drafter.propose(params, state, seq_BL[:, p], jax.random.split(jax.random.key(0), b))
    accepted_B = jnp.asarray([3, 1], jnp.int32)
    draft = Draft(seq_BL[:, p:p + n], jnp.broadcast_to(jnp.arange(-1, n - 1), (b, n)), jnp.ones((b, n), bool))
    bonus_B = jnp.take_along_axis(seq_BL, (p + accepted_B)[:, None], axis=1)[:, 0]
    path_BN = jnp.where(jnp.arange(n)[None] < accepted_B[:, None], jnp.arange(n)[None], 0)
    cache, last = drafter.update(params, state, draft, Verdict(path_BN.astype(jnp.int32), accepted_B, bonus_B),
                                 (feats_BLD[:, p:p + n],))
    np.testing.assert_array_equal(cache.lengths, p + accepted_B)
    for row in range(b):
        m = p + int(accepted_B[row])
        ctx = PrefillContext(seq_BL[row:row + 1, :m], jnp.asarray([m], jnp.int32), seq_BL[row:row + 1, m],
                             (feats_BLD[row:row + 1, :m],))
        ref_cache, ref_last = drafter.init(params, ctx)
        np.testing.assert_allclose(last[row], ref_last[0], atol=1e-5, rtol=0)
        for j in range(drafter.cfg.num_layers):
            np.testing.assert_allclose(cache.k[j][row, :m], ref_cache.k[j][0, :m], atol=1e-5, rtol=0)
            np.testing.assert_allclose(cache.v[j][row, :m], ref_cache.v[j][0, :m], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- conversion


def test_conversion_round_trip_keeps_mtp(mtp_dirs, targets, tmp_path):
    for layout, d in mtp_dirs.items():
        dst = specjax.convert(d, tmp_path / layout)
        converted = specjax.load(dst)
        assert converted.mtp is not None
        assert jax.tree.structure(converted.mtp) == jax.tree.structure(targets[layout].mtp)
        for a, b in zip(jax.tree.leaves(converted.mtp), jax.tree.leaves(targets[layout].mtp)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(converted.params), jax.tree.leaves(targets[layout].params)):
            np.testing.assert_array_equal(a, b)
        drafter = specjax.load_drafter(dst, converted)
        assert isinstance(drafter, MtpDrafter) and drafter.cfg.layout == layout


def test_bf16_conversion_casts_mtp_too(mtp_dirs, tmp_path):
    target = specjax.load(specjax.convert(mtp_dirs["deepseek"], tmp_path / "bf16", dtype="bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(target.mtp)} == {jnp.dtype("bfloat16")}
    assert mtp_drafter(target).params["layers"][1]["fc"].dtype == jnp.bfloat16


def _refused(base_dir, tmp_path, layout, match, num=2, **kw):
    src = add_mtp(base_dir, tmp_path / "bad", layout, num, **kw)
    with pytest.raises(ValueError, match=match):
        specjax.load(src)


def test_eh_proj_not_matching_the_hidden_size_is_refused(base_dir, tmp_path):
    edit = lambda t: {**t, "model.layers.3.eh_proj.weight": np.zeros((64, 96), np.float32)}  # noqa: E731
    _refused(base_dir, tmp_path, "deepseek", r"'model.layers.3.eh_proj.weight' has shape \(64, 96\) but the "
                                             r"target's hidden_size 64 .* implies \(64, 128\)", edit=edit)


def test_head_not_matching_the_vocabulary_is_refused(base_dir, tmp_path):
    edit = lambda t: {**t, "model.layers.2.shared_head.head.weight": np.zeros((300, 64), np.float32)}  # noqa: E731
    _refused(base_dir, tmp_path, "deepseek", r"shared_head.head.weight' has shape \(300, 64\) but the target's "
                                             r"vocabulary has 256 tokens", edit=edit)


def test_block_not_matching_the_target_layer_is_refused(base_dir, tmp_path):
    edit = lambda t: {**t, "mtp.layers.0.mlp.up_proj.weight": np.zeros((96, 64), np.float32)}  # noqa: E731
    _refused(base_dir, tmp_path, "qwen3_next", r"'mtp.layers.0.mlp.up_proj.weight' has shape \(96, 64\) but one "
                                               r"decoder layer of the target .* implies \(128, 64\)", num=1, edit=edit)


def test_missing_and_unknown_mtp_tensors_are_refused(base_dir, tmp_path):
    drop = lambda t: {k: v for k, v in t.items() if k != "mtp.pre_fc_norm_hidden.weight"}  # noqa: E731
    _refused(base_dir, tmp_path / "a", "qwen3_next", r"lacks MTP tensor 'mtp.pre_fc_norm_hidden.weight'", num=1,
             edit=drop)
    moe = lambda t: {**t, "model.layers.2.mlp.experts.0.up_proj.weight": np.zeros((4, 4), np.float32)}  # noqa: E731
    _refused(base_dir, tmp_path / "b", "deepseek", r"1 MTP tensor\(s\) specjax does not know: "
                                                   r"'model.layers.2.mlp.experts.0.up_proj.weight'.*experts on an "
                                                   r"MoE target", edit=moe)


def test_layer_count_disagreeing_with_the_config_is_refused(base_dir, tmp_path):
    _refused(base_dir, tmp_path, "deepseek", r"'num_nextn_predict_layers' is 3 but the checkpoint has 2 MTP layer",
             config_edit=lambda c: {**c, "num_nextn_predict_layers": 3})


def test_mtp_drafter_of_a_target_without_mtp_is_refused(base_dir):
    base = specjax.load(base_dir)
    with pytest.raises(ValueError, match="has no MTP layers"):
        mtp_drafter(base)
    with pytest.raises(ValueError, match="has no MTP layers"):
        specjax.load_drafter(base_dir, base, mtp=True)


def test_inspect_draft_records_the_logits_each_draft_came_from(targets):
    for layout, target in targets.items():
        out = specjax.inspect_draft(target, specjax.load_drafter(target.path, target), [7, 30, 12, 5],
                                    num_draft_tokens=3)
        assert out.logits.shape == (3, target.cfg.vocab_size), layout
        np.testing.assert_array_equal(out.logits.argmax(-1), out.tokens)
