"""EAGLE-3 training-time test: training and serving compute the same head.

A 4-layer random target (taps hidden_states 1, 2, 3, as the embedded target's head uses) and a
random head. Step 0 of training must equal serving's prefill at every row; step j at row
P-1 must equal the j-th chain-drafting step after a prompt of length P whose drafts were the
sequence's own next tokens; the attention mask must be the original's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import chain
from specjax.drafters.eagle3 import Eagle3Drafter, head_of, init_head_cache
from specjax.models.cache import KVCache, init_cache
from specjax.models.decoder import unstack_layers
from specjax.models.model import forward, init_params
from specjax.train import eagle3 as ttt
from specjax.train import trainer

S = 24
TAPS = (1, 2, 3)


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5)
    return cfg, unstack_layers(init_params(cfg, jax.random.key(0), scale=0.2))


@pytest.fixture(scope="module")
def head(target):
    tcfg, tparams = target
    cfg = ttt.head_config(tcfg, TAPS, draft_vocab_size=128, intermediate_size=96, rope_theta=500000.0)
    counts = np.random.default_rng(0).integers(0, 1000, tcfg.vocab_size)
    d2t, _ = ttt.draft_vocab_from_counts(counts, cfg.draft_vocab_size)
    trainable = ttt.init_head(cfg, jax.random.key(1), scale=0.15)
    frozen = {"target": tparams, "embed": tparams["embed"], "d2t": jnp.asarray(d2t)}
    return cfg, trainable, frozen


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, S)), jnp.int32)


def serving_features(tparams, tcfg, prompt_BT):
    """The target's taps as serving's prefill computes them: a cache longer than the prompt."""
    cache = init_cache(tcfg, prompt_BT.shape[0], 128, per_layer=True)
    _, taps, _ = forward(tparams, tcfg, prompt_BT, cache, capture=TAPS, attn_impl="xla")
    return taps


def test_step0_equals_serving_prefill_at_every_row(target, head, tokens):
    tcfg, tparams = target
    cfg, trainable, frozen = head
    net = head_of(cfg, ttt.full_params(trainable, frozen))
    features, _ = ttt.target_features(tparams, tcfg, tokens, TAPS)
    train0 = ttt.unroll(net, features, ttt.shift_left(tokens, 1), steps=1)[0]

    taps = serving_features(tparams, tcfg, tokens)
    h_BTD = net.fuse(jnp.concatenate(taps, -1))
    cache = init_head_cache(cfg, tokens.shape[0], 128)
    served_BTD, _ = net.midlayer(ttt.shift_left(tokens, 1), h_BTD, cache, attn_impl="xla")
    served = net.draft_logits(served_BTD)
    # the last row pairs with a token past the sequence (0 in training, the root when serving)
    np.testing.assert_allclose(train0[:, :-1], served[:, :-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt_lens", [(5, 11), (17, 8)])
def test_step_j_equals_chain_drafting_teacher_forced(target, head, tokens, prompt_lens):
    """Serving's Eagle3Drafter.init on ragged prompts, then its chain step (midlayer over its cache at
    lengths + i, fed its own hidden) with the sequence's next tokens as the drafts."""
    tcfg, tparams = target
    cfg, trainable, frozen = head
    params = ttt.full_params(trainable, frozen)
    net = head_of(cfg, params)
    features, _ = ttt.target_features(tparams, tcfg, tokens, TAPS)
    steps = 7
    train = ttt.unroll(net, features, ttt.shift_left(tokens, 1), steps=steps)

    lens_B = jnp.asarray(prompt_lens, jnp.int32)
    pmax = max(prompt_lens)
    prompt_BT = jnp.where(jnp.arange(pmax)[None] < lens_B[:, None], tokens[:, :pmax], 0)
    root_B = tokens[jnp.arange(2), lens_B]
    settings = Settings(tree=chain(steps), sampling=SamplingConfig(), cache_len=128, max_new_tokens=32)
    drafter = Eagle3Drafter(cfg, params, attn_impl="xla").configure(settings)
    ctx = PrefillContext(prompt_BT, lens_B, root_B, serving_features(tparams, tcfg, prompt_BT))
    cache, h_BD = drafter.init(params, ctx)
    rows = jnp.arange(2)
    for j in range(steps):
        served_BV = net.draft_logits(h_BD[:, None])[:, 0]
        np.testing.assert_allclose(train[j][rows, lens_B - 1], served_BV, atol=2e-5, rtol=1e-5,
                                   err_msg=f"step {j}")
        draft_B = tokens[rows, lens_B + 1 + j]  # teacher-forced draft j + 1
        h_B1D, c = net.midlayer(draft_B[:, None], h_BD[:, None], KVCache(cache.k, cache.v, cache.lengths + j),
                                  attn_impl="xla")
        cache, h_BD = KVCache(c.k, c.v, cache.lengths), h_B1D[:, 0]


