"""MTP head training: training and serving compute the same layer; training lowers the loss; the shipped head drafts.

A 2-layer random target and a random MTP layer (DeepSeek-V3 layout, as specjax.train.mtp trains).
Step 0 of training must equal the serving MtpDrafter's first-draft logits after a teacher-forced
prefill at every position; step j must equal chain drafting (the layer reused, fed back its own
output) whose drafts were the sequence's own next tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import chain
from specjax.drafters import MtpDrafter, mtp
from specjax.models.decoder import unstack_layers
from specjax.models.model import init_params
from specjax.models.target import Target
from specjax.train import mtp as tm
from specjax.train import trainer
from specjax.train.tiny import llama_hf_config

S = 20
TINY = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny"


def random_layer(tcfg: ModelConfig, seed: int) -> dict:
    """A random MTP layer with non-trivial norms, so every weight matters in the comparison."""
    layer = tm.init_layer(tcfg, jax.random.key(seed), scale=0.2)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x * jnp.asarray(1 + 0.2 * rng.standard_normal(x.shape), x.dtype)
        if "norm" in str(path[-1]) else x, layer)


@pytest.fixture(scope="module", params=["tied", "untied"])
def setup(request):
    tied = request.param == "tied"
    hf = llama_hf_config(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256)
    hf["tie_word_embeddings"] = tied
    tcfg = ModelConfig.from_hf(hf)
    tparams = unstack_layers(init_params(tcfg, jax.random.key(0), scale=0.2))
    cfg = tm.head_config(tcfg)
    layer = random_layer(tcfg, 1)
    frozen = tm.frozen_params(tparams, tcfg)
    return hf, tcfg, tparams, cfg, layer, frozen


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(1).integers(1, 256, (1, S)), jnp.int32)


def teacher_forced_init(setup, tokens, prompt_lens, steps=1):
    """The serving drafter after a prefill of tokens[:P] (P per row) whose root is tokens[P]."""
    _, tcfg, tparams, cfg, layer, frozen = setup
    params = tm.serving_params(layer, frozen)
    lens_B = jnp.asarray(prompt_lens, jnp.int32)
    b = len(prompt_lens)
    seq_BS = jnp.broadcast_to(tokens, (b, S))
    prompt_BT = seq_BS[:, : S - 1]  # right padding = the rest of the sequence: causal rows never see it
    h_BTD, _ = tm.target_hidden(tparams, tcfg, prompt_BT)
    root_B = seq_BS[jnp.arange(b), lens_B]
    settings = Settings(tree=chain(steps), sampling=SamplingConfig(), cache_len=128, max_new_tokens=32)
    drafter = MtpDrafter(cfg, params, attn_impl="xla").configure(settings)
    state = drafter.init(params, PrefillContext(prompt_BT, lens_B, root_B, (h_BTD,)))
    return drafter, params, state, seq_BS, lens_B


def test_step0_equals_the_serving_drafters_first_step_at_every_position(setup, tokens):
    _, tcfg, tparams, cfg, layer, frozen = setup
    h_BSD, _ = tm.target_hidden(tparams, tcfg, tokens)
    train0 = tm.unroll(mtp.head_of(cfg, tm.serving_params(layer, frozen)), h_BSD, tm.shift_left(tokens, 1))[0][0]
    # row b: prompt tokens[:b+1], root tokens[b+1]; its first draft pairs h_b with t_{b+1}
    prompt_lens = list(range(1, S))
    drafter, params, state, _, _ = teacher_forced_init(setup, tokens, prompt_lens)
    served_BV = mtp.head_of(cfg, params).logits(0, state[1])
    assert float(jnp.max(jnp.abs(served_BV))) > 1.0  # not a trivially small comparison
    np.testing.assert_allclose(train0[: S - 1], served_BV, atol=1e-5, rtol=1e-5)
    draft, _ = drafter.propose(params, state, tokens[0, 1:], jax.random.split(jax.random.key(0), S - 1))
    np.testing.assert_array_equal(draft.tokens[:, 1], jnp.argmax(train0[: S - 1], -1))


@pytest.mark.parametrize("prompt_lens", [(3, 11), (15, 6)])
def test_step_j_equals_chain_drafting_teacher_forced(setup, tokens, prompt_lens):
    """The drafter's chain steps (head_step at position P - 1 + s, after its committed rows, fed back its
    own output), with the sequence's next tokens as the drafts."""
    _, tcfg, tparams, cfg, layer, frozen = setup
    steps = 3
    h_BSD, _ = tm.target_hidden(tparams, tcfg, tokens)
    head = mtp.head_of(cfg, tm.serving_params(layer, frozen))
    train = [x[0] for x in tm.unroll(head, h_BSD, tm.shift_left(tokens, 1), steps)]
    _, _, (cache, last_BD), seq_BS, lens_B = teacher_forced_init(setup, tokens, prompt_lens, steps)
    rows = jnp.arange(len(prompt_lens))
    out_BD, k, v = last_BD, cache.k[0], cache.v[0]
    for j in range(steps):
        served_BV = head.logits(0, out_BD)
        np.testing.assert_allclose(train[j][lens_B - 1], served_BV, atol=2e-5, rtol=1e-5, err_msg=f"step {j}")
        draft_B1 = seq_BS[rows, lens_B + 1 + j][:, None]  # teacher-forced draft j + 1
        h_B1D = head.feedback(0, out_BD)[:, None]
        out_B1D, k, v = head.step(0, draft_B1, h_B1D, k, v, cache.lengths + j, positions_BT=(lens_B + j)[:, None],
                                  attn_impl="xla")
        out_BD = out_B1D[:, 0]