def test_ttt_attention_is_the_originals_mask():
    """Step j's query at row p sees step-0 keys of rows <= p and steps 1..j at row p: an explicit mask."""
    rng = np.random.default_rng(2)
    b, t, h, kv, d, j = 2, 6, 4, 2, 8, 3
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    ks = [jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.float32) for _ in range(j + 1)]
    vs = [jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.float32) for _ in range(j + 1)]
    got = ttt.ttt_attention(q, ks, vs)

    k_all = np.concatenate([np.asarray(k) for k in ks], axis=1)  # [B, (j+1)T, Hkv, D], step-major
    v_all = np.concatenate([np.asarray(v) for v in vs], axis=1)
    mask = np.zeros((t, (j + 1) * t), bool)
    for p in range(t):
        mask[p, : p + 1] = True
        for i in range(1, j + 1):
            mask[p, i * t + p] = True
    k_rep, v_rep = np.repeat(k_all, h // kv, axis=2), np.repeat(v_all, h // kv, axis=2)
    logits = np.einsum("bthd,bshd->bhts", np.asarray(q), k_rep) / np.sqrt(d)
    logits = np.where(mask, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bhts,bshd->bthd", probs, v_rep)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_draft_vocab_from_counts():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = ttt.draft_vocab_from_counts(counts, 4)
    kept = np.arange(4) + d2t
    assert kept.tolist() == [0, 2, 3, 5]  # most frequent, sorted by id
    assert t2d.tolist() == [i in kept for i in range(8)]
    assert ttt.draft_vocab_from_counts(counts, 1)[0].tolist() == [2]  # tie 9/9: the lower id
    with pytest.raises(ValueError, match="draft_vocab_size"):
        ttt.draft_vocab_from_counts(counts, 9)


def test_draft_targets_restrict_and_renormalise():
    logits = jnp.asarray([[[0.0, 2.0, 1.0, 5.0]]])
    d2t = jnp.asarray([0, 1], jnp.int32)  # draft ids 0, 1 -> target ids 0, 2
    probs, in_vocab = ttt.draft_targets(logits, d2t)
    np.testing.assert_allclose(probs[0, 0], jax.nn.softmax(jnp.asarray([0.0, 1.0])), rtol=1e-6)
    assert not bool(in_vocab[0, 0])  # the target's top-1 (id 3) is outside the draft vocabulary


def test_head_config_refuses_bad_taps(target):
    tcfg, _ = target
    with pytest.raises(ValueError, match="three distinct"):
        ttt.head_config(tcfg, (1, 1, 3), draft_vocab_size=128, intermediate_size=96)
    with pytest.raises(ValueError, match="1..3"):
        ttt.head_config(tcfg, (1, 2, 4), draft_vocab_size=128, intermediate_size=96)


def test_training_lowers_the_ttt_loss(target, head, tmp_path):
    tcfg, tparams = target
    cfg, trainable, frozen = head
    tokens = np.random.default_rng(3).integers(0, 256, (4, 16)).astype(np.int32)
    mask = np.zeros((4, 15), bool)
    mask[:, 4:] = True
    batch = ttt.sequence_batch(tokens, mask)
    loss_fn = ttt.eagle3_loss(cfg, tcfg, steps=3)
    before, metrics = loss_fn(trainable, batch, frozen)
    assert set(metrics) >= {"loss_0", "loss_2", "acc_1", "tokens"}
    np.testing.assert_allclose(before, sum(0.8 ** j * metrics[f"loss_{j}"] for j in range(3)), rtol=1e-5)
    tc = trainer.TrainConfig(steps=20, peak_lr=3e-3, warmup_steps=2, clip_norm=0.5, weight_decay=0.0, log_every=5,
                             eval_every=1000, ckpt_every=10)
    state = trainer.train(tmp_path / "run", tc, trainable, loss_fn, lambda step: batch, frozen=frozen, desc="ttt")
    after, _ = loss_fn(state["params"], batch, frozen)
    assert float(after) < 0.8 * float(before)