def test_training_lowers_the_loss(setup, tmp_path):
    _, tcfg, tparams, cfg, _, frozen = setup
    layer = tm.init_layer(tcfg, jax.random.key(2))
    seq = np.random.default_rng(3).integers(1, 256, (4, 16)).astype(np.int32)
    mask = np.zeros((4, 15), bool)
    mask[:, 4:] = True
    batch = tm.sequence_batch(seq, mask)
    for steps in (1, 2):
        loss_fn = tm.mtp_loss(cfg, steps=steps)
        before, metrics = loss_fn(layer, batch, frozen)
        assert set(metrics) >= {"loss_0", "kl_0", "acc_0", "tokens"}
        np.testing.assert_allclose(before, sum(0.8 ** j * metrics[f"loss_{j}"] for j in range(steps)), rtol=1e-5)
    loss_fn = tm.mtp_loss(cfg)
    before, _ = loss_fn(layer, batch, frozen)
    tc = trainer.TrainConfig(steps=20, peak_lr=1e-2, warmup_steps=2, weight_decay=0.0, log_every=5,
                             eval_every=1000, ckpt_every=10)
    state = trainer.train(tmp_path / "run", tc, layer, loss_fn, lambda step: batch, frozen=frozen, desc="mtp")
    after, metrics = loss_fn(state["params"], batch, frozen)
    assert float(after) < 0.9 * float(before)
    # only the MTP layer trained: the frozen target's tables are untouched (state holds the layer only)
    assert jax.tree.structure(state["params"]) == jax.tree.structure(layer)
    hard, hard_metrics = tm.mtp_loss(cfg, objective="hard")(state["params"], batch, frozen)
    assert float(hard_metrics["acc_0"]) == float(metrics["acc_0"])


def test_mtp_only_directory_round_trip_and_fit_check(setup, tmp_path):
    hf, tcfg, tparams, cfg, layer, _ = setup
    target = Target(tparams, tcfg, hf, attn_impl="xla")
    out = tm.write_head(tmp_path / "head", hf, layer, target_ref="../target", dtype="float32")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    drafter = specjax.load_drafter(out, target)
    assert isinstance(drafter, MtpDrafter) and drafter.cfg.layout == "deepseek" and drafter.cfg.num_layers == 1
    for got, want in zip(jax.tree.leaves(drafter.params["layers"][0]), jax.tree.leaves(layer)):
        np.testing.assert_array_equal(got, want)
    assert drafter.params["embed"] is target.params["embed"]
    other_hf = llama_hf_config(hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, vocab=256)
    other_cfg = ModelConfig.from_hf(other_hf)
    other = Target(unstack_layers(init_params(other_cfg, jax.random.key(0))), other_cfg, other_hf, attn_impl="xla")
    with pytest.raises(ValueError, match="intermediate_size 128 vs the target's 96"):
        specjax.load_drafter(out, other)


# ---------------------------------------------------------------- the shipped head for the embedded target


@pytest.fixture(scope="module")
def embedded():
    if not (TINY / "mtp" / "config.json").is_file():
        pytest.fail("checkpoints/tiny/mtp is missing: run python scripts/train_mtp.py")
    target = specjax.load(TINY / "target")
    return target, specjax.load_drafter(TINY / "mtp", target)


def test_shipped_head_drafts_losslessly(embedded):
    target, drafter = embedded
    assert isinstance(drafter, MtpDrafter) and drafter.cfg.num_layers == 1
    prompts = [p["text"] for p in json.loads((TINY / "manifest.json").read_text())["held_out_prompts"][:2]]
    plain = specjax.generate(target, prompts, max_new_tokens=16)
    spec = specjax.generate(target, prompts, max_new_tokens=16, drafter=drafter, num_draft_tokens=3)
    assert spec.tokens == plain.tokens
    assert spec.stats["acceptance_length"] > 1.3  # a trained head: random drafts would give ~1.0


def test_shipped_record(embedded):
    record = json.loads((TINY / "mtp" / "record.json").read_text())["mtp"]
    assert record["acceptance"]["chain_1"]["outputs_equal_plain_greedy"]
    assert record["acceptance"]["chain_1"]["measured_greedy_tau"] > 1.3
